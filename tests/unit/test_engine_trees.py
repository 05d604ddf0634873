"""Engine trees and logs are untrusted input (issue 56): the reader's bounds on what it evaluates,
the kinds each fact's value must have, and the files it reads (METADATA, kernel libraries,
start-up logs), on trees and logs made here. The cases one command shows are hostile cases
(tests/hostile_fourth.py); the gate check's child is tested in tests/system/test_engine_check.py."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from commbench.cli import main as cli
from commbench.engines import facts, flashinfer, log, sglang, source, values, vllm
from commbench.errors import UsageError
from commbench.files import NoSuchFile, byte_blocks

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "tests/data/engine-src/vllm-site"
CUSTOM_AR = "vllm/distributed/device_communicators/custom_all_reduce.py"


def _value(expression: str, before: str = "") -> object:
    """`expression` as the reader evaluates it, with module-level lines `before`."""
    module = ast.parse(before)
    return facts.evaluate(ast.parse(expression, mode="eval").body, facts._module_names(module))


@pytest.mark.parametrize("fact", vllm.FACTS.facts + sglang.FACTS.facts + flashinfer.FACTS.facts, ids=lambda f: f.key)
def test_every_built_in_fact_is_of_its_own_kind(fact):
    assert values.problem(fact.value, values.kind_of([fact.value]), fact.key) is None


@pytest.mark.parametrize("expression, value", [
    ("8 * 1024 * 1024", 8 << 20), ("1 << 20", 1 << 20), ("2 ** 63", 1 << 63), ("0.5 * 4", 2.0), ("-(2 ** 10)", -1024),
    ("frozenset({'a', 'b'})", frozenset({"a", "b"})), ("{(100, 8, 1): 128}", {(100, 8, 1): 128}),
    ("tuple([2, 4])", (2, 4)), ("1 ** (2 ** 62)", 1),
    ("2147483647 & ~((1 << 21) - 1)", 2145386496),     # FlashInfer's MAX_COMM_SIZE: a mask
])
def test_the_literals_engines_write_are_read(expression, value):
    assert _value(expression) == value


@pytest.mark.parametrize("expression, before, why", [
    ("1 / 0", "", "divides by zero"),
    ("0 ** -1", "", "divides by zero"),
    ("2 ** 64", "", "is larger than 2^64 (2 ** 64)"),
    ("1e300 ** 2", "", "is larger than 2^64"),
    ("2.0 ** 5000", "", "cannot be computed (OverflowError)"),
    ("1e999", "", "is inf, not a finite number"),
    ("(2 ** 62) * (2 ** 62)", "", "is larger than 2^64"),
    ("1 << 64", "", "shifts by 64, not 0 to 63 bits"),
    ("1 << -1", "", "shifts by -1"),
    ("1.5 & 3", "", "cannot be computed (TypeError)"),
    ("(-8) ** 0.5", "", "is complex, not a real number"),
    ("0x" + "f" * 8192, "", "is larger than 2^64"),
    ("list(5)", "", "calls list() on a int, which is no collection"),
    ("{[1]: 2}", "", "has a list, set or table as a dict key"),
    ("frozenset([[1]])", "", "has a list, set or table as a set member"),
    ("X", "X = 1 / 0\n", "uses X (line 1), which divides by zero"),
    ("D", "A = 10 ** 30\nB = A ** 64\nC = B ** 64\nD = C ** 64\n", "uses D, from A (line 1), which is larger"),
    ("Z", "A = [0] * 0\nA = [" + "0, " * 5000 + "]\n" + "".join(f"B{i} = tuple(A)\n" for i in range(300))
     + "Z = tuple(A)\n", "uses Z (line 303), which takes more than 1048576 steps"),
])
def test_a_literal_that_would_be_huge_slow_or_no_number_is_refused_before_it_is_computed(expression, before, why):
    with pytest.raises(facts.Refused) as refused:
        _value(expression, before)
    assert str(refused.value).startswith(why), str(refused.value)


def test_a_mask_of_no_whole_number_is_unreadable():
    with pytest.raises(facts.Unreadable, match="~ on something that is not a whole number"):
        _value("~1.5")


def test_a_name_that_is_no_literal_stays_unreadable_and_a_later_one_unbinds_it():
    with pytest.raises(facts.Unreadable, match="name X is not a module-level constant") as unread:
        _value("X", "X = 4\nX = helper()\n")
    assert not isinstance(unread.value, facts.Refused)


@pytest.mark.parametrize("fact, value, why", [
    (vllm.FACTS.fact("custom_ar_max_bytes"), float("nan"), "is nan, not a whole number >= 0"),
    (vllm.FACTS.fact("custom_ar_max_bytes"), -1, "is -1, not a whole number >= 0"),
    (vllm.FACTS.fact("custom_ar_max_bytes"), 1.5, "is 1.5, not a whole number >= 0"),
    (vllm.FACTS.fact("custom_ar_world_sizes"), [2, "4"], "[1] is '4', not a whole number >= 0"),
    (vllm.FACTS.fact("symm_mem_max_bytes"), {"9.0": {2: None}}, "['9.0'][2] is None, not a whole number >= 0"),
    (vllm.FACTS.fact("flashinfer_max_mb"), {90: {2: float("inf")}}, "[90][2] is inf, not a number >= 0"),
    (vllm.FACTS.fact("flashinfer_mnnvl_max_mb"), {(100, 8): 128}, "key (100, 8) is (100, 8), not 3 values"),
    (vllm.FACTS.fact("nccl_symm_config"), {"custom_ar_preferred_ranges": {4: (16384,)}},
     "['custom_ar_preferred_ranges'][4] is (16384,), not 2 values"),
    (sglang.FACTS.fact("flashinfer_archs"), frozenset({"x" * 300}), "member is 'xxxxx"),
    (sglang.FACTS.fact("flashinfer_archs"), ["GlmMoeDsaForCausalLM"], "is ['GlmMoeDsaForCausalLM'], not a set"),
    (vllm.FACTS.fact("env_skip_p2p_check"), 1, "is 1, not text"),
    (sglang.FACTS.fact("v2_push_env"), [1], "is [1], not a number, text, True/False or None"),
])
def test_a_value_not_of_its_facts_kind_is_named_with_its_place(fact, value, why):
    wrong = values.problem(value, values.kind_of([fact.value]), fact.symbol)
    assert wrong is not None and wrong.startswith(f"{fact.symbol}{why}" if why[0] in "[ " else f"{fact.symbol} {why}"), \
        wrong


def test_a_value_past_the_bound_on_values_is_refused_without_being_walked():
    nested: list = [0] * 10
    for _ in range(9):      # 10^9 values by reference: a walk of it, or its repr, would never end
        nested = [nested] * 10
    deep: list = [1]
    for _ in range(9):
        deep = [deep]
    kind = values.kind_of([deep])
    assert "more than 1024 values" in values.problem(nested, kind, "X")
    assert len(values.shown(nested)) <= 60 and values.shown(1 << 100) == "a 101-bit number"


def _tree(tmp_path: Path, text: str) -> Path:
    site = tmp_path / "site"
    shutil.copytree(SITE, site)
    (site / CUSTOM_AR).write_text(text)
    return site


def test_an_int_literal_python_will_not_parse_is_bad_input_naming_its_line(tmp_path, capsys):
    site = _tree(tmp_path, "class CustomAllreduce:\n    def __init__(self, max_size=" + "9" * 8192 + "):\n        pass\n")
    assert cli(["engines", "--engine", "vllm", "--engine-site", str(site)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"{site / CUSTOM_AR}:2: not Python this interpreter parses (Exceeds the limit (4300 digits) "
                        "for integer string conversion: value has 8192 digits; use ...)") and "\n" not in err


def test_a_missing_file_is_still_a_difference_and_not_bad_input(tmp_path):
    site = _tree(tmp_path, "")
    (site / "vllm/envs.py").unlink()
    read, differences = facts.read(facts.SourceTree(site), vllm.FACTS, "0.34.0", "read")
    assert any(d.why == "vllm/envs.py cannot be read (FileNotFoundError)" for d in differences)
    assert read.value("env_use_symm_mem") == "1"        # the built-in value, with a warning


def test_metadata_is_read_to_the_end_of_its_header_only(tmp_path):
    info = tmp_path / "vllm-0.34.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Name: vllm\nVersion: 0.34.0\n\n" + "description\n" * 200_000)   # 2.4 MB
    assert source.version_at(tmp_path, "vllm") == "0.34.0"
    (info / "METADATA").write_text("Name: vllm\n\nVersion: 9.9.9\n")      # a Version in the description is none
    assert source.version_at(tmp_path, "vllm") is None
    (info / "METADATA").write_bytes(b"Name: vllm\n" + b"\0" * 100 + b"\nVersion: 0.34.0\n")
    with pytest.raises(UsageError, match="METADATA: binary file, not a dist-info METADATA"):
        source.version_at(tmp_path, "vllm")


def test_a_kernel_scan_names_the_line_of_the_first_name_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(facts, "SCAN_CHUNK", 64)
    cuh = tmp_path / "k.cuh"
    cuh.write_text("\n" * 9 + "x" * 100 + "\nALL_REDUCE_KERNEL void all_reduce_1shot_push_kernel(\n")
    fact = sglang.FACTS.fact("v2_kernels")
    assert facts.SourceTree(tmp_path).scan("k.cuh", fact.symbol) == (["all_reduce_1shot_push_kernel"], 11)
    monkeypatch.setattr(facts, "MAX_LIBRARY_BYTES", 128)
    with pytest.raises(UsageError, match="k.cuh: larger than 0 MiB, not an engine's kernel source or library"):
        facts.SourceTree(tmp_path).scan("k.cuh", fact.symbol)


def test_a_start_up_log_is_streamed_and_its_tp_line_found_past_a_block(tmp_path):
    line = (SITE.parent / "vllm-startup.log").read_text()
    big = tmp_path / "vllm.log"
    big.write_text("INFO a line of start-up noise\n" * 100_000 + line)      # 3 MB before the line
    assert log.read_chain(str(big), vllm.ENGINE).names == ("FLASHINFER", "CUSTOM", "PYNCCL")
    (tmp_path / "bad.log").write_bytes(b"\xff\xfe\n" + line.encode())
    with pytest.raises(UsageError, match=r"^--engine-log .*bad.log: not UTF-8 text \(byte 0\)"):
        log.read_chain(str(tmp_path / "bad.log"), vllm.ENGINE)


def test_byte_blocks_bound_what_is_read_and_a_missing_file_is_its_own_refusal(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 100)
    assert b"".join(byte_blocks(tmp_path / "f", "a test file", 7, 100)) == b"x" * 100
    with pytest.raises(UsageError, match="larger than 0 MiB"):
        list(byte_blocks(tmp_path / "f", "a test file", 7, 99))
    with pytest.raises(NoSuchFile):
        list(byte_blocks(tmp_path / "absent", "a test file"))
