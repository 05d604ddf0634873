"""The nccl family's flags, without torch: the sweep's parser (and `commbench sweep --help`) reads
them alone (commbench.backends.flags_of); variants reads what they say (read_options)."""

from __future__ import annotations

import argparse


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--nccl-proto", help="sweep NCCL protocols, e.g. LL,LL128,Simple (one group per variant)")
    group.add_argument("--nccl-algo", help="sweep NCCL algorithms, e.g. Ring,Tree")
    group.add_argument("--nccl-symm", action="store_true",
                       help="also run nccl:symm: the row's buffers registered as NCCL symmetric windows")
    group.add_argument("--nccl-lib", action="append", default=[], metavar="[LABEL=]PATH",
                       help="also run every nccl variant with this libnccl.so.2 (a file, or a folder holding "
                            "nvidia/nccl/lib/libnccl.so.2), preloaded in a child torchrun of its own, as "
                            "nccl:...,lib=LABEL (repeatable; needs --nproc N)")
    group.add_argument("--no-nccl-log", action="store_true",
                       help="do not record the algorithm/protocol NCCL used (logged only around untimed calls)")
