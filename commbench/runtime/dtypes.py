"""The torch dtypes behind commbench's dtype names (bf16, fp16, fp32)."""

from __future__ import annotations

import torch

from commbench.units import parse_dtype_names

TORCH_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_dtypes(text: str) -> list[torch.dtype]:
    return [TORCH_DTYPES[name] for name in parse_dtype_names(text)]


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in TORCH_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")
