"""Sizes with K/M/G suffixes (powers of two, like nccl-tests), integer lists and dtype names.

No torch here: the analysis half reads results on machines without it. The torch dtypes
behind the names are commbench.sweep.dtypes.
"""

from __future__ import annotations

import re

from commbench.errors import UsageError

_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
           "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

# dtype name -> bytes per element; aliases a user may type for them.
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


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


def parse_dtype_names(text: str) -> list[str]:
    """'bf16,half' -> ['bf16', 'fp16'], in commbench's spelling."""
    out = []
    for raw in text.split(","):
        name = DTYPE_ALIASES.get(raw.strip().lower(), raw.strip().lower())
        if name not in DTYPE_BYTES:
            raise UsageError(f"unknown dtype {raw.strip()!r}: choose from {', '.join(DTYPE_BYTES)}")
        out.append(name)
    return out
