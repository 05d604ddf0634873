"""The settings a backend declares (Backend.engine_settings builds a Settings from the names
here; run.json records them), the paste-ready lines recommend prints, and the settings that do
nothing on a probed box. The switches themselves are each engine's, in its own file (vllm.py,
sglang.py), and named here for the backends under the names they always had. No torch here: the
analysis reads it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from commbench.engines import libs, sglang, vllm
from commbench.engines.paths import (CUSTOM_AR, FLASHINFER_AR, FLASHINFER_FUSED, FLASHINFER_PCIE_IPC,  # noqa: F401
                                     MSCCLPP, NCCL_PATH, NCCL_SYMM, TORCH_SYMM_MEM, InertSetting, Launch, move)
from commbench.engines.registry import BY_KEY, ENGINES as ALL_ENGINES, NAMES
from commbench.results.schema import PRELOAD_VAR   # one name for the variable, where rows record it
from commbench.topology.box import Box, nccl_version as _version_of

VLLM_VERSION = vllm.VERSION
SGLANG_VERSION = sglang.VERSION
NCCL_VERSION = libs.NCCL_VERSION

# --- facts, with their sources --------------------------------------------------------------

# Allreduce kernels of libraries no commbench backend runs, as they appear in a profiler trace,
# for `commbench attribute` (a backend module's TRACE_KERNELS layout: regex, library, floor
# variants, note); the kernels of backends are in their modules.
TRACE_KERNELS = (
    # vLLM csrc/quickreduce (ROCm)
    (r"\bquickreduce::allreduce_prototype_", "vLLM quick allreduce (ROCm)", "", ""),
    # TensorRT-LLM cpp/tensorrt_llm/kernels/communicationKernels/allReduceFusionKernels.cu
    (r"\btensorrt_llm::kernels::ar_fusion::", "TensorRT-LLM allreduce fusion", "", ""),
)


# Each engine's switches (vllm.py, sglang.py), under the names the backends use.
VLLM_ONLY_NCCL = vllm.ONLY_NCCL
VLLM_ONLY_CUSTOM_ALLREDUCE = vllm.ONLY_CUSTOM_ALLREDUCE
VLLM_ONLY_SYMM_MEM = vllm.ONLY_SYMM_MEM
DISABLE_CUSTOM_ALLREDUCE = vllm.DISABLE_CUSTOM_ALLREDUCE     # the same flag in both engines
SGLANG_TORCH_SYMM_MEM = sglang.TORCH_SYMM_MEM_FLAG
SGLANG_MSCCLPP = sglang.MSCCLPP_FLAG
SGLANG_NCCL_SYMM = sglang.NCCL_SYMM_FLAG
MSCCLPP_NO_NVLS_ENV = {"MSCCLPP_FORCE_DISABLE_NVLS": "1"}
VLLM_FLASHINFER_TRTLLM_ENV = vllm.FLASHINFER_TRTLLM_ENV
SGLANG_FLASHINFER_TRTLLM = sglang.FLASHINFER_TRTLLM
FUSE_ALLREDUCE_RMS_CONFIG = vllm.FUSE_ALLREDUCE_RMS_CONFIG
VLLM_FUSE_ALLREDUCE_RMS = vllm.FUSE_ALLREDUCE_RMS
NO_FUSE_ALLREDUCE_RMS_CONFIG = vllm.NO_FUSE_ALLREDUCE_RMS_CONFIG
VLLM_NO_FUSE_ALLREDUCE_RMS = vllm.NO_FUSE_ALLREDUCE_RMS
SGLANG_NO_FLASHINFER = sglang.NO_FLASHINFER

CUSTOM_AR_PCIE_GATE = (f"vLLM enables its custom allreduce for more than 2 GPUs only when every pair is "
                       f"NVLink-connected; on PCIe at TP>2 it stays off whatever you set (vLLM {VLLM_VERSION}, "
                       "custom_all_reduce.py; vLLM #56128); SGLang's custom allreduce has the same gate")
CUSTOM_AR_ON_BY_DEFAULT = ("custom CUDA-IPC allreduce is on by default in both engines (do not pass "
                           "--disable-custom-all-reduce); they pick one-shot or two-shot by size themselves")
# The engines' own custom allreduce kernels (backends/sglang_custom_ar.py, vllm_custom_ar.py).
SGLANG_CUSTOM_AR_V2_ENV = sglang.CUSTOM_AR_V2_ENV
SGLANG_CUSTOM_AR_V2 = (f"SGLang {SGLANG_VERSION} runs its JIT custom allreduce v2 by default on CUDA "
                       "(SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2=1; 0 falls back to the legacy kernel), only where "
                       "every GPU pair is NVLink-connected, 2 GPUs included (can_use_custom_all_reduce_v2), for "
                       "messages up to 16 MiB inclusive (SGLANG_CUSTOM_ALL_REDUCE_V2_MAX_SIZE_KB), after a real P2P "
                       "test (SGLANG_SKIP_P2P_CHECK=0 by default; custom_all_reduce_v2.py, environ.py)")
SGLANG_ALGO_BY_SIZE = (f"SGLang {SGLANG_VERSION} picks 1shot_push / 2shot_push / 1shot_pull / 2shot_pull (multicast "
                       "where it works) by size and world size itself; SGLANG_FORCE_CUSTOM_ALL_REDUCE_V2_PUSH_SIZE_KB "
                       "only forces one-shot push up to a size: this algorithm at every size is headroom, and "
                       "SGLang's custom allreduce is priced by sglang:auto")
VLLM_ALGO_VAR = vllm.ALGO_VAR      # read by vLLM's custom_all_reduce.cuh: 1stage | 2stage
VARIANT_VARS = (VLLM_ALGO_VAR,)    # engine variables that make one option of a path differ from another
VLLM_STAGE_FORCED = (f"VLLM_CUSTOM_ALLREDUCE_ALGO=1stage|2stage forces vLLM's custom allreduce stage at every size it "
                     f"takes (read by its kernel, custom_all_reduce.cuh, in vLLM {VLLM_VERSION}'s _C library): "
                     "a setting a user can choose")


def vllm_forced_stage(variant: str, stage: str, notes: list[str]) -> "Settings":
    """vLLM's custom allreduce with its stage forced (stage: '1stage' or '2stage')."""
    return Settings(variant, vllm_env={**VLLM_ONLY_CUSTOM_ALLREDUCE, VLLM_ALGO_VAR: stage}, sglang_supported=False,
                    notes=[VLLM_STAGE_FORCED, *notes], engine_paths=claim(CUSTOM_AR, VLLM))
SGLANG_NOT_VLLM_KERNEL = (f"SGLang {SGLANG_VERSION} runs its own custom allreduce v2 on NVLink, not vLLM's kernel "
                          "(measure sglang:auto for SGLang)")
FLASHINFER_PCIE_IPC_ENV = vllm.PCIE_IPC_ENV
SGLANG_PCIE_IPC_ENV = sglang.PCIE_IPC_ENV
FLASHINFER_PCIE_ALTERNATIVE = ("on PCIe hosts without NVLink the upstream alternative is FlashInfer's PCIe IPC "
                               "allreduce: vLLM VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1 (bf16/fp16, 2/4/8 ranks, CUDA "
                               "graphs only; vLLM #53576), SGLang SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 (bf16, 2/4/8 ranks)")
LL128_OFF_NVLINK = ("LL128 forced off NVLink can corrupt data silently (NVIDIA/nccl #786, #1261): keep it only "
                    "where this run's correctness check passed on the same fabric")
NCCL_ENV_IS_PROCESS_WIDE = "NCCL_* variables apply to every NCCL communicator of the process, not only TP"
NCCL_SYMM_VLLM = ("vLLM uses NCCL symmetric memory only from 4 ranks and prefers its custom allreduce for 16-512 KiB "
                  "at TP4 and 16-128 KiB at TP8 (NCCL_SYMM_MEM_ALL_REDUCE_CONFIG, vLLM "
                  f"{VLLM_VERSION})")
SYMM_MEM_NEEDS_MULTICAST = ("vLLM and SGLang turn their symm-mem communicator off when multicast is unavailable, "
                            "even for two-shot (vLLM #50179); with multicast they use multimem at 4/6/8 ranks on "
                            "SM90")
MULTIMEM_NEEDS_NVSWITCH = ("multimem needs NVSwitch multicast: never on PCIe, nor where NCCL_NVLS_ENABLE=0 / "
                           "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is policy")
FLASHINFER_NEVER_AUTO = "use trtllm, never auto: auto picks mnnvl, which creates multicast objects"
FLASHINFER_ARCHS = libs.FLASHINFER_ARCHS
FUSED_TIMING = ("the fused allreduce+residual+RMSNorm timing includes the norm: compare it with allreduce + a "
                "separate RMSNorm, not with a bare allreduce")
SGLANG_PCIE_IPC = (f"SGLang {SGLANG_VERSION} runs FlashInfer's PCIe IPC allreduce with SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 "
                   "(bf16 only, TP 2/4/8, tried right after its custom allreduce; pcie_ipc_ar.py)")
MSCCLPP_NO_VLLM = ("vLLM has no MSCCL++ path; the NCCL-API shim (mscclpp:shim) replaces NCCL underneath any engine "
                   "instead")
MSCCLPP_SHIM = ("MSCCL++'s NCCL-API shim (libmscclpp_nccl.so) loaded in place of NCCL is not an engine's MSCCL++ path "
                "(SGLang's --enable-mscclpp runs MSCCL++'s own Python API: mscclpp:auto measures that): it serves "
                "whatever the engine sends to NCCL, so these rows price the engine's NCCL path with the shim loaded")
MSCCLPP_SGLANG = "SGLang's MSCCL++ needs 4+ consecutive ranks and runs only inside CUDA graphs"
UNFUSED_BASELINE = ("the unfused baseline is plain allreduce + a separate residual add and RMSNorm: what engines run "
                    "when fusion is off; pick the allreduce backend it used instead")
GLOO_CPU = ("gloo is the CPU backend: this run measured the host, not GPUs, and no engine serves decode "
            "through it")

# --- engine paths -----------------------------------------------------------------------------
# A backend says which engine path its rows price (Settings.engine_paths): the path id per
# engine, and whether it runs that path's own kernels or only stands in for them (commbench's
# p2p kernels stand in for the engines' custom allreduce until the engines' kernels are measured).

VLLM, SGLANG = vllm.KEY, sglang.KEY
ENGINES = tuple(e.key for e in ALL_ENGINES)
ENGINE_NAMES = NAMES


def claim(path: str, *engine_ids: str, stand_in: bool = False) -> dict[str, dict[str, Any]]:
    """engine_paths for a backend that runs `path` (stand_in: a similar kernel, not the engine's own)."""
    return {engine: {"path": path, "stand_in": stand_in} for engine in engine_ids}


@dataclass
class Settings:
    """What selects one backend variant in NCCL, vLLM and SGLang (recorded in run.json)."""

    variant: str
    nccl_env: dict[str, str] = field(default_factory=dict)
    vllm_env: dict[str, str] = field(default_factory=dict)
    vllm_flags: list[str] = field(default_factory=list)
    sglang_env: dict[str, str] = field(default_factory=dict)
    sglang_flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    vllm_supported: bool = True
    sglang_supported: bool = True
    # engine -> {"path": path id, "stand_in": bool}: the engine path these rows price (claim()).
    engine_paths: dict[str, dict[str, Any]] = field(default_factory=dict)
    # A library loaded in place of the engine's NCCL (LD_PRELOAD): "" is the NCCL the engine
    # ships. Part of what makes two settings different; never printed as a paste-ready line.
    preload: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def launch(self, engine: str) -> Launch:
        """This engine's variables and flags, as its path model reads a launch line."""
        return Launch.of(getattr(self, f"{engine}_env"), getattr(self, f"{engine}_flags"))

    def supported(self, engine: str) -> bool:
        return bool(getattr(self, f"{engine}_supported"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Settings":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def with_process_env(self, env_setting: dict[str, str]) -> "Settings":
        """The same settings under a driver run's process-level variables (NCCL_* knobs). A
        library the run preloaded is the settings' preload, not a knob (runs recorded before
        backends declared preload carry it only there)."""
        knobs = {k: v for k, v in env_setting.items() if k != PRELOAD_VAR}
        preload = self.preload or env_setting.get(PRELOAD_VAR, "")
        if not knobs and preload == self.preload:
            return self
        notes = self.notes if not knobs or NCCL_ENV_IS_PROCESS_WIDE in self.notes else [*self.notes,
                                                                                         NCCL_ENV_IS_PROCESS_WIDE]
        return Settings(**{**asdict(self), "nccl_env": {**knobs, **self.nccl_env}, "notes": notes, "preload": preload})


# What SGLANG_ALGO_BY_SIZE and VLLM_STAGE_BY_SIZE say in every wording they were recorded with.
FORCED_BY_SIZE_MARKS = ("picks 1shot_push / 1shot_pull / 2shot_pull by size", "picks one- or two-stage by size itself",
                        "picks 1shot_push / 2shot_push / 1shot_pull / 2shot_pull")


def declared_paths(s: Settings) -> dict[str, dict[str, Any]]:
    """The engine paths a backend's settings claim. Runs recorded before backends declared
    engine_paths get them from the settings themselves: what an engine's variables and flags
    select is the path (a custom-allreduce claim from then can only be commbench's stand-in)."""
    if s.engine_paths:
        return {e: dict(c) for e, c in s.engine_paths.items()
                if e in ENGINES and isinstance(c, dict) and isinstance(c.get("path"), str)}
    if any(mark in note for note in s.notes for mark in FORCED_BY_SIZE_MARKS):
        # One algorithm or stage of an engine's kernel forced at every size: the engine runs it
        # only where its own size rule picks it, so it prices no path (the runs of 2026-12-02
        # 06:2x recorded the engine's default switch beside an earlier wording of the note).
        return {}
    out: dict[str, dict[str, Any]] = {}
    env, flags = s.vllm_env, " ".join(s.vllm_flags)
    vllm = (FLASHINFER_PCIE_IPC if env.get("VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC") == "1"
            else FLASHINFER_FUSED if "fuse_allreduce_rms" in flags
            else FLASHINFER_AR if env.get("VLLM_ALLREDUCE_USE_FLASHINFER") == "1"
            else NCCL_SYMM if env.get("VLLM_USE_NCCL_SYMM_MEM") == "1"
            else TORCH_SYMM_MEM if env.get("VLLM_ALLREDUCE_USE_SYMM_MEM") == "1"
            else NCCL_PATH if DISABLE_CUSTOM_ALLREDUCE in s.vllm_flags
            else CUSTOM_AR if env == VLLM_ONLY_CUSTOM_ALLREDUCE else None)
    # Only vLLM's own kernel (backends/vllm_custom_ar.py) says SGLang does not run it.
    vllm_own = SGLANG_NOT_VLLM_KERNEL in s.notes
    if s.vllm_supported and vllm:
        out[VLLM] = {"path": vllm, "stand_in": vllm == CUSTOM_AR and not vllm_own}
    sg = s.sglang_flags
    # Only SGLang's own custom allreduce declares the switch of its v2 kernel (backends/sglang_custom_ar.py).
    sglang_own = s.sglang_env == SGLANG_CUSTOM_AR_V2_ENV
    sglang = (FLASHINFER_PCIE_IPC if s.sglang_env == SGLANG_PCIE_IPC_ENV
              else MSCCLPP if SGLANG_MSCCLPP in sg else TORCH_SYMM_MEM if SGLANG_TORCH_SYMM_MEM in sg
              else NCCL_SYMM if SGLANG_NCCL_SYMM in sg
              else FLASHINFER_FUSED if SGLANG_FLASHINFER_TRTLLM[0] in sg and FLASHINFER_FUSED == vllm
              else FLASHINFER_AR if SGLANG_FLASHINFER_TRTLLM[0] in sg and FLASHINFER_AR == vllm
              else NCCL_PATH if DISABLE_CUSTOM_ALLREDUCE in sg
              else CUSTOM_AR if sglang_own or vllm == CUSTOM_AR else None)
    if s.sglang_supported and sglang:
        out[SGLANG] = {"path": sglang, "stand_in": sglang == CUSTOM_AR and not sglang_own}
    return out


def pcie_ipc(variant: str, notes: list[str]) -> Settings:
    """FlashInfer's PCIe IPC allreduce: one kernel both engines run, each behind its own variable."""
    return Settings(variant, vllm_env=dict(FLASHINFER_PCIE_IPC_ENV), sglang_env=dict(SGLANG_PCIE_IPC_ENV),
                    notes=[SGLANG_PCIE_IPC, *notes], engine_paths=claim(FLASHINFER_PCIE_IPC, VLLM, SGLANG))


STAGE_VARIANT = re.compile(r"^vllm:(one|two)_stage(,|$)")
OLD_PCIE_IPC_NOTE = "SGLang integrates FlashInfer PCIe IPC in sglang #34528"


def upgraded(s: Settings) -> Settings:
    """Settings a run recorded under older engine facts, as today's facts have them: vLLM's forced
    custom-allreduce stage is a setting (VLLM_CUSTOM_ALLREDUCE_ALGO), SGLang 0.5.23 selects
    FlashInfer's PCIe IPC allreduce (SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1) and runs FlashInfer's trtllm
    allreduce for plain allreduces where its fusion is on."""
    stage = STAGE_VARIANT.match(s.variant)
    if stage and any(FORCED_BY_SIZE_MARKS[1] in n for n in s.notes):
        rest = [n for n in s.notes if FORCED_BY_SIZE_MARKS[1] not in n]
        return vllm_forced_stage(s.variant, f"{'1' if stage.group(1) == 'one' else '2'}stage", rest)
    if s.vllm_env == FLASHINFER_PCIE_IPC_ENV and not s.sglang_supported and not s.preload:
        return pcie_ipc(s.variant, [n for n in s.notes if not n.startswith(OLD_PCIE_IPC_NOTE)])
    if s.sglang_flags == SGLANG_FLASHINFER_TRTLLM and s.engine_paths == claim(FLASHINFER_AR, VLLM):
        # SGLang sends plain allreduces to the same trtllm kernel where its fusion is on (sglang.py)
        return Settings(**{**asdict(s), "engine_paths": claim(FLASHINFER_AR, VLLM, SGLANG)})
    return s


def nccl_path(variant: str, nccl_env: dict[str, str] | None = None, notes: list[str] | None = None,
              preload: str = "") -> Settings:
    """Settings that leave every call of both engines on their NCCL path (PyNccl): what a backend
    serving NCCL's API prices, with NCCL's knobs or with another library loaded in its place."""
    return Settings(variant, nccl_env=dict(nccl_env or {}), vllm_env=dict(VLLM_ONLY_NCCL),
                    vllm_flags=[DISABLE_CUSTOM_ALLREDUCE], sglang_flags=[DISABLE_CUSTOM_ALLREDUCE],
                    notes=list(notes or []), preload=preload, engine_paths=claim(NCCL_PATH, VLLM, SGLANG))


def none_selects(variant: str, why: str) -> Settings:
    """A path that no engine setting selects."""
    return Settings(variant, notes=[why], vllm_supported=False, sglang_supported=False)


# --- paste-ready lines: only what an engine accepts, shell-quoted -----------------------------
# Settings come from run.json, which users forward: a value is printed only when it has the form
# the engine reads, and every token goes through shlex.quote.

ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
LIBRARY_PATH = re.compile(r"^/[A-Za-z0-9_.+/-]{1,255}$")
# The engines' PyNccl opens libnccl.so.2 through ctypes unless given a path: vLLM 0.33.0
# vllm/utils/nccl.py find_nccl_library (VLLM_NCCL_SO_PATH); SGLang 0.5.23 pynccl_wrapper.py
# (SGLANG_NCCL_SO_PATH).
NCCL_SO_PATH_VAR = {e.key: e.words.nccl_so_var for e in ALL_ENGINES}
ENV_PREFIXES = ("NCCL_", "VLLM_", "SGLANG_", "MSCCLPP_", "TORCH_", "NVSHMEM_")
ENV_VALUE = re.compile(r"^[A-Za-z0-9_.,:+-]{1,64}$")
# Flags an engine setting may carry, with the values each takes (None: a switch).
KNOWN_FLAGS: dict[str, frozenset[str] | None] = {
    DISABLE_CUSTOM_ALLREDUCE: None, SGLANG_TORCH_SYMM_MEM: None, SGLANG_MSCCLPP: None, SGLANG_NCCL_SYMM: None,
    SGLANG_FLASHINFER_TRTLLM[0]: frozenset({"trtllm"}), SGLANG_NO_FLASHINFER: None,
    # runs recorded before the raw form carried the JSON in single quotes
    VLLM_FUSE_ALLREDUCE_RMS[0]: frozenset({FUSE_ALLREDUCE_RMS_CONFIG, f"'{FUSE_ALLREDUCE_RMS_CONFIG}'",
                                           NO_FUSE_ALLREDUCE_RMS_CONFIG}),
}
COMMANDS = {e.key: e.words.command for e in ALL_ENGINES}


def without_offs(s: Settings, engine: str, off_here: set[str]) -> Settings:
    """The settings less what only turns off a path that is off here anyway (printing them would
    name settings this box ignores): a variable or flag that is some path's off switch."""
    offs = [r.off for r in BY_KEY[engine].rules if r.off is not None and r.path in off_here]
    drop_env = {pair for o in offs for pair in o.env}
    drop_flags = {o.flags[0] for o in offs if len(o.flags) == 1}
    env = {k: v for k, v in getattr(s, f"{engine}_env").items() if (k, v) not in drop_env}
    flags = [f for f in getattr(s, f"{engine}_flags") if f not in drop_flags]
    return Settings(**{**asdict(s), f"{engine}_env": env, f"{engine}_flags": flags})


def with_switches(s: Settings, engine: str, switches: tuple[Any, ...]) -> Settings:
    """The settings plus a path model's switches (paths.Move.added) in this engine's variables and flags."""
    env = dict(getattr(s, f"{engine}_env"))
    flags = list(getattr(s, f"{engine}_flags"))
    for switch in switches:
        env.update(dict(switch.env))
        if not Launch.of(env, flags).has(switch):
            flags += list(switch.flags)
    return Settings(**{**asdict(s), f"{engine}_env": env, f"{engine}_flags": flags})


def turned_off_note(engine: str, switch: Any, title: str, path_title: str) -> str:
    """Why a launch line carries a switch the path model added (paths.Move.added)."""
    return (f"{switch.text()} turns {title} off: {NAMES[engine]} tries it first and it would otherwise take these "
            f"decode sizes ahead of {path_title}")


def graphs_note(engine: str) -> str:
    return f"this path runs only inside CUDA graphs: do not add {BY_KEY[engine].words.eager}"


def launch_settings(s: Settings, engine: str, path: str, found: list[Any], sizes: list[int] | tuple[int, ...]
                    ) -> tuple[Settings, Any]:
    """`s` plus what its path needs to take the decode sizes it claims in `engine` here: each
    default-on path ahead of it that would take them, turned off (paths.move), with a note per
    switch, and a word where the path runs only inside CUDA graphs. Also the move itself (its
    sizes, or why no line can move them)."""
    moved = move(found, path, s.launch(engine), sizes)
    rules = BY_KEY[engine].rules
    title = next(r.title for r in rules if r.path == path)
    notes = list(s.notes)
    for switch in moved.added:
        off = next(r for r in rules if r.off == switch)
        notes.append(turned_off_note(engine, switch, off.title, title))
    if next(r for r in rules if r.path == path).graphs_only:
        notes.append(graphs_note(engine))
    out = with_switches(s, engine, moved.added)
    return Settings(**{**asdict(out), "notes": notes}), moved


def env_refusal(env: dict[str, Any]) -> str | None:
    for name, value in env.items():
        # The refusal never repeats the text it refuses: run.json is untrusted.
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name) or not name.startswith(ENV_PREFIXES):
            return "a variable that is not an NCCL, vLLM, SGLang, MSCCL++ or torch variable"
        if not isinstance(value, str) or not ENV_VALUE.fullmatch(value):
            return f"the value of {name} is not a plain word"
    return None


def flags_refusal(flags: list[Any]) -> str | None:
    items = list(flags)
    while items:
        flag = items.pop(0)
        if flag not in KNOWN_FLAGS:
            return "a flag that is not one of the engine flags commbench knows"
        values = KNOWN_FLAGS[flag]
        if values is not None and (not items or items.pop(0) not in values):
            return f"flag {flag} lacks a value the engine accepts"
    return None


def _unquoted(token: str) -> str:
    return token[1:-1] if len(token) > 1 and token[0] == token[-1] == "'" else token


def preload_shown(path: Any) -> str | None:
    """The preloaded library's path where it is a plain absolute path (run.json is untrusted)."""
    return path if isinstance(path, str) and LIBRARY_PATH.fullmatch(path) and "/../" not in path else None


def preload_deployment(s: Settings, engine: str) -> str:
    """How a setting with another library under the engine is deployed: no engine flag selects it,
    so commbench prints no paste-ready line for it."""
    path = preload_shown(s.preload)
    if path is None:
        return "a preloaded library whose path is not a plain absolute path"
    return (f"no engine setting loads {path}: start the engine with {PRELOAD_VAR}={path} (torch's NCCL) and "
            f"{NCCL_SO_PATH_VAR[engine]}={path} (the engine's PyNccl, which opens NCCL by name through ctypes)")


def paste_lines(s: Settings, engine: str, tp: int | None) -> tuple[list[str], str | None]:
    """The shell lines that select this setting in `engine` (NCCL exports first), or a refusal."""
    if s.preload:
        return [], preload_deployment(s, engine)
    env = getattr(s, f"{engine}_env")
    flags = getattr(s, f"{engine}_flags")
    refusal = env_refusal(s.nccl_env) or env_refusal(env) or flags_refusal(flags)
    if refusal:
        return [], refusal
    lines = [f"export {k}={shlex.quote(v)}" for k, v in sorted(s.nccl_env.items())]
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(env.items()))
    command = COMMANDS[engine].format(tp=int(tp) if tp else "TP")
    lines.append(prefix + command + "".join(" " + shlex.quote(_unquoted(str(f))) for f in flags))
    return lines, None


# --- settings that do nothing on a probed box ------------------------------------------------
# Users turn these on, nothing changes, and hours go into finding out why. Each engine's rules are
# in its own file and name the version whose code they read.

NCCL_SYMMETRIC_PCIE_OFF = libs.NCCL_SYMMETRIC_PCIE_OFF


def nccl_version(snapshot: dict[str, Any]) -> tuple[int, ...] | None:
    """The NCCL torch carries, as recorded by the probe ('2.28.9'); None when unknown."""
    software = snapshot.get("software") if isinstance(snapshot, dict) else None
    return _version_of((software or {}).get("nccl") if isinstance(software, dict) else None)


def inert_settings(box: Box) -> list[InertSetting]:
    """Settings that change nothing at this world size on this box, each with why and the rule's
    source, every engine's (built-in facts: the probe's explain names no installed engine)."""
    if not box.fabric_known:
        return []
    return [rule for e in ALL_ENGINES for rule in e.inert(box, e.facts)]
