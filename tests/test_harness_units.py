"""The pieces of the sweep harness that need no processes: sizes, plan, patterns, statistics,
NCCL log parsing, backend spec parsing and the driver's argument handling."""

from __future__ import annotations

import argparse

import pytest
import torch

from commbench import backends
from commbench.backends.base import BackendUnavailable, SweepFacts
from commbench.backends.mscclpp import MscclppOptions
from commbench.backends.nccl_variants import NcclOptions
from commbench.errors import UsageError
from commbench.sweep.launcher import child_arguments, parse_env_settings
from commbench.sweep.plan import Shape, build_plan
from commbench.sweep.command import add_arguments, backend_options
from commbench.sweep.options import SweepOptions
from commbench import inflight
from commbench.inflight import ENDED, HANG, PeerWatch, Record, read_records, recover
from commbench.results import CRASHED, OK, Cell, Measurement, RunDir, percentile
from commbench.runtime.timing import headline_us, jitter_stats, max_over_ranks
from commbench.runtime.dtypes import parse_dtypes
from commbench.units import format_bytes, parse_bytes
from commbench.runtime.workload import bandwidths_gbps, exact_pattern, expected_sum, name_failure, pattern_amplitude


def sweep_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


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


def test_default_plans_gpu_decode_to_prefill_and_short_cpu() -> None:
    gpu = build_plan(sweep_args(), on_gpu=True)
    assert gpu.shapes[0].message_bytes == 4 << 10 and gpu.shapes[-1].message_bytes == 256 << 20
    assert len(gpu.shapes) == 17 and gpu.modes == ["eager", "graph"] and gpu.dtypes == [torch.bfloat16]
    cpu = build_plan(sweep_args(), on_gpu=False)
    assert [s.message_bytes for s in cpu.shapes] == [1024, 4096, 16384, 65536, 262144]
    assert cpu.modes == ["eager"] and cpu.dtypes == [torch.float32]


def test_iterations_scale_down_with_size_within_bounds() -> None:
    plan = build_plan(sweep_args(), on_gpu=True)
    counts = [plan.iterations_for(s.message_bytes) for s in plan.shapes]
    assert counts[0] == 200 and counts == sorted(counts, reverse=True)
    # Every timed output is kept for the check: 2 GiB of them at most, so 8 calls at 256 MiB.
    assert plan.iterations_for(64 << 20) == 20 and counts[-1] == plan.iterations_for(256 << 20) == 8
    assert build_plan(sweep_args("--iters", "7"), on_gpu=True).iterations_for(1 << 30) == 7


def test_graphs_capture_enough_calls_to_hide_the_replay_overhead() -> None:
    plan = build_plan(sweep_args(), on_gpu=True)
    ops = {size: plan.graph_ops_for(size) for size in (4 << 10, 1 << 20, 2 << 20, 4 << 20, 64 << 20, 256 << 20)}
    assert ops == {4 << 10: 128, 1 << 20: 128, 2 << 20: 128, 4 << 20: 64, 64 << 20: 4, 256 << 20: 1}
    assert [plan.graph_replays_for(s) for s in (4 << 10, 4 << 20, 256 << 20)] == [50, 20, 20]
    fixed = build_plan(sweep_args("--graph-ops", "10", "--iters", "30"), on_gpu=True)
    assert (fixed.graph_ops_for(4 << 10), fixed.graph_replays_for(4 << 10)) == (10, 30)


def test_model_shapes_and_explicit_lists() -> None:
    plan = build_plan(sweep_args("--tokens", "1,8", "--hidden", "7168"), on_gpu=True)
    assert plan.shapes == [Shape(14336, 1, 7168), Shape(8 * 14336, 8, 7168)]
    plan = build_plan(sweep_args("--sizes", "12K,8K", "--dtype", "fp16,fp32"), on_gpu=True)
    assert [s.message_bytes for s in plan.shapes] == [8192, 12288]
    assert plan.sizes_for(torch.float32) == plan.shapes


def test_the_plan_yields_each_variants_cells_in_the_order_they_are_measured() -> None:
    plan = build_plan(sweep_args("--sizes", "12K,8K", "--dtype", "fp16,fp32"), on_gpu=True)
    cells = plan.cells("nccl:proto=LL", "allreduce", {"NCCL_B": "2", "NCCL_A": "1"})
    assert [(c.dtype, c.shape.message_bytes, c.mode) for c in cells[:3]] == [
        ("fp16", 8192, "eager"), ("fp16", 8192, "graph"), ("fp16", 12288, "eager")]
    assert len(set(cells)) == len(cells) == 8 and {c.dtype for c in cells[4:]} == {"fp32"}
    # The setting is kept sorted: the order it was written in never makes two cells differ.
    assert cells[0].env_setting == (("NCCL_A", "1"), ("NCCL_B", "2"))
    assert cells == plan.cells("nccl:proto=LL", "allreduce", {"NCCL_A": "1", "NCCL_B": "2"})
    assert cells[0].library == "" and cells[0].backend == "nccl:proto=LL" and cells[0].op == "allreduce"


def test_a_row_is_its_cell_plus_an_outcome_in_the_row_format_it_always_had() -> None:
    cell = Cell("nccl:lib=next", "allreduce", "bf16", Shape(14336, 1, 7168), "graph",
                Cell.setting({"LD_PRELOAD": "/opt/nccl/libnccl.so.2"}))
    row = Measurement.of(cell, 8, OK, count=7168, latency_us=12.5)
    flat = Measurement(backend="nccl:lib=next", mode="graph", dtype="bf16", message_bytes=14336, world_size=8,
                       status=OK, count=7168, tokens=1, hidden=7168, latency_us=12.5,
                       env_setting={"LD_PRELOAD": "/opt/nccl/libnccl.so.2"})
    assert row.to_dict() == flat.to_dict() and row.cell == flat.key() == cell
    assert cell.library == "/opt/nccl/libnccl.so.2"
    # Every part of the cell tells rows apart; the outcome does not.
    for other in (Shape(14336), Shape(28672, 2, 7168)):
        assert Measurement.of(Cell("nccl:lib=next", "allreduce", "bf16", other, "graph", cell.env_setting), 8,
                              OK).key() != row.key()
    assert Measurement.from_dict({**row.to_dict(), "op": "allreduce_residual_rmsnorm"}).key() != row.key()
    assert Measurement.from_dict({**row.to_dict(), "env_setting": {}}).key() != row.key()
    assert Measurement.of(cell, 8, CRASHED, reason="died").key() == row.key()


def test_an_in_flight_record_keeps_its_cells_row_and_recovery_writes_it_once(tmp_path) -> None:
    run = RunDir.create(tmp_path)
    cell = Cell("demo", "allreduce", "fp32", Shape(4096), "eager", Cell.setting({"NCCL_PROTO": "LL"}))
    template = Measurement.of(cell, 2, CRASHED, count=1024, requested={"NCCL_PROTO": "LL"})
    (run.path / "inflight").mkdir()
    record = Record(rank=1, pid=999999999, host="synthetic-host", step=3, phase="row", what="demo 4K fp32 eager",
                    row=template, started=1.0, deadline=None)
    (run.path / "inflight" / "rank1.json").write_text(record.to_json())
    assert read_records(run.path)[0].row == template
    assert len(recover(run.path)) == 1 and recover(run.path) == []   # the records are gone after the first
    written = run.rows()
    assert len(written) == 1 and written[0].cell == cell and written[0].status == CRASHED
    assert written[0].requested == {"NCCL_PROTO": "LL"} and written[0].failed_rank == 1


def test_a_peer_whose_watchdog_wrote_hang_just_before_it_exited_is_a_hang_not_a_silent_death(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen at 8 ranks on the H200: rank 4's watchdog wrote "hang, ended" and left by os._exit
    # between a peer's read of the records and its look at /proc; the peer read the older
    # record with a dead process and called it "died without a trace (SIGKILL?)".
    run = RunDir.create(tmp_path)
    (run.path / "inflight").mkdir()
    cell = Cell("demo", "allreduce", "bf16", Shape(16384), "graph", Cell.setting({}))
    running = Record(rank=4, pid=999999999, host="synthetic-host", step=7, phase="row", what="demo 16K bf16 graph",
                     row=Measurement.of(cell, 8, CRASHED), started=1.0, deadline=21.0)
    path = run.path / "inflight" / "rank4.json"
    path.write_text(running.to_json())

    def exits_after_its_last_write(record: Record) -> bool:
        final = Record(**{**vars(running), "state": HANG, "detail": "no progress within 20 s during demo",
                          "exit": ENDED, "exit_at": 22.0})
        path.write_text(final.to_json())
        return False

    monkeypatch.setattr(inflight, "is_alive", exits_after_its_last_write)
    stop = PeerWatch(run.path, rank=0, step=7, peer_wait_s=0.0)()
    assert stop is not None and stop.status == HANG and "no progress within 20 s" in stop.reason, stop


@pytest.mark.parametrize("argv, hidden", [(["--tokens", "1,8", "--hidden", "4096"], 4096), ([], None)])
def test_model_shapes_bring_the_unfused_baseline_into_the_gpu_defaults(argv: list[str], hidden: int | None) -> None:
    args = sweep_args(*argv)
    options = backend_options(SweepOptions.from_args(args, argv), build_plan(args, on_gpu=True), None)
    assert options.sweep.hidden == hidden
    unfused = [b.name for b in backends.expand(None, options, True) if b.family == "unfused"]
    assert unfused == (["unfused:best"] if hidden else [])


def test_backends_get_every_planned_size() -> None:
    """flashinfer:pcie_ipc tunes one bucket per planned size at setup, so it is told them all."""
    args = sweep_args("--tokens", "1,8", "--hidden", "4096")
    options = backend_options(SweepOptions.from_args(args, []), build_plan(args, on_gpu=True), None)
    assert options.sweep.message_bytes == (8192, 65536)
    args = sweep_args("--sizes", "1M,8K,64K")
    options = backend_options(SweepOptions.from_args(args, []), build_plan(args, on_gpu=True), None)
    assert options.sweep.message_bytes == (8192, 65536, 1 << 20)


@pytest.mark.parametrize("argv, message", [
    (["-b", "4K", "--sizes", "8K"], "two ways"),
    (["--hidden", "4096"], "need both"),
    (["--tokens", "1", "--hidden", "4096", "--dtype", "bf16,fp32"], "one --dtype"),
    (["--mode", "fast"], "unknown mode"),
    (["-f", "1"], "step factor"),
    (["--timeout", "0"], "--timeout"),
    (["--setup-timeout", "-1"], "--setup-timeout must be a positive, finite number of seconds"),
])
def test_plan_rejects_contradictions(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        build_plan(sweep_args(*argv), on_gpu=True)


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


def test_backend_specs_keep_their_options_together() -> None:
    assert backends.split_specs("nccl:proto=LL,algo=Ring,gloo, nccl") == ["nccl:proto=LL,algo=Ring", "gloo", "nccl"]
    flags = SweepOptions.from_args(sweep_args("--nccl-proto", "ll,Simple", "--nccl-algo", "ring"), [])
    names = [b.name for b in backends.expand(["nccl"], backends.Options(families=flags.families), True)]
    assert names == ["nccl", "nccl:proto=LL,algo=Ring", "nccl:proto=Simple,algo=Ring"]
    with pytest.raises(UsageError, match="unknown backend"):
        backends.expand(["warp"], backends.Options(), True)


def test_each_family_is_handed_its_own_options_and_the_sweeps_facts() -> None:
    from commbench.backends.flashinfer import FlashinferOptions
    from commbench.backends.p2p_rules import P2POptions

    flags = SweepOptions.from_args(sweep_args("--p2p-max-bytes", "4M", "--nccl-proto", "ll"), [])
    assert flags.families["p2p"] == P2POptions(max_bytes=4 << 20)
    assert flags.families["nccl"] == NcclOptions(protos=("LL",))
    options = backends.Options(SweepFacts(hidden=4096), flags.families)
    (p2p,) = backends.expand(["p2p:oneshot"], options, True)
    assert p2p.options is flags.families["p2p"]
    # unfused:best rebuilds the allreduce it measured fastest as the sweep made it, p2p's options and all.
    (unfused,) = backends.expand(["unfused:best"], options, True)
    assert unfused._rebuild("p2p:oneshot").options.max_bytes == 4 << 20
    with pytest.raises(BackendUnavailable, match="cannot rebuild backend 'nccl:algo=Ring,proto=LL'"):
        backends.Options().build("nccl:algo=Ring,proto=LL")   # no variant has that name (nccl:proto=LL,algo=Ring)
    with pytest.raises(BackendUnavailable, match="outside a sweep"):
        backends.factory("unfused").variants("best")[0]._rebuild("p2p:oneshot")
    # Where no flags were read (the probe), a family gets what it reads from its flags' defaults.
    assert backends.factory("p2p").default_options() == P2POptions()
    assert backends.factory("flashinfer").default_options() == FlashinferOptions()
    assert backends.factory("gloo").default_options() is None


def test_driver_splits_its_own_flags_from_the_childrens() -> None:
    argv = ["--nproc", "8", "--env=NCCL_MAX_CTAS=8,16", "-b", "4K", "--env", "NCCL_NTHREADS=256", "--mps",
            "--share-gpus", "--child-timeout", "60", "--resume=x", "--backends", "nccl"]
    assert child_arguments(argv) == ["-b", "4K", "--share-gpus", "--backends", "nccl"]
    settings = parse_env_settings(["NCCL_MAX_CTAS=8,16", "NCCL_NTHREADS=256"], allow_multicast=False)
    assert settings == [{"NCCL_MAX_CTAS": "8", "NCCL_NTHREADS": "256"}, {"NCCL_MAX_CTAS": "16", "NCCL_NTHREADS": "256"}]


def test_mps_clients_get_an_equal_share_of_their_gpu() -> None:
    from commbench.sweep.mps import client_env

    assert client_env(8, 1) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "12"}
    assert client_env(2, 1) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
    assert client_env(8, 2) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    assert client_env(3, 8) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}


def test_driver_never_turns_multicast_on_under_a_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    with pytest.raises(UsageError, match="multicast"):
        parse_env_settings(["NCCL_NVLS_ENABLE=1"], allow_multicast=True)
    assert parse_env_settings(["NCCL_NVLS_ENABLE=0"], allow_multicast=False) == [{"NCCL_NVLS_ENABLE": "0"}]


@pytest.mark.procs
def test_driver_gives_a_preloaded_nccl_replacement_its_own_child(tmp_path) -> None:
    from commbench.sweep.launcher import child_runs

    library = tmp_path / "libmscclpp_nccl.so"
    library.write_bytes(b"")
    options = backends.Options(families={"mscclpp": MscclppOptions(str(library))})
    variants = backends.expand(["nccl", "mscclpp:shim"], options, True)
    argv = ["--nproc", "8", "--backends", "nccl,mscclpp:shim", "-b", "4K", "--mscclpp-nccl-lib", str(library)]
    runs = child_runs(argv, [], variants, allow_multicast=False)
    assert runs[0] == ({}, ["--backends", "nccl,mscclpp:shim", "-b", "4K", "--mscclpp-nccl-lib", str(library)])
    env, args = runs[1]
    assert env == {"LD_PRELOAD": str(library.resolve()), "MSCCLPP_FORCE_DISABLE_NVLS": "1"}
    assert args == ["-b", "4K", "--mscclpp-nccl-lib", str(library), "--backends", "mscclpp:shim"]
    assert len(runs) == 2
    # Ranks that share a GPU: the shim needs one GPU per rank, so the first child's rows say why
    # and no preloaded child is started to say it again.
    assert child_runs(argv, [], variants, allow_multicast=False, shares_gpus=True) == runs[:1]


def test_a_plugin_written_for_the_flat_options_dict_still_reads_it() -> None:
    """Before typed options, make() got one dict: a plug-in's own read_options entries beside the
    sweep's facts. options.get still answers both (docs/new-backend.md)."""
    from commbench.backends.base import MakeOptions

    old = MakeOptions({"hookdemo_level": 3}, SweepFacts(hidden=4096, message_bytes=(8192,)))
    assert old.get("hookdemo_level", 1) == 3 and old.get("hidden") == 4096
    assert old.get("message_bytes") == (8192,) and old.get("run_dir") is None
    assert old.get("nothing_like_it", "d") == "d" and old.get("build", "d") == "d"   # fields of neither
    typed = MakeOptions(NcclOptions(protos=("LL",)))
    assert typed.get("protos", "d") == "d" and typed.get("allow_multicast") is False
