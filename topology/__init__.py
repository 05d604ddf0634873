"""The machine's facts, torch-free: the probe's steps (run in child processes, ctypes over the
driver, sysfs, NVML, NCCL's log and XML) and the checks over a snapshot (needs, selection,
islands, findings), read by the probe (commbench.probe), the backends and the analysis.

Modules that touch the GPU (cudadrv, local_checks, group_checks, nvml_facts, nccl_child) are
imported lazily by the probe's snapshot; the checks (needs, findings, islands) read dicts only.
"""
