"""scripts/p2p_kernel_static.py without a compiler: its SASS counts and resource lines are read
right, and a checkout that is not SGLang's is one line and exit 2."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest

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


PULL_SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.64 R2, desc[UR4][R4.64] ;
        /*0020*/                   ACQBULK ;
        /*0030*/                   LDG.E.STRONG.SYS R6, desc[UR4][R6.64] ;
        /*0040*/                   LDG.E.64.CONSTANT R8, desc[UR4][R8.64] ;
        /*0050*/                   REDG.E.ADD.STRONG.SYS desc[UR4][R4.64], R7 ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0070*/                   LDG.E.64.CONSTANT R10, desc[UR4][R10.64+0x8] ;
        /*0080*/                   LD.E.128 R12, desc[UR4][R2.64] ;
        /*0090*/               @P0 LD.E.128 R16, desc[UR4][R8.64] ;
        /*00a0*/                   FADD R12, R12, R16 ;
        /*00b0*/                   F2FP.BF16.F32.PACK_AB R12, R13, R12 ;
        /*00c0*/                   STG.E.128 desc[UR4][R10.64], R12 ;
        /*00d0*/                   NOP ;
        /*00e0*/                   PREEXIT ;
        /*00f0*/                   REDG.E.ADD.STRONG.SYS desc[UR4][R4.64], R7 ;
        /*0100*/                   LDG.E.STRONG.SYS R6, desc[UR4][R4.64] ;
        /*0110*/                   EXIT ;
"""


def test_pull_counts_split_the_kernel_at_the_first_peer_read_and_the_store():
    assert static.pull_counts(PULL_SASS) == static.PullCounts(
        instructions=17, before_load=8, loads_before_wait=1, loads_after_wait=2, barriers_before_load=1,
        atomics_before_load=1, strong_before_load=1, loads_after_barrier=1, peer_loads="2 LD.E.128", load_to_store=4,
        packs=1, store="STG.E.128", after_store=4, atomics_after_store=1, strong_after_store=1,
        trigger="after the store")


def test_the_pull_pair_takes_sglangs_graph_kernel_not_its_staged_one():
    name = ("_ZN6sglang28all_reduce_1shot_pull_kernelINS_13LoadStoreImplINS_6device13AlignedVectorI14__nv_bfloat162"
            "Lm4EEELj8ELb{}EEE13__nv_bfloat16Lj8ELb1EEEvNS_19AllReducePullParamsIXT1_EEE")
    pattern = static.PAIRS["pull"].sglang_function
    assert re.search(pattern, name.format(1)) and not re.search(pattern, name.format(0))


def test_resource_usage_reads_the_line_under_its_function():
    text = (" Function other:\n  REG:8 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:560\n"
            " Function f:\n  REG:56 STACK:16 SHARED:0 LOCAL:8 CONSTANT[0]:1052 TEXTURE:0\n")
    usage = static.resource_usage(text, "f")
    assert (usage["REG"], usage["STACK"], usage["LOCAL"], usage["CONSTANT[0]"]) == (56, 16, 8, 1052)


def test_a_folder_without_sglangs_kernel_is_one_line_and_exit_2(tmp_path, capsys):
    assert static.main(["--sglang", str(tmp_path), "--tvm-ffi-include", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"p2p_kernel_static: --sglang {tmp_path}: no {static.SGLANG_SOURCE} there"


@pytest.mark.parametrize("pair", sorted(static.PAIRS))
def test_each_tables_separator_has_a_cell_per_column(pair, monkeypatch):
    monkeypatch.setattr(static, "builds", lambda *args: [])
    header, separator = static.table(argparse.Namespace(pair=pair, worlds=[2]), Path("."))
    assert header.count(" | ") + 1 == separator.count("|---")
