"""The types of the nested tables of run.json the analysis acts on: the probe snapshot (also read
from `probe --from` and `qualify --snapshot` files) and each backend's recorded engine settings.

Checked where the file is read (commbench.results.validate.info_problem, and the snapshot file
reader), so that the probe's renderers, recommend, floor and qualify never meet a list where a
table belongs. A schema is a scalar kind ("int", "number", "text", "bool"), a list [schema], a
table {field: schema} (a field may be absent, unless its name starts with "!", or with "+" in a
snapshot file: the probe's renderers read those; fields it does not name are not used, so not
checked), Table(schema) for a table whose keys are free, Null(schema) for a value that may also
be null, or "any". A wrong value is named with its path: `gpus[3].pcie.gen_max is 'x', not a whole
number`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from commbench.results.text import clean_text

MAX_INDEX = 1 << 20     # GPU indices, ranks, participants: as many as a world has ranks
MAX_WHOLE = 1 << 62     # counters (words, ECC errors, memory sizes)


@dataclass(frozen=True)
class Table:
    """A table whose keys are free (software versions, hosts, attributes)."""
    value: Any


@dataclass(frozen=True)
class Null:
    """The schema, or null."""
    value: Any


_KINDS = {"any": "", "int": "a whole number", "index": "a whole number from 0", "number": "a finite number",
          "text": "text", "bool": "true or false"}


def _short(value: Any) -> str:
    text = clean_text(repr(value))
    return text if len(text) <= 40 else text[:37] + "..."


def _scalar_fits(value: Any, kind: str) -> bool:
    if kind == "any":
        return True
    if kind == "bool":
        return value.__class__ is bool
    if kind == "text":
        return isinstance(value, str)
    if value.__class__ is bool or not isinstance(value, (int, float)):
        return False
    if kind == "number":
        return math.isfinite(value)
    if kind == "index":
        return isinstance(value, int) and 0 <= value <= MAX_INDEX
    return isinstance(value, int) and -MAX_WHOLE <= value <= MAX_WHOLE


def problem(value: Any, schema: Any, where: str, whole: bool = False) -> str | None:
    """The first value that does not fit schema, named by its path; None when all fit. whole: a
    snapshot file as the probe writes it, whose "+" fields are there too."""
    if isinstance(schema, Null):
        return None if value is None else problem(value, schema.value, where, whole)
    if isinstance(schema, str):
        return None if _scalar_fits(value, schema) else f"{where} is {_short(value)}, not {_KINDS[schema]}"
    if isinstance(schema, list):
        if not isinstance(value, list):
            return f"{where} is {_short(value)}, not a list"
        return next(filter(None, (problem(item, schema[0], f"{where}[{i}]", whole)
                                  for i, item in enumerate(value))), None)
    if not isinstance(value, dict):
        return f"{where} is {_short(value)}, not a table"
    if isinstance(schema, Table):
        return next(filter(None, (problem(item, schema.value, f"{where}.{clean_text(str(key))[:40]}", whole)
                                  for key, item in value.items())), None)
    for key, part in schema.items():
        name = key.lstrip("!+")
        path = f"{where}.{name}" if where else name
        if name not in value:
            if key.startswith("!") or (whole and key.startswith("+")):
                return f"{path} is missing"
            continue
        wrong = problem(value[name], part, path, whole)
        if wrong:
            return wrong
    return None


_PCIE = {"gen_current": "int", "gen_max": "int", "width_current": "int", "width_max": "int", "replay_counter": "int"}
_STATUS = {"!status": "text", "detail": Null("text")}
_PAIR = {"+src": "index", "+dst": "index"}
_EXPORTS = {"tested": "bool", "exports": [{"!participant": "index", **_STATUS}],
            "pairs": [{"!owner": "index", "!writer": "index", **_STATUS}]}

SNAPSHOT: dict[str, Any] = {
    "kind": "text", "schema": "int", "mode": "text", "world_size": "index", "shares_gpus": "bool",
    "taken_at": "text", "notes": ["text"],
    "gpus": [{
        "+index": "index", "cuda_ordinal": "index", "nvml_index": "index", "name": "text", "uuid": "text",
        "pci_bus_id": "text", "+host": "text", "compute_capability": "text", "cpu_affinity": "text",
        "numa_node": "int", "sm_count": "int", "memory_total_mib": "int", "bar1_total_mib": "int",
        "fabric_state": Null("int"), "pcie": Null(_PCIE), "attributes": Table("int"),
        "nvlink": Null({"links_active": "int", "links_total": "int", "to_switch": "int"}),
        "ecc": Null({"enabled": Null("bool"), "remap_failed": Null("bool"), "remap_pending": Null("bool"),
                     "retired_pages_pending": Null("bool"), "retired_pages": Null("int"),
                     "aggregate_uncorrected": Null("int"), "volatile_corrected": Null("int"),
                     "volatile_uncorrected": Null("int"), "remapped_rows_uncorrectable": Null("int")}), "aer": Null(Table(Null(Table("any")))),
        "nvml_errors": Table("text"),
    }],
    "participants": [{"!id": "index", "!gpu": "index", "device": "index", "host": "text", "rank": Null("index")}],
    "p2p": [{**_PAIR, "can_access_peer": "bool", "nvml": Null(Table("text")),
             "write_verify": Null({"status": "text", "detail": "text", "words": "int", "wrong_words": "int"}),
             "enable_peer_access": Null(_STATUS)}],
    "links": {"matrix": [["text"]], "nvswitch": "bool", "source": Null("text"), "error": Null("text")},
    "pcie_paths": [{"+a": "index", "+b": "index",
                    "bridges": [{"+bdf": "text", "acs_ctl": "text", "req_redir": "bool", "cmplt_redir": "bool",
                                 "flags": ["text"], "error": "text", "acs": "text"}]}],
    "software": {"packages": Null(Table("text"))},
    "backend_software": Table(Null("text")),
    "hosts": Table({"hostname": "text", "cpu": "text", "cpu_count": "int", "kernel": "text", "cmdline": "text",
                    "aspm_policy": "text", "uvm_disable_hmm": "text", "numa_nodes": Table("text"),
                    "numa_sockets": Table("int"), "iommu": {"mode": "text", "source": "text"},
                    "nvidia_module": Table(Null("text"))}),
    "ipc": _EXPORTS, "vmm": _EXPORTS,
    "multicast": {"attribute": Table("int"), "functional": _STATUS},
    "bandwidth": Null({"method": "text", "pairs": [{**_PAIR, "+bandwidth_gbps": "number",
                                                    "+latency_us": "number", "peer_access": "bool"}]}),
    "sm_peer": Null({"method": "text", "pairs": [{**_PAIR, "status": "text", "load_gbps": Null("number"),
                                                  "store_gbps": Null("number"), "read_latency_us": Null("number")}]}),
    "link_under_load": Null([{"gpu": "index", "during": "text", **_PCIE}]),
    "nccl_checks": Null([{"host": "text", "gpus": ["index"], "ab": [Table("any")], "topology": Table("any")}]),
    "errors": [{"host": "text", "step": "text", "detail": "text", "timed_out": "bool"}],
    "options": Table("any"),
}

_ENV = Table("text")
ENGINE_SETTINGS: dict[str, Any] = {
    "variant": "text", "nccl_env": _ENV, "vllm_env": _ENV, "sglang_env": _ENV, "vllm_flags": ["text"],
    "sglang_flags": ["text"], "notes": ["text"], "vllm_supported": "bool", "sglang_supported": "bool",
    "engine_paths": Table({"path": "text", "stand_in": "bool"}), "preload": "text",
}
BACKEND_FACTS = Table({"family": "text", "needs": ["text"], "engine_settings": Null(ENGINE_SETTINGS)})


def snapshot_problem(snapshot: Any, whole: bool = False) -> str | None:
    """What is wrong with a probe snapshot (a type, or a participant on a GPU it does not list);
    whole: a snapshot file (probe --from, qualify --snapshot), whose renderers read every field
    the probe writes; run.json's may be a part of one."""
    wrong = problem(snapshot, SNAPSHOT, "", whole)
    if wrong or not snapshot.get("gpus"):
        return wrong
    indices = {gpu.get("index") for gpu in snapshot["gpus"]}
    for i, participant in enumerate(snapshot.get("participants") or []):
        if participant["gpu"] not in indices:
            return f"participants[{i}].gpu is {participant['gpu']}, a GPU the snapshot does not list"
    return None
