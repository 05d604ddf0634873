"""p2p backend rules that need no GPU: variants, options, eligibility, size and tensor rules,
launch shapes and the grid cap, buffer plan and Layout words, p2p:auto's rule, the timeout report,
PDL (the decision, its reasons, the launch parameters and the call into cuda-python), and that the
Python constants match the CUDA source."""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import statistics
import struct
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from commbench.backends import factory
from commbench.backends.p2p import backend as p2p, kernels as p2p_kernels, layout as p2p_layout, rules as p2p_rules
from commbench.backends.p2p import variants as p2p_variants
from commbench.backends.base import Backend, BackendTimeout, BackendUnavailable
from commbench.probe.verdicts import run_verdicts
from commbench.runtime.context import Emulation, RunContext
from commbench.errors import UsageError
from helpers import installed_module


def ctx_for(world_size: int = 2, device: str = "cuda", local_world_size: int | None = None,
            verdicts: dict[str, str | None] | None = None) -> RunContext:
    return RunContext(rank=0, world_size=world_size, local_rank=0,
                      local_world_size=world_size if local_world_size is None else local_world_size,
                      device=torch.device(device, 0) if device == "cuda" else torch.device("cpu"),
                      control_group=None, verdicts=verdicts or {})


def backend(variant: str = "oneshot", **options) -> p2p.P2PAllreduce:
    return factory("p2p").variants(variant, p2p_rules.P2POptions.from_options(options))[0]


@pytest.fixture
def fake_gpus(monkeypatch):
    """A node with `count` GPUs where `blocked` pairs have no peer access; cupy 'installed'."""
    def install(count: int = 8, blocked: frozenset[tuple[int, int]] = frozenset()) -> None:
        installed_module(monkeypatch, "cupy")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) not in blocked)
    return install


# -- factory and options ------------------------------------------------------------------

def test_registry_exposes_the_family_and_its_default_variants():
    fac = factory("p2p")
    assert fac.family == "p2p"
    assert [b.name for b in fac.variants(None)] == ["p2p:oneshot_lamport", "p2p:oneshot", "p2p:twoshot_lamport",
                                                    "p2p:twoshot", "p2p:auto"]
    assert [b.name for b in fac.variants("oneshot_pull")] == ["p2p:oneshot_pull"]
    assert all(b.node_local and b.graph_capturable for b in fac.variants(None))


def test_unknown_variant_is_a_usage_error_naming_the_choices():
    with pytest.raises(UsageError, match="oneshot_lamport, oneshot, oneshot_pull, twoshot_lamport, twoshot, oneshot_graph, twoshot_graph, auto, fused, fused_oneshot, fused_twoshot"):
        factory("p2p").variants("threeshot")


def test_options_accept_numbers_and_size_strings():
    opts = p2p_rules.P2POptions.from_options({"p2p_max_bytes": "4M", "p2p_auto_rule": "oneshot_lamport<=64K, twoshot",
                                        "p2p_timeout_ms": 250})
    assert (opts.max_bytes, opts.auto_rule, opts.timeout_ms) == \
        (4 << 20, ((65536, p2p_layout.ONESHOT_LL), (None, p2p_layout.TWOSHOT)), 250.0)
    defaults = p2p_rules.P2POptions.from_options({})
    assert (defaults.max_bytes, defaults.auto_rule) == (8 << 20, None)


def test_an_auto_rule_reads_back_as_it_was_written():
    text = "oneshot_lamport<=4K,oneshot<=64K,twoshot_lamport<=4M,twoshot"
    rule = p2p_rules.parse_auto_rule(text)
    assert p2p_rules.format_auto_rule(rule) == text
    assert [p2p_rules.rule_kernel(rule, n) for n in (16, 4096, 4112, 65536, 4 << 20, 8 << 20)] == \
        [p2p_layout.ONESHOT_LL, p2p_layout.ONESHOT_LL, p2p_layout.ONESHOT_PUSH, p2p_layout.ONESHOT_PUSH,
         p2p_layout.TWOSHOT_LL, p2p_layout.TWOSHOT]


@pytest.mark.parametrize("options, message", [
    ({"p2p_max_bytes": 1000}, "not a multiple of 16"),
    ({"p2p_max_bytes": -16}, "positive number of bytes"),
    ({"p2p_timeout_ms": 0}, "must be positive"),
    ({"p2p_auto_rule": "oneshot_push<=4K,twoshot"}, "unknown kernel 'oneshot_push'"),
    ({"p2p_auto_rule": "oneshot<=4K"}, "the last none"),
    ({"p2p_auto_rule": "oneshot,twoshot"}, "needs '<=SIZE'"),
    ({"p2p_auto_rule": "oneshot<=64K,twoshot<=4K,twoshot_lamport"}, "sizes must grow"),
    ({"p2p_auto_rule": "oneshot<=lots,twoshot"}, "lots"),
    ({"p2p_threads": 100}, "multiple of 32 from 32 to 512"),
    ({"p2p_threads": 1024}, "multiple of 32 from 32 to 512"),
    ({"p2p_threads": "many"}, "whole number"),
    ({"p2p_vectors_per_thread": 0}, "from 1 to 16"),
    ({"p2p_pdl": "maybe"}, "p2p_pdl must be on or off, got 'maybe'"),
])
def test_bad_options_are_usage_errors(options, message):
    with pytest.raises(UsageError, match=message):
        p2p_rules.P2POptions.from_options(options)


# -- eligibility -------------------------------------------------------------------------

def test_world_size_rules():
    assert backend("oneshot").check(ctx_for(world_size=9, device="cpu")) == \
        "supports at most 8 ranks, this run has 9"
    # World size 1 is the kernel floor: plain one-shot only.
    assert backend("twoshot").check(ctx_for(world_size=1, device="cpu")) == "needs at least 2 ranks, this run has 1"
    assert "node-local" in backend("auto").check(ctx_for(world_size=8, local_world_size=4))


def test_needs_cuda_then_cupy(monkeypatch):
    assert "needs CUDA" in backend().check(ctx_for(device="cpu"))
    monkeypatch.setitem(sys.modules, "cupy", None)      # a machine without cupy: the import fails
    assert backend().check(ctx_for()) == "cupy not installed (pip install cupy-cuda12x or cupy-cuda13x)"


def test_the_cupy_check_is_the_declared_requirement(monkeypatch):
    # The base software_reason answers for every variant, in the wording of every declared package.
    assert p2p.P2PAllreduce.software_reason is Backend.software_reason
    monkeypatch.setitem(sys.modules, "cupy", None)
    for b in map(backend, p2p_rules.VARIANTS):
        assert b.requires is p2p.REQUIRES
        assert b.software_reason() == p2p.REQUIRES.reason() == "cupy not installed (pip install cupy-cuda12x or cupy-cuda13x)"
    installed_module(monkeypatch, "cupy")
    assert backend().software_reason() is None


def test_without_cupy_the_sweep_skips_p2p_with_the_declared_reason(monkeypatch):
    # The sweep's verdicts on a machine whose fabric p2p suits (8 H200 on NVLink): what check()
    # votes on, so every row of every variant is skipped with the declared words.
    snapshot = json.loads((Path(__file__).parents[1] / "fixtures/snapshots/h200-nvlink-8x.json").read_text())
    variants = [backend(name) for name in p2p_rules.VARIANTS]
    installed_module(monkeypatch, "cupy")
    assert set(run_verdicts(variants, snapshot, 8, False).values()) == {None}
    monkeypatch.setitem(sys.modules, "cupy", None)
    verdicts = run_verdicts(variants, snapshot, 8, False)
    assert {b.check(ctx_for(8, verdicts=verdicts)) for b in variants} == {p2p.REQUIRES.reason()}


def test_a_cupy_that_does_not_import_says_why(monkeypatch, tmp_path):
    # Installed but broken (no CUDA runtime for it): not "not installed", which would send the
    # user to install what is there.
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    (tmp_path / "cupy.py").write_text("raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert backend().check(ctx_for()) == ("cupy is installed but does not import: "
                                          "ImportError: libcudart.so.13: cannot open shared object file")


def test_probe_verdicts_decide_when_present(fake_gpus):
    fake_gpus(count=4, blocked=frozenset({(0, 3)}))
    verdict = "P2P write/read between GPU 1 and GPU 2 failed"
    assert backend("auto").check(ctx_for(4, verdicts={"p2p:auto": verdict})) == verdict
    # A verdict of None (eligible) is trusted over CUDA's own answer.
    assert backend("auto").check(ctx_for(4, verdicts={"p2p:auto": None})) is None


def test_without_verdicts_every_gpu_pair_needs_peer_access(fake_gpus):
    fake_gpus(count=4, blocked=frozenset({(0, 3)}))
    assert backend().check(ctx_for(4)) == "no peer access from cuda:0 to cuda:3 (CUDA reports no P2P between them)"
    assert backend().check(ctx_for(3)) is None        # ranks 0..2 use cuda:0..2 only


def test_pcie_with_more_than_two_gpus_is_not_switched_off(fake_gpus):
    fake_gpus(count=8)           # no NVLink question is asked: working P2P is enough
    assert all(b.check(ctx_for(8)) is None for b in factory("p2p").variants(None))


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

def dims(algorithm: str, units: int, world: int = 8, cap: int = 64, sms: int = 132,
         shape: p2p_layout.LaunchShape = p2p_layout.LaunchShape()) -> tuple[int, int]:
    return p2p_layout.launch_dims(algorithm, units, world, cap, sms, shape)


def test_grid_depends_only_on_size_world_and_the_agreed_cap_and_sms():
    assert dims(p2p_layout.ONESHOT_PUSH, 1) == (1, 32)
    assert dims(p2p_layout.ONESHOT_PUSH, 513) == (5, 128)
    assert dims(p2p_layout.ONESHOT_PUSH, (8 << 20) // 16) == (p2p_layout.MAX_BLOCKS, 512)
    # Two-shot sizes its grid by one rank's slice, Lamport or not.
    assert dims(p2p_layout.TWOSHOT, 4 * 512 + 1, world=4) == (5, 128)
    assert dims(p2p_layout.TWOSHOT_LL, 4 * 512 + 1, world=4) == (5, 128)
    assert dims(p2p_layout.ONESHOT_LL, 4 * 512 + 1, world=2) == (17, 128)
    assert dims(p2p_layout.TWOSHOT, 3) == (1, 32)


def test_blocks_spread_one_per_sm_with_the_fewest_threads_that_fit():
    # 14 SMs (one of 8 MPS clients at 12%): 64 KiB one-shot is 4096 vectors, 8 blocks of 512.
    assert dims(p2p_layout.ONESHOT_LL, 4096, world=2, sms=14, cap=28) == (8, 512)
    assert dims(p2p_layout.ONESHOT_LL, 1024, world=2, sms=14, cap=28) == (8, 128)
    # 256 KiB two-shot at 8 ranks: a 2048-vector slice, 8 blocks of 256.
    assert dims(p2p_layout.TWOSHOT_LL, 16384, sms=14, cap=28) == (8, 256)
    # More work than the SMs hold at 512 threads a block: 512 threads, as many blocks as the cap.
    assert dims(p2p_layout.ONESHOT_LL, 1 << 18, sms=14, cap=28) == (28, 512)
    assert p2p_layout.size_dims(4096, 28, 14) == (8, 512)
    assert p2p_layout.spread_threads(66 * 128, 66) == 128 and p2p_layout.spread_threads(66 * 128 + 1, 66) == 256


@pytest.mark.parametrize("units, cap, sms, expected", [
    (256, 28, 14, (8, 32)),        # 8 ranks under MPS (14 SMs, cap 28), 4K: a warp in each of 8 blocks
    (512, 28, 14, (8, 64)),        # 8K: 16 warps over 14 SMs take 2 a block; only the 8 blocks that hold them
    (4096, 28, 14, (13, 320)),     # 64K: 10 warps a block, 13 blocks
    (2048, 64, 32, (32, 64)),      # 4 ranks (32 SMs), 32K
    (256, 4, 16, (4, 64)),         # the agreed cap bounds the blocks before the SMs do
    (4096, 64, 132, (64, 64)),     # a whole H200: MAX_BLOCKS does
    (16384, 64, 16, None),         # 1024 threads a block: not this shape
])
def test_warp_spread_spreads_a_messages_warps_over_the_sms_first(units, cap, sms, expected):
    assert p2p_layout.warp_spread(units, cap, sms) == expected


def test_the_own_slot_lamport_one_shot_spreads_its_warps_and_no_other_launch_does():
    # Above 2 ranks up to LL_OWN_SLOT_UNITS the launch runs the own-slot form: spread.
    assert dims(p2p_layout.ONESHOT_LL, 256, world=8, cap=28, sms=14) == (8, 32)
    assert dims(p2p_layout.ONESHOT_LL, 4096, world=4, cap=64, sms=32) == (32, 128)
    # the same sizes at 2 ranks, another kernel, a larger message or a shape set by option: by size
    assert dims(p2p_layout.ONESHOT_LL, 256, world=2, cap=28, sms=14) == (2, 128)
    assert dims(p2p_layout.ONESHOT_PUSH, 256, world=8, cap=28, sms=14) == (2, 128)
    big = p2p_layout.LL_OWN_SLOT_UNITS + 16
    assert dims(p2p_layout.ONESHOT_LL, big, world=8, cap=28, sms=14) == p2p_layout.size_dims(big, 28, 14)
    shape = p2p_layout.LaunchShape(threads=128)
    assert dims(p2p_layout.ONESHOT_LL, 256, world=8, cap=28, sms=14, shape=shape) == (2, 128)


def test_one_block_launches_take_only_the_warps_their_work_needs():
    assert dims(p2p_layout.ONESHOT_LL, 1, world=2) == (1, 32)
    assert dims(p2p_layout.ONESHOT_LL, 100, world=2) == (1, 128)
    assert dims(p2p_layout.ONESHOT_LL, 100, world=2, sms=1) == (1, 128)
    assert dims(p2p_layout.ONESHOT_LL, 257, world=2, sms=1) == (1, 288)
    assert dims(p2p_layout.TWOSHOT_LL, 256) == (1, 32)                    # a 32-vector slice
    assert p2p_layout.WARP_THREADS >= p2p_layout.MAX_RANKS


def test_options_fix_the_threads_and_the_vectors_per_thread():
    # Four vectors a thread: a quarter of the blocks, and single blocks a quarter of the threads.
    shape = p2p_layout.LaunchShape(threads=256, vectors_per_thread=4)
    assert dims(p2p_layout.ONESHOT_LL, 4096, shape=shape) == (4, 256)
    assert dims(p2p_layout.ONESHOT_LL, 256, shape=shape) == (1, 64)
    assert p2p_rules.P2POptions.from_options({"p2p_threads": "256", "p2p_vectors_per_thread": 4}).shape == shape
    assert p2p_rules.P2POptions.from_options({}).shape == p2p_layout.LaunchShape(None, 1)


def test_grid_never_exceeds_the_agreed_cap():
    assert dims(p2p_layout.ONESHOT_PUSH, (8 << 20) // 16, cap=16) == (16, 512)
    assert dims(p2p_layout.TWOSHOT, (8 << 20) // 16, cap=3) == (3, 512)
    assert dims(p2p_layout.ONESHOT_PUSH, 513, cap=16) == (5, 128)     # small messages stay small


H200_SMS = 132


def shared_gpu(ranks: int, mps: bool | None, sm_percent: float | None = None) -> Emulation:
    return Emulation(gpus=1, ranks=ranks, mps=mps, sm_percent=sm_percent)


def test_one_gpu_per_rank_gets_the_whole_gpu():
    capacity = p2p_layout.grid_capacity(2, H200_SMS, None)
    assert (capacity.sms, capacity.blocks) == (H200_SMS, 264)
    assert capacity.refusal() is None


def test_ranks_taking_turns_each_get_the_whole_gpu():
    # Time slicing: a rank's spinning blocks are preempted, and while it runs the GPU is its own.
    assert p2p_layout.grid_capacity(1, H200_SMS, shared_gpu(8, mps=False)).blocks == H200_SMS


def test_eight_ranks_under_mps_without_an_sm_limit_get_one_block_per_sm_of_a_fair_split():
    # The deadlock of the old fixed grid: 256 KiB wanted 32 blocks per rank, 8 x 32 > 132 SMs;
    # two blocks per SM (the occupancy API's answer) deadlocked too.
    capacity = p2p_layout.grid_capacity(2, H200_SMS, shared_gpu(8, mps=True))
    assert (capacity.sms, capacity.blocks) == (16, 16)
    assert dims(p2p_layout.ONESHOT_PUSH, (256 << 10) // 16, cap=capacity.blocks, sms=capacity.sms) == (16, 512)


def test_an_unknown_mps_answer_counts_as_mps():
    assert p2p_layout.grid_capacity(2, H200_SMS, shared_gpu(8, mps=None)).blocks == 16


# Under MPS with an SM share CUDA reports the client's share: 14 SMs at 12% on an H200.
@pytest.mark.parametrize("sm_percent, reported_sms, sms, blocks", [
    (12, 14, 14, 28),       # 8 x 12% fits the GPU: each client has SMs of its own
    (12.5, 16, 16, 32),
    (50, 66, 16, 16),       # 8 x 50% overlap: one block per SM of a fair split
])
def test_an_mps_sm_share_is_the_clients_own_unless_shares_overlap(sm_percent, reported_sms, sms, blocks):
    capacity = p2p_layout.grid_capacity(2, reported_sms, shared_gpu(8, mps=True, sm_percent=sm_percent))
    assert (capacity.sms, capacity.blocks) == (sms, blocks)


def test_an_sm_share_without_mps_means_nothing():
    assert p2p_layout.grid_capacity(1, H200_SMS, shared_gpu(8, mps=False, sm_percent=12.5)).blocks == H200_SMS


def test_no_block_fitting_is_refused_with_what_would_help():
    capacity = p2p_layout.grid_capacity(2, H200_SMS, shared_gpu(200, mps=True))
    assert capacity.blocks == 0
    assert capacity.refusal() == (
        "p2p needs every block of every rank resident at once, but this rank may count on 0 SMs "
        "(1 block(s) per SM): run fewer ranks per GPU or give each MPS client a larger SM share "
        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)")


def grid_setup(monkeypatch, emulation: Emulation, peer_blocks: int) -> tuple[p2p.P2PAllreduce, RunContext]:
    """A backend whose kernels fit 1 block per SM of an H200, and a two-rank context whose
    peer reports `peer_blocks`."""
    monkeypatch.setattr(p2p, "kernel_blocks_per_sm", lambda device, functions, algorithms: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=H200_SMS))
    ctx = replace(ctx_for(2), emulation=emulation)
    # One gather carries each rank's (refusal, (cap, sms)); the peer has no refusal.
    monkeypatch.setattr(RunContext, "all_gather_objects", lambda self, obj: [obj, (None, (peer_blocks, 10))])
    b = backend("auto")
    b._functions[torch.bfloat16] = {}
    return b, ctx


def test_every_rank_takes_the_smallest_ranks_cap(monkeypatch):
    b, ctx = grid_setup(monkeypatch, shared_gpu(2, mps=True), peer_blocks=20)
    assert b._agree_grid(ctx, torch.bfloat16) == (20, 10)        # this rank fits 66 on 66 SMs
    b, ctx = grid_setup(monkeypatch, shared_gpu(2, mps=True), peer_blocks=100)
    assert b._agree_grid(ctx, torch.bfloat16) == (p2p_layout.MAX_BLOCKS, 10)


def test_setup_refuses_when_not_one_block_per_rank_fits(monkeypatch):
    b, ctx = grid_setup(monkeypatch, shared_gpu(200, mps=True), peer_blocks=1)
    with pytest.raises(BackendUnavailable, match=r"^p2p grid sizing failed on rank 0: p2p needs every block .*"
                                                 r"count on 0 SMs .*fewer ranks per GPU"):
        b._agree_grid(ctx, torch.bfloat16)


def test_rows_record_the_grid_cap_and_the_launch_shape():
    b = backend("oneshot")
    b._dtype = torch.bfloat16
    assert "p2p_grid_cap_blocks" not in b.row_fields()["extra"]     # before setup
    b._grids[torch.bfloat16] = (16, 14)
    extra = b.row_fields()["extra"]
    assert (extra["p2p_grid_cap_blocks"], extra["p2p_grid_sms"]) == (16, 14)
    assert (extra["p2p_threads"], extra["p2p_vectors_per_thread"]) == ("by size", 1)


# -- tensors a launch accepts ----------------------------------------------------------------

CPU = torch.device("cpu")


def test_contiguous_aligned_matching_tensors_are_accepted():
    buffer = torch.zeros(64)
    assert p2p_rules.tensor_reason(buffer[4:20], buffer[20:36], CPU) is None      # 16-byte offsets


@pytest.mark.parametrize("x, out, reason", [
    (torch.zeros(20)[1:17], torch.zeros(16), r"^x is not 16-byte aligned \(address 0x[0-9a-f]+\)"),
    (torch.zeros(16), torch.zeros(20)[3:19], r"^out is not 16-byte aligned"),
    (torch.zeros(32)[::2], torch.zeros(16), r"^x is not contiguous"),
    (torch.zeros(16), torch.zeros(4, 8)[:, :4], r"^out is not contiguous"),
    (torch.zeros(16), torch.zeros(16, dtype=torch.bfloat16), r"does not match x"),
    (torch.zeros(16), torch.zeros(12), r"^out \(12 x torch.float32\) does not match x \(16 x torch.float32\)"),
])
def test_tensors_that_would_fault_are_refused(x, out, reason):
    assert re.search(reason, p2p_rules.tensor_reason(x, out, CPU))


def test_tensors_on_another_device_are_refused():
    assert p2p_rules.tensor_reason(torch.zeros(16), torch.zeros(16), torch.device("cuda", 0)) == \
        "x is on cpu, this rank runs on cuda:0"


def test_allreduce_refuses_a_misaligned_view_before_any_launch(monkeypatch):
    b = backend("oneshot")
    b._ctx = ctx_for(2, device="cpu")
    b._area = p2p_kernels.SharedArea(b._ctx, p2p_layout.plan_areas(b.algorithms, 2, 4096), b.options.timeout_ms)
    b._grids[torch.float32] = (8, 8)
    launched = []
    monkeypatch.setattr(b, "_launch", lambda algorithm, x, out: launched.append((x.data_ptr(), out.data_ptr())))
    buffer = torch.zeros(64)
    with pytest.raises(ValueError, match=r"^p2p:oneshot: x is not 16-byte aligned"):
        b.allreduce(buffer[1:17], buffer[32:48])
    assert launched == []
    b.allreduce(buffer[4:20], buffer[32:48])
    assert launched == [(buffer[4:].data_ptr(), buffer[32:].data_ptr())]


def test_area_plan_allocates_only_what_the_kernels_use_without_overlap():
    slot = 1 << 20
    push = p2p_layout.plan_areas(p2p_rules.VARIANTS["oneshot"], 4, slot)
    assert push.gather is None and push.stage is None and push.recv >= p2p_layout.FLAG_AREA_BYTES
    pull = p2p_layout.plan_areas(p2p_rules.VARIANTS["oneshot_pull"], 4, slot)
    assert pull.recv is None and pull.gather is None
    lamport = p2p_layout.plan_areas(p2p_rules.VARIANTS["oneshot_lamport"], 4, slot)
    assert (lamport.recv, lamport.gather, lamport.ll_rs) == (None, None, None)
    assert lamport.lamport_spans == ((lamport.ll, 2 * 4 * slot),)     # the one-shot rotates two buffers
    auto = p2p_layout.plan_areas(p2p_rules.VARIANTS["auto"], 4, slot)
    assert auto.stage is None and auto.slice_bytes == slot // 4
    spans = sorted([(0, p2p_layout.FLAG_AREA_BYTES), (auto.recv, auto.recv + 2 * 4 * slot),
                    (auto.gather, auto.gather + 2 * slot), (auto.ll, auto.ll + 2 * 4 * slot),
                    (auto.ll_rs, auto.ll_rs + 3 * 4 * auto.slice_bytes), (auto.ll_ag, auto.ll_ag + 3 * slot)])
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] == auto.total_bytes
    assert all(offset % p2p_layout.AREA_ALIGN_BYTES == 0 for offset in (auto.recv, auto.gather, auto.ll, auto.ll_rs))
    # Only the Lamport areas start filled with LL_EMPTY, and all of each of them.
    filled = auto.lamport_spans
    assert [start for start, _ in filled] == [auto.ll, auto.ll_rs, auto.ll_ag]
    assert all(nbytes >= need for (_, nbytes), need in zip(filled, (2 * 4 * slot, 3 * slot, 3 * slot)))


def test_two_shot_slices_round_up_to_whole_vectors():
    plan = p2p_layout.plan_areas(p2p_rules.VARIANTS["twoshot_lamport"], 3, 1040)     # 65 vectors over 3 ranks
    assert plan.slice_bytes == 22 * 16


def test_layout_words_follow_the_struct_and_leave_absent_areas_zero():
    plan = p2p_layout.plan_areas(p2p_rules.VARIANTS["oneshot_lamport"], 2, 4096)
    bases = [0x7000_0000_0000, 0x7100_0000_0000]
    words = p2p_layout.layout_words(plan, bases, timeout_ns=5_000_000, ctrl=0xC0, report=0xD0, rank=1)
    assert len(words) == p2p_layout.LAYOUT_WORDS
    ranks = p2p_layout.MAX_RANKS
    area = {name: words[i * ranks:(i + 1) * ranks] for i, name in enumerate(p2p_layout.LAYOUT_AREAS)}
    assert area["flags"] == bases + [0] * 6
    assert area["ll"] == [b + plan.ll for b in bases] + [0] * 6
    assert area["recv"] == area["ll_rs"] == [0] * 8
    assert words[-len(p2p_layout.LAYOUT_SCALARS):] == [4096, plan.slice_bytes, 5_000_000, 0xC0, 0xD0, 1, 2]
    value = p2p_layout.layout_parameter(plan, bases, 5_000_000, 0xC0, 0xD0, 1)
    assert value.nbytes == 8 * p2p_layout.LAYOUT_WORDS and list(value["words"][0]) == words


# -- p2p:auto's rule ----------------------------------------------------------------------

SIZES = [4096, 16384, 65536, 262144, 1 << 20, 4 << 20]
LL1, PUSH1, LL2, PUSH2 = p2p_layout.ONESHOT_LL, p2p_layout.ONESHOT_PUSH, p2p_layout.TWOSHOT_LL, p2p_layout.TWOSHOT


def test_each_size_goes_to_its_fastest_kernel_and_runs_merge():
    times = {LL1: [3.0, 3.2, 4.0, 9.0, 30.0, 110.0],
             PUSH1: [5.0, 5.5, 7.0, 12.0, 30.0, 100.0],
             LL2: [6.0, 6.1, 6.5, 8.0, 20.0, 70.0],
             PUSH2: [8.0, 8.2, 8.5, 10.0, 18.0, 60.0]}
    assert p2p_rules.choose_rule(SIZES, times) == ((65536, LL1), (262144, LL2), (None, PUSH2))


def test_a_later_kernel_must_win_by_the_margin():
    times = {LL1: [10.0, 10.0], PUSH1: [9.9, 9.0]}
    assert p2p_rules.choose_rule([4096, 8192], times) == ((4096, LL1), (None, PUSH1))
    assert p2p_rules.choose_rule([4096, 8192], {LL1: [10.0, 10.0], PUSH1: [5.0, 9.9]}) == ((4096, PUSH1), (None, LL1))


def test_one_kernel_everywhere_is_a_rule_of_one_entry_and_size_order_does_not_matter():
    times = {LL1: [9.0] * 6, LL2: [3.0] * 6}
    assert p2p_rules.choose_rule(SIZES[::-1], times) == ((None, LL2),)


def test_the_rule_needs_one_time_per_size():
    with pytest.raises(ValueError):
        p2p_rules.choose_rule(SIZES, {LL1: [1.0]})


def test_calibration_graphs_hold_100_calls_at_small_sizes_and_fewer_at_large_ones():
    assert [p2p_rules.calibration_calls(s) for s in SIZES] == [100, 100, 100, 100, 64, 16]
    assert p2p_rules.CALIBRATION_SIZES[0] == 4096 and p2p_rules.CALIBRATION_SIZES[-1] == p2p_rules.DEFAULT_MAX_BYTES
    assert p2p_rules.calibration_calls(64 << 20) == p2p_rules.CALIBRATION_MIN_CALLS
    assert p2p_rules.CALIBRATION_REPLAYS >= 10


def noisy_replays_us(per_call_us: float, calls: int, late: int) -> list[float]:
    """CALIBRATION_REPLAYS replays of `calls` calls with +-2% jitter, the first `late` of them
    five times slower (the host or another process got in the way)."""
    return [per_call_us * calls * (1 + 0.01 * (k * 7 % 5 - 2)) * (5 if k < late else 1)
            for k in range(p2p_rules.CALIBRATION_REPLAYS)]


def test_noisy_replays_do_not_move_the_rule():
    one = [5.0, 5.5, 7.0, 12.0, 30.0, 100.0]
    two = [8.0, 8.2, 8.5, 10.0, 20.0, 60.0]          # two-shot wins from 256 KiB on
    calls = [p2p_rules.calibration_calls(s) for s in SIZES]
    # Rank 0: late one-shot replays at 64 KiB; rank 1: late two-shot replays at 4 MiB.
    late = [{"oneshot_push": {2: 2}, "twoshot_push": {}}, {"oneshot_push": {}, "twoshot_push": {5: 3}}]
    per_rank = [{algo: [noisy_replays_us(true[i], calls[i], rank_late[algo].get(i, 0)) for i in range(len(SIZES))]
                 for algo, true in (("oneshot_push", one), ("twoshot_push", two))} for rank_late in late]

    def rule(per_call) -> p2p_rules.AutoRule:
        slowest = p2p_rules.slowest_rank_times([{algo: [per_call(r, c) for r, c in zip(replays, calls)]
                                           for algo, replays in rank.items()} for rank in per_rank])
        return p2p_rules.choose_rule(SIZES, slowest)

    assert rule(p2p_rules.per_call_median_us) == ((65536, "oneshot_push"), (None, "twoshot_push"))
    # The mean of the same replays would have sent 64 KiB to two-shot and 4 MiB to one-shot.
    assert rule(lambda replays, c: statistics.mean(replays) / c) != rule(p2p_rules.per_call_median_us)


def test_the_slowest_rank_counts():
    per_rank = [{"oneshot_push": [1.0, 5.0], "twoshot_push": [2.0, 3.0]},
                {"oneshot_push": [1.5, 4.0], "twoshot_push": [2.5, 2.0]}]
    assert p2p_rules.slowest_rank_times(per_rank) == {"oneshot_push": [1.5, 5.0], "twoshot_push": [2.5, 3.0]}


def test_auto_with_a_given_rule_splits_by_size_and_records_it():
    auto = backend("auto", p2p_auto_rule="oneshot_lamport<=64K,twoshot_lamport")
    assert auto.algorithm_for(65536, torch.bfloat16) == p2p_layout.ONESHOT_LL
    assert auto.algorithm_for(65536 + 16, torch.bfloat16) == p2p_layout.TWOSHOT_LL
    auto._dtype = torch.bfloat16
    extra = auto.row_fields()["extra"]
    assert (extra["p2p_auto_rule"], extra["p2p_auto_rule_source"]) == ("oneshot_lamport<=64K,twoshot_lamport",
                                                                        "option")
    assert backend("oneshot_pull").algorithm_for(1 << 20, torch.float32) == p2p_layout.ONESHOT_PULL


def linked(labels: list[list[str]]) -> dict:
    """A probe snapshot of len(labels) GPUs with this link matrix."""
    return {"gpus": [{"index": i} for i in range(len(labels))], "links": {"matrix": labels}}


NV4 = linked([["X", "NV18", "NV18", "NV18"], ["NV18", "X", "NV18", "NV18"],
              ["NV18", "NV18", "X", "NV18"], ["NV18", "NV18", "NV18", "X"]])
PCIE4 = linked([["X", "NV12", "SYS", "SYS"], ["NV12", "X", "SYS", "SYS"],
                ["SYS", "SYS", "X", "NV12"], ["SYS", "SYS", "NV12", "X"]])


def test_auto_reads_peer_memory_only_where_reads_are_known_to_complete():
    assert p2p_rules.peer_reads_reason(None, 8, shared_gpu(8, mps=True)) is None        # one GPU: local memory
    assert p2p_rules.peer_reads_reason(NV4, 4, None) is None
    assert p2p_rules.peer_reads_reason(PCIE4, 2, None) is None                           # GPUs 0 and 1: NVLink
    assert p2p_rules.peer_reads_reason(PCIE4, 4, None) == (
        "GPU 0 and GPU 2 are linked by SYS, not NVLink: a read of peer memory may never complete there, "
        "and no timeout can bound it")
    two = Emulation(gpus=2, ranks=8, mps=True, sm_percent=25)      # 8 ranks sharing 2 GPUs
    assert p2p_rules.peer_reads_reason(linked([["X", "NV18"], ["NV18", "X"]]), 8, two) is None
    assert p2p_rules.peer_reads_reason(linked([["X", "PIX"], ["PIX", "X"]]), 8, two).startswith(
        "GPU 0 and GPU 1 are linked by PIX, not NVLink")
    for snapshot in (None, {"error": "RuntimeError: no NVML"}):
        assert p2p_rules.peer_reads_reason(snapshot, 4, None).startswith(
            "no probe snapshot says how the GPUs are linked")


@pytest.mark.parametrize("snapshot, emulation, pull", [(NV4, None, True), (PCIE4, None, False),
                                                       (None, shared_gpu(4, mps=True), True), (None, None, False)])
def test_auto_adds_the_pull_kernel_last_and_rows_say_why_not(snapshot, emulation, pull):
    b = backend("auto")
    ctx = replace(ctx_for(4), snapshot=snapshot, emulation=emulation)
    b._choose_auto_kernels(ctx)
    auto = p2p_rules.VARIANTS["auto"]
    assert b.algorithms == ((*auto, p2p_layout.ONESHOT_PULL, p2p_layout.ONESHOT_GRAPH, p2p_layout.TWOSHOT_GRAPH) if pull
                            else auto)
    extra = b.row_fields()["extra"]
    assert extra["p2p_kernels"] == list(b.algorithms)
    assert ("p2p_auto_pull_reason" in extra) is not pull
    assert (p2p_layout.plan_areas(b.algorithms, 4, 1 << 20).stage is not None) is pull    # its staging area
    fixed = backend("oneshot")
    fixed._choose_auto_kernels(ctx)
    assert fixed.algorithms == (p2p_layout.ONESHOT_PUSH,) and "p2p_auto_pull_reason" not in fixed.row_fields()["extra"]


def test_a_forced_auto_rule_that_names_the_pull_kernel_asks_for_it():
    b = backend("auto", p2p_auto_rule="oneshot_lamport<=64K,oneshot_pull<=2M,twoshot")
    assert b.algorithms == (*p2p_rules.VARIANTS["auto"], p2p_layout.ONESHOT_PULL)
    ctx = replace(ctx_for(4), snapshot=PCIE4)
    b._choose_auto_kernels(ctx)                    # the rule decides, not the links
    assert p2p_layout.ONESHOT_PULL in b.algorithms
    assert b.algorithm_for(1 << 20, torch.bfloat16) == p2p_layout.ONESHOT_PULL
    assert backend("auto", p2p_auto_rule="oneshot_lamport<=64K,twoshot").algorithms == p2p_rules.VARIANTS["auto"]


def test_the_graph_one_shot_needs_peer_atomics_for_its_counter_barrier():
    assert "atomics" in backend("oneshot_graph").needs
    assert "atomics" in backend("auto", p2p_auto_rule="oneshot_lamport<=64K,oneshot_graph").needs
    assert all("atomics" not in backend(v).needs for v in ("twoshot_graph", "oneshot_lamport", "auto"))


# -- the timeout report ------------------------------------------------------------------

def test_a_recorded_timeout_becomes_a_clear_error_before_any_launch():
    report = (ctypes.c_uint32 * 4)(1, 3, 17, 0)
    b = backend(p2p_timeout_ms=300)
    area = p2p_kernels.SharedArea(ctx_for(4), p2p_layout.plan_areas(b.algorithms, 4, 4096), b.options.timeout_ms)
    area.report = ctypes.addressof(report)
    b._area = area
    expected = r"^p2p: peer rank 3 did not arrive within 300 ms \(rank 0, call 17, first barrier\)"
    with pytest.raises(p2p_kernels.P2PTimeoutError, match=expected):
        b.raise_if_failed()
    with pytest.raises(p2p_kernels.P2PTimeoutError, match=expected):
        b.allreduce(torch.zeros(8), torch.empty(8))
    # The sweep asks raise_if_failed() after each pass (test_sweep_engine): a timeout inside graph
    # replays, which never pass through allreduce(), surfaces there as a BackendTimeout.
    assert issubclass(p2p_kernels.P2PTimeoutError, BackendTimeout)
    report[1] = p2p_kernels.PEER_UNKNOWN          # the graph one-shot's counter barrier counts, names no one
    with pytest.raises(p2p_kernels.P2PTimeoutError, match=r"^p2p: a peer rank did not arrive within 300 ms \(rank 0,"):
        b.raise_if_failed()
    report[0] = 0
    b.raise_if_failed()           # nothing recorded: no error
    area.report = 0               # keep release() away from this fake report


# -- the CUDA source matches the Python side ------------------------------------------------

def test_cuda_source_constants_match():
    source = p2p_kernels.KERNEL_SOURCE.read_text()
    assert int(re.search(r"#define P2P_MAX_RANKS (\d+)", source).group(1)) == p2p_layout.MAX_RANKS
    assert int(re.search(r"#define P2P_MAX_BLOCKS (\d+)", source).group(1)) == p2p_layout.MAX_BLOCKS
    assert set(re.findall(r"__launch_bounds__\((\d+)\)", source)) == {str(p2p_layout.THREADS_PER_BLOCK)}
    layout = re.search(r"struct Layout \{(.*?)\};", source, re.S).group(1)
    fields = re.findall(r"^\s*u64 (\w+)(\[P2P_MAX_RANKS\])?;", layout, re.M)
    words = sum(p2p_layout.MAX_RANKS if array else 1 for _, array in fields)
    assert words == p2p_layout.LAYOUT_WORDS
    assert [name for name, array in fields if array] == list(p2p_layout.LAYOUT_AREAS)
    assert [name for name, array in fields if not array] == list(p2p_layout.LAYOUT_SCALARS)
    assert int(re.search(r"#define LL_BUFFERS (\d+)", source).group(1)) == p2p_layout.LL_BUFFERS
    assert int(re.search(r"#define LL_ONESHOT_BUFFERS (\d+)", source).group(1)) == p2p_layout.LL_ONESHOT_BUFFERS
    assert int(re.search(r"#define SEMAPHORE_WORDS (\d+)", source).group(1)) == p2p_layout.SEMAPHORE_WORDS
    assert int(re.search(r"#define PEER_UNKNOWN (0x[0-9a-f]+)u", source).group(1), 16) == p2p_kernels.PEER_UNKNOWN
    assert int(re.search(r"#define LL_EMPTY (0x[0-9a-f]+)u", source).group(1), 16) == p2p_layout.LL_EMPTY
    ctrl = re.search(r"struct Ctrl \{(.*?)\};", source, re.S).group(1)
    ctrl_words = sum(int({"LL_BUFFERS": p2p_layout.LL_BUFFERS, "P2P_MAX_BLOCKS": p2p_layout.MAX_BLOCKS}.get(n, n or 1))
                     for n in re.findall(r"^\s*u32 \w+(?:\[(\w+)\])?;", ctrl, re.M))
    assert ctrl_words == p2p_layout.CTRL_WORDS
    phases = re.findall(r"#define PHASE_\w+ (\d+)", source)
    assert [int(n) for n in phases] == list(range(len(p2p_kernels.PHASE_NAMES)))
    for kernel, name in p2p_layout.KERNEL_NAMES.items():
        threads = p2p_layout.THREADS_PER_BLOCK
        table = "LamportLayout" if kernel in p2p_layout.LAMPORT_LAYOUT_KERNELS else "Layout"
        assert f"void __launch_bounds__({threads}) {name}(const __grid_constant__ {table} L," in source


# -- programmatic dependent launch ----------------------------------------------------------

def test_pdl_is_on_unless_the_option_says_off():
    assert p2p_rules.P2POptions.from_options({}).pdl is True
    assert p2p_rules.P2POptions.from_options({"p2p_pdl": "on"}).pdl is True
    assert p2p_rules.P2POptions.from_options({"p2p_pdl": "off"}).pdl is False
    assert p2p_rules.P2POptions.from_options({"p2p_pdl": False}).pdl is False
    parser = argparse.ArgumentParser()
    p2p_variants.add_arguments(parser.add_argument_group("p2p"))
    assert p2p_variants.read_options(parser.parse_args([])).pdl is True
    assert p2p_variants.read_options(parser.parse_args(["--p2p-pdl", "off"])).pdl is False


SM90, SM86 = (9, 0), (8, 6)


@pytest.mark.parametrize("enabled, import_error, capability, emulation, reason", [
    (True, None, SM90, None, None),
    (True, None, (10, 0), None, None),
    (False, None, SM90, None, "off (--p2p-pdl off)"),
    (False, "No module named 'cuda'", SM86, None, "off (--p2p-pdl off)"),      # the option speaks first
    (True, "No module named 'cuda'", SM90, None, "cuda-python not installed (No module named 'cuda')"),
    (True, None, SM86, None, "SM 8.6: PDL needs SM 9.0+"),
    # Ranks that take turns, or MPS clients with SM shares of their own, launch with PDL.
    (True, None, SM90, shared_gpu(8, mps=False), None),
    (True, None, SM90, shared_gpu(8, mps=True, sm_percent=12.5), None),
    (True, None, SM90, shared_gpu(8, mps=True), "ranks share a GPU concurrently without SM shares of their own"),
    (True, None, SM90, shared_gpu(8, mps=None), "ranks share a GPU concurrently"),
    (True, None, SM90, shared_gpu(8, mps=True, sm_percent=50), "ranks share a GPU concurrently"),
])
def test_pdl_reason_says_why_a_rank_cannot_launch_with_pdl(enabled, import_error, capability, emulation, reason):
    got = p2p_rules.pdl_reason(enabled, import_error, capability, emulation)
    assert got == reason if reason is None else (got or "").startswith(reason), got


def test_ranks_agree_on_pdl_and_a_lone_rank_is_named():
    missing = "cuda-python not installed (No module named 'cuda')"
    assert p2p_rules.agreed_pdl_reason([None, None, None]) is None
    assert p2p_rules.agreed_pdl_reason(["off (--p2p-pdl off)"] * 2) == "off (--p2p-pdl off)"
    assert p2p_rules.agreed_pdl_reason([None, missing, None]) == f"rank 1: {missing}"
    assert p2p_rules.agreed_pdl_reason([None, None, "SM 8.6: PDL needs SM 9.0+", missing]) == \
        "rank 2: SM 8.6: PDL needs SM 9.0+"


def test_kernel_params_point_at_each_arguments_bytes():
    plan = p2p_layout.plan_areas(p2p_rules.VARIANTS["auto"], 2, 4096)
    layout = p2p_layout.layout_parameter(plan, [0x7000_0000_0000, 0x7100_0000_0000], 5_000_000, 0xC0, 0xD0, 1)
    params = p2p_layout.kernel_params(layout, 0x7f00_1234_5670, 0x7f00_89ab_cde0, 4097)
    array = (ctypes.c_void_p * 4).from_address(params.address)
    # The Layout by value: the very bytes of the structured value, all LAYOUT_WORDS of them.
    assert array[0] == layout.ctypes.data
    assert ctypes.string_at(array[0], 8 * p2p_layout.LAYOUT_WORDS) == layout.tobytes()
    assert ctypes.string_at(array[1], 8) == struct.pack("<Q", 0x7f00_1234_5670)
    assert ctypes.string_at(array[2], 8) == struct.pack("<Q", 0x7f00_89ab_cde0)
    assert ctypes.string_at(array[3], 4) == struct.pack("<I", 4097)


class FakeDriver:
    """The parts of cuda-python's driver module a PDL launch uses; records every launch."""

    class CUresult:
        CUDA_SUCCESS = 0

    CUlaunchAttributeID = SimpleNamespace(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION=6)

    def __init__(self, result: int = 0):
        self.result = result
        self.launches: list[tuple[SimpleNamespace, Any, bytes]] = []

    @staticmethod
    def CUlaunchAttribute() -> SimpleNamespace:
        return SimpleNamespace(id=None, value=SimpleNamespace())

    @staticmethod
    def CUlaunchConfig() -> SimpleNamespace:
        return SimpleNamespace()

    @staticmethod
    def CUstream(ptr: int) -> tuple[str, int]:
        return ("stream", ptr)

    @staticmethod
    def CUfunction(ptr: int) -> tuple[str, int]:
        return ("function", ptr)

    def cuLaunchKernelEx(self, config, function, kernel_params: int, extra: int) -> tuple[int]:
        units = ctypes.string_at((ctypes.c_void_p * 4).from_address(kernel_params)[3], 4)
        self.launches.append((config, function, units, extra))
        return (self.result,)

    @staticmethod
    def cuGetErrorName(result: int) -> tuple[int, bytes]:
        return 0, b"CUDA_ERROR_INVALID_VALUE"


def pdl_setup(monkeypatch, peer_reason: str | None, driver: FakeDriver | None = None) -> p2p.P2PAllreduce:
    """A backend that decided PDL on an SM 9.0 rank with cuda-python, its peer answering peer_reason."""
    monkeypatch.setattr(p2p, "cuda_driver", lambda: (driver or FakeDriver(), None))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: SM90)
    ctx = ctx_for(2)
    monkeypatch.setattr(RunContext, "all_gather_objects", lambda self, obj: [obj, (None, peer_reason)])
    b = backend("oneshot")
    b._decide_pdl(ctx)
    return b


def test_rows_say_whether_pdl_is_on_and_why_not(monkeypatch):
    assert "p2p_pdl" not in backend().row_fields()["extra"]          # before setup
    extra = pdl_setup(monkeypatch, None).row_fields()["extra"]
    assert extra["p2p_pdl"] is True and "p2p_pdl_reason" not in extra
    b = pdl_setup(monkeypatch, "cuda-python not installed (No module named 'cuda')")
    extra = b.row_fields()["extra"]
    assert (extra["p2p_pdl"], extra["p2p_pdl_reason"]) == (False, "rank 1: cuda-python not installed "
                                                                   "(No module named 'cuda')")
    assert b._pdl is None


def launch_ready(b: p2p.P2PAllreduce, monkeypatch, function: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Give a backend what _launch reads: a shared area with a Layout, a grid, one kernel."""
    b._ctx = ctx_for(2, device="cpu")
    plan = p2p_layout.plan_areas(b.algorithms, 2, 4096)
    b._area = p2p_kernels.SharedArea(b._ctx, plan, b.options.timeout_ms)
    b._area.layout = p2p_layout.layout_parameter(plan, [0x7000_0000_0000, 0x7100_0000_0000], 1, 2, 3, 0)
    b._area.lamport_layout = p2p_layout.lamport_parameter(b._area.layout)
    b._grids[torch.float32] = (8, 8)
    b._functions[torch.float32] = {p2p_layout.ONESHOT_PUSH: function}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=0x5000))
    return torch.zeros(1024), torch.zeros(1024)


def test_a_pdl_launch_asks_cuda_python_for_programmatic_stream_serialization(monkeypatch):
    driver = FakeDriver()
    b = pdl_setup(monkeypatch, None, driver)
    x, out = launch_ready(b, monkeypatch, SimpleNamespace(ptr=0xF00))
    b._launch(p2p_layout.ONESHOT_PUSH, x, out)
    [(config, function, units, extra)] = driver.launches
    assert function == ("function", 0xF00) and extra == 0
    blocks, threads = p2p_layout.launch_dims(p2p_layout.ONESHOT_PUSH, 256, 2, 8, 8)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (blocks, 1, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (threads, 1, 1)
    assert (config.sharedMemBytes, config.hStream, config.numAttrs) == (0, ("stream", 0x5000), 1)
    [attribute] = config.attrs
    assert attribute.id == 6 and attribute.value.programmaticStreamSerializationAllowed == 1
    assert units == struct.pack("<I", 256)                  # 4 KiB of fp32 in 16-byte vectors


def test_pdl_launches_reuse_one_config_per_grid_and_stream(monkeypatch):
    driver = FakeDriver()
    b = pdl_setup(monkeypatch, None, driver)
    x, out = launch_ready(b, monkeypatch, SimpleNamespace(ptr=0xF00))
    b._launch(p2p_layout.ONESHOT_PUSH, x, out)
    b._launch(p2p_layout.ONESHOT_PUSH, x, out)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=0x6000))
    b._launch(p2p_layout.ONESHOT_PUSH, x, out)
    b._launch(p2p_layout.ONESHOT_PUSH, x[:512], out[:512])          # 2 KiB: a smaller grid
    b._launch(p2p_layout.ONESHOT_PUSH, x[:512], out[:512])
    first, second, other_stream, smaller, smaller_again = driver.launches
    assert first[0] is second[0] and other_stream[0] is not first[0]
    assert other_stream[0].hStream == ("stream", 0x6000) and first[0].hStream == ("stream", 0x5000)
    assert smaller[0] is smaller_again[0] and smaller[0].gridDimX < other_stream[0].gridDimX
    assert (first[0].gridDimX, first[0].blockDimX) == (other_stream[0].gridDimX, other_stream[0].blockDimX)
    assert first[1] is second[1] is other_stream[1] is smaller[1]
    assert (first[2], smaller[2]) == (struct.pack("<I", 256), struct.pack("<I", 128))   # units: per call


def test_a_failed_pdl_launch_raises_with_the_drivers_name(monkeypatch):
    b = pdl_setup(monkeypatch, None, FakeDriver(result=1))
    x, out = launch_ready(b, monkeypatch, SimpleNamespace(ptr=0xF00))
    with pytest.raises(RuntimeError, match="^p2p: cuLaunchKernelEx failed: CUDA_ERROR_INVALID_VALUE$"):
        b._launch(p2p_layout.ONESHOT_PUSH, x, out)


def test_without_pdl_the_kernel_launches_through_cupy(monkeypatch):
    b = pdl_setup(monkeypatch, "off (--p2p-pdl off)", FakeDriver())
    calls = []
    x, out = launch_ready(b, monkeypatch, lambda grid, block, args, stream: calls.append((grid, block, args)))
    monkeypatch.setattr(b, "_stream", lambda: "cupy stream")
    b._launch(p2p_layout.ONESHOT_PUSH, x, out)
    [(grid, block, args)] = calls
    assert args[0] is b._area.layout and [int(a) for a in args[1:]] == [x.data_ptr(), out.data_ptr(), 256]


@pytest.mark.parametrize("nranks, units, form", [
    (4, 1, p2p_layout.ONESHOT_LL_OWN_SLOT), (8, p2p_layout.LL_OWN_SLOT_UNITS, p2p_layout.ONESHOT_LL_OWN_SLOT),
    (8, p2p_layout.LL_OWN_SLOT_UNITS + 1, p2p_layout.ONESHOT_LL),     # above 64 KiB the extra write costs
    (2, 1, p2p_layout.ONESHOT_LL),                                     # it wins nothing at 2 ranks
])
def test_the_lamport_one_shot_runs_its_own_slot_kernel_above_two_ranks_up_to_64_kib(nranks, units, form):
    assert p2p_layout.LL_OWN_SLOT_UNITS * p2p_layout.VECTOR_BYTES == 64 * 1024
    assert p2p_layout.kernel_form(p2p_layout.ONESHOT_LL, units, nranks) == form
    assert p2p_layout.kernel_form(p2p_layout.TWOSHOT_LL, units, nranks) == p2p_layout.TWOSHOT_LL
    # compiled, and counted in the grid's occupancy, wherever the Lamport one-shot may launch
    assert p2p_layout.ONESHOT_LL_OWN_SLOT in p2p_layout.KERNEL_NAMES
    assert p2p_layout.kernel_forms((p2p_layout.ONESHOT_LL,)) == (p2p_layout.ONESHOT_LL, p2p_layout.ONESHOT_LL_OWN_SLOT)
    assert p2p_layout.kernel_forms((p2p_layout.TWOSHOT,)) == (p2p_layout.TWOSHOT,)


def test_a_small_lamport_one_shot_launches_the_own_slot_kernel_with_the_same_grid(monkeypatch):
    b = pdl_setup(monkeypatch, "off (--p2p-pdl off)", FakeDriver())
    calls = []
    x, out = launch_ready(b, monkeypatch, None)
    b._ctx = ctx_for(4, device="cpu")
    b._functions[torch.float32] = {
        form: (lambda grid, block, args, stream, form=form: calls.append((form, grid, block, args[0])))
        for form in (p2p_layout.ONESHOT_LL, p2p_layout.ONESHOT_LL_OWN_SLOT)}
    monkeypatch.setattr(b, "_stream", lambda: "cupy stream")
    b._launch(p2p_layout.ONESHOT_LL, x, out)                            # 4 KiB: 256 units
    big = torch.zeros((p2p_layout.LL_OWN_SLOT_UNITS + 1) * 4)
    b._launch(p2p_layout.ONESHOT_LL, big, torch.zeros_like(big))
    assert [form for form, _, _, _ in calls] == [p2p_layout.ONESHOT_LL_OWN_SLOT, p2p_layout.ONESHOT_LL]
    blocks, threads = p2p_layout.launch_dims(p2p_layout.ONESHOT_LL, 256, 4, *b._grids[torch.float32])
    assert calls[0][1:3] == ((blocks,), (threads,))     # the Lamport one-shot's launch shape
    # both kernels take the Lamport one-shot's own parameter (LamportLayout), no other kernel does
    assert calls[0][3] is calls[1][3] is b._area.lamport_layout
    assert b._area.parameter(p2p_layout.ONESHOT_PUSH) is b._area.layout


def test_the_lamport_one_shot_parameter_holds_its_areas_and_the_scalars_it_reads():
    plan = p2p_layout.plan_areas(p2p_rules.VARIANTS["auto"], 4, 4096)
    bases = [0x1000_0000 * (r + 1) for r in range(4)]
    full = p2p_layout.layout_parameter(plan, bases, timeout_ns=7_000_000, ctrl=0xC0, report=0xE0, rank=2)
    small = p2p_layout.lamport_parameter(full)
    assert list(small["words"][0]) == ([b + plan.ll for b in bases] + [0] * (p2p_layout.MAX_RANKS - 4)
                                       + [plan.slot_bytes, 7_000_000, 0xC0, 0xE0, 2])
    assert small.nbytes == 104 and full.nbytes == 504 == 8 * p2p_layout.LAYOUT_WORDS
    # the struct's fields in allreduce.cu, in this order
    source = p2p_kernels.KERNEL_SOURCE.read_text()
    struct = source.split("struct LamportLayout {")[1].split("};")[0]
    assert tuple(re.findall(r"u64 (\w+)", struct)) == p2p_layout.LAMPORT_LAYOUT_FIELDS
    for kernel in p2p_layout.LAMPORT_LAYOUT_KERNELS:
        assert f"{p2p_layout.KERNEL_NAMES[kernel]}(const __grid_constant__ LamportLayout L," in source


# -- the graph kernels (p2p:oneshot_graph, p2p:twoshot_graph) -------------------------------

def test_the_graph_kernels_plan_their_eager_fallbacks_areas_and_are_rule_names():
    plan = p2p_layout.plan_areas(p2p_rules.VARIANTS["twoshot_graph"], 4, 1 << 20)
    assert plan.recv is not None and plan.gather is not None       # eager calls run the staged two-shot
    assert plan.ll is None
    assert p2p_layout.launched_kernels((p2p_layout.TWOSHOT_GRAPH,)) == (p2p_layout.TWOSHOT_GRAPH, p2p_layout.TWOSHOT)
    plan = p2p_layout.plan_areas(p2p_rules.VARIANTS["oneshot_graph"], 4, 1 << 20)
    assert plan.ll is not None and plan.lamport_spans              # eager calls run the Lamport one-shot
    assert plan.recv is None and plan.gather is None and plan.stage is None
    assert p2p_layout.launched_kernels((p2p_layout.ONESHOT_GRAPH,)) == (p2p_layout.ONESHOT_GRAPH, p2p_layout.ONESHOT_LL)
    text = "oneshot_lamport<=16K,oneshot_graph<=1M,twoshot_graph"
    assert p2p_rules.format_auto_rule(p2p_rules.parse_auto_rule(text)) == text
    algorithms = backend("auto", p2p_auto_rule=text).algorithms
    assert algorithms[-2:] == (p2p_layout.ONESHOT_GRAPH, p2p_layout.TWOSHOT_GRAPH)   # the read kernels, last
    for name in ("oneshot_graph", "twoshot_graph"):
        assert name not in p2p_rules.DEFAULT_VARIANTS     # they read peer memory: asked for only
        assert backend(name).min_world_size == 2


def test_a_graph_kernel_captured_outside_graph_capture_is_refused_not_launched(monkeypatch):
    """Its table row would never be filled and the replay would read null pointers: once, a test
    harness that captured without graph_capture() got an illegal address instead of an error."""
    b = backend("oneshot_graph")
    launched = []
    x, out = launch_ready(b, monkeypatch, lambda grid, block, args, stream: launched.append(int(args[1])))
    b._functions[torch.float32][p2p_layout.ONESHOT_GRAPH] = b._functions[torch.float32][p2p_layout.ONESHOT_PUSH]
    monkeypatch.setattr(b, "_stream", lambda: "cupy stream")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    b._graph = SimpleNamespace(row_address=lambda i, o: 0xAB00, drop_pending=lambda: None,
                               register=lambda: launched.append("registered"))
    with pytest.raises(RuntimeError, match=r"^p2p:oneshot_graph: a CUDA-graph capture of oneshot_graph must be "
                                           r"inside backend.graph_capture\(\)"):
        b._launch(p2p_layout.ONESHOT_GRAPH, x, out)
    assert launched == []
    with b.graph_capture():
        b._launch(p2p_layout.ONESHOT_GRAPH, x, out)
    assert launched == [0xAB00, "registered"]       # the row's address, registered when the capture ends
    with pytest.raises(RuntimeError, match="graph_capture"):         # and only inside it
        b._launch(p2p_layout.ONESHOT_GRAPH, x, out)


def test_auto_leaves_both_graph_kernels_out_of_its_eager_rule():
    LL1, GRAPH1, GRAPH2 = p2p_layout.ONESHOT_LL, p2p_layout.ONESHOT_GRAPH, p2p_layout.TWOSHOT_GRAPH
    sizes = [4096, 262144, 1 << 20, 8 << 20]
    times = {LL1: [2.0, 5.0, 15.0, 500.0], GRAPH1: [4.0, 4.0, 7.0, 130.0], GRAPH2: [5.0, 6.0, 9.5, 45.0]}
    graph, eager = p2p_rules.choose_rules(sizes, times)
    assert graph == ((4096, LL1), (1 << 20, GRAPH1), (None, GRAPH2))
    assert eager == ((None, LL1),)
    # A later kernel must win by the margin: 3% faster is not enough to take a size.
    close = {LL1: [2.0], GRAPH1: [2.0 / 1.02]}
    assert p2p_rules.choose_rule([4096], close) == ((None, LL1),)


def test_auto_has_a_graph_rule_and_an_eager_rule_without_the_graph_kernel():
    LL1, PUSH2, GRAPH2 = p2p_layout.ONESHOT_LL, p2p_layout.TWOSHOT, p2p_layout.TWOSHOT_GRAPH
    times = {LL1: [2.0, 9.0, 30.0], PUSH2: [5.0, 8.0, 20.0], GRAPH2: [6.0, 4.0, 10.0]}
    graph, eager = p2p_rules.choose_rules([4096, 65536, 1 << 20], times)
    assert graph == ((4096, LL1), (None, GRAPH2))
    assert eager == ((4096, LL1), (None, PUSH2))
    b = backend("auto")
    b._calibrations[torch.bfloat16] = p2p._Calibration([4096, 65536, 1 << 20], [100, 100, 64], times, graph, eager)
    assert b.algorithm_for(1 << 20, torch.bfloat16) == GRAPH2
    assert b.algorithm_for(1 << 20, torch.bfloat16, in_graph=False) == PUSH2
    b._dtype = torch.bfloat16
    extra = b.row_fields()["extra"]
    assert (extra["p2p_auto_rule"], extra["p2p_auto_eager_rule"]) == ("oneshot_lamport<=4K,twoshot_graph",
                                                                      "oneshot_lamport<=4K,twoshot")


class _FakeIpc:
    """cupy.cuda.runtime's IPC calls: a handle opens at 0x100000 times its first byte."""

    def __init__(self):
        self.opened: list[bytes] = []
        self.closed: list[int] = []
        self.cuda = SimpleNamespace(runtime=self)

    def ipcOpenMemHandle(self, handle: bytes) -> int:
        self.opened.append(handle)
        return 0x100000 * handle[0]

    def ipcCloseMemHandle(self, base: int) -> None:
        self.closed.append(base)


def graph_table(monkeypatch, rank: int, peer_answers: list[Any]) -> p2p_kernels.GraphTable:
    """A GraphTable on the CPU whose exchange hands back peer_answers (this rank's own answer
    is put in its place); a buffer's allocation is its address rounded down to 0x1000."""
    monkeypatch.setattr(p2p_kernels, "_segment_handle", lambda ptr: (bytes([ptr >> 12, rank]), ptr & 0xfff))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def gather(answer: Any) -> list[Any]:
        return [answer if r == rank else a for r, a in enumerate(peer_answers)]

    ctx = SimpleNamespace(rank=rank, world_size=len(peer_answers), device=torch.device("cpu"),
                          all_gather_objects=gather)
    return p2p_kernels.GraphTable(ctx)


def test_graph_rows_hold_own_buffers_and_peers_opened_ones_each_handle_opened_once(monkeypatch):
    ipc = _FakeIpc()
    monkeypatch.setattr(p2p_kernels, "cupy_module", lambda: ipc)
    peer = [((bytes([5, 1]), 0x10), (bytes([6, 1]), 0x20)), ((bytes([5, 1]), 0x30), (bytes([6, 1]), 0x40))]
    table = graph_table(monkeypatch, 0, [None, (None, peer)])
    first = table.row_address(0x1000, 0x2000)
    assert table.row_address(0x1010, 0x2010) == first + p2p_layout.GRAPH_ROW_WORDS * 8
    table.register()
    rows = table.rows[:2].numpy().view("uint64").tolist()
    M = p2p_layout.MAX_RANKS
    assert (rows[0][0], rows[0][1], rows[0][M], rows[0][M + 1]) == (0x1000, 0x500010, 0x2000, 0x600020)
    assert (rows[1][0], rows[1][1], rows[1][M], rows[1][M + 1]) == (0x1010, 0x500030, 0x2010, 0x600040)
    assert ipc.opened == [bytes([5, 1]), bytes([6, 1])] and table.used == 2 and table.pending == []
    other = graph_table(monkeypatch, 0, [None, (None, peer[:1])])   # a second table: shares the openings
    other.row_address(0x1000, 0x2000)
    other.register()
    assert len(ipc.opened) == 2
    table.release()
    assert ipc.closed == []                     # still held by the other table
    other.release()
    assert sorted(ipc.closed) == [0x500000, 0x600000] and p2p_kernels._OPENED == {}


def test_a_rank_that_cannot_register_makes_every_rank_refuse_the_graph(monkeypatch):
    monkeypatch.setattr(p2p_kernels, "cupy_module", _FakeIpc)
    table = graph_table(monkeypatch, 0, [None, ("RuntimeError: expandable segment", [])])
    table.row_address(0x1000, 0x2000)
    with pytest.raises(BackendUnavailable, match="rank 1: RuntimeError: expandable segment"):
        table.register()
    assert table.used == 0 and table.pending == []


def test_a_full_graph_table_refuses_the_capture(monkeypatch):
    table = graph_table(monkeypatch, 0, [None, (None, [])])
    table.used = p2p_layout.GRAPH_ROWS - 1
    table.row_address(0x1000, 0x2000)
    with pytest.raises(BackendUnavailable, match="graph table is full"):
        table.row_address(0x1000, 0x2000)


def test_auto_measures_without_the_graph_kernel_where_its_buffers_cannot_be_registered(monkeypatch):
    b = backend("auto")
    b.algorithms = p2p_rules.auto_kernels(p2p_rules.AUTO_READ_KERNELS)
    b._ctx = SimpleNamespace(all_gather_objects=lambda obj: [obj, obj], device=torch.device("cpu"), world_size=2)
    b._area = p2p_kernels.SharedArea(b._ctx, p2p_layout.plan_areas(b.algorithms, 2, 8192), b.options.timeout_ms)
    refusal = "p2p cannot register the captured buffers with its peers (rank 1: RuntimeError: no IPC handle)"

    def kernel_us(algorithm: str, x: torch.Tensor, out: torch.Tensor) -> float:
        if algorithm == p2p_layout.TWOSHOT_GRAPH:
            raise BackendUnavailable(refusal)
        return {p2p_layout.ONESHOT_LL: 1.0}.get(algorithm, 2.0) * x.numel()

    monkeypatch.setattr(b, "_kernel_us", kernel_us)
    calibration = b._calibrate(torch.float32)
    assert p2p_layout.TWOSHOT_GRAPH not in calibration.times_us and calibration.sizes == [4096, 8192]
    assert calibration.rule == calibration.eager_rule == ((None, p2p_layout.ONESHOT_LL),)
    b._calibrations[torch.float32], b._dtype = calibration, torch.float32
    assert b.row_fields()["extra"]["p2p_auto_graph_reason"] == refusal
