"""deploy/: the Kubernetes manifests against the Kubernetes schemas (kubernetes-validate, offline)
and the TrainJob against the committed schema written from Kubeflow Trainer's CRD; the Slurm
script's refusals. The Slurm script's real run is tests/system/test_fleet_cpu.py's fixture."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).parents[2] / "deploy"
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "k8s" / name).read_text())


def env_of(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in entries}


def test_the_indexed_job_validates_and_runs_one_pod_per_node_with_multicast_off() -> None:
    job = load("commbench-node-job.yaml")
    kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"] == spec["template"]["metadata"]["labels"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
    env = env_of(container["env"])
    assert MULTICAST_OFF.items() <= env.items()
    assert env["COMMBENCH_NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert '"$COMMBENCH_RESULTS/$COMMBENCH_NODE/$COMMBENCH_JOB"' in container["args"][0]


def test_a_broken_job_fails_the_schema() -> None:
    job = load("commbench-node-job.yaml")
    broken = copy.deepcopy(job)
    broken["spec"]["template"]["spec"]["containers"][0]["resource"] = {}   # a typo of resources
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)
    broken = copy.deepcopy(job)
    broken["spec"]["completions"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_the_trainjob_validates_against_the_trainer_schema() -> None:
    schema = json.loads((DEPLOY / "k8s" / "schema" / "trainjob-v1alpha1.json").read_text())
    job = load("commbench-trainjob.yaml")
    jsonschema.validate(job, schema)
    trainer = job["spec"]["trainer"]
    assert MULTICAST_OFF.items() <= env_of(trainer["env"]).items()
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    assert "torchrun --standalone" in trainer["args"][0]
    for path, value in ((("trainer", "numNode"), 4), (("runtimeRef", "name"), ""), (("trainer", "numNodes"), "4")):
        broken = copy.deepcopy(job)
        broken["spec"][path[0]][path[1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)


@pytest.mark.procs
def test_the_slurm_script_refuses_without_a_results_root(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "COMMBENCH_RESULTS"}
    done = subprocess.run(["bash", str(DEPLOY / "slurm" / "commbench-node.sbatch")], capture_output=True, text=True,
                          env=env, timeout=30, cwd=tmp_path)
    assert done.returncode != 0 and "set COMMBENCH_RESULTS" in done.stderr and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- each attempt its own run (issue 56)

# Stand-ins for the commands the scripts run, generated per test: a sweep makes one new run dir
# under its --out (as commbench's does: a new folder per run), qualify prints what it was given.
FAKE_COMMBENCH = r'''#!/usr/bin/env bash
set -eu
while [[ $# -gt 0 && "$1" != sweep && "$1" != qualify ]]; do shift; done
what="$1"; shift
if [[ "$what" == sweep ]]; then
    while [[ "$1" != --out ]]; do shift; done
    run="$2/$(date +%Y%m%d-%H%M%S%N)-attempt"
    mkdir -p "$run" && echo '{}' > "$run/run.json"
else
    echo "QUALIFY $*"
fi
'''


def fakes(folder: Path) -> Path:
    folder.mkdir()
    for name in ("python", "torchrun", "commbench"):
        (folder / name).write_text(FAKE_COMMBENCH)
        (folder / name).chmod(0o755)
    return folder


def attempt(script: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(script, capture_output=True, text=True, env=env, timeout=60, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def qualified(done: subprocess.CompletedProcess) -> Path:
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("QUALIFY ")]
    return Path(line.split("--spec spec.toml ", 1)[1].split(" --junit", 1)[0])


@pytest.mark.procs
def test_a_requeued_slurm_job_qualifies_its_own_run_and_node_names_stay_inside(tmp_path: Path) -> None:
    bin_dir = fakes(tmp_path / "bin")
    root = tmp_path / "shared" / "results"
    env = {**os.environ, "PATH": os.pathsep.join([str(DEPLOY.parent / "tests" / "fakes" / "slurm"), str(bin_dir),
                                                    os.environ["PATH"]]),
           "COMMBENCH_RESULTS": str(root), "COMMBENCH_PYTHON": str(bin_dir / "python"), "COMMBENCH_SPEC": "spec.toml",
           "SLURMD_NODENAME": "gpu-7", "SLURM_JOB_ID": "4242", "GPUS_PER_NODE": "1"}
    script = ["bash", str(DEPLOY / "slurm" / "commbench-node.sbatch")]
    first = qualified(attempt(script, env, tmp_path))
    second = qualified(attempt(script, env, tmp_path))   # requeued: the same node and job id
    runs = sorted((root / "gpu-7" / "4242").glob("*-attempt"))
    assert len(runs) == 2 and [first, second] == [Path(f"{r}/") for r in runs] and first != second
    for name in ("../../x", "..", ".hidden", "a/../../b"):
        done = attempt(script, {**env, "SLURMD_NODENAME": name}, tmp_path)
        run = qualified(done).resolve()
        assert run.is_relative_to(root.resolve()) and run.parent.parent.parent == root.resolve(), (name, run)
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["results"]


@pytest.mark.procs
@pytest.mark.parametrize("manifest", ["commbench-node-job.yaml", "commbench-trainjob.yaml"])
def test_a_retried_pod_qualifies_its_own_run(manifest: str, tmp_path: Path) -> None:
    doc = load(manifest)
    spec = doc["spec"]
    container = spec["trainer"] if "trainer" in spec else spec["template"]["spec"]["containers"][0]
    assert container["command"] == ["bash", "-c"]
    bin_dir = fakes(tmp_path / "bin")
    root = tmp_path / "results"
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"]]), "COMMBENCH_RESULTS": str(root),
           "COMMBENCH_NODE": "gpu-7", "COMMBENCH_JOB": "commbench-node-uid", "COMMBENCH_SPEC": "spec.toml",
           "GPUS_PER_NODE": "8", "COMMBENCH_SWEEP_ARGS": "-b 4K"}
    first, second = (qualified(attempt(["bash", "-c", container["args"][0]], env, tmp_path)) for _ in range(2))
    runs = sorted((root / "gpu-7" / "commbench-node-uid").glob("*-attempt"))
    assert [first, second] == [Path(f"{r}/") for r in runs] and first != second
