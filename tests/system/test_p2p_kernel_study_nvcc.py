"""scripts/p2p_kernel_study.py's compiled variants, built with nvcc where it is installed (no GPU):
every kernel of each study of the Lamport one-shot and of the graph one-shot compiles and is named
in the cubin, and small_params' Lamport one-shot takes a parameter of 104 bytes where the shipped
one takes 504."""

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


@pytest.mark.parametrize("name, layout_bytes", [("base", 8 * p2p_layout.LAYOUT_WORDS), ("small_params", 104),
                                                ("own_slot_always", 8 * p2p_layout.LAYOUT_WORDS),
                                                ("own_slot_never", 8 * p2p_layout.LAYOUT_WORDS),
                                                ("bf16_int", 8 * p2p_layout.LAYOUT_WORDS),
                                                ("call_thread0", 8 * p2p_layout.LAYOUT_WORDS),
                                                ("first_barrier_nosync", 8 * p2p_layout.LAYOUT_WORDS)])
def test_each_study_source_compiles_with_nvcc(tmp_path, name, layout_bytes):
    source = tmp_path / f"{name}.cu"
    source.write_text(study.patched(p2p_kernels.KERNEL_SOURCE.read_text(), name))
    kernels = list(p2p_layout.KERNEL_NAMES.values())
    cubin, mangled = study.nvcc_cubin(source, kernels, BF16, RANKS, study.nvrtc_options("sm_90a"), tmp_path)
    assert cubin.stat().st_size > 0 and set(mangled) == set(kernels)
    assert mangled["p2p_ll_oneshot"] == "_Z14p2p_ll_oneshotILi2ELi8EEv6LayoutPK5uint4PS1_j".replace(
        "6Layout", "11SmallLayout" if name == "small_params" else "6Layout")
    # Layout, in, out, units
    assert _parameter_bytes((tmp_path / "kernels.ptx").read_text(), mangled["p2p_ll_oneshot"]) == [layout_bytes, 8, 8, 4]


def test_an_nvcc_error_is_one_line_naming_the_command(tmp_path):
    source = tmp_path / "broken.cu"
    source.write_text("this is not CUDA\n")
    with pytest.raises(RuntimeError, match="nvcc -ptx .* exited"):
        study.nvcc_cubin(source, ["p2p_ll_oneshot"], BF16, RANKS, study.nvrtc_options("sm_90a"), tmp_path)
