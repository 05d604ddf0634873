"""`commbench sweep`'s flags and its entry point, without torch: `commbench sweep --help` builds
this parser alone (each backend family's flags from its torch-free flags module, through the
registry), and only running the sweep imports commbench.sweep.command and torch."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from commbench import backends
from commbench.sweep import nccl_flags


def add_arguments(p: argparse.ArgumentParser) -> None:
    sizes = p.add_argument_group("sizes (nccl-tests style, K/M/G = 2^10/2^20/2^30)")
    sizes.add_argument("-b", "--min-bytes", help="smallest message (default 4K on GPU, 1K on CPU)")
    sizes.add_argument("-e", "--max-bytes", help="largest message (default 256M on GPU, 256K on CPU)")
    sizes.add_argument("-f", "--step-factor", type=int, help="multiply the size by this each step (default 2 on GPU, 4 on CPU)")
    sizes.add_argument("--sizes", help="explicit list, e.g. 8K,12K,1M")
    sizes.add_argument("--tokens", help="model shapes: token counts, e.g. 1,2,4,...,256 (with --hidden)")
    sizes.add_argument("--hidden", help="model shapes: hidden size; bytes = tokens x hidden x dtype size")
    sizes.add_argument("--model", metavar="NAME",
                       help="a model preset (commbench floor --list-models): its decode sizes, tokens 1-256 x "
                            "hidden x its dtype, in graph mode; ends by printing the command that turns the run "
                            "into the decision")
    sizes.add_argument("--prefill-tokens", metavar="N[,M]",
                       help="with --model (or --tokens/--hidden): also measure these prefill chunks, e.g. 4096, so "
                            "recommend and floor can price a setting at prefill too")
    sizes.add_argument("--tp", type=int, metavar="N",
                       help="with --model: the tensor-parallel size, which must be the sweep's world size")
    what = p.add_argument_group("what to run")
    what.add_argument("--backends", help="comma list of backend specs (default: every backend for this machine); "
                      "see --list-backends")
    what.add_argument("--list-backends", action="store_true", help="list backend families and example variants")
    what.add_argument("-d", "--dtype", help="bf16,fp16,fp32, or as nccl-tests spells them: bfloat16,half,float "
                      "(default bf16 on GPU, fp32 on CPU)")
    what.add_argument("--mode", help="eager,graph (default both on GPU; eager on CPU)")
    timing = p.add_argument_group("timing and checks (nccl-tests' -n -w -G -c -T where they mean the same)")
    timing.add_argument("-n", "--iters", type=int,
                        help="timed calls per pass in eager mode, timed graph replays in graph mode "
                             "(default: scales down with size); with -G: calls captured per graph, as in nccl-tests")
    timing.add_argument("--jitter-calls", type=int, metavar="N",
                        help="eager mode: calls timed one by one for p10..p99, in rounds over the row's buffers, each "
                             "call checked (default: -n's count where given, else 100 or the timed calls if more)")
    timing.add_argument("-w", "--warmup", type=int, help="warm-up calls per row (default 5 on GPU, 2 on CPU)")
    timing.add_argument("--graph-ops", type=int,
                        help="calls captured per CUDA graph (default: 128, fewer for messages above 2 MiB)")
    timing.add_argument("-G", "--graph-launches", type=int, metavar="N",
                        help="nccl-tests' -G: graph mode only, each pass replaying the captured graph N times "
                             "(-n then counts the calls captured per graph); -G 0 is eager mode only")
    timing.add_argument("-c", "--check", type=int, default=1, metavar="N",
                        help="a count, as nccl-tests' -c: 1 or more (default 1) checks every timed call's output; "
                             "0 checks nothing, the rows say so and analysis trusts none of them")
    timing.add_argument("-T", "--timeout", type=float, default=120.0, help="watchdog seconds per row (default 120)")
    timing.add_argument("--setup-timeout", type=float, default=900.0,
                        help="watchdog seconds for a backend's setup, which may build its kernels on first use "
                             "(FlashInfer's JIT build takes minutes) (default 900)")
    out = p.add_argument_group("results")
    out.add_argument("--out", default="results", help="results root (default results/)")
    out.add_argument("--resume", metavar="DIR", help="continue the run in DIR: finished rows are skipped")
    out.add_argument("--run-dir", help=argparse.SUPPRESS)   # the driver's children append here
    out.add_argument("--qualify", type=Path, metavar="SPEC.toml",
                     help="after the sweep, run `commbench qualify --spec SPEC.toml` on its results "
                          "(the exit status is qualify's)")
    out.add_argument("--junit", type=Path, metavar="FILE", help="with --qualify: also write JUnit XML")
    env = p.add_argument_group("machine and safety")
    env.add_argument("--cpu", action="store_true", help="run on the CPU with gloo even if CUDA is present")
    env.add_argument("--share-gpus", action="store_true",
                     help="let several ranks share one GPU (correctness runs only; timings mean nothing)")
    env.add_argument("--allow-multicast", action="store_true",
                     help="allow backends that create NVLink multicast objects (never with a policy variable set)")
    env.add_argument("--no-probe", action="store_true", help="skip the topology probe at start-up")
    drv = p.add_argument_group("driver (outside torchrun)")
    drv.add_argument("--nproc", type=int, help="launch torchrun with this many processes per node yourself")
    drv.add_argument("--env", action="append", default=[], metavar="NAME=V1,V2",
                     help="process-level setting to sweep, one torchrun per value (repeatable: all combinations)")
    drv.add_argument("--mps", action="store_true",
                     help="with --share-gpus: start a private MPS daemon for the children, so ranks sharing a GPU "
                          "run concurrently (each an equal share of the SMs); stopped when the driver ends")
    drv.add_argument("--child-timeout", type=float, default=3600.0,
                     help="seconds before the driver kills a child torchrun (default 3600)")
    backends.add_arguments(p)   # each backend family's own flags
    nccl_flags.add_arguments(p, p._option_string_actions)   # nccl-tests' other letters: one line each


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    from commbench.sweep import command   # torch, the backends and the harness: only to run

    return command.main(args, argv)
