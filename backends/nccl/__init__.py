"""The nccl family: variants (flags, variants, the factory), backend (NCCL through torch's
ProcessGroupNCCL), symm (registered symmetric windows) and libs (other libnccl builds, each in a
child torchrun of its own)."""
