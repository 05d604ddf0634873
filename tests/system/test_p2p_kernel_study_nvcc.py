"""scripts/p2p_kernel_study.py's compiled variants, built with nvcc where it is installed (no GPU):
every kernel of each study compiles and is named in the cubin, and the Lamport one-shot's kernels
take their own 104-byte parameter (LamportLayout) where the others take the 504-byte Layout."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from commbench.backends.p2p import kernels as p2p_kernels
from commbench.backends.p2p import layout as p2p_layout

_SPEC = importlib.util.spec_from_file_location("p2p_kernel_study_nvcc_test",
                                               Path(__file__).parents[2] / "scripts" / "p2p_kernel_study.py")
study = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(study)

pytestmark = [pytest.mark.procs,
              pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")]

BF16, RANKS = 2, 8


def _parameter_bytes(ptx: str, entry: str) -> list[int]:
    params = ptx.split(f".entry {entry}(")[1].split(")")[0]
    return [int(n) if n else int(width) // 8
            for width, n in re.findall(r"\.param \.(?:align \d+ \.b8|[bsu](\d+))\s+\w+(?:\[(\d+)\])?", params)]


@pytest.mark.parametrize("name", ["base", "own_slot_always", "own_slot_never", "bf16_int", "graph_all_read",
                                  "unroll_every_world", "unroll_none", "graph_plain_loads", "ll_bare", "window_late",
                                  "graph_bare", "graph_nocount", "graph_lean"])
def test_each_study_source_compiles_with_nvcc(tmp_path, name):
    source = tmp_path / f"{name}.cu"
    source.write_text(study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), name))
    kernels = list(p2p_layout.KERNEL_NAMES.values())
    cubin, mangled = study.nvcc_cubin(source, kernels, BF16, RANKS, study.nvrtc_options("sm_90a"), tmp_path)
    assert cubin.stat().st_size > 0 and set(mangled) == set(kernels)
    assert mangled["p2p_ll_oneshot"] == "_Z14p2p_ll_oneshotILi2ELi8EEv13LamportLayoutPK5uint4PS1_j"
    ptx = (tmp_path / "kernels.ptx").read_text()
    # Layout or LamportLayout by value, in, out, units
    assert _parameter_bytes(ptx, mangled["p2p_ll_oneshot"]) == [104, 8, 8, 4]
    assert _parameter_bytes(ptx, mangled["p2p_ll_oneshot_own_slot"]) == [104, 8, 8, 4]
    assert _parameter_bytes(ptx, mangled["p2p_oneshot_graph"]) == [8 * p2p_layout.LAYOUT_WORDS, 8, 8, 4]


def test_an_nvcc_error_is_one_line_naming_the_command(tmp_path):
    source = tmp_path / "broken.cu"
    source.write_text("this is not CUDA\n")
    with pytest.raises(RuntimeError, match="nvcc -ptx .* exited"):
        study.nvcc_cubin(source, ["p2p_ll_oneshot"], BF16, RANKS, study.nvrtc_options("sm_90a"), tmp_path)
