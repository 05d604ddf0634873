"""The settings that select each engine path, and how commbench prints them: what a backend
declares (Backend.engine_settings builds a Settings from the names here), the paste-ready lines
recommend prints, and the settings that do nothing on a probed box. The facts these follow are
data in vllm.py, sglang.py and libs.py, each with its source. No torch here: the analysis reads it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from commbench.engines import libs, source
from commbench.results.schema import PRELOAD_VAR   # one name for the variable, where rows record it
from commbench.topology.needs import full_nvlink
from commbench.topology.selection import gpu_pairs, p2p_entry, used_gpus, used_hosts

VLLM_VERSION = source.BUILT_IN["vllm"].version
SGLANG_VERSION = source.BUILT_IN["sglang"].version
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


# vLLM's dispatch order tries FlashInfer and torch symm-mem before/around its custom allreduce
# (vllm/distributed/device_communicators/cuda_communicator.py): turning them off makes the path
# a backend stands for the one that runs.
VLLM_ONLY_NCCL = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_ALLREDUCE_USE_FLASHINFER": "0"}
VLLM_ONLY_CUSTOM_ALLREDUCE = {"VLLM_ALLREDUCE_USE_FLASHINFER": "0", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
VLLM_ONLY_SYMM_MEM = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "1", "VLLM_ALLREDUCE_USE_FLASHINFER": "0"}
DISABLE_CUSTOM_ALLREDUCE = "--disable-custom-all-reduce"     # the same flag in both engines
SGLANG_TORCH_SYMM_MEM = "--enable-torch-symm-mem"
SGLANG_MSCCLPP = "--enable-mscclpp"
MSCCLPP_NO_NVLS_ENV = {"MSCCLPP_FORCE_DISABLE_NVLS": "1"}
VLLM_FLASHINFER_TRTLLM_ENV = {"VLLM_ALLREDUCE_USE_FLASHINFER": "1", "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm"}
SGLANG_FLASHINFER_TRTLLM = ["--flashinfer-allreduce-fusion-backend", "trtllm"]
# The raw JSON: paste-ready lines quote every value themselves (shlex.quote).
FUSE_ALLREDUCE_RMS_CONFIG = '{"pass_config": {"fuse_allreduce_rms": true}}'
VLLM_FUSE_ALLREDUCE_RMS = ["--compilation-config", FUSE_ALLREDUCE_RMS_CONFIG]
# vLLM's default -O2 turns the fusion on at TP > 1 on SM90/SM10x (vllm/config/vllm.py): a line that
# moves decode allreduces off FlashInfer turns it off too, or the fused kernel still takes them.
NO_FUSE_ALLREDUCE_RMS_CONFIG = '{"pass_config": {"fuse_allreduce_rms": false}}'
VLLM_NO_FUSE_ALLREDUCE_RMS = ["--compilation-config", NO_FUSE_ALLREDUCE_RMS_CONFIG]
# SGLang routes every TP allreduce of up to 2048 tokens to FlashInfer where its fusion is on (by
# default for the architectures in sglang.py flashinfer_archs): this flag wins over that default.
SGLANG_NO_FLASHINFER = "--enforce-disable-flashinfer-allreduce-fusion"
VLLM_FUSION_OFF_NOTE = ("the fusion of allreduce + RMSNorm is turned off (fuse_allreduce_rms false): at vLLM's default "
                        "-O2 it would otherwise run FlashInfer's fused kernel for these decode allreduces")
SGLANG_FLASHINFER_OFF_NOTE = ("--enforce-disable-flashinfer-allreduce-fusion: for this architecture SGLang otherwise "
                              "sends every allreduce of up to 2048 tokens to FlashInfer, ahead of this path")
NEEDS_CUDA_GRAPHS = "this path runs only inside CUDA graphs: do not add --enforce-eager"

CUSTOM_AR_PCIE_GATE = (f"vLLM enables its custom allreduce for more than 2 GPUs only when every pair is "
                       f"NVLink-connected; on PCIe at TP>2 it stays off whatever you set (vLLM {VLLM_VERSION}, "
                       "custom_all_reduce.py; vLLM #56128); SGLang's custom allreduce has the same gate")
CUSTOM_AR_ON_BY_DEFAULT = ("custom CUDA-IPC allreduce is on by default in both engines (do not pass "
                           "--disable-custom-all-reduce); they pick one-shot or two-shot by size themselves")
# The engines' own custom allreduce kernels (backends/sglang_custom_ar.py, vllm_custom_ar.py).
SGLANG_CUSTOM_AR_V2_ENV = {"SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2": "1"}   # the default in 0.5.23
SGLANG_CUSTOM_AR_V2 = (f"SGLang {SGLANG_VERSION} runs its JIT custom allreduce v2 by default on CUDA "
                       "(SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2=1; 0 falls back to the legacy kernel), only where "
                       "every GPU pair is NVLink-connected, 2 GPUs included (can_use_custom_all_reduce_v2), for "
                       "messages up to 16 MiB inclusive (SGLANG_CUSTOM_ALL_REDUCE_V2_MAX_SIZE_KB), after a real P2P "
                       "test (SGLANG_SKIP_P2P_CHECK=0 by default; custom_all_reduce_v2.py, environ.py)")
SGLANG_ALGO_BY_SIZE = (f"SGLang {SGLANG_VERSION} picks 1shot_push / 2shot_push / 1shot_pull / 2shot_pull (multicast "
                       "where it works) by size and world size itself; SGLANG_FORCE_CUSTOM_ALL_REDUCE_V2_PUSH_SIZE_KB "
                       "only forces one-shot push up to a size: this algorithm at every size is headroom, and "
                       "SGLang's custom allreduce is priced by sglang:auto")
VLLM_ALGO_VAR = "VLLM_CUSTOM_ALLREDUCE_ALGO"      # read by vLLM's custom_all_reduce.cuh: 1stage | 2stage
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
FLASHINFER_PCIE_IPC_ENV = {"VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC": "1"}   # vLLM #53576, opt-in
SGLANG_PCIE_IPC_ENV = {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1"}              # SGLang 0.5.23 environ.py, opt-in
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

# --- engine paths: the allreduce implementations an engine dispatches to ---------------------
# A backend says which engine path its rows price (Settings.engine_paths): the path id per
# engine, and whether it runs that path's own kernels or only stands in for them (commbench's
# p2p kernels stand in for the engines' custom allreduce until the engines' kernels are measured).

VLLM, SGLANG = "vllm", "sglang"
ENGINES = (VLLM, SGLANG)
ENGINE_NAMES = {VLLM: "vLLM", SGLANG: "SGLang"}
CUSTOM_AR = "custom_ar"                  # the engines' CUDA-IPC custom allreduce
NCCL_PATH = "nccl"                       # PyNccl: NCCL's own kernels
TORCH_SYMM_MEM = "torch_symm_mem"        # torch symmetric-memory one/two-shot or multimem
NCCL_SYMM = "nccl_symm"                  # NCCL symmetric-memory kernels on registered windows
FLASHINFER_AR = "flashinfer_ar"          # FlashInfer trtllm allreduce (vLLM's standalone path)
FLASHINFER_PCIE_IPC = "flashinfer_pcie_ipc"
FLASHINFER_FUSED = "flashinfer_fused"    # FlashInfer allreduce + residual + RMSNorm, one kernel
MSCCLPP = "mscclpp"


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
              else NCCL_SYMM if "--enable-symm-mem" in sg
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
NCCL_SO_PATH_VAR = {VLLM: "VLLM_NCCL_SO_PATH", SGLANG: "SGLANG_NCCL_SO_PATH"}
ENV_PREFIXES = ("NCCL_", "VLLM_", "SGLANG_", "MSCCLPP_", "TORCH_", "NVSHMEM_")
ENV_VALUE = re.compile(r"^[A-Za-z0-9_.,:+-]{1,64}$")
# Flags an engine setting may carry, with the values each takes (None: a switch).
KNOWN_FLAGS: dict[str, frozenset[str] | None] = {
    DISABLE_CUSTOM_ALLREDUCE: None, SGLANG_TORCH_SYMM_MEM: None, SGLANG_MSCCLPP: None, "--enable-symm-mem": None,
    SGLANG_FLASHINFER_TRTLLM[0]: frozenset({"trtllm"}), SGLANG_NO_FLASHINFER: None,
    # runs recorded before the raw form carried the JSON in single quotes
    VLLM_FUSE_ALLREDUCE_RMS[0]: frozenset({FUSE_ALLREDUCE_RMS_CONFIG, f"'{FUSE_ALLREDUCE_RMS_CONFIG}'",
                                           NO_FUSE_ALLREDUCE_RMS_CONFIG}),
}
COMMANDS = {VLLM: "vllm serve MODEL --tensor-parallel-size {tp}",
            SGLANG: "python -m sglang.launch_server --model-path MODEL --tp {tp}"}


# Settings whose only effect is to turn a path off: left out of a paste-ready line where that
# path is off on the box anyway (printing them would name settings this box ignores).
TURN_OFF_ENV = {("VLLM_ALLREDUCE_USE_FLASHINFER", "0"): FLASHINFER_AR, ("VLLM_ALLREDUCE_USE_SYMM_MEM", "0"): TORCH_SYMM_MEM}
TURN_OFF_FLAGS = {DISABLE_CUSTOM_ALLREDUCE: CUSTOM_AR}


def without_offs(s: Settings, engine: str, off_here: set[str]) -> Settings:
    """The settings less what only turns off a path that is off here anyway."""
    env = {k: v for k, v in (s.vllm_env if engine == VLLM else s.sglang_env).items()
           if TURN_OFF_ENV.get((k, v)) not in off_here}
    flags = [f for f in (s.vllm_flags if engine == VLLM else s.sglang_flags) if TURN_OFF_FLAGS.get(f) not in off_here]
    if engine == VLLM:
        return Settings(**{**asdict(s), "vllm_env": env, "vllm_flags": flags})
    return Settings(**{**asdict(s), "sglang_env": env, "sglang_flags": flags})


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
    env = s.vllm_env if engine == VLLM else s.sglang_env
    flags = s.vllm_flags if engine == VLLM else s.sglang_flags
    refusal = env_refusal(s.nccl_env) or env_refusal(env) or flags_refusal(flags)
    if refusal:
        return [], refusal
    lines = [f"export {k}={shlex.quote(v)}" for k, v in sorted(s.nccl_env.items())]
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(env.items()))
    command = COMMANDS[engine].format(tp=int(tp) if tp else "TP")
    lines.append(prefix + command + "".join(" " + shlex.quote(_unquoted(str(f))) for f in flags))
    return lines, None


def versions() -> dict[str, str]:
    """The engine versions whose facts the outputs use: installed here (or --engine-site), else built in."""
    return {"vllm": source.active(VLLM).version, "sglang": source.active(SGLANG).version, "nccl": NCCL_VERSION}


# --- settings that do nothing on a probed box ------------------------------------------------
# Users turn these on, nothing changes, and hours go into finding out why. Each rule names the
# version whose code it reads, so a release that changes the rule shows as a stale source.

NCCL_SYMMETRIC_PCIE_OFF = libs.NCCL_SYMMETRIC_PCIE_OFF


class InertSetting(NamedTuple):
    setting: str
    why: str
    source: str
    paths: tuple[tuple[str, str], ...] = ()     # the (engine, path id) pairs it leaves off


def nccl_version(snapshot: dict[str, Any]) -> tuple[int, ...] | None:
    """The NCCL torch carries, as recorded by the probe ('2.28.9'); None when unknown."""
    text = str((snapshot.get("software") or {}).get("nccl") or "")
    parts = text.split(".")
    return tuple(int(p) for p in parts) if parts and all(p.isdigit() for p in parts) else None


def _fusion_rules(cc: str) -> list[InertSetting]:
    if not cc.startswith("12."):
        return []
    return [
        InertSetting("vLLM compilation pass fuse_allreduce_rms (FlashInfer allreduce + RMSNorm fusion)",
                     f"turned on automatically at -O2 on SM90 and every SM10x only; its size table "
                     f"FI_ALLREDUCE_FUSION_MAX_SIZE_MB has no row for compute capability {cc}, so nothing is fused",
                     f"vLLM {VLLM_VERSION} config/vllm.py, compilation/passes/fusion/allreduce_rms_fusion.py",
                     ((VLLM, FLASHINFER_FUSED),)),
        InertSetting("SGLang --enable-flashinfer-allreduce-fusion",
                     f"an alias of --flashinfer-allreduce-fusion-backend=auto, which needs SM90 or SM10x: on compute "
                     f"capability {cc} the server fails at start-up ('FlashInfer allreduce fusion requires SM90 or "
                     "SM10X NVIDIA GPUs', raised while it sets up the workspaces); leave the flag out",
                     f"SGLang {SGLANG_VERSION} srt/layers/flashinfer_comm_fusion.py, srt/arg_groups/serving_hook.py",
                     ((SGLANG, FLASHINFER_FUSED),)),
    ]


def _symm_mem_rules(cc: str, multicast: bool) -> list[InertSetting]:
    out = []
    if cc == "12.0":
        out.append(InertSetting("vLLM VLLM_ALLREDUCE_USE_SYMM_MEM=1 (torch symmetric-memory allreduce, on by default)",
                                "SYMM_MEM_ALL_REDUCE_MAX_SIZES gives sizes for compute capability 9.0 and 10.x and "
                                "none for 12.0: no message takes this path",
                                f"vLLM {VLLM_VERSION} distributed/device_communicators/symm_mem.py",
                                ((VLLM, TORCH_SYMM_MEM),)))
    if not multicast:
        out.append(InertSetting("SGLang --enable-torch-symm-mem",
                                "the communicator disables itself when the GPUs have no multicast (PCIe GPUs never do)",
                                f"SGLang {SGLANG_VERSION} distributed/device_communicators/torch_symm_mem.py",
                                ((SGLANG, TORCH_SYMM_MEM),)))
    return out


def _custom_allreduce_rule(world_size: int, nvlink: bool) -> list[InertSetting]:
    if world_size <= 2 or nvlink:
        return []
    return [InertSetting("vLLM / SGLang custom allreduce (on by default: no --disable-custom-all-reduce needed to "
                         "turn it off here)",
                         f"above 2 GPUs it needs NVLink between every pair ('not supported on more than two "
                         f"PCIe-only GPUs'); at TP {world_size} without full NVLink both engines fall back to NCCL",
                         f"vLLM {VLLM_VERSION} distributed/device_communicators/custom_all_reduce.py; "
                         f"SGLang {SGLANG_VERSION} custom_all_reduce.py", ((VLLM, CUSTOM_AR), (SGLANG, CUSTOM_AR)))]


def _nccl_symmetric_rule(version: tuple[int, ...] | None, world_size: int, nvlink: bool) -> list[InertSetting]:
    if version is None or version < NCCL_SYMMETRIC_PCIE_OFF or nvlink or world_size < 2:
        return []
    shown = ".".join(str(p) for p in version)
    return [InertSetting("NCCL symmetric kernels (vLLM VLLM_USE_NCCL_SYMM_MEM=1, SGLang --enable-symm-mem, "
                         "NCCL_SYM_KERNEL)",
                         f"from NCCL 2.29.2 the built-in symmetric kernels run only on fully NVLink-connected systems "
                         f"(ncclSymkAvailable() is false otherwise): NCCL {shown} here uses its regular kernels",
                         libs.NCCL_SYMMETRIC_SOURCE, ((VLLM, NCCL_SYMM), (SGLANG, NCCL_SYMM)))]


def inert_settings(snapshot: dict[str, Any], world_size: int) -> list[InertSetting]:
    """Settings that change nothing at this world size on this box, each with why and the rule's source."""
    gpus_used = used_gpus(snapshot, world_size)
    if not gpus_used or len(used_hosts(snapshot, world_size)) > 1:
        return []
    gpus = snapshot["gpus"]
    cc = str(gpus[gpus_used[0]].get("compute_capability", "?"))
    distinct = sorted(set(gpus_used))
    nvlink = len(distinct) > 1 and nvlink_everywhere(snapshot, distinct)
    multicast = all((gpus[g].get("attributes") or {}).get("multicast") == 1 for g in distinct)
    rules = _fusion_rules(cc) + _symm_mem_rules(cc, multicast)
    if len(distinct) < len(gpus_used):
        return rules    # ranks share GPUs (an emulation): no fabric to read the NVLink gates from
    return (rules + _custom_allreduce_rule(world_size, nvlink)
            + _nccl_symmetric_rule(nccl_version(snapshot), world_size, nvlink))


# --- NVLink as the engines' gates read it (commbench.engines.paths applies them) ---------------

def _nvml_nvlink_all(snapshot: dict[str, Any], gpu_ids: list[int]) -> bool:
    """vLLM's is_fully_connected: NVML P2P status for the NVLINK index is OK on every pair."""
    for a, b in gpu_pairs(gpu_ids):
        nv = (p2p_entry(snapshot, a, b) or {}).get("nvml") or {}
        if nv.get("nvlink") != "OK":
            return False
    return True


def nvlink_everywhere(snapshot: dict[str, Any], gpu_ids: list[int]) -> bool:
    """NVLink between every pair, by the link matrix or by NVML (vLLM's is_fully_connected asks NVML)."""
    return full_nvlink(snapshot, gpu_ids) or _nvml_nvlink_all(snapshot, gpu_ids)
