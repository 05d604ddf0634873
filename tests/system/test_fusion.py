"""Fused vs unfused allreduce + residual + RMSNorm: the math, the checks and the bookkeeping.

The distributed test runs ``unfused:best`` for real on gloo processes: its allreduce is a
plain gloo allreduce backend (registered here as the family ``cpugloo``) picked from measured
rows, followed by torch's residual add and RMSNorm on the CPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from commbench.backends.base import Backend, BackendFactory, BackendUnavailable
from commbench.analysis.fusion import FUSED_OP, summarize
from commbench.backends.fused import (RMS_EPS, TOLERANCE, check_fused, reference_residual_rmsnorm, residual_rmsnorm,
                                      rms_gamma)
from commbench.backends.unfused import best_allreduce_rows
from commbench.results import Measurement
import factories
from helpers import spawn_ranks


class CpuGlooAllreduce(Backend):
    """Out-of-place gloo allreduce, the plain baseline the measured rows name."""

    family = "cpugloo"
    graph_capturable = False

    def __init__(self, noop: bool = False):
        self.noop = noop
        self.name = "cpugloo:noop" if noop else "cpugloo:plain"
        self._group: Any = None

    def setup(self, ctx, max_bytes: int, dtype: torch.dtype) -> None:
        self._group = ctx.control_group

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x)
        if not self.noop:
            dist.all_reduce(out, group=self._group)


FACTORY = BackendFactory(family="cpugloo", make=lambda variant, options: [CpuGlooAllreduce(variant == "noop")])


def row(backend: str, us: float | None, **changes: Any) -> Measurement:
    """`backend`'s row taking `us`, 8 KiB unless `changes` say otherwise (factories.row)."""
    return factories.row(backend=backend, latency_us=us, **{"message_bytes": 8192, **changes})


# --- math ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_unfused_tail_matches_the_fp32_reference_within_tolerance(dtype):
    torch.manual_seed(0)
    summed = torch.randint(-8, 9, (16, 512)).to(dtype)
    residual = torch.randint(-4, 5, (16, 512)).to(dtype)
    gamma = rms_gamma(512, torch.device("cpu"), dtype)
    residual_out, norm_out = torch.empty_like(summed), torch.empty_like(summed)
    residual_rmsnorm(summed, residual, gamma, RMS_EPS, residual_out, norm_out)
    expected_residual, expected_norm = reference_residual_rmsnorm(summed, residual, gamma, RMS_EPS)
    assert torch.equal(residual_out.float(), expected_residual)
    tol = TOLERANCE[dtype]
    assert bool(((norm_out.float() - expected_norm).abs() <= tol + tol * expected_norm.abs()).all())
    # The reference really normalizes: unit RMS before gamma.
    rms = (expected_norm / gamma.float()).pow(2).mean(dim=-1).sqrt()
    nonzero = expected_residual.abs().sum(dim=-1) > 0
    assert torch.allclose(rms[nonzero], torch.ones_like(rms[nonzero]), atol=1e-4)


def test_check_fused_names_noop_stale_and_values():
    dtype = torch.bfloat16
    gamma = rms_gamma(64, torch.device("cpu"), dtype)
    x_local = torch.full((4, 64), 1.0)
    residual_in = torch.arange(64.0).repeat(4, 1) % 5
    summed_now, summed_before = x_local * 3, x_local * 2
    now = reference_residual_rmsnorm(summed_now, residual_in, gamma, RMS_EPS)
    before = reference_residual_rmsnorm(summed_before, residual_in, gamma, RMS_EPS)
    local = x_local + residual_in

    def check(residual_out: torch.Tensor, norm_out: torch.Tensor):
        return check_fused(residual_out.to(dtype), norm_out.to(dtype), now, before, local, dtype)

    assert check(*now) == (0, None)
    assert check(*before) == (4 * 64, "stale")
    noop_norm = reference_residual_rmsnorm(x_local, residual_in, gamma, RMS_EPS)[1]
    assert check(local, noop_norm)[1] == "noop"
    off_norm = now[1].clone()
    off_norm[1, 3] += 0.5
    assert check(now[0], off_norm) == (1, "values")
    assert check(now[0], torch.full_like(now[1], float("nan"))) == (4 * 64, "values")
    nan = torch.full_like(now[1], float("nan"))
    assert check(nan, nan) == (4 * 64, "unwritten")


# --- picking the baseline and pairing the rows ---------------------------------------------

def test_best_allreduce_rows_prefers_graph_and_correct_reproducible_rows():
    rows = [
        row("gloo:plain", 40.0, mode="eager"),
        row("nccl:default", 30.0),
        row("symm_mem:one_shot", 9.0),
        row("symm_mem:one_shot", 5.0, dtype="fp16"),
        row("p2p:oneshot", 3.0, status="wrong"),
        row("nccl:proto=LL", 2.0, env_setting={"NCCL_NTHREADS": "64"}),
        row("flashinfer:fused_oneshot", 1.0, op=FUSED_OP),
        row("nccl:default", 50.0, message_bytes=16384),
        row("symm_mem:two_shot", 45.0, message_bytes=16384, world_size=4),
    ]
    best = best_allreduce_rows(rows, "bf16", 2)
    assert {size: r.backend for size, r in best.items()} == {8192: "symm_mem:one_shot", 16384: "nccl:default"}
    # Without graph rows (a CPU run), eager rows are the baseline.
    assert best_allreduce_rows([rows[0]], "bf16", 2)[8192].backend == "gloo:plain"


def test_summarize_pairs_fused_with_the_unfused_baseline_of_the_same_work():
    shape = {"tokens": 4, "hidden": 1024, "message_bytes": 8192}
    rows = [
        row("gloo:plain", 30.0, mode="eager"),
        row("unfused:best", 42.0, op=FUSED_OP, mode="eager", extra={"allreduce_backend": "gloo:plain"}, **shape),
        row("unfused:best", 12.0, op=FUSED_OP, extra={"allreduce_backend": "nccl:default"}, **shape),
        row("flashinfer:fused_oneshot", 8.0, op=FUSED_OP, **shape),
        row("flashinfer:fused_twoshot", 15.0, op=FUSED_OP, **shape),
        row("flashinfer:fused_oneshot", 30.0, op=FUSED_OP, mode="eager", **shape),
        row("flashinfer:fused_oneshot", 7.0, op=FUSED_OP, tokens=8, hidden=1024, message_bytes=16384),
        row("flashinfer:fused_twoshot", None, op=FUSED_OP, status="skipped", **shape),
    ]
    out = summarize(rows)
    by_key = {(d["mode"], d["fused_backend"], d["tokens"]): d for d in out}
    assert len(out) == 4
    one = by_key[("graph", "flashinfer:fused_oneshot", 4)]
    assert (one["fused_us"], one["unfused_us"], one["saving_us"]) == (8.0, 12.0, 4.0)
    assert one["unfused_allreduce"] == "nccl:default"
    assert one["saving_pct"] == pytest.approx(100 * 4.0 / 12.0)
    assert by_key[("graph", "flashinfer:fused_twoshot", 4)]["saving_us"] == -3.0
    eager = by_key[("eager", "flashinfer:fused_oneshot", 4)]
    assert (eager["unfused_us"], eager["saving_us"], eager["unfused_allreduce"]) == (42.0, 12.0, "gloo:plain")
    lonely = by_key[("graph", "flashinfer:fused_oneshot", 8)]
    assert (lonely["unfused_us"], lonely["saving_us"]) == (None, None)
    assert summarize([r for r in rows if r.op == "allreduce"]) == []


# --- unfused:best delegates what its allreduce needs ----------------------------------------

class _RegisteringAllreduce(CpuGlooAllreduce):
    """An allreduce whose captured calls need its own graph_capture() (p2p's graph kernels, the
    engines' custom allreduce), and whose kernels record a wait that gave up."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.captures: list[str] = []
        self.gave_up: Exception | None = None

    @contextmanager
    def graph_capture(self) -> Iterator[None]:
        self.captures.append("enter")
        yield
        self.captures.append("registered")

    def raise_if_failed(self) -> None:
        if self.gave_up is not None:
            raise self.gave_up


def test_unfused_best_captures_and_checks_the_allreduce_it_picked_as_that_backend_does():
    """unfused:best's capture of a size is its chosen allreduce's capture (its buffers registered
    when it ends), and a timeout that allreduce's kernels recorded is raised through it."""
    from commbench.backends.base import BackendTimeout
    from commbench.backends.unfused import UnfusedBest
    from types import SimpleNamespace

    built: dict[str, _RegisteringAllreduce] = {}
    backend = UnfusedBest(lambda name: built.setdefault(name, _RegisteringAllreduce(name)))
    small, large = 4 * 256 * 2, 64 * 256 * 2
    backend.take_rows([row("reg:small", 5.0, message_bytes=small, world_size=1),
                       row("reg:large", 9.0, message_bytes=large, world_size=1)])
    ctx = SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu"), control_group=None, verdicts={},
                          local_world_size=1)
    backend.setup(ctx, large, torch.bfloat16)
    for tokens, name in ((4, "reg:small"), (64, "reg:large")):
        backend.make_workload(ctx, tokens * 256, torch.bfloat16, (tokens, 256), pairs=2)
        with backend.graph_capture():
            assert built[name].captures == ["enter"]
        assert built[name].captures == ["enter", "registered"]
        backend.raise_if_failed()
        built[name].gave_up = BackendTimeout(f"{name}: peer 1 never arrived")
        with pytest.raises(BackendTimeout, match=name):
            backend.raise_if_failed()
    assert built["reg:small"].captures == ["enter", "registered"]   # each size, its own allreduce
    backend.close()


# --- unfused:best for real, on gloo processes ----------------------------------------------

def _unfused_worker(rank: int, world: int, baseline: str) -> dict[str, Any]:
    from commbench import backends
    from commbench.backends.unfused import UnfusedBest
    from commbench.runtime.context import init_context, shutdown

    backends.BUILTIN["cpugloo"] = "test_fusion"
    ctx, _ = init_context(force_cpu=True, timeout_s=60)
    tokens, hidden, dtype = 6, 256, torch.bfloat16
    nbytes = tokens * hidden * dtype.itemsize
    out: dict[str, Any] = {}
    backend = UnfusedBest(backends.Options().build)   # rebuilds its allreduce as the sweep would
    backend.take_rows([row("cpugloo:plain", 50.0, mode="eager", message_bytes=nbytes, world_size=world),
                       row(baseline, 20.0, mode="eager", message_bytes=nbytes, world_size=world)])
    try:
        assert backend.check(ctx) is None
        backend.setup(ctx, nbytes, dtype)
        out["graph_capturable"] = backend.graph_capturable
        try:
            backend.make_workload(ctx, tokens * hidden * 2, dtype, (tokens * 2, hidden), pairs=4)
        except BackendUnavailable as exc:
            out["other_size"] = str(exc)
        workload = backend.make_workload(ctx, tokens * hidden, dtype, (tokens, hidden), pairs=4)
        out["fields"] = backend.row_fields()
        results_by_epoch = []
        for epoch in (1, 10):
            workload.prepare(epoch)
            for i in range(4):   # back to back, each call with its own outputs, all checked
                workload.call(i)
            check = workload.verify(0, 4)
            results_by_epoch.append((check.calls, check.wrong_calls, sorted(check.kinds)))
        out["checks"] = results_by_epoch
    finally:
        backend.close()
    shutdown()
    return out


def _run_unfused(baseline: str) -> dict[int, dict]:
    return spawn_ranks(_unfused_worker, 2, baseline)


@pytest.mark.procs
def test_unfused_best_runs_the_fastest_measured_allreduce_then_torch_norm():
    got = _run_unfused("cpugloo:plain")   # the same backend twice: the faster row wins
    for rank, out in got.items():
        assert out["checks"] == [(4, 0, []), (4, 0, [])], rank
        assert out["fields"] == {"extra": {"allreduce_backend": "cpugloo:plain", "allreduce_mode": "eager",
                                           "allreduce_us": 20.0}}
        assert out["graph_capturable"] is False
        assert out["other_size"] == ("no plain allreduce was measured correct at 6144 bytes bf16: "
                                     "run the allreduce variants on the same shapes")


@pytest.mark.procs
def test_unfused_check_catches_an_allreduce_that_does_nothing():
    got = _run_unfused("cpugloo:noop")
    for rank, out in got.items():
        assert out["fields"]["extra"]["allreduce_backend"] == "cpugloo:noop"
        assert out["checks"] == [(4, 4, ["noop"]), (4, 4, ["noop"])], rank
