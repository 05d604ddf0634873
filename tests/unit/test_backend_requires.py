"""Which built-in families declare their software (Backend.requires, checked by the base
software_reason in one wording) and which check it themselves, as base.py's docstring and
docs/new-backend.md name them."""

from __future__ import annotations

import re
from pathlib import Path

from commbench import backends
from commbench.backends import base

ROOT = Path(__file__).parents[2]
DECLARED = ("flashinfer", "nccl4py", "p2p")
OWN_CHECK = ("nccl", "symm_mem", "mscclpp", "sglang", "vllm")   # more than an import


def software_checks() -> tuple[list[str], list[str]]:
    """(families whose variants declare requires, families that only override software_reason)."""
    declared, own = [], []
    for family in backends.BUILTIN:
        variants = backends.factory(family).variants(None)
        if any(b.requires is not None for b in variants):
            declared.append(family)
        elif any(type(b).software_reason is not base.Backend.software_reason for b in variants):
            own.append(family)
    return sorted(declared), sorted(own)


def one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_the_families_that_declare_their_software_are_those_the_docs_name() -> None:
    assert software_checks() == (sorted(DECLARED), sorted(OWN_CHECK))
    docstring = one_line(base.__doc__ or "")
    guide = one_line((ROOT / "docs/new-backend.md").read_text())
    declared = f"{', '.join(DECLARED[:-1])} and {DECLARED[-1]} declare"
    assert declared in docstring and declared in guide
    assert f"{', '.join(OWN_CHECK)})" in docstring
    overrides = guide[guide.index("Override `software_reason()` only"):]
    overrides = overrides[:overrides.index(".")]
    assert all(f"{family})" in overrides or f"{family}," in overrides for family in OWN_CHECK)
