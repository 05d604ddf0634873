"""Model shapes for the decode floor: presets from data/models.toml or a custom model."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from dataclasses import dataclass
from importlib import resources
from typing import Any

from commbench.errors import UsageError
from commbench.units import DTYPE_BYTES, dtype_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# Decode batch sizes looked at when none are given (floor, recommend).
DEFAULT_CONCURRENCIES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
_FIELDS = {"name", "aliases", "layers", "hidden", "architecture", "ar_per_layer", "dtype", "source", "note"}
ARCH = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,79}$")   # a config.json architectures[0] class name


@dataclass(frozen=True)
class Model:
    key: str
    name: str
    layers: int
    hidden: int
    ar_per_layer: int
    dtype: str
    source: str
    note: str = ""
    arch: str | None = None     # config.json architectures[0]; None: not known (a custom shape)

    @property
    def allreduces_per_token(self) -> int:
        return self.layers * self.ar_per_layer

    def message_bytes(self, concurrency: int) -> int:
        """One decode step reduces [concurrency tokens x hidden] in the activation dtype."""
        return concurrency * self.hidden * DTYPE_BYTES[self.dtype]

    def describe(self) -> str:
        arch = f", {self.arch}" if self.arch else ", architecture not given (--arch NAME)"
        return (f"{self.name}: {self.layers} layers x {self.ar_per_layer} allreduces = "
                f"{self.allreduces_per_token} per token, hidden {self.hidden}, {self.dtype}{arch}")


def _validated(key: str, data: dict[str, Any]) -> Model:
    unknown = set(data) - _FIELDS
    if unknown:
        raise UsageError(f"models.toml [{key}]: unknown key {sorted(unknown)[0]!r}")
    try:
        model = Model(key=key, name=str(data["name"]), layers=int(data["layers"]), hidden=int(data["hidden"]),
                      ar_per_layer=int(data["ar_per_layer"]), dtype=str(data["dtype"]),
                      source=str(data["source"]), note=str(data.get("note", "")),
                      arch=str(data["architecture"]) if "architecture" in data else None)
    except KeyError as exc:
        raise UsageError(f"models.toml [{key}]: missing key {exc.args[0]!r}") from None
    if model.dtype not in DTYPE_BYTES:
        raise UsageError(f"models.toml [{key}]: dtype must be one of {', '.join(DTYPE_BYTES)}")
    return model


def presets() -> dict[str, Model]:
    text = resources.files("commbench").joinpath("data/models.toml").read_text(encoding="utf-8")
    return {key: _validated(key, value) for key, value in tomllib.loads(text).items()}


def _aliases() -> dict[str, str]:
    text = resources.files("commbench").joinpath("data/models.toml").read_text(encoding="utf-8")
    out = {}
    for key, value in tomllib.loads(text).items():
        out[key] = key
        for alias in value.get("aliases", []):
            out[str(alias).lower()] = key
    return out


def lookup(name: str) -> Model:
    key = _aliases().get(name.strip().lower())
    if key is None:
        raise UsageError(f"unknown model {name!r}: choose from {', '.join(presets())} "
                         "or give --layers, --hidden and --ar-per-layer")
    return presets()[key]


def custom(layers: int, hidden: int, ar_per_layer: int, dtype: str) -> Model:
    if min(layers, hidden, ar_per_layer) <= 0:
        raise UsageError("--layers, --hidden and --ar-per-layer must be positive")
    dtype = dtype_name(dtype)
    return Model(key="custom", name=f"custom ({layers} layers, hidden {hidden})", layers=layers,
                 hidden=hidden, ar_per_layer=ar_per_layer, dtype=dtype, source="command line")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (a preset or a custom shape)")
    group.add_argument("--model", help="preset name, e.g. glm-5, deepseek-v3, llama-3.1-70b (see --list-models)")
    group.add_argument("--layers", type=int, help="custom model: decoder layers")
    group.add_argument("--hidden", type=int, help="custom model: hidden size")
    group.add_argument("--ar-per-layer", type=int, default=None, help="custom model: allreduces per layer (2 under plain TP)")
    group.add_argument("--dtype", default=None, help="activation dtype: bf16 (default), fp16, fp32")
    group.add_argument("--arch", default=None, metavar="NAME",
                       help="the model's architecture (config.json architectures[0], e.g. GlmMoeDsaForCausalLM): "
                            "engines route allreduces by it; a preset carries its own")
    group.add_argument("--list-models", action="store_true", help="print the presets with their sources and exit")


def from_args(args: argparse.Namespace) -> Model:
    return with_arch(_shape_from_args(args), getattr(args, "arch", None))


def with_arch(model: Model, arch: str | None, dtype: str | None = None) -> Model:
    """The model with the architecture --arch names (checked) and the dtype --dtype names."""
    if arch is not None:
        if not ARCH.match(arch):
            raise UsageError(f"--arch {arch[:80]!r}: expected a class name like GlmMoeDsaForCausalLM")
        model = dataclasses.replace(model, arch=arch)
    return dataclasses.replace(model, dtype=dtype_name(dtype)) if dtype else model


def _shape_from_args(args: argparse.Namespace) -> Model:
    custom_given = [v is not None for v in (args.layers, args.hidden, args.ar_per_layer)]
    if args.model and any(custom_given):
        raise UsageError("give either --model or --layers/--hidden/--ar-per-layer, not both")
    if args.model:
        model = lookup(args.model)
        return dataclasses.replace(model, dtype=dtype_name(args.dtype)) if args.dtype else model
    if all(custom_given):
        return custom(args.layers, args.hidden, args.ar_per_layer, args.dtype or "bf16")
    if any(custom_given):
        raise UsageError("a custom model needs all of --layers, --hidden and --ar-per-layer")
    raise UsageError("which model? give --model NAME (see --list-models) or --layers, --hidden and --ar-per-layer")


def requested(args: argparse.Namespace) -> Model | None:
    """The model a floor / recommend command asks about (and its --tp checked); None where
    --list-models asks for the presets instead (the caller prints `described()`)."""
    if args.list_models:
        return None
    if args.tp is not None and args.tp <= 0:
        raise UsageError(f"--tp must be a positive number of ranks (got {args.tp})")
    return from_args(args)


def described() -> list[tuple[str, list[str]]]:
    """Each preset: its name, then what it is, its source and its note (--list-models)."""
    return [(model.key, [model.describe(), f"source: {model.source}", *([f"note: {model.note}"] if model.note else [])])
            for model in presets().values()]
