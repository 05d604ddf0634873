"""The mscclpp family's flags, without torch: the sweep's parser (and `commbench sweep --help`) reads
them alone (commbench.backends.flags_of); backend reads what they say (read_options)."""

from __future__ import annotations

import argparse


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--mscclpp-nccl-lib", help="path to libmscclpp_nccl.so for the mscclpp:shim backend")
