"""What a backend uses while it runs (commbench/runtime/): dtypes, the exact input patterns and
the check of every call, and the headline and jitter statistics."""

from __future__ import annotations

import pytest
import torch

from commbench.errors import UsageError
from commbench.results import percentile
from commbench.runtime.dtypes import parse_dtypes
from commbench.runtime.timing import headline_us, jitter_stats, max_over_ranks
from commbench.runtime.workload import bandwidths_gbps, exact_pattern, expected_sum, name_failure, pattern_amplitude


def test_parse_dtypes_accepts_aliases_and_rejects_unknown() -> None:
    assert parse_dtypes("bf16,half,float32") == [torch.bfloat16, torch.float16, torch.float32]
    with pytest.raises(UsageError, match="fp8"):
        parse_dtypes("fp8")


@pytest.mark.parametrize("world_size", [1, 2, 8, 64, 128])
def test_pattern_sums_are_exact_in_bf16(world_size: int) -> None:
    amp = pattern_amplitude(world_size)
    assert amp * world_size <= 256
    exact = expected_sum(3, 4099, world_size, torch.device("cpu"), torch.int64)
    in_bf16 = expected_sum(3, 4099, world_size, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(in_bf16.to(torch.int64), exact)
    ranks = [exact_pattern(r, 3, 64, world_size, torch.device("cpu"), torch.int64) for r in range(min(world_size, 4))]
    assert all(not torch.equal(ranks[0], other) for other in ranks[1:])


def test_name_failure_tells_noop_stale_unwritten_and_wrong_values_apart() -> None:
    cpu = torch.device("cpu")
    local = exact_pattern(0, 2, 100, 4, cpu, torch.float32)
    expected = expected_sum(2, 100, 4, cpu, torch.float32)
    previous = expected_sum(1, 100, 4, cpu, torch.float32)
    assert name_failure(local.clone(), expected, local, previous) == "noop"
    assert name_failure(previous.clone(), expected, local, previous) == "stale"
    assert name_failure(torch.full((100,), float("nan")), expected, local, previous) == "unwritten"
    one = expected.clone()
    one[57] += 1
    assert name_failure(one, expected, local, previous) == "values"


def test_the_headline_is_the_slowest_ranks_loop_total_and_jitter_is_kept_apart() -> None:
    assert headline_us([1000.0, 1500.0], calls=100) == {"latency_us": 15.0, "latency_rank_mean_us": 12.5}
    assert max_over_ranks([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    stats = jitter_stats([[40.0, 10.0, 30.0, 20.0, 1000.0]], calls_per_step=10)
    assert stats["jitter_p50_us"] == 3.0 and stats["jitter_min_us"] == 1.0 and stats["jitter_max_us"] == 100.0
    assert stats["jitter_samples"] == 5
    algbw, busbw = bandwidths_gbps(1 << 20, 10.0, 2 * 7 / 8)
    assert algbw == pytest.approx(104.8576) and busbw == pytest.approx(104.8576 * 14 / 8)
    assert bandwidths_gbps(1 << 20, 10.0, None)[1] is None and bandwidths_gbps(1 << 20, None, 1.0) == (None, None)
