"""Sizes with K/M/G suffixes (powers of two, like nccl-tests), comma lists, dtype names and
positive finite limits.

No torch here: the analysis half reads results on machines without it. The torch dtypes
behind the names are commbench.runtime.dtypes.
"""

from __future__ import annotations

import math
import re
from typing import Callable, TypeVar

from commbench.errors import UsageError

_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
           "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
T = TypeVar("T")
MAX_MESSAGE_BYTES = 1 << 50      # 1 PiB per rank: no allreduce message comes near it
# A model shape (tokens x hidden): no engine batches 16 M tokens into one step, no model has a
# hidden size of a million; the sweep and attribute take the same bounds.
MAX_TOKENS = 1 << 24
MAX_HIDDEN = 1 << 20

# dtype name -> bytes per element; aliases a user may type for them.
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def parse_bytes(text: str) -> int:
    """'12K' -> 12288, '1.5M' -> 1572864; a bare number is bytes."""
    match = _SIZE_RE.fullmatch(text)
    if not match or match.group(2).upper() not in _SUFFIX:
        raise UsageError(f"malformed size {text!r}: use a number with an optional K, M or G suffix")
    value = float(match.group(1)) * _SUFFIX[match.group(2).upper()]
    if not value <= MAX_MESSAGE_BYTES:
        raise UsageError(f"size {text[:40]!r} is larger than {format_bytes(MAX_MESSAGE_BYTES)}, the most a rank can send")
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


def parse_list(text: str, flag: str, parse_one: Callable[[str], T]) -> list[T]:
    """A flag's comma list, each entry parsed. An empty list, or an entry given twice, is bad
    input: the first would run nothing, the second measure (or print) the same row twice."""
    values = [parse_one(item.strip()) for item in text.split(",") if item.strip()]
    if not values:
        raise UsageError(f"{flag} {text!r}: the list is empty")
    for i, value in enumerate(values):
        if value in values[:i]:
            raise UsageError(f"{flag} {text!r}: {value} is listed twice")
    return values


def parse_int_list(text: str, flag: str) -> list[int]:
    """'1,8,64' -> [1, 8, 64]: positive whole numbers."""
    def one(item: str) -> int:
        try:
            value = int(item)
        except ValueError:
            raise UsageError(f"{flag} {text!r}: {item!r} is not a whole number") from None
        if value <= 0:
            raise UsageError(f"{flag} {text!r}: {value} is not positive")
        return value

    return parse_list(text, flag, one)


def shape_bytes(tokens: int, hidden: int, item_bytes: int, tokens_flag: str = "--tokens",
                hidden_flag: str = "--hidden") -> int:
    """tokens x hidden x item_bytes, each of tokens and hidden a whole number from 1 to its bound
    (so the message stays far below MAX_MESSAGE_BYTES); anything else is bad input."""
    for value, flag, bound in ((tokens, tokens_flag, MAX_TOKENS), (hidden, hidden_flag, MAX_HIDDEN)):
        if not 1 <= value <= bound:
            raise UsageError(f"{flag} must be a whole number from 1 to {bound} (got {value})")
    return tokens * hidden * item_bytes


def positive_finite(value: float, flag: str, unit: str, at_most: float = math.inf) -> float:
    """value when 0 < value <= at_most; NaN and infinity are bad input (NaN fails every
    comparison, so an unchecked NaN limit never fires, and infinity is no limit at all)."""
    if not (0 < value < math.inf and value <= at_most):
        bound = f", at most {at_most:g}" if value > at_most else ""
        raise UsageError(f"{flag} must be a positive, finite number of {unit}{bound} (got {value:g})")
    return value


def dtype_name(raw: str) -> str:
    """'half' -> 'fp16': one dtype in commbench's spelling."""
    name = DTYPE_ALIASES.get(raw.strip().lower(), raw.strip().lower())
    if name not in DTYPE_BYTES:
        raise UsageError(f"unknown dtype {raw.strip()!r}: choose from {', '.join(DTYPE_BYTES)}")
    return name


def parse_dtype_names(text: str) -> list[str]:
    """'bf16,half' -> ['bf16', 'fp16']."""
    return parse_list(text, "--dtype", dtype_name)
