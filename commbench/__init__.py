"""commbench: allreduce microbenchmarks and backend choice for tensor-parallel inference."""

__version__ = "0.1.0"
