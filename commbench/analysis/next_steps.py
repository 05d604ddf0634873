"""The whole commands the analysis prints as a user's next step, built in one place so that each is
one the tool accepts as printed (tests/system/test_hints.py collects every command the analysis
commands print and puts it through the tool's own argument checks).

A command inside a sentence is written between backticks (`inline`), which render.prose never
breaks; a command on a line of its own is indented, as a paste block is."""

from __future__ import annotations

import shlex
from typing import Iterable

from commbench.models import DEFAULT_CONCURRENCIES, Model


def inline(command: str) -> str:
    """A command inside a sentence."""
    return f"`{command}`"


def sweep_command(model: Model, ranks: int | None, tokens: Iterable[int] = (),
                  prefill_tokens: Iterable[int] = ()) -> str:
    """The sweep on the serving box, one process per GPU, that measures `model`'s decode sizes (the
    default token counts, and any of `tokens` beyond them) and the prefill chunks given. With the
    world size unknown, torchrun starts one process per GPU of the box (`--nproc-per-node gpu`)."""
    wanted = sorted(set(tokens) - set(DEFAULT_CONCURRENCIES))
    decode = sorted({*DEFAULT_CONCURRENCIES, *wanted})
    words = ["torchrun", "--nproc-per-node", str(ranks) if ranks else "gpu", "-m", "commbench", "sweep"]
    if model.key == "custom":
        words += ["--tokens", _ints(decode), "--hidden", str(model.hidden), "--dtype", model.dtype]
    else:
        words += ["--model", model.key]
        if wanted:
            words += ["--tokens", _ints(decode)]
    if ranks and model.key != "custom":   # --tp names a preset's TP size
        words += ["--tp", str(ranks)]
    prefill = sorted(set(prefill_tokens) - set(decode))
    if prefill:
        words += ["--prefill-tokens", _ints(prefill)]
    return shlex.join(words)


def dtype_sweep_command(ranks: int, dtype: str) -> str:
    """The default sweep of one dtype at a world size (no model: its sizes are nccl-tests')."""
    return shlex.join(["torchrun", "--nproc-per-node", str(ranks), "-m", "commbench", "sweep", "--dtype", dtype])


def qualify_sweep_command(spec_path: str, ranks: int | None) -> str:
    """The sweep that measures every size a qualify spec checks, and qualifies its run."""
    return shlex.join(["torchrun", "--nproc-per-node", str(ranks) if ranks else "gpu", "-m", "commbench", "sweep",
                       "--qualify", spec_path])


def engines_command(run_dir: str, engine: str, tp: int | None) -> str:
    """The engine's chain on the run's box with each path's gate, limit and the source of its rule."""
    return shlex.join(["commbench", "engines", run_dir, "--engine", engine, *(["--tp", str(tp)] if tp else [])])


def probe_command(*flags: str, json_file: str = "probe.json") -> str:
    """The probe that writes a snapshot file other commands read (qualify --snapshot,
    import-nccl-tests --snapshot)."""
    return shlex.join(["commbench", "probe", *flags, "--json", json_file])


def import_command(logs: Iterable[str], snapshot: str, out: str) -> str:
    """The nccl-tests logs imported again with the probe snapshot of their box: it records the box
    in the run they were imported to (its engine answers then read the box's gates)."""
    return shlex.join(["commbench", "import-nccl-tests", *logs, "--snapshot", snapshot, "--out", out])


def _ints(values: Iterable[int]) -> str:
    return ",".join(str(v) for v in values)
