"""Fused rows (allreduce + residual + RMSNorm) answer a model only at its shape, tokens x hidden:
the decode curves of GLM-5 (hidden 6144) never hold a row of another hidden with the same bytes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from commbench import models
from commbench.analysis.curves import decode_curves, price
from commbench.ops import FUSED_OP
from commbench.runs import load_run
from factories import STAND_IN_US, fused_run

GLM5 = models.lookup("glm-5")        # hidden 6144, bf16, 78 layers x 2 = 156 allreduces per token


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same run with and without the stand-in, each in a folder named `run` (the outputs name it)."""
    root = tmp_path_factory.mktemp("fused")
    return fused_run(root / "with" / "run"), fused_run(root / "without" / "run", stand_ins=False)


def test_fused_rows_answer_a_model_only_at_its_shape(runs: tuple[Path, Path]) -> None:
    run = load_run(runs[0])
    stand_in = next(c for c in decode_curves(run, 8, "bf16", "auto", GLM5) if c.key.variant == "p2p:fused")
    # 6 x 7168 has the bytes of 7 x 6144, and the row claiming 2 tokens has 8 tokens' bytes: neither counts
    assert [(p.message_bytes, p.latency_us) for p in stand_in.points] == \
        [(t * 6144 * 2, us) for t, us in STAND_IN_US["p2p:fused"].items()]
    at7 = price(stand_in, GLM5.message_bytes(7))
    # between 1 token (4.00 us) and 8 (6.00) in log-log: 4 x 1.5^(ln 7 / ln 8) = 5.85 us, never the 7168 row's 1.0
    assert at7.how == "interpolated" and at7.latency_us == pytest.approx(4.0 * 1.5 ** (math.log(7) / math.log(8)))
    deepseek = decode_curves(run, 8, "bf16", "auto", models.lookup("deepseek-v3"))   # hidden 7168
    fused = [c for c in deepseek if c.key.op == FUSED_OP]
    assert [(c.key.variant, [p.latency_us for p in c.points]) for c in fused] == [("p2p:fused", [1.0])]
