"""The --nproc driver (commbench/sweep/launcher.py, mps.py): its own flags and the children's, MPS
shares, the multicast policy, a child per preloaded NCCL."""

from __future__ import annotations

import pytest

from commbench import backends
from commbench.backends.mscclpp.backend import MscclppOptions
from commbench.errors import UsageError
from commbench.sweep.launcher import child_arguments, parse_env_settings


def test_driver_splits_its_own_flags_from_the_childrens() -> None:
    argv = ["--nproc", "8", "--env=NCCL_MAX_CTAS=8,16", "-b", "4K", "--env", "NCCL_NTHREADS=256", "--mps",
            "--share-gpus", "--child-timeout", "60", "--resume=x", "--backends", "nccl"]
    assert child_arguments(argv) == ["-b", "4K", "--share-gpus", "--backends", "nccl"]
    settings = parse_env_settings(["NCCL_MAX_CTAS=8,16", "NCCL_NTHREADS=256"], allow_multicast=False)
    assert settings == [{"NCCL_MAX_CTAS": "8", "NCCL_NTHREADS": "256"}, {"NCCL_MAX_CTAS": "16", "NCCL_NTHREADS": "256"}]


def test_mps_clients_get_an_equal_share_of_their_gpu() -> None:
    from commbench.sweep.mps import client_env

    assert client_env(8, 1) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "12"}
    assert client_env(2, 1) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
    assert client_env(8, 2) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    assert client_env(3, 8) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}


def test_driver_never_turns_multicast_on_under_a_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    with pytest.raises(UsageError, match="multicast"):
        parse_env_settings(["NCCL_NVLS_ENABLE=1"], allow_multicast=True)
    assert parse_env_settings(["NCCL_NVLS_ENABLE=0"], allow_multicast=False) == [{"NCCL_NVLS_ENABLE": "0"}]


@pytest.mark.procs
def test_driver_gives_a_preloaded_nccl_replacement_its_own_child(tmp_path) -> None:
    from commbench.sweep.launcher import child_runs

    library = tmp_path / "libmscclpp_nccl.so"
    library.write_bytes(b"")
    options = backends.Options(families={"mscclpp": MscclppOptions(str(library))})
    variants = backends.expand(["nccl", "mscclpp:shim"], options, True)
    argv = ["--nproc", "8", "--backends", "nccl,mscclpp:shim", "-b", "4K", "--mscclpp-nccl-lib", str(library)]
    runs = child_runs(argv, [], variants, allow_multicast=False)
    assert runs[0] == ({}, ["--backends", "nccl,mscclpp:shim", "-b", "4K", "--mscclpp-nccl-lib", str(library)])
    env, args = runs[1]
    assert env == {"LD_PRELOAD": str(library.resolve()), "MSCCLPP_FORCE_DISABLE_NVLS": "1"}
    assert args == ["-b", "4K", "--mscclpp-nccl-lib", str(library), "--backends", "mscclpp:shim"]
    assert len(runs) == 2
    # Ranks that share a GPU: the shim needs one GPU per rank, so the first child's rows say why
    # and no preloaded child is started to say it again.
    assert child_runs(argv, [], variants, allow_multicast=False, shares_gpus=True) == runs[:1]
