"""Sizes with K/M/G suffixes (powers of two, like nccl-tests) and dtype names."""

from __future__ import annotations

import re

import torch

from commbench.errors import UsageError

_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
           "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def parse_bytes(text: str) -> int:
    """'12K' -> 12288, '1.5M' -> 1572864; a bare number is bytes."""
    match = _SIZE_RE.match(text)
    if not match or match.group(2).upper() not in _SUFFIX:
        raise UsageError(f"malformed size {text!r}: use a number with an optional K, M or G suffix")
    value = float(match.group(1)) * _SUFFIX[match.group(2).upper()]
    if value != int(value) or value <= 0:
        raise UsageError(f"malformed size {text!r}: must be a positive whole number of bytes")
    return int(value)


def format_bytes(n: int) -> str:
    """4096 -> '4K', 1572864 -> '1.5M', 12000 -> '11.7K'."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if n % scale == 0 else f"{value:.1f}{unit}"
    return f"{n}B"


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"malformed {what} list {text!r}: expected integers separated by commas") from None
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"malformed {what} list {text!r}: expected positive integers")
    return values


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


def parse_dtypes(text: str) -> list[torch.dtype]:
    out = []
    for raw in text.split(","):
        name = _ALIASES.get(raw.strip().lower(), raw.strip().lower())
        if name not in DTYPES:
            raise UsageError(f"unknown dtype {raw.strip()!r}: choose from {', '.join(DTYPES)}")
        out.append(DTYPES[name])
    return out
