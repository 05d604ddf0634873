# test stand-in: two environment defaults read with os.getenv
import os

environment_variables = {
    "VLLM_ALLREDUCE_USE_FLASHINFER": lambda: bool(int(os.getenv("VLLM_ALLREDUCE_USE_FLASHINFER", "1"))),
    "VLLM_SKIP_P2P_CHECK": lambda: os.getenv("VLLM_SKIP_P2P_CHECK", "0") == "1",
}
