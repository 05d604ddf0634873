"""NCCL and FlashInfer facts the engines' paths rest on, with their sources. No wheel of these
ships Python that states them, so `commbench engines --check` does not read them: each names the
release and the file it was read in."""

from __future__ import annotations

NCCL_VERSION = "2.30.7"      # the NCCL whose environment semantics the settings follow
# NCCL 2.29.2, commit ebd1e929 (src/sym_kernels.cc): the first NCCL whose built-in symmetric
# kernels run only on fully NVLink-connected systems (ncclSymkAvailable() false otherwise).
NCCL_SYMMETRIC_PCIE_OFF = (2, 29, 2)
NCCL_SYMMETRIC_SOURCE = "NCCL 2.29.2, commit ebd1e929 (src/sym_kernels.cc)"

# FlashInfer 0.7.4 flashinfer/comm: the trtllm allreduce kernels are built for SM 9.x/10.x/12.x, its
# workspace takes 2, 4, 8 or 16 ranks of one node; the PCIe IPC allreduce (PcieIpcAllReduceWorkspace,
# since 0.7.2) takes 2, 4 or 8 ranks.
FLASHINFER_WORLD_SIZES = (2, 4, 8, 16)
FLASHINFER_ARCHS = "FlashInfer's trtllm kernels are built for SM 9.x/10.x/12.x only (not RTX 4090 / L40)"
