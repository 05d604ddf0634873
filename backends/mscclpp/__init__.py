"""The mscclpp family, MSCCL++ from its Python API and its NCCL-API shim: backend (the backends,
their variants and the factory) and flags (its flags, without torch)."""
