"""The ops a row can measure, named once: the sweep's backends, the rows they write, the engines'
paths and the analysis all use these names (a row's `op` is one of them, or an imported
nccl-tests reduction such as "allreduce_max")."""

from __future__ import annotations

ALLREDUCE = "allreduce"                            # out = the sum over ranks of x
FUSED_OP = "allreduce_residual_rmsnorm"            # allreduce, + residual, RMSNorm (one fused kernel)

# Ops whose work depends on the message's shape, not only its bytes (the norm is per token of
# `hidden` elements): their rows answer a model's question only at its hidden size, matched by
# tokens and hidden.
SHAPED_OPS = (FUSED_OP,)

# How outputs name an op.
OP_WORDS = {ALLREDUCE: "allreduce", FUSED_OP: "allreduce + residual add + RMSNorm"}
