"""The NCCL each variant's processes loaded, from its rows (extra.nccl_version_loaded /
nccl_lib_loaded): report and compare both say it."""

from __future__ import annotations

from typing import Iterable

from commbench.analysis.curves import variant_label
from commbench.results import Measurement


def nccl_versions(rows: list[Measurement]) -> dict[str, dict[str, list[str]]]:
    """Per variant label (backend[env setting]): the NCCL versions and library files its rows
    say their processes ran (extra.nccl_version_loaded / nccl_lib_loaded), for variants that
    recorded one. Two NCCL versions side by side are told apart here."""
    found: dict[str, dict[str, list[str]]] = {}
    for row in rows:
        add_nccl(found, row)
    return found


def add_nccl(found: dict[str, dict[str, list[str]]], row: Measurement) -> None:
    version, lib = row.extra.get("nccl_version_loaded"), row.extra.get("nccl_lib_loaded")
    if version is None and lib is None:
        return
    entry = found.setdefault(variant_label(row), {"versions": [], "libraries": []})
    for key, value in (("versions", version), ("libraries", lib)):
        if value is not None and value not in entry[key]:
            entry[key].append(str(value))


def nccl_version_lines(rows: Iterable[Measurement]) -> list[str]:
    """'variant: NCCL 2.29.7 (/path/libnccl.so.2)', one line per variant that recorded its NCCL."""
    return nccl_lines(nccl_versions(rows))


def nccl_lines(entries: dict[str, dict[str, list[str]]]) -> list[str]:
    return [f"{label}: NCCL {', '.join(entry['versions']) or '?'} ({', '.join(entry['libraries']) or '?'})"
            for label, entry in sorted(entries.items())]
