"""scripts/p2p_kernel_study.py without a GPU: every study still applies to the shipped kernel file,
prepare writes a plug-in the registry loads, and the table and the winners read the rows right."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from commbench import backends
from commbench.backends.p2p import kernels as p2p_kernels
from commbench.backends.p2p import layout as p2p_layout
from commbench.backends.p2p.backend import P2PAllreduce
from commbench.results import WRONG
from factories import row, write_run

SCRIPT = Path(__file__).parents[2] / "scripts" / "p2p_kernel_study.py"


def load_study():
    spec = importlib.util.spec_from_file_location("p2p_kernel_study_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


study = load_study()


@pytest.mark.parametrize("name", list(study.STUDIES))
def test_every_study_applies_to_the_shipped_kernels(name):
    source = p2p_kernels.KERNEL_SOURCE.read_text()
    changed = study.patched(source, name)
    assert (changed == source) == (not study.STUDIES[name])
    assert set(study.STUDY_KERNELS[name]) <= set(p2p_layout.KERNEL_NAMES)


def test_a_study_that_no_longer_matches_stops():
    with pytest.raises(SystemExit, match="flag_oneshot: the kernel file no longer holds"):
        study.patched("// an unrelated kernel file\n", "flag_oneshot")


def test_flag_oneshot_gives_the_graph_one_shot_the_flag_barriers_back():
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), "flag_oneshot")
    one_shot = changed.split("p2p_oneshot_graph(")[1]
    assert "graph_call_begin<N, false>" in one_shot and "counter_barrier" not in one_shot


def test_small_params_gives_only_the_lamport_one_shot_the_small_struct():
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), "small_params")
    assert "p2p_ll_oneshot(const __grid_constant__ SmallLayout L," in changed
    assert "p2p_ll_oneshot_own_slot(const __grid_constant__ SmallLayout L," in changed
    assert changed.count("const __grid_constant__ Layout L,") == len(p2p_layout.KERNEL_NAMES) - 2
    struct = changed.split("struct SmallLayout {")[1].split("};")[0]
    assert tuple(re.findall(r"u64 (\w+)", struct)) == study.SMALL_LAYOUT_FIELDS


def _lamport_one_shot(name):
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), name)
    return changed, changed.split("p2p_ll_oneshot(")[1].split("\n}\n")[0]


@pytest.mark.parametrize("name, shape", [("own_slot_always", "true"), ("own_slot_never", "false")])
def test_own_slot_studies_give_both_lamport_one_shot_kernels_one_shape(name, shape):
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), name)
    for kernel in ("p2p_ll_oneshot(", "p2p_ll_oneshot_own_slot("):
        body = changed.split(kernel)[1].split("\n}\n")[0]
        assert f"  ll_oneshot<DT, N, {shape}>(L, in, out, units);" in body
    shipped = p2p_kernels.KERNEL_SOURCE.read_text()
    assert len(changed.splitlines()) == len(shipped.splitlines())
    assert len([a for a, b in zip(changed.splitlines(), shipped.splitlines()) if a != b]) == 1


def test_call_thread0_reads_the_count_and_the_abort_word_once_per_block():
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), "call_thread0")
    begin = changed.split("Call begin_call(")[1].split("\n}\n")[0]
    assert begin.count("load_volatile(") == 2 and "if (threadIdx.x == 0) {" in begin
    # the block waits for thread 0's reads before any thread uses them or publishes the next count
    assert begin.index("__syncthreads();") < begin.index("call.count = first_read[0];") < begin.index("counters[b] =")
    assert "__syncthreads_or" not in begin


def test_first_barrier_nosync_drops_only_the_first_counter_barriers_block_barrier():
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), "first_barrier_nosync")
    barrier = changed.split("bool counter_barrier(")[1].split("\n}\n")[0]
    assert "  if (kSync) __syncthreads();" in barrier
    assert "counter_barrier<N, false>(L, window, call.count, PHASE_FIRST_BARRIER)" in changed
    assert "counter_barrier<N>(L, window + N, call.count, PHASE_SECOND_BARRIER)" in changed   # the second keeps it


def test_bf16_int_rounds_every_bf16_lane_in_integer_code_again():
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), "bf16_int")
    pack = changed.split("__device__ __forceinline__ uint4 pack(")[1].split("\n}\n")[0]
    assert "#if 0\n      if (DT == 2) {" in pack and "float_to_bf16" in pack
    shipped = p2p_kernels.KERNEL_SOURCE.read_text().split("__device__ __forceinline__ uint4 pack(")[1]
    # cvt.rn.bf16x2.f32 d, a, b puts a in d's upper half: lane 2i + 1 is the high half, as lo | (hi << 16)
    assert 'asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(f[2 * i + 1]), "f"(f[2 * i]));' in shipped


def test_small_layout_carries_the_lamport_areas_and_the_scalars_the_kernel_reads():
    plan = p2p_layout.plan_areas(("oneshot_lamport",), 4, 4096)
    bases = [0x1000_0000 * (r + 1) for r in range(4)]
    full = p2p_layout.layout_parameter(plan, bases, timeout_ns=7_000_000, ctrl=0xC0, report=0xE0, rank=2)
    small = study.small_layout(full)
    assert list(small["words"][0]) == ([b + plan.ll for b in bases] + [0] * (p2p_layout.MAX_RANKS - 4)
                                       + [plan.slot_bytes, 7_000_000, 0xC0, 0xE0, 2])
    assert small.itemsize == 8 * (p2p_layout.MAX_RANKS + 5)
    assert study.small_layout(small) is small      # a later setup that kept its area


def test_small_params_hands_the_kernel_the_small_value_after_every_setup(monkeypatch):
    plan = p2p_layout.plan_areas(("oneshot_lamport",), 2, 4096)
    full = p2p_layout.layout_parameter(plan, [0x1000, 0x2000], timeout_ns=1, ctrl=2, report=3, rank=1)

    rebuilds = [True, False, True]    # a new area (the full Layout), the area kept, a new one again

    def shipped_setup(self, ctx, max_bytes, dtype):    # the p2p backend's setup, as far as the layout goes
        if rebuilds.pop(0):
            self._area = types.SimpleNamespace(layout=full)

    monkeypatch.setattr(P2PAllreduce, "setup", shipped_setup)
    (backend,) = study._factory().make("small_params.oneshot_lamport", None)
    while rebuilds:
        backend.setup(None, 4096, torch.bfloat16)
        assert list(backend._area.layout["words"][0]) == list(study.small_layout(full)["words"][0])


def test_prepare_writes_a_plug_in_the_registry_loads(tmp_path, monkeypatch):
    study.prepare(tmp_path)
    assert sorted(p.stem for p in (tmp_path / "p2p_kernel_study_sources").iterdir()) == sorted(study.STUDIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "p2p_kernel_study", raising=False)
    backends.factory.cache_clear()
    try:
        made = backends.expand(["p2pstudy:flag_volatile.twoshot_graph", "p2pstudy:nopdl.oneshot_lamport"],
                               backends.Options(), on_gpu=True)
        assert [b.name for b in made] == ["p2pstudy:flag_volatile.twoshot_graph", "p2pstudy:nopdl.oneshot_lamport"]
        assert made[0].kernel_source == tmp_path / "p2p_kernel_study_sources" / "flag_volatile.cu"
        assert made[0].algorithms == ("twoshot_graph",) and made[0].options.pdl
        assert not made[1].options.pdl
        (nvcc,) = backends.expand(["p2pstudy:nvcc.oneshot_lamport"], backends.Options(), on_gpu=True)
        monkeypatch.setattr(shutil, "which", lambda name: None)
        assert nvcc.check(None) == study.NVCC_MISSING      # a skipped row with this reason
        with pytest.raises(Exception, match="unknown study backend 'p2pstudy:ll_relaxed.twoshot_graph'"):
            backends.expand(["p2pstudy:ll_relaxed.twoshot_graph"], backends.Options(), on_gpu=True)
    finally:
        sys.modules.pop("p2p_kernel_study", None)
        backends.factory.cache_clear()


def _run(tmp_path, name, world=8):
    base = {4096: 3.0, 65536: 5.0}
    rows = [row(backend="sglang:1shot_push", world_size=world, message_bytes=4096, latency_us=2.0)]
    for size, us in base.items():
        rows += [row(backend="p2pstudy:base.oneshot_lamport", world_size=world, message_bytes=size, latency_us=us),
                 row(backend="p2pstudy:ll_relaxed.oneshot_lamport", world_size=world, message_bytes=size,
                     latency_us=us * (0.9 if size == 4096 else 1.0)),
                 row(backend="p2pstudy:noabort.oneshot_lamport", world_size=world, message_bytes=size,
                     latency_us=us * 0.98),
                 row(backend="p2pstudy:pdl_late.oneshot_lamport", world_size=world, message_bytes=size,
                     latency_us=us * 0.5, status=WRONG if size == 65536 else "ok")]
    return write_run(tmp_path / name, rows)


def test_winners_beat_base_by_the_margin_and_were_never_wrong(tmp_path):
    # pdl_late is fastest but was wrong once; noabort won only 2%.
    assert study.winners([_run(tmp_path, "a")]) == ["ll_relaxed"]


def test_the_table_gives_study_rows_as_ratios_to_base(tmp_path):
    lines = study.table([_run(tmp_path, "a")])
    assert lines[0].startswith("### 8 ranks")
    sglang = next(line for line in lines if line.startswith("| sglang:1shot_push |"))
    assert sglang == "| sglang:1shot_push | 2.00 | - |"
    relaxed = next(line for line in lines if line.startswith("| p2pstudy:ll_relaxed.oneshot_lamport |"))
    assert relaxed == "| p2pstudy:ll_relaxed.oneshot_lamport | 0.90x | 1.00x |"
    assert "| p2pstudy:base.oneshot_lamport | 3.00 | 5.00 |" in lines


def test_a_run_dir_without_rows_is_one_line_and_exit_2(tmp_path, capsys):
    assert study.main(["table", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"p2p_kernel_study: {tmp_path}: no measurements.jsonl"
