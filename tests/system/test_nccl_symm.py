"""nccl:symm on the CPU: NCCL's [Symmetric] log lines, the rules that say beforehand where no
symmetric kernel will run, what a row records from the log, the torch feature check, and the
variant's bad input. NCCL's own runs need GPUs (tests/gpu/test_nccl_gpu.py, several GPUs for
the kernels themselves)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from commbench import backends
from commbench.backends.base import SweepFacts
from commbench.backends.nccl.variants import NcclOptions
from commbench.backends.nccl import backend as nccl_backend
from commbench.backends.nccl import symm as nccl_symm
from commbench.topology.nccl_log import (LOG_VARIABLES, NcclLogSwitch, symmetric_kernel, symmetric_unsupported,
                                         used_algo_proto)
from commbench.backends.nccl.symm import expected_reason, registration_reason
from commbench.errors import UsageError
from helpers import run_cli

LOGS = Path(__file__).parents[1] / "data" / "nccl-logs"
SNAPSHOTS = Path(__file__).parents[1] / "fixtures" / "snapshots"


def log_lines(name: str) -> list[str]:
    return (LOGS / name).read_text().splitlines()


def snapshot(name: str) -> dict:
    return json.loads((SNAPSHOTS / name).read_text())


def test_the_symmetric_kernel_is_read_per_size_in_every_format() -> None:
    assert symmetric_kernel(log_lines("symm-2.27-nvswitch.observe.log"), 4096) == "AllReduce_AGxLL_R"
    lines = log_lines("symm-2.28-nvswitch.observe.log")
    assert symmetric_kernel(lines, 4096) == "AllReduce_AGxLL_R"
    assert symmetric_kernel(lines, 1 << 20) == "AllReduce_RSxLD_AGxST"
    assert symmetric_kernel(lines, 8192) is None                 # an AllGather, not an allreduce
    assert symmetric_kernel(lines, 64 << 20) is None             # this size went to Ring
    assert used_algo_proto(lines, 64 << 20) == ("Ring", "Simple")
    suffixed = "h:1:1 [0] NCCL INFO AllReduce [Symmetric]: 512 Bytes -> Kernel AllReduce_AGxLL_R nchannels 1 " \
               "nthreads 512 nWorks 1 cgaClusterSize 2"         # 2.29 adds a non-default cluster size
    assert symmetric_kernel([suffixed], 512) == "AllReduce_AGxLL_R"


def test_nccl_s_own_refusal_is_found_in_the_init_log() -> None:
    assert symmetric_unsupported(log_lines("symm-2.29-pcie.init.log")) == (
        "Symmetric memory is not supported. cuMemEnable 1, globalGinSupport 0, globalNicFused 0 cuMemGdrSupport 1")
    assert symmetric_unsupported(log_lines("symm-2.28-nvswitch.observe.log")) is None


@pytest.mark.parametrize("code, world, nodes, snap, env, dtype, reason", [
    (None, 8, 1, None, {}, None, "the NCCL version of this process is unknown"),
    (22609, 8, 1, None, {}, None, "NCCL 2.26.9 has no symmetric kernels (they start at 2.27)"),
    (22809, 1, 1, None, {}, None, "world size 1: NCCL's allreduce over one rank is a local copy"),
    (22809, 8, 1, None, {"NCCL_WIN_ENABLE": "0"}, None, "NCCL_WIN_ENABLE=0: window registration off"),
    (22809, 8, 1, None, {"NCCL_CUMEM_ENABLE": "0"}, None, "NCCL_CUMEM_ENABLE=0: no cuMem memory"),
    (22809, 8, 1, None, {}, torch.int32, "takes bf16, fp16 and fp32, not int32"),
    (22707, 16, 2, None, {}, None, "NCCL 2.27.7 runs symmetric kernels within one node only; this run spans 2 nodes"),
    (22907, 8, 1, "pcie-8x-dual-socket.json", {}, None,
     "NCCL 2.29.7 (>= 2.29) runs its symmetric kernels only where every GPU pair is NVLink-connected: GPU 0 - GPU 1 is PIX"),
    (22907, 16, 2, None, {}, None, "only where every GPU pair is NVLink-connected; this run spans 2 nodes"),
])
def test_where_no_symmetric_kernel_will_run_and_why(code: int | None, world: int, nodes: int, snap: str | None,
                                                    env: dict[str, str], dtype: torch.dtype | None,
                                                    reason: str) -> None:
    got = expected_reason(code, world, nodes, snapshot(snap) if snap else None, env, dtype)
    assert reason in (got or ""), got


@pytest.mark.parametrize("code, snap", [
    (22809, "pcie-8x-dual-socket.json"),      # 2.27/2.28 run them on PCIe too
    (22907, "nvswitch-8x-h100.json"),         # all-NVLink: 2.29 runs them
    (22907, None),                            # no snapshot: nothing says otherwise, the log decides
    (23201, "nvswitch-8x-h100.json"),
])
def test_where_a_symmetric_kernel_may_run(code: int, snap: str | None) -> None:
    assert expected_reason(code, 8, 1, snapshot(snap) if snap else None, {}, torch.bfloat16) is None


class _Ctx:
    world_size, rank, nodes, snapshot = 8, 0, 1, None


@pytest.fixture
def observing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """An nccl:symm variant whose setup has run on rank 0 of 8, logging through a stand-in NCCL
    that writes the recorded lines where NCCL_DEBUG_FILE points."""
    from test_nccl_log import FakeNccl

    for name in LOG_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    switch = NcclLogSwitch.for_library(FakeNccl(22907), "libnccl.so.2")
    monkeypatch.setattr(nccl_backend, "process_switch", lambda: switch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    backend = backends.expand(["nccl:symm"], backends.Options(SweepFacts(run_dir=tmp_path)), True)[0]
    assert isinstance(backend, nccl_symm.NcclSymmBackend)
    backend._observe_calls, backend._not_observed = True, None   # what setup sets on rank 0 of 8

    def logs(name: str):
        def call() -> None:
            path = Path(os.environ["NCCL_DEBUG_FILE"].replace("%%", "%"))
            with path.open("a") as handle:
                handle.write((LOGS / name).read_text())
        return call

    return backend, logs


def test_a_row_names_the_symmetric_kernel_nccl_ran(observing) -> None:
    backend, logs = observing
    got = backend.observe(logs("symm-2.28-nvswitch.observe.log"), 4096)
    assert got == {"observed": {"NCCL_SYM_KERNEL": "AllReduce_AGxLL_R"},
                   "extra": {"nccl_symmetric_kernel": "AllReduce_AGxLL_R", "nccl_symmetric_note": None}}


def test_a_row_without_one_says_what_ran_instead_and_why(observing) -> None:
    backend, logs = observing
    got = backend.observe(logs("symm-2.28-nvswitch.observe.log"), 64 << 20)
    assert got["observed"] == {"NCCL_PROTO": "Simple", "NCCL_ALGO": "Ring"}
    assert got["extra"] == {"nccl_symmetric_kernel": None,
                            "nccl_symmetric_note": f"NCCL chose Ring/Simple for {64 << 20} bytes, not a symmetric kernel"}
    backend._expected = expected_reason(22907, 8, 1, snapshot("pcie-8x-dual-socket.json"), {})
    note = backend.observe(logs("symm-2.29-pcie.observe.log"), 4096)["extra"]["nccl_symmetric_note"]
    assert note.startswith("NCCL 2.29.7 (>= 2.29) runs its symmetric kernels only where every GPU pair is NVLink")
    assert note.endswith("(NCCL chose Ring/LL for 4096 bytes)")


def test_nccl_s_init_refusal_is_the_reason_when_no_rule_foresaw_it(observing) -> None:
    backend, logs = observing
    init = backend._log_file("init")
    init.parent.mkdir(parents=True, exist_ok=True)
    init.write_text((LOGS / "symm-2.29-pcie.init.log").read_text())
    note = backend.observe(logs("symm-2.29-pcie.observe.log"), 4096)["extra"]["nccl_symmetric_note"]
    assert note == ("NCCL: Symmetric memory is not supported. cuMemEnable 1, globalGinSupport 0, globalNicFused 0 "
                    "cuMemGdrSupport 1 (NCCL chose Ring/LL for 4096 bytes)")


def test_without_the_log_a_row_says_why_nothing_was_observed(tmp_path: Path) -> None:
    quiet = backends.Options(SweepFacts(run_dir=tmp_path), {"nccl": NcclOptions(log=False)})
    backend = backends.expand(["nccl:symm"], quiet, True)[0]
    backend._not_observed = "NCCL's log was not asked for (--no-nccl-log)"
    assert backend.observe(lambda: None, 4096)["extra"] == {
        "nccl_symmetric_kernel": None, "nccl_symmetric_note": "not observed: NCCL's log was not asked for (--no-nccl-log)"}
    backend._expected = "world size 1: NCCL's allreduce over one rank is a local copy, no symmetric kernel runs"
    assert backend.observe(lambda: None, 4096)["extra"]["nccl_symmetric_note"] == backend._expected


def test_the_torch_feature_is_detected_not_its_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    class NoPools:
        pass

    class PoolsWithoutSymm:
        mem_allocator = object()

        def register_mem_pool(self, pool):
            """register_mem_pool(self, pool: torch.cuda.MemPool) -> None"""

    class PoolsWithSymm(PoolsWithoutSymm):
        def register_mem_pool(self, pool, symm=False):
            """register_mem_pool(self, pool: torch.cuda.MemPool, symm: bool = False) -> None"""

    monkeypatch.setattr(dist, "ProcessGroupNCCL", NoPools, raising=False)
    assert "too old: ProcessGroupNCCL has no mem_allocator / register_mem_pool" in registration_reason()
    monkeypatch.setattr(dist, "ProcessGroupNCCL", PoolsWithoutSymm, raising=False)
    assert "too old: register_mem_pool takes no symm=" in registration_reason()
    monkeypatch.setattr(dist, "ProcessGroupNCCL", PoolsWithSymm, raising=False)
    monkeypatch.setattr(torch.cuda, "MemPool", object, raising=False)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", object, raising=False)
    assert registration_reason() is None
    monkeypatch.delattr(torch.cuda, "use_mem_pool")
    assert "has no torch.cuda.MemPool / use_mem_pool" in registration_reason()


def test_a_cpu_torch_says_it_has_no_nccl_before_anything_about_pools() -> None:
    backend = backends.expand(["nccl:symm"], backends.Options(), True)[0]
    if torch.distributed.is_nccl_available():
        pytest.skip("this torch has NCCL")
    assert backend.software_reason().endswith("has no NCCL (a CPU-only build; NCCL needs CUDA)")


def test_symm_settings_select_nccl_symmetric_memory_in_the_engines() -> None:
    settings = backends.expand(["nccl:symm"], backends.Options(), True)[0].engine_settings(8)
    assert settings.vllm_env["VLLM_USE_NCCL_SYMM_MEM"] == "1" and settings.sglang_flags == ["--enable-symm-mem"]


@pytest.mark.parametrize("spec, message", [
    ("nccl:symm=1", "nccl:symm takes no value"),
    ("nccl:symm,proto=LL", "nccl:symm takes no proto/algo"),
    ("nccl:window", "unknown nccl option 'window'"),
])
def test_bad_symm_variants_are_usage_errors(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        backends.expand([spec], backends.Options(), True)


@pytest.mark.procs
def test_a_bad_symm_variant_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_cli(["sweep", "--cpu", "--out", str(tmp_path), "--backends", "nccl:symm,algo=Ring"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("nccl:symm takes no proto/algo: NCCL picks its "
                                                           "symmetric kernel itself")
    assert not any(tmp_path.iterdir())


def test_the_probe_judges_the_new_variants_by_their_recorded_software() -> None:
    from commbench.backends import probe_variants
    from commbench.probe.verdicts import backend_verdicts, software_record

    variants = [b for b in probe_variants() if b.name in ("nccl:symm", "nccl4py")]
    assert sorted(b.name for b in variants) == ["nccl4py", "nccl:symm"]
    snap = {**snapshot("nvswitch-8x-h100.json"), "backend_software": software_record(variants)}
    assert backend_verdicts(snap, 8, False, variants) == {b.name: b.software_reason() for b in variants}
