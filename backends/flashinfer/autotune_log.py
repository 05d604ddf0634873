"""What FlashInfer's autotuner says while it tunes PCIe IPC: the candidates that failed (from its DEBUG log),
the tuned table it saved and the launch configuration each shape runs, as row fields."""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


PROFILE_FAILURE = "due to failure while profiling: "   # the autotuner's DEBUG line for a candidate that raised


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("[Autotuner]: Skipping tactic") and PROFILE_FAILURE in message:
            self.errors.append(message.split(PROFILE_FAILURE, 1)[1])


def _set_level(logger: logging.Logger, level: int) -> None:
    # FlashInfer's logger is built directly, not by logging.getLogger, so setLevel cannot reach
    # its cache of isEnabledFor answers: clear it, or an earlier answer outlives the new level.
    logger.setLevel(level)
    getattr(logger, "_cache", {}).clear()


@contextmanager
def profiling_failures(logger: logging.Logger) -> Iterator[list[str]]:
    """The errors of the candidates FlashInfer's autotuner failed to profile, collected while the
    block runs: it says why only at DEBUG, so the logger goes to DEBUG for the block while its
    own handlers keep printing what they printed before."""
    collect = _Collect()
    saved_level = logger.level
    saved_handlers = [(handler, handler.level) for handler in logger.handlers]
    for handler, level in saved_handlers:
        handler.setLevel(max(level, logger.getEffectiveLevel()))
    logger.addHandler(collect)
    _set_level(logger, logging.DEBUG)
    try:
        yield collect.errors
    finally:
        logger.removeHandler(collect)
        _set_level(logger, saved_level)
        for handler, level in saved_handlers:
            handler.setLevel(level)


PROFILE_ERROR_CHARS = 1000     # per distinct error kept on a row: a failed JIT build's is ninja's whole output


def clip(text: str, limit: int = PROFILE_ERROR_CHARS) -> str:
    """The text, or its start and end when longer than limit (a compiler's first error comes
    first, ninja's verdict last)."""
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]} ... {text[-half:]}"


def failure_summary(errors: list[str]) -> dict[str, Any]:
    """How many candidate profiles failed, and the distinct errors (the first three, clipped)."""
    return {"profile_failures": len(errors), "profile_errors": [clip(e) for e in list(dict.fromkeys(errors))[:3]]}


def saved_configs(cache: str | None) -> int | None:
    """How many tuned configurations FlashInfer's tune cache holds (its keys other than the
    ``_metadata``-style ones); 0 when it wrote none or no file. None without a path of ours:
    FlashInfer's default file may hold other runs' entries, so its count would not say what
    this tuning kept."""
    if cache is None:
        return None
    try:
        table = json.loads(Path(cache).read_text())
    except (OSError, ValueError):
        return 0
    return sum(1 for key in table if not key.startswith("_")) if isinstance(table, dict) else 0


def describe_config(config: Any) -> str | None:
    """An IpcLaunchConfig (blocks, threads, variant) as one short string; None if unsupported."""
    if config is None:
        return None
    variant = getattr(config.variant, "name", config.variant)
    return f"{variant} blocks={config.blocks} threads={config.threads}"


def launch_choice(config: Any, seed: Any) -> dict[str, Any]:
    """A shape's row fields: the configuration it runs, the seed, and whether they are one.
    tune() hands back the seed for a bucket whose every candidate failed, so "runs the seed" is
    what holds whether the seed won or nothing did."""
    ran, seeded = describe_config(config), describe_config(seed)
    return {"pcie_ipc_config": ran, "pcie_ipc_seed": seeded, "pcie_ipc_runs_seed": ran == seeded}
