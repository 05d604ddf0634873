"""Library backends on a machine without them: every "cannot run here" path says why."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from importlib import metadata
from types import SimpleNamespace

import pytest
import torch

from commbench import engines
from commbench.backends import factory
from commbench.backends.flashinfer import autotune_log, pcie, trtllm, variants
from commbench.backends.flashinfer import common as fi
from commbench.backends.mscclpp import backend as mp_backend
from commbench.backends import symm_mem
from commbench.backends.base import Backend, BackendUnavailable, Requires, SweepFacts, raise_unless_all_ranks_ok
from commbench.policy import MULTICAST_POLICY_VARS
from commbench.runtime.context import RunContext
from commbench.errors import UsageError
from helpers import spawn_ranks


@pytest.fixture
def no_policy(monkeypatch):
    for name in MULTICAST_POLICY_VARS:
        monkeypatch.delenv(name, raising=False)


def cpu_ctx(world_size: int = 2, allow_multicast: bool = False, local_world_size: int | None = None) -> RunContext:
    return RunContext(rank=0, world_size=world_size, local_rank=0,
                      local_world_size=local_world_size or world_size, device=torch.device("cpu"),
                      control_group=None, allow_multicast=allow_multicast)


def names(family: str, variant: str | None, sweep: SweepFacts = SweepFacts()) -> list[str]:
    return [b.name for b in factory(family).variants(variant, sweep=sweep)]


# --- variants -------------------------------------------------------------------------------

def test_default_variants_leave_fused_work_to_model_shape_sweeps():
    assert names("flashinfer", None) == ["flashinfer:trtllm_oneshot", "flashinfer:trtllm_twoshot",
                                         "flashinfer:pcie_ipc", "flashinfer:mnnvl"]
    assert "flashinfer:fused_oneshot" in names("flashinfer", None, SweepFacts(hidden=4096))
    assert names("unfused", None) == []
    assert names("unfused", None, SweepFacts(hidden=4096)) == ["unfused:best"]
    assert names("symm_mem", None) == ["symm_mem:one_shot", "symm_mem:two_shot", "symm_mem:multimem"]
    each = [f"mscclpp:algo={name}" for name in mp_backend.DEFAULT_ALGORITHMS]
    assert names("mscclpp", None) == ["mscclpp:auto", *each, "mscclpp:shim"]
    assert names("mscclpp", "each") == each and len(each) == 10
    assert names("mscclpp", "algo=default_allreduce_packet") == ["mscclpp:algo=default_allreduce_packet"]


@pytest.mark.parametrize("family,variant", [("symm_mem", "three_shot"), ("flashinfer", "auto"),
                                            ("mscclpp", "fast"), ("unfused", "worst")])
def test_unknown_variant_is_a_usage_error(family, variant):
    with pytest.raises(UsageError, match="unknown variant"):
        factory(family).variants(variant)


# --- package missing / too old / broken -------------------------------------------------------

def test_flashinfer_missing_says_how_to_install():
    assert fi.REQUIRES.reason() == "flashinfer-python not installed (pip install 'commbench[flashinfer]')"
    backend = factory("flashinfer").variants("fused_oneshot")[0]
    assert backend.software_reason() == fi.REQUIRES.reason()
    assert backend.check(cpu_ctx()) == "needs CUDA GPUs; this run is on the CPU"
    assert factory("flashinfer").packages == ("flashinfer-python",)


def test_a_declared_requirement_is_the_software_check_in_one_wording(monkeypatch, tmp_path):
    class Needy(Backend):
        name = family = "needy"
        requires = Requires("needy-lib", "needy_lib_module", "pip install needy-lib")

        def setup(self, ctx, max_bytes, dtype):
            raise AssertionError("never set up")

        def allreduce(self, x, out):
            raise AssertionError("never run")

    assert Needy().software_reason() == "needy-lib not installed (pip install needy-lib)"
    (tmp_path / "needy_lib_module.py").write_text("raise ImportError('libneedy.so.1 not found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert Needy().software_reason() == ("needy-lib is installed but does not import: "
                                         "ImportError: libneedy.so.1 not found")


def test_flashinfer_too_old_and_broken(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda dist: "0.5.3")
    assert fi.REQUIRES.reason() == ("flashinfer-python 0.5.3 is too old: needs >= 0.6 "
                                  "(create_allreduce_fusion_workspace)")
    monkeypatch.setattr(metadata, "version", lambda dist: "0.7.2.post1")

    def broken(name):
        raise ModuleNotFoundError("No module named 'tvm_ffi'", name="tvm_ffi")

    monkeypatch.setattr(importlib, "import_module", broken)
    assert fi.REQUIRES.reason() == ("flashinfer-python 0.7.2.post1 is installed but does not import: "
                                  "ModuleNotFoundError: No module named 'tvm_ffi'")


def test_mscclpp_missing_says_build_from_source():
    backend = factory("mscclpp").variants("auto")[0]
    assert backend.software_reason() == ("mscclpp not installed: build it from a checkout with "
                                         "scripts/build-mscclpp.sh (docs/mscclpp.md)")
    assert factory("mscclpp").packages == ("mscclpp",)
    # Importing sets the NVLS switch off first: MSCCL++ reads it at initialisation.
    with pytest.raises(ModuleNotFoundError):
        mp_backend.import_mscclpp(allow_multicast=False)
    assert os.environ.get("MSCCLPP_FORCE_DISABLE_NVLS") == "1"


def test_mscclpp_rsag_zero_copy_is_skipped_where_its_kernel_has_no_instance():
    # MSCCL++ 0.9.0 instantiates it for 4 and 8 ranks per node and throws InvalidUsage otherwise.
    zero_copy = factory("mscclpp").variants("algo=default_allreduce_rsag_zero_copy")[0]
    assert zero_copy.world_size_reason(2) == \
        "default_allreduce_rsag_zero_copy runs 4 or 8 ranks per node (MSCCL++ 0.9.0), this run has 2"
    assert zero_copy.world_size_reason(4) is None and zero_copy.world_size_reason(8) is None
    assert zero_copy.world_size_reason(1) == "needs at least 2 ranks, this run has 1"
    assert factory("mscclpp").variants("algo=default_allreduce_rsag")[0].world_size_reason(2) is None


def test_a_family_sweeps_at_a_world_size_one_of_its_variants_cannot_use():
    """`--backends mscclpp` at 2 ranks: rsag_zero_copy (4 or 8 ranks) is a skipped row with its
    reason, not a refused sweep; named alone it is bad input."""
    from commbench import backends

    family = backends.expand(["mscclpp"], backends.Options(), True, world_size=2)
    assert [b.name for b in family] == names("mscclpp", None)
    assert [b.world_size_reason(2) is None for b in family].count(False) == 1
    with pytest.raises(UsageError, match="backend mscclpp:algo=default_allreduce_rsag_zero_copy cannot run with 2 rank"):
        backends.expand(["mscclpp", "mscclpp:algo=default_allreduce_rsag_zero_copy"], backends.Options(), True,
                        world_size=2)
    with pytest.raises(UsageError, match="backend mscclpp:auto cannot run with 1 rank"):
        backends.expand(["mscclpp"], backends.Options(), True, world_size=1)


def test_mscclpp_grid_barrier_algorithm_needs_an_sm_per_block(monkeypatch):
    """rsag_zero_copy's blocks wait for each other at a grid-wide barrier: 4 ranks sharing an H200
    under MPS count on 33 SMs each, fewer than its 64 blocks, and would hang; one H200 per rank runs."""
    name = "default_allreduce_rsag_zero_copy"
    assert mp_backend.grid_barrier_reason(name, 8 << 10, 33) == (
        f"{name} waits at a grid-wide barrier for all 64 blocks of 1024 threads of its launch (MSCCL++ 0.9.0), "
        "and this rank may count on 33 SMs: with fewer SMs than blocks it can hang")
    assert mp_backend.grid_barrier_reason(name, 8 << 20, 132) is None
    assert "all 128 blocks" in mp_backend.grid_barrier_reason(name, 64 << 20, 100)   # from 64 MiB it launches 128
    assert mp_backend.grid_barrier_reason("default_allreduce_rsag", 8 << 10, 1) is None

    zero_copy = factory("mscclpp").variants(f"algo={name}")[0]
    rsag = factory("mscclpp").variants("algo=default_allreduce_rsag")[0]
    monkeypatch.setattr(Backend, "check", lambda self, ctx: None)    # world, verdicts, needs, software: fine
    assert zero_copy.check(SimpleNamespace(resident_sms=33)).startswith(f"{name} waits")
    assert zero_copy.check(SimpleNamespace(resident_sms=132)) is None
    assert rsag.check(SimpleNamespace(resident_sms=1)) is None
    # per size, once setup knows the SMs: 100 SMs hold 64 blocks, not 128
    zero_copy._algorithms = {name: SimpleNamespace(message_size_range=(0, 1 << 40))}
    zero_copy._sms = 100
    assert zero_copy.supports(32 << 20, torch.bfloat16) is None
    assert "all 128 blocks" in zero_copy.supports(64 << 20, torch.bfloat16)


@pytest.mark.procs
def test_mscclpp_shim_needs_a_library_path(tmp_path):
    assert factory("mscclpp").variants("shim")[0].software_reason() == \
        "needs the MSCCL++ NCCL shim: pass --mscclpp-nccl-lib PATH (build/lib/libmscclpp_nccl.so)"
    missing = tmp_path / "libmscclpp_nccl.so"
    shim = factory("mscclpp").variants("shim", mp_backend.MscclppOptions(str(missing)))[0]
    assert shim.software_reason() == f"--mscclpp-nccl-lib {missing}: no such file"
    assert shim.check(cpu_ctx()) == "needs CUDA GPUs; this run is on the CPU"
    assert shim.process_env(allow_multicast=False) is None     # nothing to preload: no child of its own
    missing.write_bytes(b"")
    assert shim.process_env(allow_multicast=False) == {"LD_PRELOAD": str(missing.resolve()), "MSCCLPP_FORCE_DISABLE_NVLS": "1"}
    assert not mp_backend.shim_preloaded(str(missing))


def test_mscclpp_shim_prices_the_engines_nccl_path_not_sglangs_mscclpp(tmp_path):
    """The shim replaces NCCL under any engine: it claims both engines' NCCL path with the library
    as part of the setting, never SGLang's --enable-mscclpp; its deployment is said, not pasted."""
    library = tmp_path / "libmscclpp_nccl.so"
    shim = factory("mscclpp").variants("shim", mp_backend.MscclppOptions(str(library)))[0]
    settings = shim.engine_settings(8)
    real = os.path.realpath(library)
    assert settings.preload == real and engines.SGLANG_MSCCLPP not in settings.sglang_flags
    assert engines.declared_paths(settings) == {engines.VLLM: {"path": engines.NCCL_PATH, "stand_in": False},
                                                engines.SGLANG: {"path": engines.NCCL_PATH, "stand_in": False}}
    assert engines.MSCCLPP_SHIM in settings.notes and "not an engine's MSCCL++ path" in engines.MSCCLPP_SHIM
    for engine in engines.ENGINES:
        lines, how = engines.paste_lines(settings, engine, 8)
        assert lines == [] and f"LD_PRELOAD={real}" in how and f"{engines.NCCL_SO_PATH_VAR[engine]}={real}" in how
    # MSCCL++'s Python API is the one that prices SGLang's --enable-mscclpp
    auto = factory("mscclpp").variants("auto")[0].engine_settings(8)
    assert engines.declared_paths(auto) == {engines.SGLANG: {"path": engines.MSCCLPP, "stand_in": False}}


SEGV_BOOTSTRAP = """
import os, signal
class CppTcpBootstrap:
    @staticmethod
    def create(rank, size):
        return CppTcpBootstrap()
    def create_unique_id(self):
        os.kill(os.getpid(), signal.SIGSEGV)
"""


@pytest.mark.procs
def test_mscclpp_whose_bootstrap_dies_is_skipped_with_the_signal(tmp_path, monkeypatch):
    package = tmp_path / "mscclpp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_mscclpp.py").write_text(SEGV_BOOTSTRAP)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    mp_backend.bootstrap_reason.cache_clear()
    try:
        reason = factory("mscclpp").variants("auto")[0].software_reason()
    finally:
        mp_backend.bootstrap_reason.cache_clear()
        for name in ("mscclpp", "mscclpp._mscclpp"):
            monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    assert reason.startswith("MSCCL++'s TCP bootstrap died with SIGSEGV at ")
    assert "_mscclpp.py\", line 8 in create_unique_id after 'created'" in reason
    assert reason.endswith("needs an MSCCL++ build whose bootstrap runs on this machine "
                           "(docs/mscclpp.md, 'SIGSEGV in MSCCL++'s TCP bootstrap')")


def test_mscclpp_bootstrap_outcomes():
    assert mp_backend.describe_bootstrap_failure(0, "imported\ncreated\ncreate_unique_id ok\n", "") is None
    failed = mp_backend.describe_bootstrap_failure(1, "imported\n", "Traceback...\nmscclpp._mscclpp.Error: no iface\n")
    assert failed.startswith("MSCCL++'s TCP bootstrap failed: mscclpp._mscclpp.Error: no iface after 'imported'")


def test_mscclpp_bootstrap_that_dies_beside_a_static_cxx_runtime_says_so():
    died = mp_backend.describe_bootstrap_failure(-11, "imported\ncreated\n", "", ["libmscclpp.so"])
    assert died == ("MSCCL++'s TCP bootstrap died with SIGSEGV after 'created' (one process: "
                    "CppTcpBootstrap.create(0, 1).create_unique_id()); libmscclpp.so link libstdc++ statically, "
                    "and a second C++ runtime beside torch's breaks C++ streams: rebuild with "
                    "scripts/build-mscclpp.sh, or preload the shared libstdc++ (LD_PRELOAD) "
                    "(docs/mscclpp.md, 'SIGSEGV in MSCCL++'s TCP bootstrap')")


@pytest.mark.procs
@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("ldd") is None, reason="needs g++ and ldd")
def test_mscclpp_libraries_that_carry_their_own_cxx_runtime_are_found(tmp_path, monkeypatch):
    lib = tmp_path / "mscclpp" / "lib"
    lib.mkdir(parents=True)
    (tmp_path / "mscclpp" / "__init__.py").write_text("")
    source = tmp_path / "s.cc"
    source.write_text('#include <sstream>\nint parse() { std::istringstream s("60"); int i = 0; s >> i; return i; }\n')
    for name, flags in (("libmscclpp.so", ["-static-libstdc++"]), ("libmscclpp_collectives.so", [])):
        subprocess.run(["g++", "-shared", "-fPIC", *flags, "-o", str(lib / name), str(source)], check=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mscclpp", raising=False)
    assert mp_backend.static_runtime_libraries() == ["libmscclpp.so"]
    assert mp_backend.links_shared_libstdcxx(tmp_path / "nothing.so") is None


def test_mscclpp_enums_of_any_nanobind_become_numbers():
    import enum

    class CommResult(enum.Enum):        # what a nanobind 2+ build makes: int() refuses it
        SUCCESS = 0
        INVALID_USAGE = 3

    with pytest.raises(TypeError):
        int(CommResult.SUCCESS)
    assert mp_backend.enum_number(CommResult.SUCCESS) == 0
    assert mp_backend.enum_number(CommResult.INVALID_USAGE) == 3
    assert mp_backend.enum_number(enum.IntEnum("DataType", {"bfloat16": 5}).bfloat16) == 5
    assert mp_backend.enum_number(0) == 0


@pytest.mark.procs
@pytest.mark.skipif(shutil.which("cc") is None or shutil.which("ldd") is None, reason="needs cc and ldd")
def test_mscclpp_shim_whose_neighbours_the_loader_cannot_find_gets_no_child_of_its_own(tmp_path):
    # The wheel's copy of the shim has no RPATH to libmscclpp*.so: preloaded, python would not start.
    (tmp_path / "dep.c").write_text("int dep(void) { return 1; }\n")
    (tmp_path / "shim.c").write_text("int dep(void);\nint ncclAllReduce(void) { return dep(); }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "libmscclpp_collectives.so.0"), str(tmp_path / "dep.c"),
                    "-Wl,-soname,libmscclpp_collectives.so.0"], check=True)
    library = tmp_path / "libmscclpp_nccl.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(tmp_path / "shim.c"),
                    str(tmp_path / "libmscclpp_collectives.so.0")], check=True)
    (tmp_path / "libmscclpp_collectives.so.0").unlink()
    shim = factory("mscclpp").variants("shim", mp_backend.MscclppOptions(str(library)))[0]
    assert shim.software_reason() == (f"--mscclpp-nccl-lib {library}: the loader finds no libmscclpp_collectives.so.0 "
                                      "for it (use the shim from scripts/build-mscclpp.sh's shim step, whose RPATH "
                                      "finds its neighbours)")
    assert shim.process_env(allow_multicast=False) is None


def test_mscclpp_auto_rule_follows_the_shim_selector():
    assert mp_backend.auto_algorithm(16 << 10) == "default_allreduce_allpair_packet"
    assert mp_backend.auto_algorithm((16 << 10) + 2) == "default_allreduce_packet"
    assert mp_backend.auto_algorithm(1 << 20) == "default_allreduce_packet"
    assert mp_backend.auto_algorithm((1 << 20) + 2) == "default_allreduce_fullmesh"


# --- policy -------------------------------------------------------------------------------------

def test_multicast_variants_need_permission(no_policy):
    multimem = symm_mem.SymmMemAllreduce("multimem")
    mnnvl = factory("flashinfer").variants("mnnvl")[0]
    for backend in (multimem, mnnvl):
        assert backend.check(cpu_ctx()) == "needs NVLink multicast: not tested: pass --allow-multicast"


def test_multicast_policy_variables_win_over_permission(monkeypatch, no_policy):
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ctx = cpu_ctx(allow_multicast=True)
    assert symm_mem.SymmMemAllreduce("multimem").check(ctx) == \
        "needs NVLink multicast: disabled by policy (TORCH_SYMM_MEM_DISABLE_MULTICAST=1)"
    nvls = factory("mscclpp").variants("algo=default_allreduce_nvls_packet")[0]
    assert "multicast" in nvls.needs and "multicast" not in factory("mscclpp").variants("auto")[0].needs
    assert nvls.check(ctx) == "needs NVLink multicast: disabled by policy (TORCH_SYMM_MEM_DISABLE_MULTICAST=1)"


def test_p2p_symm_mem_variants_need_no_multicast(no_policy):
    for algo in ("one_shot", "two_shot"):
        assert "multicast" not in symm_mem.SymmMemAllreduce(algo).needs
        assert symm_mem.SymmMemAllreduce(algo).check(cpu_ctx()) == "needs CUDA GPUs; this run is on the CPU"


# --- world size, nodes, dtype, shape ----------------------------------------------------------

@pytest.mark.parametrize("world,reason", [
    (1, "needs at least 2 ranks, this run has 1"),
    (3, "supports 2, 4, 8, 16 ranks, this run has 3"),
    (32, "supports 2, 4, 8, 16 ranks, this run has 32"),
])
def test_flashinfer_world_sizes(world, reason):
    assert factory("flashinfer").variants("trtllm_twoshot")[0].check(cpu_ctx(world)) == reason


def test_declared_world_sizes_and_size_multiples_are_one_rule_for_every_family():
    vllm, sglang = factory("vllm").variants("auto")[0], factory("sglang").variants("auto")[0]
    assert vllm.check(cpu_ctx(3)) == "supports 2, 4, 6, 8 ranks, this run has 3"
    assert vllm.world_size_reason(6) is None
    for backend in (vllm, sglang):
        assert backend.supports(4096 + 8, torch.bfloat16) == "takes byte sizes that are a multiple of 16"
        assert backend.supports(4096, torch.float32) is None


def test_pcie_ipc_world_sizes_dtypes_and_packs():
    backend = factory("flashinfer").variants("pcie_ipc")[0]
    assert backend.check(cpu_ctx(16)) == "supports 2, 4, 8 ranks, this run has 16"
    assert backend.supports(4096, torch.float32) == "PCIe IPC allreduce takes bf16 and fp16 only"
    assert backend.supports(4096, torch.bfloat16) is None
    # 8 ranks need one 16-byte pack each: 64 elements of bf16 is the least
    assert pcie.pcie_admits(8, 64, 2) and not pcie.pcie_admits(8, 56, 2) and not pcie.pcie_admits(8, 68, 2)
    assert not pcie.pcie_admits(16, 4096, 2)
    # prepared shapes capture no collective (pcie_ipc_ar: capture is exempt from the stream check)
    assert backend.graph_capturable is True


def test_pcie_ipc_tunes_one_bucket_per_planned_token_count():
    plain = pcie.pcie_shapes([4 << 10, 8 << 10, 64 << 10, 8 << 20], 2, None)
    assert plain == [(1, 2048), (1, 4096), (8, 4096), (1024, 4096)]
    assert pcie.pcie_tune_plan(plain) == ((2048, 4096), (1, 8, 1024))
    model = pcie.pcie_shapes([t * 7168 * 2 for t in (1, 2, 4, 256)], 2, 7168)
    assert model == [(1, 7168), (2, 7168), (4, 7168), (256, 7168)]
    assert pcie.pcie_tune_plan(model) == ((7168,), (1, 2, 4, 256))


def test_pcie_ipc_records_the_launch_configuration_it_ran():
    class Variant:
        name = "STAGED_RING"

    class Config:
        blocks, threads, variant = 4, 512, Variant()

    assert autotune_log.describe_config(Config()) == "STAGED_RING blocks=4 threads=512"
    assert autotune_log.describe_config(None) is None
    assert autotune_log.launch_choice(Config(), Config()) == {"pcie_ipc_config": "STAGED_RING blocks=4 threads=512",
                                                    "pcie_ipc_seed": "STAGED_RING blocks=4 threads=512",
                                                    "pcie_ipc_runs_seed": True}
    assert autotune_log.launch_choice(Config(), None)["pcie_ipc_runs_seed"] is False
    backend = factory("flashinfer").variants("pcie_ipc", sweep=SweepFacts(hidden=7168))[0]
    backend._choices = {(2, 7168): {"pcie_ipc_config": "STAGED_RING blocks=4 threads=512",
                                    "pcie_ipc_seed": "UNSTAGED blocks=16 threads=128"}}
    observed = backend.observe(lambda: None, 2 * 7168 * 2)["extra"]
    assert observed == {"pcie_ipc_config": "STAGED_RING blocks=4 threads=512",
                        "pcie_ipc_seed": "UNSTAGED blocks=16 threads=128", "pcie_ipc_shape": [2, 7168]}
    assert "not in the tuned plan" in backend.observe(lambda: None, 4 * 7168 * 2)["extra"]["pcie_ipc_config"]


def test_pcie_ipc_caps_its_grid_where_ranks_share_a_gpu():
    # A GPU of one's own keeps FlashInfer's default, whatever its SM count.
    assert pcie.pcie_max_blocks(128, [132, 132], shares_gpu=False) == (128, None)
    assert pcie.pcie_max_blocks(128, [46, 46], shares_gpu=False) == (128, None)
    # Ranks sharing a GPU: one block per SM of the smallest rank's part, for every rank alike.
    blocks, reason = pcie.pcie_max_blocks(128, [33, 32, 33, 33], shares_gpu=True)
    assert blocks == 32
    assert reason == ("ranks share a GPU: one block per SM a rank may count on (32; FlashInfer's default is 128), "
                      "so that every block of every rank is resident at once")
    assert pcie.pcie_max_blocks(128, [66, 66], shares_gpu=True)[0] == 66
    assert pcie.pcie_max_blocks(128, [14] * 8, shares_gpu=True)[0] == 14
    assert pcie.pcie_max_blocks(128, [132], shares_gpu=True) == (128, None)   # a share as large as the default


def test_pcie_ipc_tune_option_and_cache_path(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    variants.add_arguments(parser.add_argument_group("flashinfer"))
    assert variants.read_options(parser.parse_args([])) == fi.FlashinferOptions(pcie_tune=True, pdl=True)
    options = variants.read_options(parser.parse_args(["--flashinfer-pcie-tune", "seed"]))
    backend = factory("flashinfer").variants("pcie_ipc", options, SweepFacts(run_dir=tmp_path))[0]
    assert backend.tune is False
    assert backend._cache_path(4, torch.bfloat16) == str(tmp_path / "flashinfer-pcie-ipc" / "w4-bfloat16.json")
    assert factory("flashinfer").variants("pcie_ipc")[0]._cache_path(4, torch.bfloat16) is None


@pytest.mark.parametrize("argv, pdl", [([], True), (["--flashinfer-pdl", "off"], False)])
def test_trtllm_variants_launch_with_pdl_unless_asked_not_to(monkeypatch, argv, pdl):
    import argparse
    import types

    parser = argparse.ArgumentParser()
    variants.add_arguments(parser.add_argument_group("flashinfer"))
    options = variants.read_options(parser.parse_args(argv))
    calls = []
    fake = types.ModuleType("flashinfer.comm")
    fake.allreduce_fusion = lambda **kwargs: calls.append(kwargs)
    monkeypatch.setitem(sys.modules, "flashinfer.comm", fake)
    for variant in ("trtllm_oneshot", "fused_twoshot"):
        backend = factory("flashinfer").variants(variant, options, SweepFacts(hidden=4096))[0]
        assert backend.row_fields()["extra"]["launch_with_pdl"] is pdl, variant
        backend._workspace = object()
        backend._fusion(torch.zeros(1, 4096), fi.K_ALLREDUCE, torch.zeros(1, 4096))
        assert calls.pop()["launch_with_pdl"] is pdl, variant


def test_pcie_ipc_counts_the_configurations_its_tuning_saved(tmp_path):
    cache = tmp_path / "w2-bfloat16.json"
    assert autotune_log.saved_configs(str(cache)) == 0
    assert autotune_log.saved_configs(None) is None       # FlashInfer's default file: not this run's alone
    cache.write_text('{"_metadata": {"flashinfer_version": "0.7.4"}, "_generation": "7ec5"}')
    assert autotune_log.saved_configs(str(cache)) == 0       # what 0.7.4 wrote under MPS: nothing tuned
    cache.write_text('{"_metadata": {}, "(1, 4096)": [0, 1], "(4, 4096)": [0, 2]}')
    assert autotune_log.saved_configs(str(cache)) == 2
    cache.write_text("not json")
    assert autotune_log.saved_configs(str(cache)) == 0


def test_pcie_ipc_tuning_collects_why_candidates_failed_without_printing_debug_lines():
    import io
    import logging

    printed = io.StringIO()
    logger = logging.Logger("flashinfer.jit", logging.INFO)   # as FlashInfer builds its own
    logger.addHandler(logging.StreamHandler(printed))
    logger.debug("before the block")        # a cached "DEBUG is off" must not hide the lines below
    with autotune_log.profiling_failures(logger) as errors:
        logger.debug("[Autotuner]: Skipping tactic runner 5, due to failure while profiling: workspace is bound")
        logger.debug("[Autotuner]: Failed when profiling runner 5, shapes=[]. Error occurred: workspace is bound")
        logger.debug("[Autotuner]: Skipping tactic runner 6, due to failure while profiling: workspace is bound")
        logger.debug("[Autotuner]: cache miss")
        logger.info("[Autotuner]: Skipped 2 unsupported tactic(s)")
    assert errors == ["workspace is bound", "workspace is bound"]
    assert printed.getvalue() == "[Autotuner]: Skipped 2 unsupported tactic(s)\n"   # no debug line printed
    assert logger.level == logging.INFO and len(logger.handlers) == 1 and logger.handlers[0].level == logging.NOTSET
    assert autotune_log.failure_summary(errors) == {"profile_failures": 2, "profile_errors": ["workspace is bound"]}
    logger.debug("after the block")
    assert "after the block" not in printed.getvalue()


def test_pcie_ipc_keeps_the_start_and_end_of_a_long_profiling_error():
    # What 0.7.4's autotuner raises for every candidate when its delay-kernel module cannot build.
    ninja = ("Ninja build failed. Ninja output:\nninja: Entering directory `/x/cached_ops/trtllm_utils'\n"
             + "[1/5] nvcc -c envUtils.cpp\n" * 200
             + "ninja: error: '/x/csrc/nv_internal/tensorrt_llm/kernels/delayStream.cu', missing and no known rule")
    (kept,) = autotune_log.failure_summary([ninja, ninja])["profile_errors"]
    assert len(kept) <= autotune_log.PROFILE_ERROR_CHARS
    assert kept.startswith("Ninja build failed.") and kept.endswith("missing and no known rule") and " ... " in kept
    assert autotune_log.clip("short") == "short"


def test_node_local_backends_refuse_several_nodes():
    ctx = cpu_ctx(world_size=8, local_world_size=4)
    for spec in ("symm_mem:one_shot", "flashinfer:trtllm_oneshot", "mscclpp:auto"):
        family, _, variant = spec.partition(":")
        reason = factory(family).variants(variant)[0].check(ctx)
        assert reason == "node-local backend: this run spans 2 nodes (P2P/IPC only works within one node)", spec


def test_symm_mem_dtype_and_alignment():
    backend = symm_mem.SymmMemAllreduce("two_shot")
    assert backend.supports(4096, torch.float16) == "torch symm_mem kernels are built for bf16 and fp32 only"
    assert backend.supports(4098, torch.bfloat16) == "torch symm_mem needs sizes that are a multiple of 4 bytes"
    assert backend.supports(4096, torch.bfloat16) is None
    assert backend.supports(4100, torch.float32) is None


@pytest.mark.parametrize("world,tokens,hidden,dtype,oneshot,reason", [
    (4, 16, 4100, torch.bfloat16, True, "hidden 4100 is not a multiple of 8 (the kernels move 16 bytes per access)"),
    (4, 16, 4098, torch.float32, True, "hidden 4098 is not a multiple of 4 (the kernels move 16 bytes per access)"),
    (4, 4, 4096, torch.bfloat16, False,
     "two-shot splits tokens across ranks: needs tokens > world size (4 <= 4)"),
    (4, 5, 4096, torch.bfloat16, False, None),
    (4, 4, 4096, torch.bfloat16, True, None),
    (8, 1 << 15, 8192, torch.bfloat16, True,
     "one-shot needs tokens*hidden*world size*2 B <= 2145386496 B (FlashInfer would run two-shot instead); "
     "this shape needs 4294967296 B"),
])
def test_trtllm_shape_rules(world, tokens, hidden, dtype, oneshot, reason):
    assert trtllm.trtllm_shape_reason(world, tokens, hidden, dtype, oneshot) == reason


def test_plain_sizes_reshape_into_tokens():
    assert fi.plain_shape(4096 * 3) == (3, 4096)
    assert fi.plain_shape(2048) == (1, 2048)
    assert fi.plain_shape(6000) == (1, 6000)


def test_fused_needs_a_model_shape_and_a_fitting_one():
    backend = factory("flashinfer").variants("fused_twoshot")[0]
    ctx = cpu_ctx(4)
    with pytest.raises(BackendUnavailable, match="pass --tokens T --hidden H"):
        backend.make_workload(ctx, 4096, torch.bfloat16, None, pairs=3)
    with pytest.raises(BackendUnavailable, match=r"needs tokens > world size \(2 <= 4\)"):
        backend.make_workload(ctx, 2 * 4096, torch.bfloat16, (2, 4096), pairs=3)


# --- the vote before a collective step ------------------------------------------------------------

def _vote_worker(rank: int, world: int, failing_rank: int) -> str | None:
    from commbench.runtime.context import init_context, shutdown

    ctx, _ = init_context(force_cpu=True, timeout_s=60)
    error = "cuMemCreate of 2097152 bytes failed: CUDA_ERROR_OUT_OF_MEMORY" if rank == failing_rank else None
    try:
        raise_unless_all_ranks_ok(ctx, error, "workspace probe")
        return None
    except BackendUnavailable as exc:
        return str(exc)
    finally:
        shutdown()


@pytest.mark.procs
@pytest.mark.slow
def test_one_failing_rank_fails_every_rank_with_its_reason():
    got = spawn_ranks(_vote_worker, 3, 2)
    expected = "workspace probe failed on rank 2: cuMemCreate of 2097152 bytes failed: CUDA_ERROR_OUT_OF_MEMORY"
    assert got == {0: expected, 1: expected, 2: expected}


def test_pcie_ipc_moves_to_a_new_stream_only_after_ordering_it_behind_the_old(monkeypatch):
    # 0.7.4's workspace refuses a second stream; graph capture warms up on a side stream first.
    class Stream:
        def __init__(self) -> None:
            self.waited_for: list["Stream"] = []

        def wait_stream(self, other: "Stream") -> None:
            self.waited_for.append(other)

    eager, side = Stream(), Stream()
    current, capturing, rebinds = [eager], [False], []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    backend = factory("flashinfer").variants("pcie_ipc")[0]
    backend._workspace = SimpleNamespace(rebind_stream=lambda: rebinds.append(current[0]))
    backend._follow_stream(torch.device("cpu"))
    backend._follow_stream(torch.device("cpu"))
    assert rebinds == [] and eager.waited_for == []
    current[0] = side
    backend._follow_stream(torch.device("cpu"))
    assert side.waited_for == [eager] and rebinds == [side]
    capturing[0] = True           # a capture binds nothing
    current[0] = Stream()
    backend._follow_stream(torch.device("cpu"))
    assert rebinds == [side] and backend._stream is side
