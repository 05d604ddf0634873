"""scripts/mps-reference.sh on a machine without a GPU: bad input is one line and exit 2,
before anything is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import child_env

pytestmark = pytest.mark.procs   # every test here launches processes

SCRIPT = Path(__file__).parents[2] / "scripts" / "mps-reference.sh"


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env=child_env({"PYTHON": sys.executable, **(env or {})}))


@pytest.mark.parametrize("args, env, expected", [
    ([], None, "needs OUT_DIR (usage: scripts/mps-reference.sh OUT_DIR [--ranks 2,4,8] "
               "[--parts allreduce,fused,pcie,nopdl,mscclpp,engines])"),
    (["--ranks", "2"], None, "needs OUT_DIR first, got --ranks"),
    (["{out}", "--ranks"], None, "--ranks needs a list, e.g. --ranks 2,4,8"),
    (["{out}", "--ranks", "3"], None, "--ranks takes 2, 4 and 8 (the world sizes every backend here supports), got 3"),
    (["{out}", "--ranks", "2,,4"], None, "--ranks takes a comma-separated list such as 2,4,8, got '2,,4'"),
    (["{out}", "--ranks=4,4"], None, "--ranks lists 4 twice"),
    (["{out}", "--parts"], None, "--parts needs a list, e.g. --parts allreduce,fused,pcie,nopdl,mscclpp,engines"),
    (["{out}", "--parts", "fused,plain"], None, "--parts takes allreduce,fused,pcie,nopdl,mscclpp,engines, got plain"),
    (["{out}", "--parts=pcie,"], None, "--parts takes a comma-separated list such as allreduce,fused,pcie,nopdl,"
                                       "mscclpp,engines, got 'pcie,'"),
    (["{out}", "--parts", "pcie,pcie"], None, "--parts lists pcie twice"),
    (["{out}", "--iters", "5"], None, "unknown argument --iters"),
    (["{out}"], {"MPS_REFERENCE_ITERS": "0"}, "MPS_REFERENCE_ITERS must be a positive whole number, got '0'"),
    (["{out}"], {"ENGINE_KERNEL_BACKENDS": "sglang;rm -rf x"},
     "ENGINE_KERNEL_BACKENDS must be a comma-separated list of backends, got 'sglang;rm -rf x'"),
    (["{file}"], None, "exists and is not a directory"),
    pytest.param(["{out}", "--ranks", "8"], None, "needs a CUDA GPU (this run puts every rank on one GPU under MPS)",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    # FlashInfer's TRT-LLM kernels are a valid engines list (engine-kernel-ratios.py's FlashInfer
    # columns read them): the script goes on to its GPU check.
    pytest.param(["{out}", "--parts", "engines"],
                 {"ENGINE_KERNEL_BACKENDS": "p2p:auto,flashinfer:trtllm_oneshot,flashinfer:trtllm_twoshot"},
                 "needs a CUDA GPU (this run puts every rank on one GPU under MPS)",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, args, env, expected):
    afile = tmp_path / "afile"
    afile.write_text("")
    out = tmp_path / "out"
    done = run([a.replace("{out}", str(out)).replace("{file}", str(afile)) for a in args], env)
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and expected in done.stderr, done.stderr
    assert not out.exists()
