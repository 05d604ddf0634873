"""NCCL's own view of the box (pure): its topology dump (NCCL_TOPO_DUMP_FILE) and the graphs
it searched (NCCL_GRAPH_DUMP_FILE), parsed from the XML NCCL writes.

Attribute names follow NCCL's xml.cc / search.cc (ncclTopoGetXmlFromGraphs, 2.2x-2.3x): a
<graphs> root with one <graph id pattern crossnic nchannels speedintra speedinter latencyinter
typeintra typeinter samechannels> per algorithm, each holding its <channel>s; a <system> root
with <cpu numaid vendor familyid modelid> nodes holding <pci> trees and <gpu dev rank> leaves.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any

# NCCL_TOPO_PATTERN_* (src/include/graph.h)
PATTERNS = {1: "balanced tree", 2: "split tree", 3: "tree", 4: "ring", 5: "NVLS", 6: "CollNet direct"}
RING, TREES = 4, (1, 2, 3)


class NcclXmlError(ValueError):
    """The dump is not XML NCCL wrote (truncated by a kill, or empty)."""


@dataclass(frozen=True)
class Graph:
    pattern: int
    nchannels: int
    speed_intra_gbps: float   # NCCL's per-channel bandwidth estimate inside the node
    type_intra: str           # the farthest path a channel takes: LOC, NVL, PIX, PXB, PHB, SYS, ...
    type_inter: str

    @property
    def name(self) -> str:
        return PATTERNS.get(self.pattern, f"pattern {self.pattern}")


def _root(text: str, tag: str) -> ET.Element:
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise NcclXmlError(f"not valid XML ({exc})") from None
    if root.tag != tag:
        raise NcclXmlError(f"root element is <{root.tag}>, expected <{tag}>")
    return root


def _number(node: ET.Element, name: str, kind: type = int) -> Any:
    try:
        return kind(node.get(name, "0"))
    except ValueError:
        raise NcclXmlError(f"<{node.tag}> {name}={node.get(name)!r} is not a number") from None


def parse_graphs(text: str) -> list[Graph]:
    """Every <graph> of a graph dump."""
    return [Graph(_number(g, "pattern"), _number(g, "nchannels"), _number(g, "speedintra", float),
                  g.get("typeintra", "?"), g.get("typeinter", "?"))
            for g in _root(text, "graphs").iter("graph")]


def parse_topology(text: str) -> dict[str, Any]:
    """CPUs (NUMA id, vendor) and the GPUs NCCL placed under each."""
    cpus = []
    for cpu in _root(text, "system").iter("cpu"):
        cpus.append({"numaid": cpu.get("numaid"), "vendor": cpu.get("vendor"), "arch": cpu.get("arch"),
                     "familyid": cpu.get("familyid"), "modelid": cpu.get("modelid"),
                     "gpus": [int(g.get("dev", "-1")) for g in cpu.iter("gpu")]})
    return {"cpus": cpus, "gpu_count": sum(len(c["gpus"]) for c in cpus)}
