"""--plot FILE.png: the topology (GPUs grouped by NUMA node, edges by link type) and, when the
snapshot has them, heatmaps of copy bandwidth and small-copy latency. Reads the dict only."""

from __future__ import annotations

import math
from typing import Any

from commbench.errors import UsageError
from commbench.topology.selection import is_nvlink

EDGE_STYLE = {  # link class -> (colour, line width, line style)
    "NVLink": ("tab:green", 2.5, "-"),
    "PCIe switch (PIX/PXB)": ("tab:blue", 1.8, "-"),
    "host bridge / same NUMA (PHB/NODE)": ("tab:orange", 1.2, "--"),
    "across sockets (SYS)": ("tab:red", 1.0, ":"),
    "other": ("grey", 0.8, ":"),
}


def link_class(label: str) -> str:
    if is_nvlink(label):
        return "NVLink"
    if label in ("PIX", "PXB"):
        return "PCIe switch (PIX/PXB)"
    if label in ("PHB", "NODE"):
        return "host bridge / same NUMA (PHB/NODE)"
    if label == "SYS":
        return "across sockets (SYS)"
    return "other"


def gpu_positions(gpus: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """One column block per NUMA node, GPUs stacked two wide inside it."""
    groups: dict[Any, list[int]] = {}
    for g in gpus:
        groups.setdefault((g.get("host"), g.get("numa_node")), []).append(g["index"])
    pos: dict[int, tuple[float, float]] = {}
    x0 = 0.0
    for members in groups.values():
        for k, idx in enumerate(members):
            pos[idx] = (x0 + (k % 2) * 1.2, -(k // 2) * 1.2)
        x0 += 3.5
    return pos


def draw_topology(ax: Any, s: dict[str, Any]) -> None:
    from matplotlib.patches import FancyBboxPatch

    gpus = s.get("gpus") or []
    matrix = (s.get("links") or {}).get("matrix") or []
    pos = gpu_positions(gpus)
    used: set[str] = set()
    switch = (s.get("links") or {}).get("nvswitch")
    if switch and pos:
        xs = [p[0] for p in pos.values()]
        sw = (sum(xs) / len(xs), max(p[1] for p in pos.values()) + 1.6)
        ax.add_patch(FancyBboxPatch(
            (sw[0] - 0.8, sw[1] - 0.25), 1.6, 0.5, boxstyle="round,pad=0.05", fc="honeydew", ec="tab:green"))
        ax.text(*sw, "NVSwitch", ha="center", va="center", fontsize=8)
        for idx, (x, y) in pos.items():
            ax.plot([x, sw[0]], [y, sw[1]], color="tab:green", lw=2.5)
        used.add("NVLink")
    for i, row in enumerate(matrix):
        for j, label in enumerate(row):
            if j <= i or i not in pos or j not in pos or (switch and is_nvlink(label)):
                continue
            cls = link_class(label)
            colour, width, style = EDGE_STYLE[cls]
            (x1, y1), (x2, y2) = pos[i], pos[j]
            ax.plot([x1, x2], [y1, y2], color=colour, lw=width, ls=style, alpha=0.8)
            ax.text((x1 + x2) / 2, (y1 + y2) / 2, label, fontsize=6, color=colour, ha="center")
            used.add(cls)
    for g in gpus:
        if g["index"] not in pos:
            continue
        x, y = pos[g["index"]]
        ax.scatter([x], [y], s=900, c="white", edgecolors="black", zorder=3)
        ax.text(x, y, f"GPU{g['index']}", ha="center", va="center", fontsize=8, zorder=4)
        ax.text(x, y - 0.38, f"NUMA {g.get('numa_node')}", ha="center", va="top", fontsize=6, zorder=4)
    for cls in sorted(used):
        colour, width, style = EDGE_STYLE[cls]
        ax.plot([], [], color=colour, lw=width, ls=style, label=cls)
    if used:
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, -0.3), fontsize=7, ncol=2)
    ax.set_title("Topology (grouped by NUMA node)")
    ax.set_aspect("equal", adjustable="datalim")
    ax.axis("off")
    if not gpus:
        ax.text(0.5, 0.5, "no CUDA GPU", ha="center", va="center", transform=ax.transAxes)


def heatmap(ax: Any, s: dict[str, Any], field: str, title: str, cmap: str) -> None:
    pairs = (s.get("bandwidth") or {}).get("pairs") or []
    n = len(s.get("gpus") or [])
    grid = [[math.nan] * n for _ in range(n)]
    for p in pairs:
        if p.get(field) is not None and p.get("src") is not None and p.get("dst") is not None:
            grid[p["src"]][p["dst"]] = p[field]
    im = ax.imshow(grid, cmap=cmap)
    for i in range(n):
        for j in range(n):
            if not math.isnan(grid[i][j]):
                ax.text(j, i, f"{grid[i][j]:.3g}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlabel("destination GPU")
    ax.set_ylabel("source GPU")
    ax.set_title(title)
    ax.figure.colorbar(im, ax=ax, fraction=0.046)


def plot_snapshot(s: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_bw = bool((s.get("bandwidth") or {}).get("pairs"))
    fig, axes = plt.subplots(1, 3 if has_bw else 1, figsize=(16 if has_bw else 7, 5.5), squeeze=False)
    draw_topology(axes[0][0], s)
    if has_bw:
        heatmap(axes[0][1], s, "bandwidth_gbps", "copy bandwidth (GB/s)", "viridis")
        heatmap(axes[0][2], s, "latency_us", "small-copy latency (us)", "magma_r")
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)
