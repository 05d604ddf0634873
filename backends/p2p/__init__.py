"""The p2p family, commbench's own CUDA-IPC allreduce: backend (the backend, its flags and
factory), rules (variants, options, eligibility, p2p:auto's choice), kernels (compiling,
launching, the shared IPC area), layout (the kernels' contract) and allreduce.cu (the kernels)."""
