"""scripts/p2p_kernel_study.py without a GPU: every study still applies to the shipped kernel file,
prepare writes a plug-in the registry loads, and the table and the winners read the rows right."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from commbench import backends
from commbench.backends.p2p import kernels as p2p_kernels
from commbench.backends.p2p import layout as p2p_layout
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


@pytest.mark.parametrize("name, shape", [("own_slot_always", "true"), ("own_slot_never", "false")])
def test_own_slot_studies_give_both_lamport_one_shot_kernels_one_shape(name, shape):
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), name)
    for kernel in ("p2p_ll_oneshot(", "p2p_ll_oneshot_own_slot("):
        body = changed.split(kernel)[1].split("\n}\n")[0]
        assert f"  ll_oneshot<DT, N, {shape}>(L, in, out, units);" in body
    shipped = p2p_kernels.KERNEL_SOURCE.read_text()
    assert len(changed.splitlines()) == len(shipped.splitlines())
    assert len([a for a, b in zip(changed.splitlines(), shipped.splitlines()) if a != b]) == 1


def test_graph_all_read_gives_the_graph_kernels_the_lamport_one_shots_vote_back():
    shipped = p2p_kernels.KERNEL_SOURCE.read_text()
    changed = study.patched(shipped, "graph_all_read")
    begin = changed.split("bool graph_call_begin(")[1].split("\n}\n")[0]
    assert "begin_call<false>(L," in begin and "begin_call<true>" not in changed
    # the Lamport kernels and the flag kernels read the count with every thread in both
    assert shipped.count("begin_call(L, ") == changed.count("begin_call(L, ") >= 3


@pytest.mark.parametrize("name, vectors", [("unroll_every_world", "2"), ("unroll_none", "1")])
def test_unroll_studies_set_the_graph_one_shots_vectors_per_pass_at_every_world_size(name, vectors):
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), name)
    one_shot = changed.split("p2p_oneshot_graph(")[1].split("\n}\n")[0]
    assert f"    constexpr u32 K = {vectors};" in one_shot
    assert "N == 2 ?" not in changed


def test_ll_bare_drops_the_vote_and_the_timeouts_and_publishes_the_count_at_the_end():
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), "ll_bare")
    body = changed.split("void ll_oneshot(")[1].split("\n}\n")[0]
    assert "begin_call" not in body and "call.failed" not in body
    # every thread has read the count before the next one is published
    assert body.index("load_volatile(counters + blockIdx.x)") < body.rindex("__syncthreads();") < \
        body.index("counters[b] = call.count;")
    wait = changed.split("bool ll_wait(")[1].split("\n}\n")[0]
    assert "if (false) {" in wait


def test_warp_blocks_launches_the_shipped_kernels_one_warp_per_block():
    (made,) = study._factory().make("warp_blocks.oneshot_lamport", None)
    assert made.options.shape == p2p_layout.LaunchShape(threads=p2p_layout.WARP_THREADS)
    assert study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), "warp_blocks") == p2p_kernels.KERNEL_SOURCE.read_text()
    (base,) = study._factory().make("base.oneshot_lamport", None)
    assert base.options.shape == p2p_layout.LaunchShape()


def test_no_warp_spread_launches_the_own_slot_form_by_the_size_rule():
    assert study.no_warp_spread(256, 28, 14) == p2p_layout.size_dims(256, 28, 14) == (2, 128)
    assert study.no_warp_spread(256, 28, 14) != p2p_layout.launch_dims(p2p_layout.ONESHOT_LL, 256, 8, 28, 14)


def test_grid_pull_pads_the_shipped_width_to_sglangs_64_blocks_and_grid_narrow_fills_them():
    assert study.grid_pull(4096, 64, 33) == (64, p2p_layout.spread_threads(4096, 33)) == (64, 128)
    assert study.grid_pull(4096, 40, 33) == (40, 128)
    assert study.grid_narrow(4096, 64, 33) == (64, 64)          # 4 ranks 64K: 64 blocks of 64
    assert study.grid_narrow(16384, 64, 33) == (64, 256)
    assert study.grid_narrow(1 << 20, 64, 66) == (64, p2p_layout.THREADS_PER_BLOCK)


@pytest.mark.parametrize("name, kernel", [(name, kernel) for name, (kernel, _) in study.LAUNCH_SHAPES.items()])
def test_a_shape_study_shapes_only_its_kernels_launches(name, kernel, monkeypatch):
    (made,) = study._factory().make(f"{name}.{kernel}", None)
    assert study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), name) == p2p_kernels.KERNEL_SOURCE.read_text()
    made._grids = {"bf16": (64, 16)}
    monkeypatch.setattr(made, "_ctx", type("Ctx", (), {"world_size": 8})(), raising=False)
    shape = study.LAUNCH_SHAPES[name][1]
    assert made._launch_dims(kernel, 256, "bf16") == shape(256, 64, 16)
    other = "twoshot_graph"     # no shape study shapes its launches
    assert made._launch_dims(other, 256, "bf16") == p2p_layout.launch_dims(other, 256, 8, 64, 16)


def test_window_late_reserves_the_graph_one_shots_window_after_its_first_arrival():
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), "window_late")
    begin = changed.split("graph_call_begin(const Layout& L, Call& call, u32& window) {")[1].split("\n}\n")[0]
    assert "atomicAdd" not in begin and "PHASE_FIRST_BARRIER, &window)" in begin
    barrier = changed.split("__device__ bool counter_barrier(")[1].split("\n}\n")[0]
    # thread 0 arrives at every peer first (red), then reserves, then polls against what it reserved
    assert barrier.index("red.relaxed.sys") < barrier.index("atomicAdd") < barrier.index("load_relaxed_sys(mine)")
    assert "target = *reserve = atomicAdd(semaphore(L.flags[L.rank], blockIdx.x, WINDOW_WORD), 2u * N);" in barrier


def test_graph_bare_polls_the_counter_barrier_without_its_checks():
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), "graph_bare")
    barrier = changed.split("__device__ bool counter_barrier(")[1].split("\n}\n")[0]
    poll = barrier.split("while (load_relaxed_sys(mine) - target < (u32)N) {")[1]
    assert "if (true) continue;" in poll and "globaltimer_ns" not in barrier and "aborted(L) ||" not in barrier
    # the flag barrier keeps its checks
    assert "if (aborted(L)) {" in changed.split("__device__ bool barrier(")[1].split("\n}\n")[0]


def test_graph_nocount_begins_the_counter_kernel_without_the_call_count_and_graph_lean_adds_graph_bare():
    source = p2p_kernels.KERNEL_SOURCE.read_text()
    changed = study.patched(source, "graph_nocount")
    begin = changed.split("graph_call_begin(const Layout& L, Call& call, u32& window) {")[1].split("\n}\n")[0]
    # the counter kernel (the one-shot) skips begin_call; the flag kernel (the two-shot) keeps it
    assert begin.index("if (kCounter) call = Call{0u, false};") < begin.index("else call = begin_call<true>(")
    lean = study.patched(source, "graph_lean")
    assert lean == changed.replace(*study.STUDIES["graph_bare"][0])   # the two changes, each once
    assert study.STUDY_KERNELS["graph_lean"] == study.STUDY_KERNELS["graph_nocount"] == ("oneshot_graph",)


def test_graph_plain_loads_changes_every_read_of_the_graph_one_shot():
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), "graph_plain_loads")
    one_shot = changed.split("p2p_oneshot_graph(")[1].split("\n}\n")[0]
    assert "load_cg" not in one_shot and one_shot.count("((const uint4*)ins[s])[") == 2


def test_bf16_int_rounds_every_bf16_lane_in_integer_code_again():
    changed = study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), "bf16_int")
    pack = changed.split("__device__ __forceinline__ uint4 pack(")[1].split("\n}\n")[0]
    assert "#if 0\n      if (DT == 2) {" in pack and "float_to_bf16" in pack
    shipped = p2p_kernels.KERNEL_SOURCE.read_text().split("__device__ __forceinline__ uint4 pack(")[1]
    # cvt.rn.bf16x2.f32 d, a, b puts a in d's upper half: lane 2i + 1 is the high half, as lo | (hi << 16)
    assert 'asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(f[2 * i + 1]), "f"(f[2 * i]));' in shipped


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
