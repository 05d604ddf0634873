"""scripts/p2p_kernel_static.py without a compiler: its SASS counts and resource lines are read
right, and a checkout that is not SGLang's is one line and exit 2."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "p2p_kernel_static.py"
_SPEC = importlib.util.spec_from_file_location("p2p_kernel_static_under_test", SCRIPT)
static = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = static     # its dataclass looks its module up
_SPEC.loader.exec_module(static)

SASS = """
        Function : _Z14p2p_ll_oneshotILi2ELi8EEv6LayoutPK5uint4PS1_j
        /*0000*/                   LDC R1, c[0x0][0x28] ;                          /* 0x00000a00ff017b82 */
        /*0010*/                   LDG.E.STRONG.SYS R4, desc[UR10][R4.64+0x120] ;
        /*0020*/                   BAR.RED.OR.DEFER_BLOCKING 0x0, P0 ;
        /*0030*/                   LDC.64 R6, c[0x0][R6+0x310] ;
        /*0040*/               @P0 BRA 0x70 ;
        /*0050*/                   STG.E.128.STRONG.SYS desc[UR10][R8.64], R12 ;
        /*0060*/                   NOP ;
        /*0070*/              @!P1 STG.E.128.STRONG.SYS desc[UR10][R8.64], R12 ;
        /*0080*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0090*/               @P2 LDG.E.128.STRONG.SYS R28, desc[UR10][R6.64] ;
        /*00a0*/                   MEMBAR.SC.SYS ;
        /*00b0*/                   ATOMG.E.CAS.STRONG.GPU PT, R44, [R44], R6, R7 ;
        /*00c0*/                   EXIT ;
"""


def test_sass_counts_follow_program_order_around_the_pushes():
    assert static.sass_counts(SASS) == static.SassCounts(
        instructions=12, before_push=5, loads_before_push=1, indexed_constants_before_push=1,
        barriers_before_push=1, branches_before_push=1, push_span=1, push_to_poll=2, pushes=2, polls=1,
        fences=1, atomics=1)


def test_resource_usage_reads_the_line_under_its_function():
    text = (" Function other:\n  REG:8 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:560\n"
            " Function f:\n  REG:56 STACK:16 SHARED:0 LOCAL:8 CONSTANT[0]:1052 TEXTURE:0\n")
    usage = static.resource_usage(text, "f")
    assert (usage["REG"], usage["STACK"], usage["LOCAL"], usage["CONSTANT[0]"]) == (56, 16, 8, 1052)


def test_a_folder_without_sglangs_kernel_is_one_line_and_exit_2(tmp_path, capsys):
    assert static.main(["--sglang", str(tmp_path), "--tvm-ffi-include", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"p2p_kernel_static: --sglang {tmp_path}: no {static.SGLANG_SOURCE} there"
