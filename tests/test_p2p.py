"""p2p backend rules that need no GPU: variants, options, eligibility, size rules, launch
shapes, buffer plan, the crossover choice, the timeout report, and that the Python constants
match the CUDA source."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from commbench.backends import factory
from commbench.backends import p2p
from commbench.backends.base import BackendTimeout
from commbench.context import RunContext
from commbench.errors import UsageError


def ctx_for(world_size: int = 2, device: str = "cuda", local_world_size: int | None = None,
            verdicts: dict[str, str | None] | None = None) -> RunContext:
    return RunContext(rank=0, world_size=world_size, local_rank=0,
                      local_world_size=world_size if local_world_size is None else local_world_size,
                      device=torch.device(device, 0) if device == "cuda" else torch.device("cpu"),
                      control_group=None, verdicts=verdicts or {})


def backend(variant: str = "oneshot", **options) -> p2p.P2PAllreduce:
    return p2p.make(variant, options)[0]


@pytest.fixture
def fake_gpus(monkeypatch):
    """A node with `count` GPUs where `blocked` pairs have no peer access; cupy 'installed'."""
    def install(count: int = 8, blocked: frozenset[tuple[int, int]] = frozenset()) -> None:
        monkeypatch.setattr(p2p, "_cupy", lambda: object())
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) not in blocked)
    return install


# -- factory and options ------------------------------------------------------------------

def test_registry_exposes_the_family_and_its_default_variants():
    fac = factory("p2p")
    assert fac.family == "p2p"
    assert [b.name for b in fac.make(None, {})] == ["p2p:oneshot", "p2p:twoshot", "p2p:auto"]
    assert [b.name for b in fac.make("oneshot_pull", {})] == ["p2p:oneshot_pull"]
    assert all(b.node_local and b.graph_capturable for b in fac.make(None, {}))


def test_unknown_variant_is_a_usage_error_naming_the_choices():
    with pytest.raises(UsageError, match="oneshot, oneshot_pull, twoshot, auto"):
        p2p.make("threeshot", {})


def test_options_accept_numbers_and_size_strings():
    opts = p2p.P2POptions.from_options({"p2p_max_bytes": "4M", "p2p_crossover_bytes": 65536, "p2p_timeout_ms": 250})
    assert (opts.max_bytes, opts.crossover_bytes, opts.timeout_ms) == (4 << 20, 65536, 250.0)
    defaults = p2p.P2POptions.from_options({})
    assert (defaults.max_bytes, defaults.crossover_bytes) == (8 << 20, None)


@pytest.mark.parametrize("options, message", [
    ({"p2p_max_bytes": 1000}, "not a multiple of 16"),
    ({"p2p_max_bytes": -16}, "positive number of bytes"),
    ({"p2p_timeout_ms": 0}, "must be positive"),
])
def test_bad_options_are_usage_errors(options, message):
    with pytest.raises(UsageError, match=message):
        p2p.P2POptions.from_options(options)


# -- eligibility -------------------------------------------------------------------------

def test_world_size_rules():
    assert backend("oneshot").check(ctx_for(world_size=9, device="cpu")) == \
        "supports at most 8 ranks, this run has 9"
    # World size 1 is the kernel floor: plain one-shot only.
    assert backend("twoshot").check(ctx_for(world_size=1, device="cpu")) == "needs at least 2 ranks, this run has 1"
    assert "node-local" in backend("auto").check(ctx_for(world_size=8, local_world_size=4))


def test_needs_cuda_then_cupy(monkeypatch):
    assert "needs CUDA" in backend().check(ctx_for(device="cpu"))
    monkeypatch.setattr(p2p, "_cupy", lambda: None)
    assert backend().check(ctx_for()).startswith("cupy not installed")


def test_probe_verdicts_decide_when_present(fake_gpus):
    fake_gpus(count=4, blocked=frozenset({(0, 3)}))
    verdict = "P2P write/read between GPU 1 and GPU 2 failed"
    assert backend("auto").check(ctx_for(4, verdicts={"p2p:auto": verdict})) == verdict
    assert backend("auto").check(ctx_for(4, verdicts={"p2p": verdict})) == verdict
    # A verdict of None (eligible) is trusted over CUDA's own answer.
    assert backend("auto").check(ctx_for(4, verdicts={"p2p:auto": None})) is None


def test_without_verdicts_every_gpu_pair_needs_peer_access(fake_gpus):
    fake_gpus(count=4, blocked=frozenset({(0, 3)}))
    assert backend().check(ctx_for(4)) == "no peer access from cuda:0 to cuda:3 (CUDA reports no P2P between them)"
    assert backend().check(ctx_for(3)) is None        # ranks 0..2 use cuda:0..2 only


def test_pcie_with_more_than_two_gpus_is_not_switched_off(fake_gpus):
    fake_gpus(count=8)           # no NVLink question is asked: working P2P is enough
    assert all(b.check(ctx_for(8)) is None for b in p2p.make(None, {}))


def test_ranks_sharing_one_gpu_need_no_peer_access(fake_gpus):
    fake_gpus(count=1, blocked=frozenset({(0, 0)}))
    assert backend().check(ctx_for(8)) is None


# -- size and dtype rules ----------------------------------------------------------------

@pytest.mark.parametrize("nbytes, reason", [
    (0, "at least 16 bytes"),
    (8, "at least 16 bytes"),
    (40, "40 B is not a multiple of 16"),
    ((8 << 20) + 16, "exceeds the p2p buffer of 8M (raise p2p_max_bytes)"),
])
def test_sizes_refused_with_a_reason(nbytes, reason):
    assert reason in backend().supports(nbytes, torch.bfloat16)


@pytest.mark.parametrize("nbytes", [16, 48, 4096 + 16, 8 << 20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sizes_accepted(nbytes, dtype):
    assert backend().supports(nbytes, dtype) is None


def test_configured_maximum_applies():
    small = backend(p2p_max_bytes="64K")
    assert small.supports(65536, torch.float32) is None
    assert "exceeds the p2p buffer of 64K" in small.supports(65536 + 16, torch.float32)


def test_other_dtypes_refused():
    assert backend().supports(64, torch.int32) == "dtype int32 not supported"


# -- launch shape and buffer plan ----------------------------------------------------------

def test_grid_depends_only_on_size_and_world():
    assert p2p.grid_blocks(p2p.ONESHOT_PUSH, 1, 8) == 1
    assert p2p.grid_blocks(p2p.ONESHOT_PUSH, 513, 8) == 2
    assert p2p.grid_blocks(p2p.ONESHOT_PUSH, (8 << 20) // 16, 8) == p2p.MAX_BLOCKS
    # Two-shot sizes its grid by one rank's slice.
    assert p2p.grid_blocks(p2p.TWOSHOT, 4 * 512 + 1, 4) == 2
    assert p2p.grid_blocks(p2p.TWOSHOT, 3, 8) == 1


def test_area_plan_allocates_only_what_the_kernels_use_without_overlap():
    slot = 1 << 20
    push = p2p.plan_areas(p2p.VARIANTS["oneshot"], 4, slot)
    assert push.gather is None and push.stage is None and push.recv >= p2p.FLAG_AREA_BYTES
    pull = p2p.plan_areas(p2p.VARIANTS["oneshot_pull"], 4, slot)
    assert pull.recv is None and pull.gather is None
    auto = p2p.plan_areas(p2p.VARIANTS["auto"], 4, slot)
    spans = sorted([(0, p2p.FLAG_AREA_BYTES), (auto.recv, auto.recv + 2 * 4 * slot),
                    (auto.gather, auto.gather + 2 * slot)])
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] == auto.total_bytes
    assert all(offset % p2p.AREA_ALIGN_BYTES == 0 for offset in (auto.recv, auto.gather))


# -- crossover choice --------------------------------------------------------------------

SIZES = [4096, 16384, 65536, 262144, 1 << 20, 4 << 20]


def test_crossover_is_where_two_shot_starts_winning_for_good():
    one = [5.0, 5.5, 7.0, 12.0, 30.0, 100.0]
    two = [8.0, 8.2, 8.5, 10.0, 20.0, 60.0]
    assert p2p.choose_crossover(SIZES, one, two) == 262144


def test_an_early_two_shot_win_that_does_not_last_is_ignored():
    one = [5.0, 9.0, 7.0, 12.0, 30.0, 100.0]
    two = [8.0, 6.0, 8.5, 10.0, 20.0, 60.0]
    assert p2p.choose_crossover(SIZES, one, two) == 262144


def test_no_crossover_when_one_shot_holds_at_the_largest_size():
    one = [5.0, 5.5, 7.0, 12.0, 30.0, 50.0]
    two = [8.0, 8.2, 6.5, 10.0, 20.0, 60.0]
    assert p2p.choose_crossover(SIZES, one, two) is None


def test_ties_within_the_margin_stay_one_shot():
    assert p2p.choose_crossover([4096, 8192], [10.0, 10.0], [9.9, 9.0]) == 8192
    assert p2p.choose_crossover([4096, 8192], [10.0, 10.0], [5.0, 9.9]) is None


def test_two_shot_everywhere_gives_the_smallest_size_and_order_does_not_matter():
    assert p2p.choose_crossover(SIZES[::-1], [9.0] * 6, [3.0] * 6) == 4096


def test_crossover_needs_one_time_per_size():
    with pytest.raises(ValueError):
        p2p.choose_crossover(SIZES, [1.0], [1.0])


def test_the_slowest_rank_counts():
    per_rank = [{"oneshot_push": [1.0, 5.0], "twoshot_push": [2.0, 3.0]},
                {"oneshot_push": [1.5, 4.0], "twoshot_push": [2.5, 2.0]}]
    assert p2p.slowest_rank_times(per_rank) == {"oneshot_push": [1.5, 5.0], "twoshot_push": [2.5, 3.0]}


def test_auto_with_a_given_crossover_splits_by_size_and_records_it():
    auto = backend("auto", p2p_crossover_bytes="64K")
    assert auto.algorithm_for(65536 - 16, torch.bfloat16) == p2p.ONESHOT_PUSH
    assert auto.algorithm_for(65536, torch.bfloat16) == p2p.TWOSHOT
    auto._dtype = torch.bfloat16
    extra = auto.row_fields()["extra"]
    assert (extra["p2p_crossover_bytes"], extra["p2p_crossover_source"]) == (65536, "option")
    assert backend("oneshot_pull").algorithm_for(1 << 20, torch.float32) == p2p.ONESHOT_PULL


# -- the timeout report ------------------------------------------------------------------

def test_a_recorded_timeout_becomes_a_clear_error_before_any_launch():
    report = (ctypes.c_uint32 * 4)(1, 3, 17, 0)
    b = backend(p2p_timeout_ms=300)
    area = p2p._SharedArea(ctx_for(4), p2p.plan_areas(b.algorithms, 4, 4096), b.options.timeout_ms)
    area.report = ctypes.addressof(report)
    b._area = area
    expected = r"^p2p: peer rank 3 did not arrive within 300 ms \(rank 0, call 17, first barrier\)"
    with pytest.raises(p2p.P2PTimeoutError, match=expected):
        b.raise_if_failed()
    with pytest.raises(p2p.P2PTimeoutError, match=expected):
        b.allreduce(torch.zeros(8))
    # The sweep verifies after it synchronised: a timeout inside graph replays surfaces there.
    workload = b.make_workload(ctx_for(4, device="cpu"), 8, torch.float32, None)
    with pytest.raises(BackendTimeout, match=expected):
        workload.verify(1, None)
    report[0] = 0
    b.raise_if_failed()           # nothing recorded: no error
    area.report = 0               # keep release() away from this fake report


# -- the CUDA source matches the Python side ------------------------------------------------

def test_cuda_source_constants_match():
    source = p2p.KERNEL_SOURCE.read_text()
    assert int(re.search(r"#define P2P_MAX_RANKS (\d+)", source).group(1)) == p2p.MAX_RANKS
    assert int(re.search(r"#define P2P_MAX_BLOCKS (\d+)", source).group(1)) == p2p.MAX_BLOCKS
    assert set(re.findall(r"__launch_bounds__\((\d+)\)", source)) == {str(p2p.THREADS_PER_BLOCK)}
    layout = re.search(r"struct Layout \{(.*?)\};", source, re.S).group(1)
    fields = re.findall(r"^\s*u64 (\w+)(\[P2P_MAX_RANKS\])?;", layout, re.M)
    words = sum(p2p.MAX_RANKS if array else 1 for _, array in fields)
    assert words == p2p.LAYOUT_WORDS
    assert [name for name, _ in fields][:4] == ["flags", "recv", "gather", "stage"]
    for name in p2p.KERNEL_NAMES.values():
        assert f"void __launch_bounds__({p2p.THREADS_PER_BLOCK}) {name}(" in source
