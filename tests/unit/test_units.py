"""Sizes as users type them and as commbench prints them (commbench/units.py)."""

from __future__ import annotations

import pytest

from commbench.errors import UsageError
from commbench.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text, value", [("8", 8), ("8K", 8192), ("12k", 12288), ("1.5M", 1572864),
                                         ("2G", 2 << 30), ("64KiB", 65536)])
def test_sizes_parse_like_nccl_tests(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "K", "12Q", "-4K", "0", "1.3"])
def test_malformed_sizes_are_usage_errors(text: str) -> None:
    with pytest.raises(UsageError):
        parse_bytes(text)


def test_format_bytes_round_trips_powers_of_two() -> None:
    assert [format_bytes(n) for n in (512, 4096, 1 << 20, 3 << 30)] == ["512B", "4K", "1M", "3G"]
