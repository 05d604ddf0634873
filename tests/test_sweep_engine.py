"""The sweep engine's bookkeeping that needs no processes (commbench/sweep/engine.py)."""

from __future__ import annotations

import pytest

from commbench.sweep.engine import Engine, UnknownRowField
from factories import row


def test_a_built_in_backends_unknown_row_field_is_an_error_and_a_plugins_goes_to_extra() -> None:
    fields = {"requested": {"NCCL_PROTO": "LL"}, "extra": {"kept": 1}}
    strict = row()
    Engine._apply_fields(strict, fields, strict="nccl")
    assert strict.requested == {"NCCL_PROTO": "LL"} and strict.extra == {"kept": 1}
    with pytest.raises(UnknownRowField, match="nccl: row_fields\\(\\) sets 'requsted'"):
        Engine._apply_fields(row(), {"requsted": {"NCCL_PROTO": "LL"}}, strict="nccl")
    plugin = row()
    Engine._apply_fields(plugin, {"requsted": "x"})
    assert plugin.extra == {"requsted": "x"} and plugin.requested == {}


def test_every_built_in_variant_names_only_row_fields() -> None:
    """What each built-in variant records before its setup (the fields that do not depend on a run)
    passes the engine's strict check: no built-in backend leans on a name landing in extra."""
    from commbench.backends import is_builtin, probe_variants

    variants = [b for b in probe_variants() if is_builtin(b.family)]
    assert len(variants) > 40
    for backend in variants:
        Engine._apply_fields(row(), backend.row_fields(), strict=backend.name)
