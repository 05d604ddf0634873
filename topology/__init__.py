"""The topology probe: devices, links, P2P, IPC, VMM, multicast and host facts, gathered into
one JSON snapshot; and the pure analysis over a snapshot (warnings, backend verdicts, explain).

Modules that touch the GPU (cudadrv, local_checks, group_checks, nvml_facts) are imported
lazily by snapshot.py; the analysis modules (findings, verdicts, render, plot) read dicts only.
"""
