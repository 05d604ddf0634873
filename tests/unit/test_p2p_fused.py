"""p2p:fused's host side, no GPU: the variants and when they are made, the kernel by size, the launch
shape, the buffer plan, the by-value arguments against the CUDA struct, the checks before a launch,
the launch itself (with and without PDL), and what its rows and engine settings say."""

from __future__ import annotations

import ctypes
import re
import struct
from types import SimpleNamespace

import numpy
import pytest
import torch

from commbench import engines
from commbench.backends import SweepFacts, factory
from commbench.backends.base import BackendUnavailable, MakeOptions
from commbench.backends.fused import RMS_EPS, FusedResidualRMSNormWorkload
from commbench.backends.p2p import backend as p2p, kernels as p2p_kernels, layout as p2p_layout, rules as p2p_rules
from commbench.backends.p2p import variants as p2p_variants
from commbench.backends.p2p.backend import P2PAllreduce
from commbench.backends.p2p.fused import P2PFused
from commbench.ops import FUSED_OP
from commbench.runtime.context import RunContext


def fused(variant: str = "fused", **options) -> P2PFused:
    [made] = p2p_variants.make(variant, MakeOptions(p2p_rules.P2POptions.from_options(options)))
    assert isinstance(made, P2PFused)
    return made


def ctx_for(world_size: int) -> RunContext:
    return RunContext(rank=0, world_size=world_size, local_rank=0, local_world_size=world_size,
                      device=torch.device("cpu"), control_group=None, verdicts={})


def test_the_fused_variants_are_made_when_named():
    # not among the defaults, plain sizes or model shapes, until its GPU checks have passed
    plain = [b.name for b in factory("p2p").variants(None)]
    model = p2p_variants.make(None, MakeOptions(p2p_rules.P2POptions(), SweepFacts(hidden=7168)))
    assert "p2p:fused" not in plain and [b.name for b in model] == plain
    for variant in p2p_rules.FUSED_VARIANTS:
        b = fused(variant)
        assert (b.name, b.op, b.family) == (f"p2p:{variant}", FUSED_OP, "p2p")
        assert b.min_world_size == 2 and b.graph_capturable and "atomics" not in b.needs


def test_the_fused_pattern_runs_only_on_model_shapes():
    with pytest.raises(BackendUnavailable, match="runs on model shapes"):
        fused().make_workload(ctx_for(2), 4096, torch.bfloat16, None, 4)


@pytest.mark.parametrize("world, message_bytes, kernel", [
    (8, 64 << 10, p2p_layout.FUSED_ONESHOT), (8, (64 << 10) + 16, p2p_layout.FUSED_TWOSHOT),
    (4, 256 << 10, p2p_layout.FUSED_ONESHOT), (4, 1 << 20, p2p_layout.FUSED_TWOSHOT),
    (2, 2 << 20, p2p_layout.FUSED_ONESHOT), (2, 4 << 20, p2p_layout.FUSED_TWOSHOT)])
def test_p2p_fused_takes_the_one_shot_up_to_its_worlds_limit(world, message_bytes, kernel):
    b = fused()
    b._ctx = ctx_for(world)
    assert b.algorithm_for(message_bytes, torch.bfloat16) == kernel
    for variant, only in (("fused_oneshot", p2p_layout.FUSED_ONESHOT), ("fused_twoshot", p2p_layout.FUSED_TWOSHOT)):
        one = fused(variant)
        one._ctx = ctx_for(world)
        assert one.algorithm_for(message_bytes, torch.bfloat16) == only


@pytest.mark.parametrize("tokens, row_units, cap, sms", [
    (1, 896, 14, 16), (1, 896, 64, 66), (2, 768, 32, 33), (7, 896, 14, 16), (8, 896, 64, 66), (63, 65, 64, 66),
    (256, 896, 14, 16), (1, 2048, 1, 1), (3, 2048, 64, 66), (300, 1, 64, 66)])
def test_the_fused_launch_covers_every_token_with_whole_groups(tokens, row_units, cap, sms):
    dims = p2p_layout.fused_dims(tokens, row_units, cap, sms)
    assert 1 <= dims.blocks <= min(cap, sms, p2p_layout.MAX_BLOCKS)
    assert dims.threads % p2p_layout.WARP_THREADS == 0 and dims.threads <= p2p_layout.THREADS_PER_BLOCK
    assert dims.blocks % dims.group_blocks == 0 and dims.group_blocks <= p2p_layout.FUSED_MAX_GROUP
    groups = dims.blocks // dims.group_blocks
    assert groups == min(tokens, groups) and groups >= 1
    # every vector of a row is some thread's, within the vectors a thread may hold
    assert dims.group_blocks * dims.threads * p2p_layout.FUSED_VECTORS >= row_units
    if dims.group_blocks > 1:      # tokens shared by blocks: one group each, within the partial slots
        assert groups == tokens and tokens * dims.group_blocks <= p2p_layout.FUSED_GROUP_TOKENS


def test_one_token_spreads_over_the_blocks_and_many_tokens_take_a_block_each():
    one = p2p_layout.fused_dims(1, 896, 14, 16)           # 8 ranks under MPS: 14 blocks, a vector a thread
    assert (one.blocks, one.group_blocks, one.threads) == (14, 14, 64)
    many = p2p_layout.fused_dims(256, 896, 14, 16)
    assert (many.blocks, many.group_blocks, many.threads) == (14, 1, 448)     # two vectors a thread


def test_rows_longer_than_a_block_holds_are_refused_with_the_limit():
    assert p2p_layout.fused_row_reason(2048) is None
    assert "exceeds the fused kernels' 32768" in p2p_layout.fused_row_reason(2049)
    b = fused()
    assert b.shape_reason(2, 4, 16384, torch.bfloat16) is None
    assert "exceeds" in b.shape_reason(2, 4, 16384, torch.float32)
    assert "not a multiple of 8" in b.shape_reason(2, 4, 7170, torch.bfloat16)


def test_the_fused_kernels_use_the_lamport_kernels_areas():
    plan = p2p_layout.plan_areas(p2p_rules.VARIANTS["fused"], 4, 1 << 20)
    same = p2p_layout.plan_areas(p2p_rules.VARIANTS["twoshot_lamport"] + p2p_rules.VARIANTS["oneshot_lamport"], 4,
                                 1 << 20)
    assert (plan.ll, plan.ll_rs, plan.ll_ag, plan.total_bytes) == (same.ll, same.ll_rs, same.ll_ag, same.total_bytes)
    assert plan.recv is plan.gather is plan.stage is None
    one = p2p_layout.plan_areas(p2p_rules.VARIANTS["fused_oneshot"], 4, 1 << 20)
    assert one.ll is not None and one.ll_rs is None


def test_fused_args_follow_the_cuda_struct():
    source = p2p_kernels.KERNEL_SOURCE.read_text()
    body = source.split("struct FusedArgs {")[1].split("};")[0]
    fields = re.findall(r"^\s*(u64|u32|float) (\w+);", body, re.M)
    assert [t for t, _ in fields] == ["u64"] * 6 + ["u32"] * 3 + ["float"] * 2 + ["u32"]
    assert [n for _, n in fields][6:] == [n for n in p2p_layout.FUSED_ARGS.names[1:]]
    assert p2p_layout.FUSED_ARGS.itemsize == 6 * 8 + 6 * 4
    for name, value in (("FUSED_VECTORS", p2p_layout.FUSED_VECTORS), ("FUSED_MAX_GROUP", p2p_layout.FUSED_MAX_GROUP),
                        ("FUSED_GROUP_TOKENS", p2p_layout.FUSED_GROUP_TOKENS)):
        assert int(re.search(rf"#define {name} (\d+)", source).group(1)) == value
    for kernel, table in ((p2p_layout.FUSED_ONESHOT, "LamportLayout"), (p2p_layout.FUSED_TWOSHOT, "Layout")):
        assert (f"{p2p_layout.KERNEL_NAMES[kernel]}(const __grid_constant__ {table} L,\n"
                f"{' ' * 57}const __grid_constant__ FusedArgs A)") in source
    args = p2p_layout.fused_args((1, 2, 3, 4, 5, 6), 7, 896, 14, RMS_EPS, 7168)
    raw = args.tobytes()
    assert struct.unpack("<6Q3I2fI", raw) == (1, 2, 3, 4, 5, 6, 7, 896, 14, pytest.approx(RMS_EPS),
                                              pytest.approx(1 / 7168), 0)


def test_fused_params_point_at_both_values():
    plan = p2p_layout.plan_areas(p2p_rules.VARIANTS["fused"], 2, 4096)
    layout = p2p_layout.layout_parameter(plan, [0x7000_0000_0000, 0x7100_0000_0000], 5_000_000, 0xC0, 0xD0, 1)
    args = p2p_layout.fused_args((1, 2, 3, 4, 5, 6), 1, 64, 1, RMS_EPS, 512)
    params = p2p_layout.fused_params(layout, args)
    array = (ctypes.c_void_p * 2).from_address(params.address)
    assert ctypes.string_at(array[0], layout.nbytes) == layout.tobytes()
    assert ctypes.string_at(array[1], args.nbytes) == args.tobytes()


def ready(monkeypatch, world: int = 2, variant: str = "fused") -> tuple[P2PFused, list]:
    """A fused backend set up as far as a launch reads it, its kernels recording their calls."""
    b = fused(variant)
    b._ctx = ctx_for(world)
    plan = p2p_layout.plan_areas(b.algorithms, world, 1 << 20)
    b._area = p2p_kernels.SharedArea(b._ctx, plan, b.options.timeout_ms)
    b._area.layout = p2p_layout.layout_parameter(plan, [0x7000_0000_0000 + r * 0x100_0000_0000 for r in range(world)],
                                                 1, 2, 3, 0)
    b._area.lamport_layout = p2p_layout.lamport_parameter(b._area.layout)
    b._partials = torch.zeros(p2p_layout.FUSED_PARTIAL_WORDS, dtype=torch.int64)
    b._grids[torch.bfloat16] = (14, 16)
    calls: list = []
    b._functions[torch.bfloat16] = {
        k: (lambda grid, block, args, stream, k=k: calls.append((k, grid, block, args))) for k in p2p_layout.FUSED_KERNELS}
    monkeypatch.setattr(b, "_stream", lambda: "cupy stream")
    return b, calls


def tensors(tokens: int, hidden: int) -> tuple[torch.Tensor, ...]:
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    return x, torch.zeros_like(x), torch.ones(hidden, dtype=torch.bfloat16), torch.empty_like(x), torch.empty_like(x)


def test_a_fused_call_launches_the_kernel_of_its_size_with_its_shape_and_arguments(monkeypatch):
    b, calls = ready(monkeypatch, world=8)
    x, residual, gamma, residual_out, norm_out = tensors(1, 7168)
    b.allreduce_residual_rmsnorm(x, residual, gamma, residual_out, norm_out)
    [(kernel, grid, block, (layout, args))] = calls
    dims = p2p_layout.fused_dims(1, 896, 14, 16)
    assert (kernel, grid, block) == (p2p_layout.FUSED_ONESHOT, (dims.blocks,), (dims.threads,))
    assert layout is b._area.lamport_layout          # the one-shot takes the Lamport one-shot's table
    assert list(args["pointers"][0]) == [x.data_ptr(), residual.data_ptr(), gamma.data_ptr(), residual_out.data_ptr(),
                                         norm_out.data_ptr(), b._partials.data_ptr()]
    assert (int(args["tokens"][0]), int(args["row_units"][0]), int(args["group_blocks"][0])) == (1, 896, 14)
    big = tensors(64, 7168)                           # 896 KiB at 8 ranks: the two-shot, the whole Layout
    b.allreduce_residual_rmsnorm(*big)
    assert calls[1][0] == p2p_layout.FUSED_TWOSHOT and calls[1][3][0] is b._area.layout


def test_a_fused_pdl_launch_passes_both_values(monkeypatch):
    b, _ = ready(monkeypatch)
    launches = []
    b._pdl = SimpleNamespace(launch=lambda ptr, blocks, threads, stream, params: launches.append((ptr, params)))
    b._functions[torch.bfloat16] = {k: SimpleNamespace(ptr=0xF0 + i) for i, k in enumerate(p2p_layout.FUSED_KERNELS)}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=0x5000))
    b.allreduce_residual_rmsnorm(*tensors(2, 6144))
    [(ptr, params)] = launches
    assert ptr == 0xF0 and params.values[0] is b._area.lamport_layout
    assert int(params.values[1]["row_units"][0]) == 768


@pytest.mark.parametrize("change, reason", [
    (lambda t: (t[0].t(), *t[1:]), "not contiguous"),
    (lambda t: (t[0], t[1], torch.ones(100, dtype=torch.bfloat16), *t[3:]), "gamma (100 x torch.bfloat16)"),
    (lambda t: (t[0], t[1].float(), *t[2:]), "does not match x"),
])
def test_tensors_a_kernel_could_not_take_are_refused_before_a_launch(monkeypatch, change, reason):
    b, calls = ready(monkeypatch)
    with pytest.raises(ValueError, match=re.escape(reason)):
        b.allreduce_residual_rmsnorm(*change(tensors(8, 64)))
    assert calls == []


def test_a_recorded_timeout_is_raised_before_a_fused_launch(monkeypatch):
    b, calls = ready(monkeypatch)
    monkeypatch.setattr(b._area, "timeout_error", lambda: p2p_kernels.P2PTimeoutError("p2p: peer rank 1 ..."))
    with pytest.raises(p2p_kernels.P2PTimeoutError):
        b.allreduce_residual_rmsnorm(*tensors(1, 64))
    assert calls == []


def test_the_fused_workload_is_the_fused_patterns_and_the_harness_asks_the_timeout(monkeypatch):
    b, _ = ready(monkeypatch)
    assert isinstance(b.make_workload(b._ctx, 128, torch.bfloat16, (2, 64), 2), FusedResidualRMSNormWorkload)
    monkeypatch.setattr(b._area, "timeout_error", lambda: p2p_kernels.P2PTimeoutError("p2p: peer rank 1 ..."))
    with pytest.raises(p2p_kernels.P2PTimeoutError):
        b.raise_if_failed()


def test_plain_allreduce_is_not_what_p2p_fused_computes():
    with pytest.raises(RuntimeError, match="allreduce_residual_rmsnorm"):
        fused().allreduce(torch.zeros(8), torch.zeros(8))


def test_rows_say_the_kernel_its_launch_the_rule_and_the_check(monkeypatch):
    b, _ = ready(monkeypatch, world=8)
    b._dtype = torch.bfloat16
    b.make_workload(b._ctx, 7168, torch.bfloat16, (1, 7168), 2)
    observed = b.observe(lambda: None, 14336)["extra"]
    assert observed == {"p2p_fused_kernel": "fused_oneshot",
                        "p2p_fused_launch": {"blocks": 14, "threads": 64, "blocks_per_token": 14}}
    extra = b.row_fields()["extra"]
    assert extra["rms_eps"] == RMS_EPS and extra["tolerance"]["bfloat16"] == 2 ** -6
    assert extra["p2p_fused_rule"]["8"] == "fused_oneshot<=64K,fused_twoshot"
    assert "p2p_auto_rule" not in extra                 # no calibration: a fixed rule
    assert "p2p_fused_rule" not in fused("fused_oneshot").row_fields()["extra"]


def test_engine_settings_price_the_engines_fused_path_as_a_stand_in():
    settings = fused().engine_settings(8)
    assert settings.engine_paths == {engines.VLLM: {"path": engines.FLASHINFER_FUSED, "stand_in": True},
                                     engines.SGLANG: {"path": engines.FLASHINFER_FUSED, "stand_in": True}}
    assert settings.vllm_flags == list(engines.VLLM_FUSE_ALLREDUCE_RMS)
    assert any("no engine runs it" in note for note in settings.notes)
    assert engines.FUSED_TIMING in settings.notes


def test_the_partial_slots_fit_every_token_a_shared_grid_holds():
    assert p2p_layout.FUSED_PARTIAL_WORDS == p2p_layout.FUSED_GROUP_TOKENS * p2p_layout.FUSED_MAX_GROUP
    assert numpy.dtype(numpy.int64).itemsize == 8    # one {call, bits} word a slot


def test_a_new_shared_area_gets_fresh_partial_slots(monkeypatch):
    # Its call counts start at 1 again: a slot tagged by the old area's count would pass for a new one's.
    b, _ = ready(monkeypatch)
    monkeypatch.setattr(P2PAllreduce, "setup", lambda self, ctx, max_bytes, dtype: None)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: object())
    b._partials = None
    b.setup(b._ctx, 1 << 20, torch.bfloat16)
    first = b._partials
    b.setup(b._ctx, 1 << 20, torch.bfloat16)        # the same area: the same slots
    assert b._partials is first
    b._area = object()                              # rebuilt (a larger buffer, or after a timeout)
    b.setup(b._ctx, 1 << 20, torch.bfloat16)
    assert b._partials is not first
