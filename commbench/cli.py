"""`commbench <subcommand>`: one module per subcommand, each with add_arguments and main.

Only the chosen subcommand's module is imported: `commbench --help` imports none, and an
analysis command never pays for torch or the backends (issue 32: every command took 6-18 s).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time

from commbench.errors import (FAILED_EXIT, NO_ROOM, USAGE_EXIT, USAGE_LINE_FILE_VAR,
                              ResultsUnwritable, Terminated, UsageError, write_advice)
from commbench.files import json_alone_on_stdout
from commbench.waits import waits

# name -> (module, one-line help). The help lives here, not in the module, so that
# `commbench --help` lists every subcommand without importing one.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "probe": ("commbench.probe.command",
              "probe the GPUs and the fabric between them: links, P2P, IPC, VMM, multicast, host facts, verdicts"),
    "sweep": ("commbench.sweep.arguments",
              "sweep allreduce sizes x dtypes x eager/graph over every backend that can run here"),
    "report": ("commbench.analysis.report",
               "plots, crossover table, fused vs unfused and a self-contained report.html for one results dir"),
    "floor": ("commbench.analysis.floor",
              "per-token allreduce floor for decode, per model, TP size and concurrency"),
    "recommend": ("commbench.analysis.recommend",
                  "per engine: the allreduce paths it can take here, its default, their costs and the fastest, "
                  "with settings"),
    "engines": ("commbench.analysis.engine_chains",
                "per engine: its allreduce dispatch chain here, each path's gate, limit and source, the default per "
                "decode size; --check PATH compares the built-in engine facts with a release's source"),
    "qualify": ("commbench.analysis.qualify",
                "PASS/WARN/FAIL a results dir against a machine-class spec (exit 1 on FAIL, JUnit XML on request)"),
    "compare": ("commbench.analysis.compare",
                "per backend and size: latency and p99 change between two runs and whether it beats their spread"),
    "table": ("commbench.analysis.table",
              "several runs (e.g. world sizes 2, 4, 8) side by side as markdown: latency per size and backend, "
              "fused saving"),
    "import-nccl-tests": ("commbench.analysis.nccl_tests_import",
                          "read nccl-tests all_reduce_perf output (stdout table or -J JSON) into a commbench "
                          "results dir"),
    "fleet": ("commbench.fleet.command",
              "many runs as one dataset (Parquet): build it, qualify every node with reasons and outliers, query it"),
    "attribute": ("commbench.analysis.attribute",
                  "what a serving trace spends on allreduce, per step and per library, against this box's floor"),
}


# backends/ and topology/ sit beside commbench/ in a checkout and become its sub-packages only when
# installed (pyproject's package-dir), so `python -m commbench` in an uninstalled checkout cannot
# import any subcommand.
LAYOUT_PACKAGES = ("commbench.backends", "commbench.topology")
NOT_INSTALLED = ("commbench: error: this checkout is not installed (its backends/ and topology/ become "
                 "commbench.backends and commbench.topology when it is): pip install -e . in it, or "
                 "bash scripts/quickstart.sh")


def installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in LAYOUT_PACKAGES)


def usage_error(line: str, message: str | None = None) -> None:
    """Bad input: one line on stderr. Under torchrun every rank fails alike, so rank 0 says it;
    a child of the --nproc driver hands `message` to the driver, which says it."""
    if os.environ.get("RANK", "0") != "0":
        time.sleep(waits().usage_error_grace_s)
    elif message is not None and os.environ.get(USAGE_LINE_FILE_VAR):
        try:
            with open(os.environ[USAGE_LINE_FILE_VAR], "w", encoding="utf-8") as handle:
                handle.write(message)
        except OSError:
            print(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input as one line and exit status 2 (its default status)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        usage_error(f"{self.prog}: error: {message}")
        raise SystemExit(USAGE_EXIT)


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand is listed; only `chosen` gets its module imported and its options."""
    parser = _Parser(prog="commbench", description=(
        "GPU allreduce benchmark for tensor-parallel inference: probe the fabric, sweep backends, "
        "and turn the curves into a per-token floor, a backend choice and a qualification."))
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", parser_class=_Parser)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
            sp.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        waits()   # a malformed COMMBENCH_WAITS is bad input before anything else
    except UsageError as exc:
        print(f"commbench: error: {exc}", file=sys.stderr)
        return USAGE_EXIT
    # The top-level parser has no options of its own but -h, so the subcommand is the first word.
    try:
        parser = build_parser(argv[0] if argv else None)
    except ImportError:
        if installed():
            raise
        print(NOT_INSTALLED, file=sys.stderr)
        return FAILED_EXIT
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return USAGE_EXIT
    try:
        with json_alone_on_stdout(getattr(args, "json", None)):
            return int(args._module.main(args, argv[1:]) or 0)
    except UsageError as exc:
        usage_error(f"commbench {args.command}: error: {exc}", str(exc))
        return USAGE_EXIT
    except ResultsUnwritable as exc:
        print(f"commbench {args.command}: error: {exc}", file=sys.stderr)
        return FAILED_EXIT
    except PermissionError as exc:
        # A file or folder the user named that this user may not read or write (an unreadable
        # run dir, say): bad input wherever it surfaces, never a commbench fault.
        usage_error(f"commbench {args.command}: error: {exc.filename}: {exc.strerror}")
        return USAGE_EXIT
    except KeyboardInterrupt:
        print(f"commbench {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated as exc:   # SIGTERM or SIGHUP: whoever sent it (torchrun, the driver) says why
        return 128 + exc.signum
    except BrokenPipeError:  # output piped into `head` and the like: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        # The environment failed a file (a full disk under --out, a lost mount): one line, and
        # exit 1, since the input was fine.
        advice = f"; {write_advice(exc)}" if exc.errno in NO_ROOM else ""
        print(f"commbench {args.command}: error: {exc.filename or 'a file'}: {exc.strerror or exc}{advice}",
              file=sys.stderr)
        return FAILED_EXIT
