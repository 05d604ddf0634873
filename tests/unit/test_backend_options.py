"""Backend specs and options (commbench/backends/__init__.py, sweep/options.py): each family gets
its own options and the sweep's facts."""

from __future__ import annotations

import pytest

from commbench import backends
from commbench.backends.base import BackendUnavailable, SweepFacts
from commbench.backends.nccl.variants import NcclOptions
from commbench.errors import UsageError
from commbench.sweep.command import backend_options
from commbench.sweep.options import SweepOptions
from commbench.sweep.plan import build_plan
from helpers import sweep_args


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


def test_backend_specs_keep_their_options_together() -> None:
    assert backends.split_specs("nccl:proto=LL,algo=Ring,gloo, nccl") == ["nccl:proto=LL,algo=Ring", "gloo", "nccl"]
    flags = SweepOptions.from_args(sweep_args("--nccl-proto", "ll,Simple", "--nccl-algo", "ring"), [])
    names = [b.name for b in backends.expand(["nccl"], backends.Options(families=flags.families), True)]
    assert names == ["nccl", "nccl:proto=LL,algo=Ring", "nccl:proto=Simple,algo=Ring"]
    with pytest.raises(UsageError, match="unknown backend"):
        backends.expand(["warp"], backends.Options(), True)


def test_each_family_is_handed_its_own_options_and_the_sweeps_facts() -> None:
    from commbench.backends.flashinfer.common import FlashinferOptions
    from commbench.backends.p2p.rules import P2POptions

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


def test_the_flags_the_parser_shows_are_the_ones_each_family_reads() -> None:
    """The sweep's parser takes a built-in family's flags from its torch-free flags module (no
    family's code loads for `sweep --help`); its factory declares the same function, so the
    flags shown and the flags read never part."""
    with_flags = {family for family in backends.BUILTIN if backends.flags_of(family) is not None}
    assert with_flags == {"nccl", "p2p", "flashinfer", "mscclpp"}
    for family in backends.BUILTIN:
        assert backends.flags_of(family) is backends.factory(family).add_arguments, family
