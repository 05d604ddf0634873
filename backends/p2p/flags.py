"""The p2p family's flags, without torch: the sweep's parser (and `commbench sweep --help`) reads
them alone (commbench.backends.flags_of); variants reads what they say (read_options)."""

from __future__ import annotations

import argparse


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--p2p-max-bytes", help="largest message for the p2p backends (default 8M)")
    group.add_argument("--p2p-auto-rule", metavar="RULE",
                       help="force p2p:auto's choice of kernel by size, e.g. "
                            "'oneshot_lamport<=256K,twoshot_lamport' (default: measured at setup); a rule that names "
                            "oneshot_pull asks for reads of peer memory")
    group.add_argument("--p2p-timeout-ms", type=float,
                       help="how long a p2p kernel waits for a peer before it gives up (default 5000)")
    group.add_argument("--p2p-threads", help="threads per p2p block, a multiple of 32 up to the kernels' block "
                                             "size (default: by size; a larger value is refused naming it)")
    group.add_argument("--p2p-vectors-per-thread",
                       help="16-byte vectors each p2p thread takes before another block is added (default 1)")
    group.add_argument("--p2p-pdl", choices=("on", "off"),
                       help="launch the p2p kernels with programmatic dependent launch where every rank can "
                            "(cuda-python, SM 9.0+; rows say why not) (default on)")
