"""nccl-tests' flags that `commbench sweep` does not take: one line each naming the commbench
equivalent, or why there is none, instead of argparse's bare "unrecognized arguments".

Meanings are nccl-tests v2.19.6's (src/common.cu); docs/nccl-tests.md has the whole table.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

# letter -> what to do in commbench instead
ANSWERS: dict[str, str] = {
    "-t": "nccl-tests' threads per process: commbench runs one process per GPU, as engines do "
          "(torchrun --nproc-per-node N, or --nproc N)",
    "-g": "nccl-tests' GPUs per thread: commbench drives one GPU per process, picked by LOCAL_RANK "
          "(torchrun --nproc-per-node N)",
    "-i": "nccl-tests' additive step: list the sizes instead (--sizes 8K,12K,16K)",
    "-m": "nccl-tests' calls per group: calls in one group are not one call's latency; commbench times single calls",
    "-N": "nccl-tests' run cycles: run the sweep again and compare the runs (commbench compare RUN_A RUN_B)",
    "-p": "nccl-tests' parallel init: threads only; commbench runs one process per GPU",
    "-o": "nccl-tests' reduction op: commbench times allreduce sum only (fused allreduce+RMSNorm is a backend)",
    "-r": "nccl-tests' root: commbench runs no rooted collective",
    "-z": "nccl-tests' blocking mode: commbench never synchronises calls one by one inside a timed pass",
    "-y": "nccl-tests' NULL stream: each backend runs on the stream it uses in an engine",
    "-C": "nccl-tests' host enqueue time: commbench times on the device (CUDA events), never enqueue time",
    "-S": "nccl-tests' timestamps: every commbench row has a timestamp already",
    "-J": "nccl-tests' JSON output: every row is in the run dir's measurements.jsonl (and .csv) already",
    "-a": "nccl-tests' cross-rank average: commbench records both, latency_us (slowest rank, -a 3) and "
          "latency_rank_mean_us (mean, -a 1)",
    "-R": "nccl-tests' buffer registration: sweep the backend variant nccl:symm (symmetric windows, -R 2)",
    "-x": "nccl-tests' CTA policy: a process setting, --env NCCL_CTA_POLICY=V1,V2 (one torchrun per value)",
    "-D": "nccl-tests' device-API kernels: none in commbench",
    "-V": "nccl-tests' device-API kernels: none in commbench",
    "-M": "nccl-tests' memory report: none in commbench",
    "-u": "nccl-tests' unaligned buffers: commbench aligns buffers as an engine does",
    "-I": "nccl-tests' per-iteration timing: always on in commbench (the jitter pass times every call)",
    "-K": "nccl-tests' per-iteration timing: always on in commbench (the jitter pass times every call)",
}


class _Answer(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is not a commbench sweep flag: {ANSWERS[str(option_string)]}")


def add_arguments(parser: argparse.ArgumentParser, taken: Sequence[str] = ()) -> None:
    """Each nccl-tests letter the parser does not take, hidden from --help, answered when used."""
    for letter in ANSWERS:
        if letter not in taken:
            parser.add_argument(letter, nargs="?", action=_Answer, help=argparse.SUPPRESS)
