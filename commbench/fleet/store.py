"""The fleet dataset: Parquet files in one folder, queried with DuckDB.

    FLEET/fleet.json                      what the folder is (format, version)
    FLEET/runs.parquet                    the run table: one row per run (node, job, GPUs, versions, provenance)
    FLEET/measurements/build-NNNNNN.parquet   the rows each build added, one per measurement
    FLEET/pairs/build-NNNNNN.parquet      the probe's GPU-pair bandwidth and latency, where a run recorded it

A build writes its measurement and pair files first and the run table last, whole (written beside
and renamed): the run table is what the fleet holds, so a build cut short leaves files whose
(run_key, build) no run names, and they are never read. Every file is read back as untrusted: a
row that is no longer a valid row is counted and named, never used.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from commbench.analysis import provenance
from commbench.analysis.curves import Curve, build_curves
from commbench.errors import ResultsUnwritable, UsageError
from commbench.files import check_dir_target
from commbench.fleet.deps import need
from commbench.fleet.sources import Loaded, name as safe_name
from commbench.results import LOCK_FILE, Measurement, Run, RunDir, RunInfo
from commbench.results.compact import CompactRows
from commbench.results.text import clean_text
from commbench.results.validate import MAX_RUN_INFO_BYTES, file_stem, info_problem, loads_json, row_problem

MARKER = "fleet.json"
FORMAT = "commbench-fleet"
VERSION = 1
RUNS = "runs.parquet"
MEASUREMENTS = "measurements"
PAIRS = "pairs"

_FIELDS = dataclasses.fields(Measurement)
_DICTS = tuple(f.name for f in _FIELDS if "dict" in str(f.type))


def _arrow_type(pa: Any, annotation: str) -> Any:
    for word, kind in (("dict", pa.string()), ("bool", pa.bool_()), ("float", pa.float64()), ("int", pa.int64()),
                       ("str", pa.string())):
        if word in annotation:
            return kind
    raise TypeError(annotation)


def measurement_schema(pa: Any) -> Any:
    return pa.schema([("run_key", pa.string()), ("build", pa.int64())]
                     + [(f.name, _arrow_type(pa, str(f.type))) for f in _FIELDS])


RUN_COLUMNS: list[tuple[str, str]] = [
    ("run_key", "str"), ("build", "int"), ("node", "str"), ("job", "str"), ("run_id", "str"), ("source", "str"),
    ("kind", "str"), ("fleet_group", "str"), ("host", "str"), ("world_size", "int"), ("nodes", "int"),
    ("gpus", "str"), ("gpu_count", "int"), ("fabric", "str"), ("torch", "str"), ("nccl", "str"),
    ("commbench", "str"), ("path", "str"), ("rows", "int"), ("finished", "bool"), ("warnings", "str"),
    ("built_at", "float"), ("info_json", "str")]
PAIR_COLUMNS: list[tuple[str, str]] = [("run_key", "str"), ("build", "int"), ("src", "int"), ("dst", "int"),
                                       ("bandwidth_gbps", "float"), ("latency_us", "float")]


def _schema(pa: Any, columns: list[tuple[str, str]]) -> Any:
    return pa.schema([(column, _arrow_type(pa, kind)) for column, kind in columns])


def is_fleet(path: str | Path) -> bool:
    """A fleet folder (it has fleet.json): needs neither pyarrow nor duckdb to tell."""
    return (Path(path) / MARKER).is_file()


def run_key(node: str, job: str) -> str:
    return f"{node}/{job}"


def fleet_group(origin: provenance.Provenance) -> str:
    """Runs comparable as one machine class: kind, world size, GPU model(s) and fabric."""
    ranks = f"{origin.world_size} ranks" if origin.world_size else "ranks not recorded"
    gpus = "no GPU" if origin.kind == provenance.CPU else origin.gpus_text()
    return f"{origin.kind}, {ranks}, {gpus}" + (f", {origin.fabric}" if origin.fabric else "")


def _versions(info: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    versions = info.get("versions") if isinstance(info.get("versions"), dict) else {}
    packages = versions.get("packages") if isinstance(versions.get("packages"), dict) else {}
    text = [versions.get("torch"), versions.get("nccl"), packages.get("commbench")]
    return tuple(str(v) if isinstance(v, (str, int, float)) else None for v in text)   # type: ignore[return-value]


def pairs_of(snapshot: Any) -> list[tuple[int, int, float | None, float | None]]:
    """(src, dst, GB/s, us) per directed GPU pair of a probe snapshot's bandwidth matrix, where recorded."""
    snapshot = snapshot if isinstance(snapshot, dict) else {}
    bandwidth = snapshot.get("bandwidth") if isinstance(snapshot.get("bandwidth"), dict) else {}
    pairs = bandwidth.get("pairs") if isinstance(bandwidth.get("pairs"), list) else []

    def number(value: Any) -> float | None:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None

    out = []
    for pair in pairs:
        if not isinstance(pair, dict):
            continue
        src, dst = pair.get("src"), pair.get("dst")
        if isinstance(src, int) and isinstance(dst, int) and 0 <= src < 4096 and 0 <= dst < 4096 and src != dst:
            out.append((src, dst, number(pair.get("bandwidth_gbps")), number(pair.get("latency_us"))))
    return out


@dataclass
class FleetRun:
    """A run of the fleet, as the analysis reads it."""

    key: str
    node: str
    job: str
    source: str
    group: str
    run: Run
    warnings: str

    @cached_property
    def curves(self) -> list[Curve]:
        """The run's trusted curves, built once: the verdicts and every export read them."""
        return build_curves(self.run.rows)


class FleetDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.pa = need("pyarrow")
        self.pq = need("pyarrow.parquet")

    # ---------------------------------------------------------------- writing

    @classmethod
    def target(cls, path: str | Path) -> "FleetDir":
        """The fleet at `path` to build into: an existing fleet, or a folder that is absent or
        empty (made by make(), once there is something to write); anything else is refused."""
        folder = Path(path)
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"--out {folder}: not a folder")
        # A build starting in the same new folder holds it by a lock file only: that is empty still.
        if folder.is_dir() and not is_fleet(folder) and any(p.name != LOCK_FILE for p in folder.iterdir()):
            raise UsageError(f"--out {folder}: a folder that is not a fleet and not empty; name a new folder")
        check_dir_target(folder, f"--out {folder}")
        fleet = cls(folder)
        if is_fleet(folder):
            fleet.check()
        return fleet

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the fleet for one build, as a sweep holds its run dir (an flock on the folder,
        the holder named in its lock file): a second build at the same time is refused with the
        holder named, where it would have rewritten the run table without the first's runs. A
        folder this build made and left empty goes with it."""
        made = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--out {self.path}: cannot write there ({exc.strerror})") from None
        held = None
        try:
            held = RunDir(self.path).lock(busy="another fleet build is writing it")
            if is_fleet(self.path):   # made by a build that held it just before
                self.check()
            yield
        finally:
            if held is not None:
                held.release()
            if made:
                try:
                    self.path.rmdir()   # only when empty: nothing was built
                except OSError:
                    pass

    def make(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if not is_fleet(self.path):
                (self.path / MARKER).write_text(json.dumps({"format": FORMAT, "version": VERSION}) + "\n",
                                                encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--out {self.path}: cannot write there ({exc.strerror})") from None

    def check(self) -> None:
        try:
            marker = json.loads((self.path / MARKER).read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            marker = None
        if not isinstance(marker, dict) or marker.get("format") != FORMAT or marker.get("version") != VERSION:
            raise UsageError(f"{self.path / MARKER}: not a commbench fleet of version {VERSION}")

    def next_build(self) -> int:
        return 1 + max([int(p.stem.split("-")[1]) for p in (self.path / MEASUREMENTS).glob("build-*.parquet")
                        if p.stem.split("-")[1].isdigit()] or [0])

    def _write(self, table: Any, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            self.pq.write_table(table, tmp, compression="zstd")
            tmp.replace(path)
        except (OSError, self.pa.ArrowException) as exc:
            tmp.unlink(missing_ok=True)
            # The run table is written last: a build that fails leaves the fleet as it was.
            raise ResultsUnwritable(f"cannot write {path}: {first_line(exc)}; the fleet holds what it held before "
                                    "this build: make room (or make it writable) and build again") from None

    def append(self, runs: Sequence[Loaded], build: int, kept: list[dict[str, Any]]) -> int:
        """Write `runs` as build number `build` after the run rows already `kept`; the rows written."""
        pa = self.pa
        fields = [f.name for f in _FIELDS]
        columns: dict[str, list[Any]] = {name: [] for name in ["run_key", "build", *fields]}
        pairs: dict[str, list[Any]] = {name: [] for name, _ in PAIR_COLUMNS}
        records = []
        now = time.time()
        values_of = operator.attrgetter(*fields)
        targets = [columns[name] for name in fields]
        dicts = [fields.index(name) for name in _DICTS]
        for loaded in runs:
            key = run_key(loaded.node, loaded.job)
            count = 0
            for row in loaded.rows:
                values = list(values_of(row))
                for index in dicts:   # dicts as JSON text: Parquet gets one string column each
                    values[index] = json.dumps(values[index], sort_keys=True) if values[index] else None
                for target, value in zip(targets, values):
                    target.append(value)
                count += 1
            columns["run_key"].extend([key] * count)
            columns["build"].extend([build] * count)
            for src, dst, gbps, us in pairs_of(loaded.info.get("snapshot")):
                for name, value in zip(pairs, (key, build, src, dst, gbps, us)):
                    pairs[name].append(value)
            run = Run(Path(loaded.path), RunInfo.from_dict(loaded.info), loaded.rows)
            origin = provenance.of(run)
            torch, nccl, commbench = _versions(loaded.info)
            records.append({"run_key": key, "build": build, "node": loaded.node, "job": loaded.job,
                            "run_id": loaded.run_id, "source": loaded.source, "kind": origin.kind,
                            "fleet_group": fleet_group(origin), "host": origin.host, "world_size": origin.world_size,
                            "nodes": loaded.info.get("nodes") if isinstance(loaded.info.get("nodes"), int) else None,
                            "gpus": origin.gpus_text(), "gpu_count": origin.gpu_count, "fabric": origin.fabric,
                            "torch": torch, "nccl": nccl, "commbench": commbench, "path": loaded.path, "rows": count,
                            "finished": bool(loaded.info.get("finished")), "warnings": "\n".join(loaded.warnings),
                            "built_at": now, "info_json": json.dumps(loaded.info, sort_keys=True, default=str)})
        name = f"build-{build:06d}.parquet"
        self._write(pa.table(columns, schema=measurement_schema(pa)), self.path / MEASUREMENTS / name)
        if pairs["run_key"]:
            self._write(pa.table(pairs, schema=_schema(pa, PAIR_COLUMNS)), self.path / PAIRS / name)
        table = pa.Table.from_pylist(kept + records, schema=_schema(pa, RUN_COLUMNS))
        self._write(table, self.path / RUNS)   # last: the commit point of this build
        return len(columns["run_key"])

    # ---------------------------------------------------------------- reading

    def _files(self, folder: str) -> list[Path]:
        return sorted((self.path / folder).glob("build-*.parquet"))

    def connect(self, confined: bool = False) -> Any:
        """A DuckDB connection with the views runs, measurements (only rows of a run the run table
        names, from the build that wrote it) and pairs.

        confined (fleet query: SQL the user typed, perhaps from someone else): the connection
        reads the fleet's own Parquet files and nothing else. External access is off, so no
        other file is read or written (read_text, COPY ... TO, ATTACH, INSTALL, the network), no
        spill file is made, and the configuration is locked: no SET gives any of it back."""
        duckdb = need("duckdb")
        con = duckdb.connect()
        runs = (self.path / RUNS).resolve()
        files = {folder: [p.resolve() for p in self._files(folder)] for folder in (MEASUREMENTS, PAIRS)}
        if confined:
            allowed = ", ".join(_quoted(p) for p in [runs, *files[MEASUREMENTS], *files[PAIRS]])
            try:
                for setting in (f"allowed_paths = [{allowed}]", "temp_directory = ''",
                                "autoinstall_known_extensions = false", "autoload_known_extensions = false",
                                "enable_external_access = false", "lock_configuration = true"):
                    con.execute(f"SET {setting}")
            except duckdb.Error as exc:
                raise UsageError(f"fleet query needs DuckDB 1.2 or later, which confines a query to the fleet's own "
                                 f"files (installed: {duckdb.__version__}; {first_line(exc)})") from None
        with self._reading(duckdb):
            con.execute(f"CREATE VIEW runs AS SELECT * FROM read_parquet({_quoted(runs)})")
            for view, folder in (("measurements", MEASUREMENTS), ("pairs", PAIRS)):
                if files[folder]:
                    listed = ", ".join(_quoted(f) for f in files[folder])
                    con.execute(f"CREATE VIEW {view}_all AS SELECT * FROM read_parquet([{listed}], union_by_name=true)")
                    con.execute(f"CREATE VIEW {view} AS SELECT m.*, r.node, r.job, r.fleet_group FROM {view}_all m "
                                "JOIN runs r ON m.run_key = r.run_key AND m.build = r.build")
                elif view == "pairs":
                    con.execute("CREATE VIEW pairs AS SELECT NULL::VARCHAR AS run_key, NULL::BIGINT AS build, "
                                "NULL::BIGINT AS src, NULL::BIGINT AS dst, NULL::DOUBLE AS bandwidth_gbps, "
                                "NULL::DOUBLE AS latency_us WHERE false")
                else:
                    raise UsageError(f"{self.path}: a fleet with no {MEASUREMENTS}/ files (no build finished)")
        return con

    @contextmanager
    def _reading(self, duckdb: Any) -> Iterator[None]:
        """A fleet file DuckDB cannot read (damaged, cut short, not Parquet) is bad input, one line."""
        try:
            yield
        except duckdb.Error as exc:
            raise UsageError(f"{self.path}: a file of the fleet cannot be read ({first_line(exc)})") from None

    def run_records(self) -> list[dict[str, Any]]:
        """The run table as stored (a build writes it back whole, with its runs added)."""
        if not (self.path / RUNS).is_file():
            return []
        try:
            return self.pq.read_table(self.path / RUNS, schema=_schema(self.pa, RUN_COLUMNS)).to_pylist()
        except (OSError, self.pa.ArrowException) as exc:
            raise UsageError(f"{self.path / RUNS}: not a fleet run table ({first_line(exc)})") from None

    def checked_records(self) -> tuple[list[dict[str, Any]], list[str]]:
        """The run table's records that the readers can use, their names cleaned, and a line for
        each one that is not (a field missing or of the wrong type, a run key held twice: the
        first is kept, so that no run is counted twice)."""
        records: list[dict[str, Any]] = []
        problems: list[str] = []
        seen: set[str] = set()
        for index, record in enumerate(self.run_records()):
            problem = _record_problem(record)
            key = record.get("run_key")
            if problem is None and key in seen:
                problem = f"run key {clean_text(key)[:80]!r} again (a run table holds each run once)"
            if problem is not None:
                problems.append(f"{self.path / RUNS}: record {index} skipped: {problem}")
                continue
            seen.add(key)
            records.append({**record, "node": safe_name(record["node"], "unknown"),
                            "job": safe_name(record["job"], "unknown"), "run_key": clean_text(key),
                            "source": clean_text(record["source"] or ""),
                            "fleet_group": clean_text(record["fleet_group"] or ""),
                            "warnings": clean_text(record["warnings"] or "", one_line=False)})
        return records, problems

    def runs(self, keys: Iterable[str] | None = None) -> tuple[list[FleetRun], list[str]]:
        """The fleet's runs (those of `keys`, else all), rows included, and one line per thing that
        was not read (a record, a run.json or a row the files no longer hold whole)."""
        chosen = None if keys is None else set(keys)
        records, problems = self.checked_records()
        records = [r for r in records if chosen is None or r["run_key"] in chosen]
        if not records:
            return [], problems
        duckdb = need("duckdb")
        con = self.connect()
        wanted = [r["run_key"] for r in records]
        rows: dict[str, CompactRows] = {key: CompactRows() for key in wanted}
        bad: dict[str, tuple[int, str]] = {}
        with self._reading(duckdb):
            relation = con.sql("SELECT * EXCLUDE (node, job, fleet_group) FROM measurements "
                               "WHERE list_contains(?, run_key) ORDER BY run_key", params=[wanted])
            # In batches: 3 x 10^5 rows made into dicts at once took 1 GiB; each run's rows are
            # held compactly (CompactRows), as a run dir's are.
            for batch in _batches(relation):
                for data in batch.to_pylist():
                    key = data.pop("run_key")
                    data.pop("build")
                    problem = _decode(data) or row_problem(data)
                    if problem is not None:
                        count, first = bad.get(key, (0, problem))
                        bad[key] = (count + 1, first)
                        continue
                    rows[key].add(Measurement.from_dict(data))
        for held in rows.values():
            held.finish()
        problems += [f"{self.path}: run {key}: skipped {count} stored row(s) that are not rows ({first})"
                     for key, (count, first) in bad.items()]
        out = []
        for record in records:
            info, problem = _stored_info(record["info_json"])
            if info is None:
                problems.append(f"{self.path}: run {record['run_key']}: its stored run.json is bad ({problem}); "
                                "skipped")
                continue
            where = self.path / "runs" / file_stem(record["run_key"].replace("/", "-"))
            out.append(FleetRun(record["run_key"], record["node"], record["job"], record["source"],
                                record["fleet_group"], Run(where, RunInfo.from_dict(info), rows[record["run_key"]]),
                                record["warnings"]))
        return out, problems


def _quoted(path: Path) -> str:
    """A path as a SQL string literal."""
    return "'" + str(path).replace("'", "''") + "'"


def first_line(exc: BaseException) -> str:
    return clean_text(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)[:300]


# The run table's fields every reader uses, with their types (read with the run schema, so a
# stored value is of its column's type or null).
_REQUIRED = {"run_key": str, "node": str, "job": str, "build": int}


def _record_problem(record: dict[str, Any]) -> str | None:
    for field_name, kind in _REQUIRED.items():
        value = record.get(field_name)
        if not isinstance(value, kind) or (kind is str and not value.strip()):
            return f"{field_name} is {clean_text(repr(value))[:40]}, not {'text' if kind is str else 'a number'}"
    if record["build"] < 1:
        return f"build is {record['build']}, not a build number"
    return None


def _stored_info(text: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A stored run.json read as a run dir's is (bounded in size and nesting, its text cleaned,
    its fields checked); (None, why) when it cannot be used."""
    if not isinstance(text, str):
        return None, "missing"
    if len(text) > MAX_RUN_INFO_BYTES:
        return None, f"larger than {MAX_RUN_INFO_BYTES >> 20} MiB"
    try:
        info = loads_json(text, "info_json")
    except UsageError as exc:
        return None, str(exc)
    problem = "not a JSON object" if not isinstance(info, dict) else info_problem(info)
    return (None, problem) if problem else (info, None)


def _batches(relation: Any) -> Iterable[Any]:
    """A DuckDB relation's result as Arrow record batches (duckdb 1.x: arrow() is a table;
    2.x: to_arrow_reader())."""
    reader = getattr(relation, "to_arrow_reader", None) or getattr(relation, "record_batch", None)
    if reader is not None:
        return reader(_BATCH_ROWS)
    return relation.arrow().to_batches(max_chunksize=_BATCH_ROWS)


_BATCH_ROWS = 10_000


def _decode(data: dict[str, Any]) -> str | None:
    """The row's dict columns parsed back from their JSON text, in place; why not, else None."""
    for name in _DICTS:
        text = data[name]
        if text is None:
            data[name] = None if name == "emulation" else {}
            continue
        try:
            data[name] = json.loads(text)
        except (ValueError, TypeError, RecursionError):
            return f"{name} is not JSON"
    return None
