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
