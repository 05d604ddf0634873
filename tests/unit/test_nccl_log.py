"""NCCL's log: the run-time switch, the line parsers and the honoured / ignored / coincided rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from commbench import backends
from commbench.backends.base import SweepFacts
from commbench.backends.nccl.variants import NcclOptions
from commbench.topology.nccl_log import (COINCIDED, HONOURED, IGNORED, LOG_VARIABLES, InitEvidence, NcclLogSwitch,
                                canonical_algo, canonical_proto, enabled_for_allreduce, env_settings,
                                LoggedAllreduce, LoggedCall, loaded_libnccl, logged_allreduces,
                                setting_applied, used_algo_proto)

# Rank 0's log of one communicator init with NCCL_PROTO=LL at 2 ranks, in the format of NCCL 2.28.9:
# src/graph/tuning.cc (the "set by environment" line, the enabled matrix, the tuning table) and
# src/enqueue.cc (the "AllReduce: ... Bytes -> Algo" line); prefix from src/debug.cc.
INIT_PROTO_LL = """\
gpu-h200-07:48213:48213 [0] NCCL INFO cudaDriverVersion 12080
gpu-h200-07:48213:48213 [0] NCCL INFO comm 0x55d0c8a3e2f0 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0
gpu-h200-07:48213:48213 [0] NCCL INFO NCCL_PROTO set by environment to LL
gpu-h200-07:48213:48213 [0] NCCL INFO Enabled NCCL Func/Proto/Algo Matrix:
     Function |       LL     LL128    Simple   |          Tree           Ring  CollNetDirect   CollNetChain           NVLS       NVLSTree            PAT  
    Broadcast |        1         0         0   |             1              1              1              1              1              1              1  
       Reduce |        1         0         0   |             1              1              1              1              1              1              1  
    AllGather |        1         0         0   |             1              1              1              1              1              1              1  
ReduceScatter |        1         0         0   |             1              1              1              1              1              1              1  
    AllReduce |        1         0         0   |             1              1              1              1              1              1              1  

gpu-h200-07:48213:48213 [0] NCCL INFO   Algorithm   |                            Tree                  |                            Ring                  |                   CollNetDirect                  |
gpu-h200-07:48213:48213 [0] NCCL INFO   Protocol    |             LL |          LL128 |         Simple |             LL |          LL128 |         Simple |             LL |          LL128 |         Simple |
gpu-h200-07:48213:48213 [0] NCCL INFO  Max NThreads |            512 |            640 |            512 |            512 |            640 |            256 |              0 |              0 |            640 |
gpu-h200-07:48213:48213 [0] NCCL INFO     AllReduce |    10.4/   5.7 |     0.0/   0.0 |     0.0/   0.0 |     8.6/  10.8 |     0.0/   0.0 |     0.0/   0.0 |     0.0/   0.0 |     0.0/   0.0 |     0.0/   0.0 |
gpu-h200-07:48213:48213 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 1
gpu-h200-07:48213:48213 [0] NCCL INFO AllReduce: 16 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..0}
""".splitlines()

# The same matrix with NCCL_ALGO=Ring alone: protocols keep their defaults (LL128's 2 = NCCL decides).
MATRIX_ALGO_RING = """\
gpu-h200-07:48213:48213 [0] NCCL INFO NCCL_ALGO set by environment to Ring
gpu-h200-07:48213:48213 [0] NCCL INFO Enabled NCCL Func/Proto/Algo Matrix:
     Function |       LL     LL128    Simple   |          Tree           Ring  CollNetDirect   CollNetChain           NVLS       NVLSTree            PAT  
    Broadcast |        1         2         1   |             0              1              0              0              0              0              0  
       Reduce |        1         2         1   |             0              1              0              0              0              0              0  
    AllGather |        1         2         1   |             0              1              0              0              0              0              0  
ReduceScatter |        1         2         1   |             0              1              0              0              0              0              0  
    AllReduce |        1         2         1   |             0              1              0              0              0              0              0  
""".splitlines()

ALL_ALGORITHMS = frozenset({"Tree", "Ring", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT"})


def test_nccl_tuning_lines_name_the_algorithm_and_protocol_used() -> None:
    # src/enqueue.cc, NCCL 2.24 to 2.30: names from ncclAlgoToString / ncclProtoToString.
    lines = ["host:1:2 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}",
             "host:1:2 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}",
             "host:1:2 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo TREE proto SIMPLE channel{Lo..Hi}={0..0}",
             "host:1:2 [0] NCCL INFO AllReduce: 16777216 Bytes -> Algo NVLS_TREE proto SIMPLE channel{Lo..Hi}={0..15}",
             "host:1:2 [0] NCCL INFO AllGather: 8192 Bytes -> Algo RING proto LL128 channel{Lo..Hi}={0..1}",
             "host:1:2 [0] NCCL INFO NCCL_PROTO set by environment to LL"]
    assert used_algo_proto(lines, 4096) == ("Ring", "LL")
    assert used_algo_proto(lines, 16 << 20) == ("NVLSTree", "Simple")
    assert used_algo_proto(lines, 8192) == (None, None)
    assert used_algo_proto(INIT_PROTO_LL, 16) == ("Ring", "LL")


@pytest.mark.parametrize("nccl, ours", [("RING", "Ring"), ("TREE", "Tree"), ("NVLS", "NVLS"), ("NVLS_TREE", "NVLSTree"),
                                        ("NVLSTree", "NVLSTree"), ("PAT", "PAT"), ("COLLNET_DIRECT", "CollnetDirect"),
                                        ("CollNetDirect", "CollnetDirect"), ("COLLNET_CHAIN", "CollnetChain"),
                                        ("CollNetChain", "CollnetChain")])
def test_every_nccl_algorithm_spelling_maps_to_commbench_s(nccl: str, ours: str) -> None:
    assert canonical_algo(nccl) == ours


def test_protocol_spellings_and_unknown_names() -> None:
    assert [canonical_proto(p) for p in ("LL", "ll128", "SIMPLE", "Simple")] == ["LL", "LL128", "Simple", "Simple"]
    assert canonical_algo("Unknown") == "Unknown"


def test_init_lines_say_which_variables_nccl_read() -> None:
    param_style = "host:1:2 [0] NCCL INFO NCCL_NTHREADS set by environment to 256."   # src/misc/param.cc
    assert env_settings(INIT_PROTO_LL + [param_style]) == {"NCCL_PROTO": "LL", "NCCL_NTHREADS": "256"}
    assert env_settings(MATRIX_ALGO_RING) == {"NCCL_ALGO": "Ring"}


def test_the_enabled_matrix_gives_what_allreduce_may_use() -> None:
    assert enabled_for_allreduce(INIT_PROTO_LL) == {"NCCL_PROTO": frozenset({"LL"}), "NCCL_ALGO": ALL_ALGORITHMS}
    assert enabled_for_allreduce(MATRIX_ALGO_RING) == {"NCCL_PROTO": frozenset({"LL", "LL128", "Simple"}),
                                                       "NCCL_ALGO": frozenset({"Ring"})}
    assert enabled_for_allreduce(INIT_PROTO_LL[:2]) == {}


def test_a_matrix_cut_short_by_nccl_s_line_limit_says_nothing() -> None:
    # src/debug.cc formats a line into 1024 bytes; a long prefix cuts the last (AllReduce) row.
    cut = MATRIX_ALGO_RING[:-1] + [MATRIX_ALGO_RING[-1][:60]]
    assert enabled_for_allreduce(cut) == {}


def test_honoured_needs_the_init_log_and_the_choice_to_agree() -> None:
    proto_ll = InitEvidence.from_lines(INIT_PROTO_LL)
    used = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}
    assert setting_applied({"NCCL_PROTO": "LL"}, used, proto_ll) == HONOURED
    assert setting_applied({"NCCL_PROTO": "LL"}, {"NCCL_PROTO": "Simple", "NCCL_ALGO": "Ring"}, proto_ll) == IGNORED
    # Ring was NCCL's own choice, and nothing shows it read NCCL_ALGO.
    assert setting_applied({"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}, used, proto_ll) == COINCIDED
    assert setting_applied({"NCCL_PROTO": "LL"}, used, InitEvidence()) == COINCIDED
    assert setting_applied({}, used, proto_ll) is None


def test_the_matrix_alone_is_evidence_that_nccl_read_the_variable() -> None:
    matrix_only = InitEvidence.from_lines(MATRIX_ALGO_RING[1:])
    assert matrix_only.env == {}
    assert setting_applied({"NCCL_ALGO": "Ring"}, {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}, matrix_only) == HONOURED
    # Protocols are not restricted by this matrix: LL is NCCL's choice among the defaults.
    assert setting_applied({"NCCL_PROTO": "LL"}, {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}, matrix_only) == COINCIDED


def test_the_loaded_libnccl_is_found_in_the_process_maps() -> None:
    lib = "/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"
    maps = ("7f3a10000000-7f3a10200000 r-xp 00000000 08:01 393 /usr/lib/x86_64-linux-gnu/libnccl-net.so\n"
            f"7f3a20000000-7f3a20400000 r--p 00000000 08:01 394 {lib}\n"
            f"7f3a20400000-7f3a2a000000 r-xp 00400000 08:01 394 {lib}\n"
            "7ffd5c000000-7ffd5c021000 rw-p 00000000 00:00 0 [stack]\n")
    assert loaded_libnccl(maps) == lib
    assert loaded_libnccl("7ffd5c000000-7ffd5c021000 rw-p 00000000 00:00 0 [stack]\n") is None


@pytest.mark.parametrize("name", LOG_VARIABLES)
def test_a_user_s_own_nccl_debug_setting_leaves_the_switch_off(name: str) -> None:
    switch = NcclLogSwitch.find(environ={name: "WARN"})
    assert switch.unavailable is not None and switch.unavailable.startswith(f"{name}=WARN was set")
    with pytest.raises(RuntimeError, match=name):
        switch.on(Path("unused.log"))


@pytest.mark.skipif(torch.distributed.is_available() and torch.distributed.is_nccl_available(),
                    reason="this torch loads NCCL")
def test_a_cpu_only_torch_has_no_libnccl_to_switch() -> None:
    assert NcclLogSwitch.find(environ={}).unavailable == (
        "no libnccl is loaded in this process (torch without NCCL, e.g. a CPU build)")


class FakeNccl:
    """Stands in for the ctypes handle of libnccl: records the calls made to it."""

    def __init__(self, version_code: int = 22809):
        self.version_code = version_code
        self.calls: list[str] = []

    def ncclGetVersion(self, version) -> int:
        version._obj.value = self.version_code
        return 0

    def ncclResetDebugInit(self) -> None:
        self.calls.append("reset")

    def ncclGroupStart(self) -> int:
        self.calls.append("group start")
        return 0

    def ncclGroupEnd(self) -> int:
        self.calls.append("group end")
        return 0


def test_old_nccl_cannot_be_switched() -> None:
    class Before224:
        def ncclGetVersion(self, version) -> int:
            return 0

    before_224 = NcclLogSwitch.for_library(Before224(), "libnccl.so.2").unavailable
    assert before_224 == "libnccl.so.2 has no ncclResetDebugInit (NCCL before 2.24): its log cannot be switched"
    assert NcclLogSwitch.for_library(FakeNccl(22602), "libnccl.so.2").unavailable.startswith(
        "NCCL 2.26.2 resets its log without its lock")
    assert NcclLogSwitch.for_library(FakeNccl(22809), "libnccl.so.2").unavailable is None


def test_on_and_off_set_and_clear_exactly_the_three_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in LOG_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    nccl = FakeNccl()
    switch = NcclLogSwitch.for_library(nccl, "libnccl.so.2")
    before = dict(os.environ)
    log_file = tmp_path / "100%" / "nccl.init.log"
    switch.on(log_file)
    added = {k: v for k, v in os.environ.items() if before.get(k) != v}
    assert added == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,ENV,TUNING",
                     "NCCL_DEBUG_FILE": str(tmp_path / "100%%" / "nccl.init.log")}  # NCCL expands %h, %p
    assert log_file.parent.is_dir()
    assert nccl.calls == ["reset", "group start", "group end"]
    switch.off()
    assert dict(os.environ) == before
    assert nccl.calls == ["reset", "group start", "group end"] * 2


def test_logging_to_switches_off_when_the_block_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in LOG_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    switch = NcclLogSwitch.for_library(FakeNccl(), "libnccl.so.2")
    with pytest.raises(ValueError), switch.logging_to(tmp_path / "x.log"):
        raise ValueError("a collective failed")
    assert not any(name in os.environ for name in LOG_VARIABLES)


def test_variants_log_into_the_run_dir_unless_told_not_to(tmp_path: Path) -> None:
    logged = backends.Options(SweepFacts(run_dir=tmp_path), {"nccl": NcclOptions(protos=("LL",))})
    variants = backends.expand(["nccl"], logged, True)
    logs = tmp_path / "nccl-logs"
    assert [(b.name, b.log_dir) for b in variants] == [("nccl", logs), ("nccl:proto=LL", logs)]
    quiet_options = backends.Options(SweepFacts(run_dir=tmp_path), {"nccl": NcclOptions(log=False)})
    quiet = backends.expand(["nccl"], quiet_options, True)
    assert [b.log_dir for b in quiet] == [None]


def test_the_backend_logs_only_around_init_and_observe_and_reads_its_verdict(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import commbench.backends.nccl.backend as nccl_backend

    for name in LOG_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    switch = NcclLogSwitch.for_library(FakeNccl(), "libnccl.so.2")
    monkeypatch.setattr(nccl_backend, "process_switch", lambda: switch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    logged: list[str] = []

    def nccl_logs(lines: list[str]) -> None:
        """A stand-in NCCL: writes recorded lines where NCCL_DEBUG_FILE points, when it is set."""
        if "NCCL_DEBUG_FILE" in os.environ:
            path = Path(os.environ["NCCL_DEBUG_FILE"].replace("%%", "%"))
            with path.open("a") as handle:
                handle.write("\n".join(lines) + "\n")
            logged.append(path.name)

    def all_reduce(tensor: torch.Tensor, group: object = None) -> None:
        tensor.mul_(2)
        nccl_logs(INIT_PROTO_LL)

    monkeypatch.setattr(nccl_backend.dist, "new_group", lambda backend: object())
    monkeypatch.setattr(nccl_backend.dist, "all_reduce", all_reduce)
    ctx = type("Ctx", (), {"world_size": 2, "rank": 0, "device": torch.device("cpu"), "snapshot": None})()
    backend = backends.expand(["nccl:proto=LL"], backends.Options(SweepFacts(run_dir=tmp_path)), True)[0]
    backend.setup(ctx, 1 << 20, torch.float32)
    assert "NCCL_PROTO" not in os.environ and not any(name in os.environ for name in LOG_VARIABLES)

    tuning = "host:1:2 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo RING proto {} channel{{Lo..Hi}}={{0..1}}"
    assert backend.observe(lambda: nccl_logs([tuning.format("LL")]), 4096) == {
        "observed": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"}, "setting_applied": HONOURED}
    assert backend.observe(lambda: nccl_logs([tuning.format("SIMPLE")]), 4096)["setting_applied"] == IGNORED
    nccl_logs(["a timed call: NCCL's log is off, so nothing is written"])
    assert logged == [f"nccl_proto=LL.init.pid{os.getpid()}.log"] + [
        f"nccl_proto=LL.4096B.{n}.pid{os.getpid()}.log" for n in (1, 1, 2, 2)]
    assert "no 'AllReduce: 8192 Bytes -> Algo' line" in backend.observe(lambda: None, 8192)["nccl_observed"]


def test_logged_allreduces_pair_each_choice_with_its_calls_nranks() -> None:
    """COLL lines give the size (count x ncclDataType_t) and nranks on every rank; the tuning line
    that follows in the same process takes the earliest waiting call of its size."""
    coll = ("{p} [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x7f recvbuff 0x7f count {n} datatype {t} op 0 root 0 "
            "comm 0x55 [nranks={r}] stream 0x56")
    lines = [coll.format(p="h:1:1", n=2048, t=9, r=2), coll.format(p="h:2:2", n=1024, t=7, r=8),
             "h:2:2 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo TREE proto SIMPLE channel{Lo..Hi}={0..1}",
             "h:1:1 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo NVLS_TREE proto LL128 channel{Lo..Hi}={0..1}",
             "h:1:1 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}",
             coll.format(p="h:1:1", n=5, t=99, r=2)]
    got = list(logged_allreduces(lines))
    assert got == [LoggedCall("h:1", 4096, 2), LoggedCall("h:2", 4096, 8),
                   LoggedAllreduce(4096, "Tree", "Simple", nranks=8),
                   LoggedAllreduce(4096, "NVLSTree", "LL128", nranks=2),
                   LoggedAllreduce(4096, "Ring", "LL"),                  # no call waiting: nranks unknown
                   LoggedCall("h:1", None, 2)]                           # a datatype NCCL added later
    assert [c.choice for c in got if isinstance(c, LoggedAllreduce)] == ["Tree/Simple", "NVLSTree/LL128", "Ring/LL"]
