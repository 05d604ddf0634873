"""The engines' own custom allreduce backends (sglang:*, vllm:*), on the CPU: registry and variant
parsing, the reason given where the library is missing, the engine settings that select them,
and the size rules each engine applies (SGLang's tuned table, vLLM's stage rule)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from commbench import engines
from commbench.backends import Options, expand, factory
from commbench.backends import sglang_custom_ar as sg
from commbench.backends import vllm_custom_ar as vl
from commbench.backends.base import BackendUnavailable, voted_rank0_first
from commbench.errors import UsageError

KB, MB = 1 << 10, 1 << 20
REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference" / "h200-mps-engine-kernels"


def names(spec: str) -> list[str]:
    return [b.name for b in expand([spec], Options(), on_gpu=True)]


def test_registry_and_variants() -> None:
    assert names("sglang") == ["sglang:1shot_push", "sglang:1shot_pull", "sglang:2shot_pull", "sglang:auto"]
    assert names("sglang:custom_ar") == names("sglang")
    assert names("sglang:auto") == ["sglang:auto"]
    assert names("vllm") == ["vllm:one_stage", "vllm:two_stage", "vllm:auto"]
    assert names("vllm:custom_ar") == names("vllm")
    assert names("vllm:auto,impl=flashinfer") == ["vllm:auto,impl=flashinfer"]
    assert names("vllm:custom_ar,impl=vllm") == ["vllm:one_stage,impl=vllm", "vllm:two_stage,impl=vllm",
                                                  "vllm:auto,impl=vllm"]
    assert factory("sglang").native and factory("vllm").native
    for bad in ("sglang:3shot", "vllm:three_stage", "vllm:auto,impl=nccl"):
        with pytest.raises(UsageError):
            expand([bad], Options(), on_gpu=True)


@pytest.fixture
def nothing_installed(monkeypatch: pytest.MonkeyPatch):
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    sg.import_reason.cache_clear()
    vl.import_reason.cache_clear()
    yield
    sg.import_reason.cache_clear()
    vl.import_reason.cache_clear()


def test_software_reason_names_the_install(nothing_installed: None) -> None:
    reason = sg.SglangCustomAllreduce("auto").software_reason()
    assert reason == ("sglang not installed: pip install sglang==0.5.23 --no-deps apache-tvm-ffi==0.1.11 "
                      "msgspec pybase64 orjson starlette pyzmq pydantic-core")
    assert "flashinfer-python not installed" in (vl.VllmCustomAllreduce("auto", "flashinfer").software_reason() or "")
    assert "vllm not installed" in (vl.VllmCustomAllreduce("auto", "vllm").software_reason() or "")
    # Without vLLM, the default implementation is FlashInfer's port.
    assert vl.default_impl() == "flashinfer"


def test_wrong_sglang_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metadata, "version", lambda name: "0.5.10")
    sg.import_reason.cache_clear()
    try:
        reason = sg.import_reason()
    finally:
        sg.import_reason.cache_clear()
    assert reason is not None and reason.startswith("sglang 0.5.10 installed; this backend follows SGLang 0.5.23")


def test_engine_settings() -> None:
    auto = sg.SglangCustomAllreduce("auto").engine_settings(4)
    assert auto.sglang_env == {"SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2": "1"} and auto.sglang_supported
    assert not auto.vllm_supported and engines.DISABLE_CUSTOM_ALLREDUCE not in auto.sglang_flags
    assert engines.SGLANG_ALGO_BY_SIZE not in auto.notes
    # A forced algorithm or stage is the engine's kernel, but no setting makes the engine run it.
    forced = sg.SglangCustomAllreduce("1shot_pull").engine_settings(4)
    assert forced.notes[0] == engines.SGLANG_ALGO_BY_SIZE
    assert not forced.sglang_supported and not forced.vllm_supported and not forced.sglang_env
    vauto = vl.VllmCustomAllreduce("auto", None).engine_settings(4)
    assert vauto.vllm_env == engines.VLLM_ONLY_CUSTOM_ALLREDUCE and vauto.vllm_supported
    assert not vauto.sglang_supported and engines.CUSTOM_AR_PCIE_GATE in vauto.notes
    stage = vl.VllmCustomAllreduce("two_stage", None).engine_settings(4)
    # VLLM_CUSTOM_ALLREDUCE_ALGO forces vLLM's stage: the stage is a setting a user can choose
    assert stage.notes[0] == engines.VLLM_STAGE_FORCED and stage.vllm_supported and not stage.sglang_supported
    assert stage.vllm_env["VLLM_CUSTOM_ALLREDUCE_ALGO"] == "2stage"
    assert engines.declared_paths(stage) == {"vllm": {"path": engines.CUSTOM_AR, "stand_in": False}}


@pytest.mark.parametrize("world, size, graph, eager", [
    (2, 4 * KB, "1shot_push", "1shot_push"),
    (2, 8 * MB, "1shot_push", "1shot_push"),
    (2, 20 * MB, None, None),                       # above SGLang's 16 MiB default workspace: NCCL
    (4, 384 * KB, "1shot_push", "1shot_push"),
    (4, 512 * KB, "2shot_pull", "1shot_push"),      # graph and eager crossovers differ
    (4, 1 * MB, "2shot_pull", "2shot_pull"),
    (8, 128 * KB, "1shot_push", "1shot_push"),
    (8, 256 * KB, "2shot_pull", "2shot_pull"),
    (8, 4 * KB + 8, None, None),                    # not a multiple of 16 bytes: SGLang uses NCCL
])
def test_sglang_choice_from_its_sm90_table(world: int, size: int, graph: str | None, eager: str | None) -> None:
    assert sg.sglang_choice(sg.SM90_TABLE, world, size) == {"graph": graph, "eager": eager}


def test_vendored_table_is_what_the_installed_sglang_held() -> None:
    """The reference runs recorded SGLang's installed table on every row (H200, SM90): the facts
    kept here for the CPU side must be the same numbers."""
    for world in (2, 4, 8):
        run = next((REFERENCE / f"world{world}").iterdir())
        rows = [json.loads(line) for line in (run / "measurements.jsonl").read_text().splitlines()]
        row = next(r for r in rows if r["backend"] == "sglang:auto" and r["status"] == "ok")
        graph, eager = sg.SM90_TABLE[world]
        assert row["extra"]["table"] == {"graph": graph.__dict__, "eager": eager.__dict__}
        assert row["extra"]["sglang_choice"] == sg.sglang_choice(sg.SM90_TABLE, world, row["message_bytes"])


@pytest.mark.parametrize("world, size, stage", [
    (2, 8 * MB, "1stage"), (4, 512 * KB - 16, "1stage"), (4, 512 * KB, "2stage"),
    (6, 256 * KB - 16, "1stage"), (8, 256 * KB, "2stage"),
])
def test_vllm_kernel_stage(world: int, size: int, stage: str) -> None:
    assert vl.kernel_stage(world, size) == stage


def test_vllm_supports_the_sizes_of_its_stage() -> None:
    one, two, auto = (vl.VllmCustomAllreduce(v, "flashinfer") for v in ("one_stage", "two_stage", "auto"))
    for backend in (one, two, auto):
        backend._world_size = 4
    import torch

    bf16 = torch.bfloat16
    assert one.supports(64 * KB, bf16) is None and two.supports(64 * KB, bf16) is not None
    assert one.supports(1 * MB, bf16) is not None and two.supports(1 * MB, bf16) is None
    assert auto.supports(8 * MB - 16, bf16) is None
    assert "hands 8388608 B to NCCL" in (auto.supports(8 * MB, bf16) or "")
    assert "multiple of 16" in (auto.supports(4 * KB + 2, bf16) or "")
    assert vl.VllmCustomAllreduce("auto", None).world_size_reason(3) is not None


def test_voted_rank0_first_runs_rank0_then_the_others() -> None:
    order: list[str] = []

    def ctx(rank: int) -> SimpleNamespace:
        return SimpleNamespace(rank=rank, all_gather_objects=lambda obj: [obj, None])

    assert voted_rank0_first(ctx(0), "build", lambda: order.append("rank0") or 1) == 1
    assert voted_rank0_first(ctx(1), "build", lambda: order.append("rank1") or 2) == 2
    assert order == ["rank0", "rank1"]

    def broken() -> None:
        raise RuntimeError("nvcc failed")

    with pytest.raises(BackendUnavailable, match="build failed on rank 0: RuntimeError: nvcc failed"):
        voted_rank0_first(ctx(0), "build", broken)


def test_sglang_hands_its_kernels_own_tensor_to_the_harness_with_no_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's kernel returns a tensor of its own: the backend returns it as it is (no copy into
    the harness's buffer, which SGLang's caller never makes), eager and in place alike."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)   # eager calls, no CUDA here
    backend = sg.SglangCustomAllreduce("1shot_push")
    calls: list[tuple[int, str]] = []

    def all_reduce(comm: object, flat: torch.Tensor, algo: str, row: object, multicast: bool) -> torch.Tensor:
        calls.append((flat.data_ptr(), algo))
        return flat * 2 if algo == "1shot_push" else flat   # a fresh tensor, or the input (in place)

    backend._comm, backend._graph_params = object(), torch.zeros(1)
    backend._module = SimpleNamespace(all_reduce=all_reduce)
    x = torch.arange(8, dtype=torch.float32)
    result = backend.allreduce(x, x)
    assert torch.equal(result, torch.arange(8, dtype=torch.float32) * 2)
    assert torch.equal(x, torch.arange(8, dtype=torch.float32))        # nothing copied back into x
    backend.algo = "2shot_pull"
    assert backend.allreduce(x, x).data_ptr() == x.data_ptr()
    assert calls == [(x.data_ptr(), "1shot_push"), (x.data_ptr(), "2shot_pull")]
