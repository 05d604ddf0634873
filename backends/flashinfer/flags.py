"""The flashinfer family's flags, without torch: the sweep's parser (and `commbench sweep --help`)
reads them alone (commbench.backends.flags_of); variants reads what they say (read_options)."""

from __future__ import annotations

import argparse


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--flashinfer-pcie-tune", choices=("measure", "seed"), default="measure",
                       help="flashinfer:pcie_ipc: tune every size bucket at setup (measure, the default) or run "
                            "FlashInfer's untuned seed configurations (seed)")
    group.add_argument("--flashinfer-pdl", choices=("on", "off"), default="on",
                       help="flashinfer trtllm and fused variants: launch with programmatic dependent launch "
                            "(on, the default, as vLLM and SGLang serve) or without it (off), to see what it saves")
