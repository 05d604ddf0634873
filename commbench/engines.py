"""Paste-ready settings that select a measured backend in NCCL, vLLM and SGLang.

Facts come from reference/backends.md (vLLM 0.33.0, SGLang 0.5.23, NCCL 2.30.7): vLLM's
dispatch order, its environment variables and gates, SGLang's flags. Where an engine has no
switch for a path, the settings say so instead of inventing one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"
NCCL_VERSION = "2.30.7"

# vLLM tries FlashInfer and torch symm-mem before/around its custom allreduce (dispatch order in
# cuda_communicator.py); turning the others off makes the chosen path the one that runs.
_VLLM_ONLY_NCCL = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_ALLREDUCE_USE_FLASHINFER": "0"}
_VLLM_PCIE_GATE = ("vLLM enables its custom allreduce for more than 2 GPUs only when every pair is "
                   "NVLink-connected; on PCIe at TP>2 it stays off whatever you set (vLLM #56128)")


@dataclass
class Settings:
    variant: str
    nccl_env: dict[str, str] = field(default_factory=dict)
    vllm_env: dict[str, str] = field(default_factory=dict)
    vllm_flags: list[str] = field(default_factory=list)
    sglang_env: dict[str, str] = field(default_factory=dict)
    sglang_flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    vllm_supported: bool = True
    sglang_supported: bool = True


def _options(variant: str) -> dict[str, str]:
    out = {}
    for part in variant.split(","):
        key, _, value = part.strip().partition("=")
        if key:
            out[key.strip().lower()] = value.strip() or key.strip()
    return out


def settings_for(backend: str, env_setting: dict[str, str], world_size: int | None) -> Settings:
    family, _, variant = backend.partition(":")
    opts = _options(variant)
    s = Settings(backend, nccl_env=dict(env_setting))
    if family == "nccl":
        if "proto" in opts:
            s.nccl_env["NCCL_PROTO"] = opts["proto"]
            if "LL128" in opts["proto"].upper():
                s.notes.append("LL128 forced off NVLink can corrupt data silently (NVIDIA/nccl #786, #1261): "
                               "keep it only where this run's correctness check passed on the same fabric")
        if "algo" in opts:
            s.nccl_env["NCCL_ALGO"] = opts["algo"]
        if "symm" in variant or "symmetric" in variant:
            s.vllm_env = {"VLLM_USE_NCCL_SYMM_MEM": "1", "NCCL_CUMEM_ENABLE": "1"}
            s.notes.append("vLLM uses NCCL symmetric memory only from 4 ranks and prefers its custom allreduce "
                           "for 16-512 KiB at TP4 and 16-128 KiB at TP8 (NCCL_SYMM_MEM_ALL_REDUCE_CONFIG)")
            s.sglang_supported = False
        else:
            s.vllm_env = dict(_VLLM_ONLY_NCCL)
            s.vllm_flags = ["--disable-custom-all-reduce"]
            s.sglang_flags = ["--disable-custom-all-reduce"]
        if s.nccl_env:
            s.notes.append("NCCL_* variables apply to every NCCL communicator of the process, not only TP")
    elif family == "p2p":
        s.vllm_env = {"VLLM_ALLREDUCE_USE_FLASHINFER": "0", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
        s.notes.append("custom CUDA-IPC allreduce is on by default in both engines (do not pass "
                       "--disable-custom-all-reduce); they pick one-shot or two-shot by size themselves")
        if world_size is None or world_size > 2:
            s.notes.append(_VLLM_PCIE_GATE + "; SGLang's custom allreduce has the same gate")
            s.notes.append("on PCIe hosts without NVLink the upstream alternative is FlashInfer's PCIe IPC "
                           "allreduce: VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1 (opt-in, bf16/fp16, 2/4/8 ranks)")
    elif family == "symm_mem":
        s.vllm_env = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "1", "VLLM_ALLREDUCE_USE_FLASHINFER": "0"}
        s.sglang_flags = ["--enable-torch-symm-mem"]
        s.notes.append("vLLM and SGLang turn their symm-mem communicator off when multicast is unavailable, "
                       "even for two-shot (vLLM #50179); with multicast they use multimem at 4/6/8 ranks on SM90")
        if "multimem" in variant:
            s.notes.append("multimem needs NVSwitch multicast: never on PCIe, nor where NCCL_NVLS_ENABLE=0 / "
                           "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is policy")
    elif family == "flashinfer":
        if "pcie" in variant:
            s.vllm_env = {"VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC": "1"}
            s.sglang_supported = False
            s.notes.append("SGLang integrates FlashInfer PCIe IPC in sglang #34528; no released flag is listed "
                           "in reference/backends.md")
        else:
            s.vllm_env = {"VLLM_ALLREDUCE_USE_FLASHINFER": "1", "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm"}
            s.sglang_flags = ["--flashinfer-allreduce-fusion-backend", "trtllm"]
            s.notes.append("use trtllm, never auto: auto picks mnnvl, which creates multicast objects")
            if "fused" in variant:
                s.vllm_flags = ["--compilation-config", '\'{"pass_config": {"fuse_allreduce_rms": true}}\'']
                s.notes.append("the fused allreduce+residual+RMSNorm timing includes the norm: compare it "
                               "with allreduce + a separate RMSNorm, not with a bare allreduce")
            s.notes.append("FlashInfer's trtllm kernels are built for SM 9.x/10.x/12.x only (not RTX 4090 / L40)")
    elif family == "mscclpp":
        s.sglang_flags = ["--enable-mscclpp"]
        s.sglang_env = {"MSCCLPP_FORCE_DISABLE_NVLS": "1"}
        s.vllm_supported = False
        s.notes.append("vLLM has no MSCCL++ path; the NCCL-API shim (LD_PRELOAD libmscclpp_nccl.so) "
                       "replaces NCCL underneath any engine")
        s.notes.append("SGLang's MSCCL++ needs 4+ consecutive ranks and runs only inside CUDA graphs")
    elif family == "unfused":
        s.vllm_supported = s.sglang_supported = False
        s.notes.append("the unfused baseline is plain allreduce + a separate residual add and RMSNorm: what "
                       "engines run when fusion is off; pick the allreduce backend it used instead")
    elif family == "gloo":
        s.vllm_supported = s.sglang_supported = False
        s.notes.append("gloo is the CPU backend: this run measured the host, not GPUs, and no engine "
                       "serves decode through it")
    else:
        s.vllm_supported = s.sglang_supported = False
        s.notes.append(f"no engine mapping known for backend family {family!r}")
    return s


def render(s: Settings, tp: int | None) -> str:
    """Shell-ready blocks for one backend; the NCCL block is exported once for either engine."""
    size = str(tp) if tp else "TP"
    lines = []
    if s.nccl_env:
        lines.append(f"# NCCL environment (NCCL {NCCL_VERSION} semantics), for either engine")
        lines.extend(f"export {k}={v}" for k, v in sorted(s.nccl_env.items()))
    if s.vllm_supported:
        lines.append(f"# vLLM {VLLM_VERSION}")
        env = " ".join(f"{k}={v}" for k, v in sorted(s.vllm_env.items()))
        lines.append(f"{env + ' ' if env else ''}vllm serve MODEL --tensor-parallel-size {size}"
                     f"{' ' + ' '.join(s.vllm_flags) if s.vllm_flags else ''}")
    else:
        lines.append(f"# vLLM {VLLM_VERSION}: no setting selects this path")
    if s.sglang_supported:
        lines.append(f"# SGLang {SGLANG_VERSION}")
        env = " ".join(f"{k}={v}" for k, v in sorted(s.sglang_env.items()))
        lines.append(f"{env + ' ' if env else ''}python -m sglang.launch_server --model-path MODEL --tp {size}"
                     f"{' ' + ' '.join(s.sglang_flags) if s.sglang_flags else ''}")
    else:
        lines.append(f"# SGLang {SGLANG_VERSION}: no setting selects this path")
    lines.extend(f"# note: {n}" for n in s.notes)
    return "\n".join(lines)
