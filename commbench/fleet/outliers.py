"""The fleet's outlier rule: a node against the median of its group's nodes, robustly.

A value is an outlier when it lies further from the group's median than both k x 1.4826 x MAD
(the median absolute deviation scaled to a normal sigma: the modified z-score of Iglewicz and
Hoaglin, who flag |z| > 3.5) and a minimum effect (a percentage of the median), on the bad side
only (slower latency, lower bandwidth). MAD, unlike a standard deviation, is not pulled by the
very outlier it is looking for; the minimum effect keeps a tight fleet's harmless 2 % from
failing a node. Fewer than min_nodes nodes measuring a point are not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from commbench.analysis.render import fmt_us

MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class Rule:
    k: float = 3.5
    min_effect_pct: float = 10.0
    min_nodes: int = 3

    def text(self) -> str:
        return (f"outlier = worse than the group's median by more than {self.k:g} x 1.4826 x MAD and by more than "
                f"{self.min_effect_pct:g}% of the median (slower latency, lower bandwidth), among >= {self.min_nodes} "
                "nodes measuring the same backend, dtype, mode and size; groups (kind, ranks, GPUs, fabric) are never "
                "compared with each other")

    def to_dict(self) -> dict[str, float | int | str]:
        return {"k": self.k, "min_effect_pct": self.min_effect_pct, "min_nodes": self.min_nodes, "text": self.text()}


@dataclass(frozen=True)
class Finding:
    name: str            # the node (run key) whose value is out
    value: float
    median: float
    limit: float         # the value the rule allows at most (latency) or at least (bandwidth)


def limit(values: list[float], rule: Rule, higher_is_worse: bool) -> tuple[float, float] | None:
    """(median, limit) of a point measured by these nodes; None with too few of them."""
    if len(values) < rule.min_nodes:
        return None
    middle = median(values)
    sigma = MAD_TO_SIGMA * median(abs(v - middle) for v in values)
    effect = abs(middle) * rule.min_effect_pct / 100.0
    spread = max(rule.k * sigma, effect)
    return middle, (middle + spread if higher_is_worse else middle - spread)


def outliers(values: dict[str, float], rule: Rule, higher_is_worse: bool = True) -> list[Finding]:
    """The names whose value is out by the rule, worst first."""
    found = limit(list(values.values()), rule, higher_is_worse)
    if found is None:
        return []
    middle, bound = found
    out = [Finding(name, value, middle, bound) for name, value in values.items()
           if (value > bound if higher_is_worse else value < bound)]
    return sorted(out, key=lambda f: -abs(f.value - middle))


def shown(value: float, unit: str) -> str:
    """A compared value as the output prints it: microseconds as every latency table does."""
    return fmt_us(value) if unit == "us" else f"{value:.3g}"
