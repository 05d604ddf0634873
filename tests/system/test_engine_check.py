"""`commbench engines --check` runs an engine's own gate functions (imported from the release, in a
child process) over a grid and compares them with commbench's: a gate edited in a copy of the
engine exits 1 naming the function's file:line. The engine tree is hand-made here, in the test:
one gate of vLLM's shape, written for this test (no engine code is committed). A library the
engines call (FlashInfer) is checked by its facts alone, its kernel names among them, in-process:
its tree too is written here, a few lines shaped like the ones its facts read."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from commbench.cli import main as cli
from commbench.engines import gates as gate_run
from commbench.waits import waits

GATE = "vllm/distributed/device_communicators/custom_all_reduce.py"
# The custom allreduce's size rule as vLLM 0.34.0 states it (custom_all_reduce.py:500-515: no
# message above 8 ranks, f32/f16/bf16, a multiple of 16 bytes, 2 ranks or NVLink on every pair,
# below max_size unless batch invariant), in this test's own words. {limit} is the world-size cap.
SOURCE = '''import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CustomAllreduce:
    _SUPPORTED_WORLD_SIZES = [2, 4, 6, 8, 16]

    def __init__(self, group, device, max_size=8 * 1024 * 1024):
        self.disabled = True

    def should_custom_ar(self, inp):
        size = inp.numel() * inp.element_size()
        if self.disabled or self.mnnvl_only or self.world_size > {limit} or inp.dtype not in DTYPES or size % 16:
            return False
        return (self.world_size == 2 or self.fully_connected) and (self.batch_invariant or size < self.max_size)
'''


def engine_tree(root: Path, limit: int) -> Path:
    (root / "vllm-0.34.0.dist-info").mkdir(parents=True)
    (root / "vllm-0.34.0.dist-info" / "METADATA").write_text("Name: vllm\nVersion: 0.34.0\n")
    gate = root / GATE
    gate.parent.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("raise SystemExit('the package is never imported whole')\n")
    gate.write_text(SOURCE.format(limit=limit))
    return root


def _gate(out: dict) -> dict:
    (engine,) = out["engines"]
    return next(g for g in engine["gates"] if g["key"] == "custom_ar_takes")


@pytest.mark.procs   # the gate check imports the engine's functions in a child process
def test_an_edited_gate_in_a_copy_of_the_engine_exits_1_naming_its_file_and_line(tmp_path, capsys, monkeypatch):
    line = SOURCE.splitlines().index("    def should_custom_ar(self, inp):") + 1
    faithful = engine_tree(tmp_path / "faithful", 8)
    # Run from a folder holding a torch.py of its own: the child imports torch and commbench from
    # the environment, never from the folder it was started in.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "torch.py").write_text("open('imported', 'w').close()\nraise SystemExit('a torch.py of the folder')\n")
    monkeypatch.chdir(cwd)
    cli(["engines", "--check", str(faithful), "--json", str(tmp_path / "faithful.json")])
    same = _gate(json.loads((tmp_path / "faithful.json").read_text()))
    assert same["differ"] == 0 and same["compared"] == 1520 and same["where"] == f"{GATE}:{line}"
    assert not (cwd / "imported").exists()
    capsys.readouterr()

    edited = engine_tree(tmp_path / "edited", 16)     # takes messages at 16 ranks: vLLM refuses them
    assert cli(["engines", "--check", str(edited), "--json", str(tmp_path / "edited.json"), "--wide"]) == 1
    text = capsys.readouterr().out
    differs = _gate(json.loads((tmp_path / "edited.json").read_text()))
    assert differs["differ"] > 0 and differs["where"] == f"{GATE}:{line}"
    assert f"gate custom_ar_takes: CustomAllreduce.should_custom_ar ({GATE}:{line}) differs at" in text
    assert "tp=16, nvlink=True" in text and "built in False; vLLM True" in text


# --- engine code that hangs, floods, raises or exits in the check's child ------------------------

COMM = "vllm/distributed/device_communicators/"
# One hostile gate per probe file, in the order vLLM's probes run; hand-written for this test.
HOSTILE = {
    COMM + "custom_all_reduce.py": 'raise RuntimeError("\\x1b[2Jthe module raises")\n',
    COMM + "symm_mem.py": '''class SymmMemCommunicator:
    def should_use_symm_mem(self, inp):
        raise RuntimeError("refused")
''',
    COMM + "all_reduce_utils.py": '''SYMM_MEM_ALL_REDUCE_MAX_SIZES = {cc: {2: 1, 4: 1, 6: 1, 8: 1} for cc in ("9.0", "10.0", "10.3")}


def should_nccl_symm_mem_allreduce(world_size, inp):
    while True:
        print("flood " * 10000)
''',
    COMM + "flashinfer_all_reduce.py": '''import os


def _resolve_fi_ar_backend(group):
    os._exit(3)
''',
}


@pytest.mark.procs
def test_a_gate_that_hangs_floods_raises_or_exits_is_named_in_one_line_each(tmp_path, capsys, monkeypatch):
    """Each bad gate gets one line naming its function and file:line, within gate_probe_s (1 s
    here): the flood goes nowhere (of what the child prints only the last 4 KiB is kept), the hung
    one is ended, and the gates after one that hangs run in a new child (two in all)."""
    root = engine_tree(tmp_path / "hostile", 8)
    for file, text in HOSTILE.items():
        (root / file).write_text(text)
    monkeypatch.setenv("COMMBENCH_WAITS", "gate_probe_s=1")
    waits.cache_clear()
    try:
        began = time.monotonic()
        assert cli(["engines", "--check", str(root), "--wide"]) == 1
        took = time.monotonic() - began
    finally:
        waits.cache_clear()
    out, err = capsys.readouterr()
    gates = {line.split(":")[0].strip(): line.strip() for line in out.splitlines() if line.startswith("  gate ")}
    assert gates["gate custom_ar_takes"].endswith(
        f"({COMM}custom_all_reduce.py): CustomAllreduce.should_custom_ar cannot be compared (RuntimeError: [2Jthe "
        "module raises)")      # the escape is gone
    assert gates["gate symm_mem_takes"].endswith(
        f"({COMM}symm_mem.py:2): SymmMemCommunicator.should_use_symm_mem cannot be compared (it raises RuntimeError at "
        "each of the 912 points)")
    assert gates["gate nccl_symm_takes"].endswith(
        f"({COMM}all_reduce_utils.py:4): should_nccl_symm_mem_allreduce cannot be compared (gave no answer in 1 s: the "
        "check ended it)")
    assert gates["gate flashinfer_backend"].endswith(
        f"({COMM}flashinfer_all_reduce.py:4): _resolve_fi_ar_backend cannot be compared (the check's process ended "
        "with exit status 3 before it answered)")
    assert "flood flood" not in out + err and "\x1b" not in out and took < 60


def _talk(code: str, probe_s: float = 30, start_s: float = 30) -> tuple[dict, str | None, str | None]:
    return gate_run.talk([sys.executable, "-c", code], ["a", "b"], probe_s, start_s)


START = 'import sys, os; print(\'{"start": "a"}\', flush=True)\n'


@pytest.mark.procs
@pytest.mark.parametrize("code, running, why", [
    (START + "while True: sys.stdout.write('x' * 65536)", "a", "printed more than 4 MiB where the check reads its "
                                                               "answers: the check ended it"),
    (START + "print('Traceback (most recent call last):', flush=True)", "a",
     "printed something other than its answers where the check reads them: the check ended it"),
    (START + "print('\\x1b]0;title\\x07last words', file=sys.stderr, flush=True); os._exit(7)", "a",
     "the check's process ended with exit status 7 before it answered: ]0;titlelast words"),
    (START + "import signal; os.kill(os.getpid(), signal.SIGKILL)", "a",
     "the check's process was killed by SIGKILL before it answered"),
    (START + "import time; time.sleep(60)", "a", "gave no answer in 0.5 s: the check ended it"),
    ("import time; time.sleep(60)", None, "the gate check did not start in 0.5 s"),
    ('print(\'{"error": "torch cannot be imported here"}\')', None, "torch cannot be imported here"),
])
def test_what_a_gate_child_says_is_read_bounded_and_checked(code, running, why):
    answers, stopped, said = _talk(code, probe_s=0.5, start_s=0.5 if running is None and "sleep" in code else 30)
    assert (answers, stopped, said) == ({}, running, why)


@pytest.mark.procs
def test_a_gate_childs_answers_are_taken_line_by_line():
    code = START + ('print(\'{"key": "a", "answers": [true, null, 3, "raises X"]}\'); print(\'{"start": "b"}\'); '
                    'print(\'{"key": "b", "error": "ImportError: no"}\')')
    assert _talk(code) == ({"a": {"answers": [True, None, 3, "raises X"]}, "b": {"error": "ImportError: no"}}, None,
                           None)
    wrong = START + 'print(\'{"key": "a", "answers": [[1]]}\')'     # an answer that is no scalar
    assert _talk(wrong)[2] == "printed something other than its answers where the check reads them: the check ended it"


# --- a library: FlashInfer's facts, its kernel names among them ----------------------------------

FI_INCLUDE = "flashinfer/data/include/flashinfer/comm/"
FUSION = FI_INCLUDE + "trtllm_allreduce_fusion.cuh"
# The lines FlashInfer 0.7.4's facts are read from (commbench/engines/flashinfer.py), in this
# test's own words: kernels with empty bodies, the namespaces, the pattern enum, the rank switch.
FLASHINFER = {
    FUSION: """namespace flashinfer {

namespace trtllm_allreduce_fusion {

enum class AllReduceFusionPattern : int {
  kAllReduce = 0,
  kARResidualRMSNorm = 1,
};

template <AllReduceFusionPattern Pattern, typename T, int NRanks, bool Fp32Acc>
__global__ void allreduce_fusion_kernel_oneshot_lamport(Params<T> params) {}

template <AllReduceFusionPattern Pattern, typename T, int NRanks, bool Fp32Acc>
__global__ void allreduce_fusion_kernel_twoshot_sync(Params<T> params) {}

void dispatch(Params<T> params) {
  switch (params.nranks) {
    case 2: DISPATCH_PATTERN(T, 2);
    case 4: DISPATCH_PATTERN(T, 4);
    case 8: DISPATCH_PATTERN(T, 8);
    case 16: DISPATCH_PATTERN(T, 16);
  }
}
}  // namespace trtllm_allreduce_fusion
}  // namespace flashinfer
""",
    FI_INCLUDE + "trtllm_mnnvl_allreduce.cuh": """namespace flashinfer {
namespace trtllm_mnnvl_allreduce {
__global__ void __launch_bounds__(1024) oneshotAllreduceFusionKernel(Params<T> params) {}
__global__ __launch_bounds__(128) void twoshotAllreduceKernel(Params<T> params) {}
__global__ __launch_bounds__(1024) void rmsNormLamport(Params<T> params) {}
}
}
""",
    FI_INCLUDE + "pcie_ipc_all_reduce.cuh": "namespace flashinfer {\nnamespace comm {\nnamespace pcie_ipc {\n" + "".join(
        f"__global__ __launch_bounds__(1024, 1) void {name}(const Params params) {{}}\n"
        for name in ("ipc_tp2_remote_push_kernel", "ipc_rsag_ring_push_param_kernel", "ipc_rsag_push_param_kernel",
                     "ipc_topo_rsag8_push_param_kernel", "ipc_topo_rsag8_ring_push_param_kernel",
                     "ipc_topo_rsag8_block_param_kernel", "push_oneshot_param_kernel")) + "}\n}\n}\n",
    "flashinfer/comm/trtllm_ar.py": """class AllReduceFusionPattern:
    kAllReduce = 0
    kARResidualRMSNorm = 1


BarrierFlagCount = 256
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)
""",
    "flashinfer/comm/pcie_ipc_ar.py": "_SUPPORTED_WORLD_SIZES = (2, 4, 8)\n",
    "flashinfer/comm/pcie_ipc_collectives/_constants.py": "PACK_BYTES = 16\n",
    "flashinfer/jit/comm.py": """def gen_trtllm_mnnvl_comm_module():
    return flags(supported_major_versions=[9, 10])


def gen_trtllm_comm_module():
    return flags(supported_major_versions=[9, 10, 12])
""",
}


def flashinfer_tree(root: Path) -> Path:
    for file, text in {"flashinfer/__init__.py": "", **FLASHINFER,
                       "flashinfer_python-0.7.4.dist-info/METADATA": "Name: flashinfer-python\nVersion: 0.7.4\n"}.items():
        (root / file).parent.mkdir(parents=True, exist_ok=True)
        (root / file).write_text(text)
    return root


def test_flashinfer_is_checked_by_its_facts_and_a_renamed_kernel_exits_1_naming_its_file_and_line(tmp_path, capsys):
    """In-process (no gate child: a library has no gates of its own). A kernel renamed in a copy of
    the tree is a difference at the line its new name is read at."""
    faithful = flashinfer_tree(tmp_path / "faithful")
    oneshot = FLASHINFER[FUSION].splitlines().index("__global__ void allreduce_fusion_kernel_oneshot_lamport("
                                                    "Params<T> params) {}") + 1
    assert cli(["engines", "--check", str(faithful), "--json", str(tmp_path / "faithful.json"), "--wide"]) == 0
    text = capsys.readouterr().out
    out = json.loads((tmp_path / "faithful.json").read_text())
    (library,) = out["libraries"]
    assert out["engines"] == [] and out["differ"] == 0 and library["gates"] == []
    assert (library["engine"], library["version"], library["differences"]) == ("flashinfer", "0.7.4", [])
    assert text.splitlines()[0] == (f"FlashInfer 0.7.4 at {faithful}: {library['compared']} facts compared with the "
                                    "built-in FlashInfer 0.7.4 facts, 0 differ; a library the engines call: no gate "
                                    "functions or dispatch order of its own to run")
    assert "0 gate functions" not in text
    assert f"  same: fusion_kernels ({FUSION}:{oneshot})" in text and "  same: max_comm_size (flashinfer/comm/trtllm_ar.py:7)" \
        in text and "  same: sm_majors (flashinfer/jit/comm.py:5)" in text

    renamed = tmp_path / "renamed"
    shutil.copytree(faithful, renamed)
    fusion = renamed / FUSION
    fusion.write_text(fusion.read_text().replace("allreduce_fusion_kernel_oneshot_lamport",
                                                 "allreduce_fusion_kernel_oneshot_push"))
    assert cli(["engines", "--check", str(renamed), "--wide"]) == 1
    text = capsys.readouterr().out
    assert ", 1 differ; a library the engines call" in text.splitlines()[0]
    assert ("  fusion_kernels: built in ['allreduce_fusion_kernel_oneshot_lamport', "
            "'allreduce_fusion_kernel_twoshot_sync']; source ['allreduce_fusion_kernel_oneshot_push', "
            f"'allreduce_fusion_kernel_twoshot_sync'] ({FUSION}:{oneshot})") in text
