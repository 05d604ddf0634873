"""`commbench <subcommand>`: one module per subcommand, each with HELP, add_arguments, main."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

from commbench.errors import FAILED_EXIT, TERMINATED_EXIT, USAGE_EXIT, ResultsUnwritable, Terminated, UsageError

# Seconds the other ranks wait after bad input, so that rank 0's line is out before torchrun
# stops every worker (it does so as soon as the first one exits).
USAGE_ERROR_GRACE_S = 2.0

SUBCOMMANDS: dict[str, str] = {
    "probe": "commbench.topology.command",
    "sweep": "commbench.sweep.command",
    "report": "commbench.analysis.report",
    "floor": "commbench.analysis.floor",
    "recommend": "commbench.analysis.recommend",
    "qualify": "commbench.analysis.qualify",
    "compare": "commbench.analysis.compare",
    "table": "commbench.analysis.table",
    "import-nccl-tests": "commbench.analysis.nccl_tests_import",
}


def usage_error(line: str) -> None:
    """Bad input: one line on stderr. Under torchrun every rank fails alike, so rank 0 says it."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)
    else:
        time.sleep(USAGE_ERROR_GRACE_S)


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input as one line and exit status 2 (its default status)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        usage_error(f"{self.prog}: error: {message}")
        raise SystemExit(USAGE_EXIT)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="commbench", description=(
        "GPU allreduce benchmark for tensor-parallel inference: probe the fabric, sweep backends, "
        "and turn the curves into a per-token floor, a backend choice and a qualification."))
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", parser_class=_Parser)
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sp)
        sp.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args._argv = argv[1:]  # the subcommand's own arguments, for the sweep driver's children
    if not getattr(args, "command", None):
        parser.print_help()
        return USAGE_EXIT
    try:
        return int(args._module.main(args) or 0)
    except UsageError as exc:
        usage_error(f"commbench {args.command}: error: {exc}")
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
    except Terminated:   # SIGTERM: whoever sent it (torchrun, the driver) says why
        return TERMINATED_EXIT
    except BrokenPipeError:  # output piped into `head` and the like: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        # The environment failed a file (a full disk under --out, a lost mount): one line, and
        # exit 1, since the input was fine.
        print(f"commbench {args.command}: error: {exc.filename or 'a file'}: {exc.strerror or exc}", file=sys.stderr)
        return FAILED_EXIT
