"""The flashinfer family: common (the import check, limits and the checks every variant shares,
TRACE_KERNELS), trtllm (the TRT-LLM workspace variants, fused and MNNVL), pcie (PCIe IPC and its
tuner), autotune_log (what the autotuner logged and saved) and variants (flags and the factory)."""
