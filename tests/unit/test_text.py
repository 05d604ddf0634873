"""commbench/results/text.py: the one cleaner and the one way to cut text to a width."""

from __future__ import annotations

import sys
import unicodedata

import pytest

from commbench.results.text import CUT_MARK, capped, clean_text, needs_cleaning


def test_every_invisible_or_reordering_character_goes() -> None:
    """Every control, format (bidi, zero-width, tag, BOM) and line/paragraph separator character
    this Python knows is removed: the class, not a list of the ones seen in an attack."""
    hidden = [chr(c) for c in range(sys.maxunicode + 1)
              if unicodedata.category(chr(c)) in ("Cc", "Cf", "Zl", "Zp") and chr(c) not in "\t\n"]
    text = "a" + "".join(hidden) + "b"
    assert clean_text(text, one_line=False) == "ab" and needs_cleaning(text)
    assert clean_text("a\tb\nc\rd\x0be\x0cf") == "a b c d e f"       # one line: line breaks keep words apart
    assert clean_text("a\tb\nc", one_line=False) == "a\tb\nc"
    assert clean_text("GPU 0 \u00e9\u4e2d\U0001f680") == "GPU 0 \u00e9\u4e2d\U0001f680"   # shown text stays


@pytest.mark.parametrize("text, cap, expected", [
    ("short", 10, "short"),
    ("sglang 0.5.23 custom allreduce v2 (JIT, sglang.kernels.ops.communication.all_reduce)", 80,
     "sglang 0.5.23 custom allreduce v2 (JIT," + CUT_MARK),
    ("abcd efgh ijkl", 13, "abcd efgh" + CUT_MARK),                 # cut between words: no word lost
    ("x" * 40, 10, "x" * 6 + CUT_MARK),                              # one long word: cut inside it
    ("a\u202eb\x1b[2Jc " * 30, 20, "ab[2Jc ab[2Jc" + CUT_MARK),      # cleaned before it is measured
])
def test_capped_cuts_at_a_word_and_says_so(text: str, cap: int, expected: str) -> None:
    assert capped(text, cap) == expected and len(capped(text, cap)) <= cap
