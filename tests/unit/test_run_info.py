"""run.json as a RunInfo (commbench/results/info.py): every committed run reads into one and
writes back the same object, every field is checked at the boundary, and what this commbench
does not know is kept."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from commbench.errors import UsageError
from commbench.results import RUN_FILE, RunDir, RunInfo
from commbench.results.validate import _INFO_CHECKS

REPO = Path(__file__).resolve().parents[2]
COMMITTED = sorted(p.parent for root in ("results/reference", "tests/data") for p in (REPO / root).rglob(RUN_FILE))


def test_every_committed_run_json_reads_into_fields_and_writes_back_unchanged(tmp_path: Path) -> None:
    assert len(COMMITTED) >= 20
    for run_dir in COMMITTED:
        on_disk = json.loads((run_dir / RUN_FILE).read_text())
        info = RunDir(run_dir).info()
        assert info.to_dict() == on_disk, run_dir
        assert info.other == {}, (run_dir, sorted(info.other))   # every key it holds is a field
        copy = RunDir(tmp_path / run_dir.name)
        copy.path.mkdir(exist_ok=True)
        copy.write_info(info)
        assert json.loads((copy.path / RUN_FILE).read_text()) == {**on_disk, "schema": 3}


def test_the_boundary_checks_every_field() -> None:
    assert set(_INFO_CHECKS) == {f.name for f in dataclasses.fields(RunInfo)} - {"schema", "other"}


@pytest.mark.parametrize("field, value, said", [
    ("shares_gpus", "yes", "shares_gpus is 'yes', not true or false"),
    ("world_size", True, "world_size is True, not a whole number of ranks >= 1"),
    ("notes", "one note", "notes is 'one note', not a list"),
    ("finished", [1], "finished is [1], not a time"),
])
def test_a_field_of_the_wrong_type_is_one_line(tmp_path: Path, field: str, value: object, said: str) -> None:
    (tmp_path / RUN_FILE).write_text(json.dumps({"schema": 3, "run_id": "x", field: value}))
    with pytest.raises(UsageError, match=re.escape(f"run.json: {said}")):
        RunDir(tmp_path).info()


def test_keys_it_does_not_know_are_kept_and_update_sets_only_fields(tmp_path: Path) -> None:
    (tmp_path / RUN_FILE).write_text(json.dumps({"schema": 3, "run_id": "x", "from_a_newer_commbench": {"a": 1}}))
    run = RunDir(tmp_path)
    run.update_info(finished=12.5, interrupted=None)
    written = json.loads((tmp_path / RUN_FILE).read_text())
    assert written == {"schema": 3, "run_id": "x", "from_a_newer_commbench": {"a": 1}, "finished": 12.5}
    assert run.info().finished == 12.5 and not run.info().swept
    with pytest.raises(TypeError):
        run.update_info(finshed=1.0)
