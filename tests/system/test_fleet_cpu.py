"""A fleet run for real on the CPU: five "nodes", each the Slurm script (deploy/slurm) with srun
shimmed only for its process launch (tests/fakes/slurm/srun: one process per task, Slurm's task
variables set), each a 2-rank gloo sweep; node-05 made slower by a known amount (testfaults:slow
sleeps 150 ms a call there, 0 elsewhere). fleet build + fleet qualify must name node-05 and only
it, with its reason, in text, JSON, JUnit and the Prometheus textfile."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from helpers import child_env, run_cli

REPO = Path(__file__).parents[2]
SCRIPT = REPO / "deploy" / "slurm" / "commbench-node.sbatch"
SHIM = Path(__file__).parents[1] / "fakes" / "slurm"
# Five: the fewest where one slow node stands out of a median (fleet qualify asks for 3 or more)
# with room to spare; each node is 2 ranks of torch start-up on CI's 2 cores.
NODES = [f"node-{i:02d}" for i in range(1, 6)]
SLOW = "node-05"
DELAY_US = 150000
JOB = "4242"
AT_ONCE = 4   # nodes launched together: 8 processes on 2 cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(root: Path, node: str) -> dict[str, str]:
    delay = DELAY_US if node == SLOW else 0
    return child_env({
        "PATH": os.pathsep.join([str(SHIM), str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "COMMBENCH_RESULTS": str(root), "COMMBENCH_PYTHON": sys.executable, "SLURMD_NODENAME": node,
        "SLURM_JOB_ID": JOB, "GPUS_PER_NODE": "2", "MASTER_PORT": str(free_port()),
        "COMMBENCH_SWEEP_ARGS": f"--backends testfaults:slow@{delay} --sizes 1K -d fp32 -n 10 -w 1 --no-probe"})


@pytest.fixture(scope="module")
def fleet_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The nodes' runs under one shared results root, as the Slurm script lays them out.
    AT_ONCE run at a time, the slow node first: its sleeps overlap the other nodes' starts
    instead of holding up a batch at its end."""
    root = tmp_path_factory.mktemp("shared") / "results"
    logs = root.parent / "logs"
    logs.mkdir()
    waiting = sorted(NODES, key=lambda node: node != SLOW)
    running: dict[str, subprocess.Popen] = {}
    deadline = time.monotonic() + 480
    while waiting or running:
        while waiting and len(running) < AT_ONCE:
            node = waiting.pop(0)
            with (logs / node).open("w") as log:
                running[node] = subprocess.Popen(["bash", str(SCRIPT)], stdout=log, stderr=subprocess.STDOUT,
                                                 env=node_env(root, node), cwd=root.parent)
        for node in [node for node, proc in running.items() if proc.poll() is not None]:
            out = (logs / node).read_text()
            assert running.pop(node).returncode == 0, f"{node}: {out[-3000:]}"
            assert f"commbench-node: {node} job {JOB} wrote {root}/{node}/{JOB}/" in out
        assert time.monotonic() < deadline, f"still running: {sorted(running)}"
        time.sleep(0.1)
    return root


@pytest.mark.procs
@pytest.mark.slow
def test_the_slurm_script_writes_one_run_per_node_named_by_node_and_job(fleet_root: Path) -> None:
    for node in NODES:
        runs = list((fleet_root / node / JOB).iterdir())
        assert len(runs) == 1
        info = json.loads((runs[0] / "run.json").read_text())
        assert info["world_size"] == 2
        assert info["env"]["COMMBENCH_NODE"] == node and info["env"]["COMMBENCH_JOB"] == JOB
        assert info["env"]["NCCL_NVLS_ENABLE"] == "0" and info["env"]["NVSHMEM_DISABLE_NVLS"] == "1"


@pytest.mark.procs
@pytest.mark.slow
def test_fleet_build_and_qualify_name_the_slow_node_only(fleet_root: Path, tmp_path: Path) -> None:
    fleet = tmp_path / "fleet"
    built = run_cli(["fleet", "build", str(fleet_root), "--out", str(fleet)])
    assert built.returncode == 0, built.stderr
    assert f"added {len(NODES)} run(s)" in built.stdout
    assert f"cpu, 2 ranks, no GPU: {len(NODES)} node(s)" in built.stdout
    junit, prom, report = tmp_path / "fleet.xml", tmp_path / "fleet.prom", tmp_path / "fleet.json"
    # Gloo on two shared cores is noisy (1-3 ms a call, and a node whose processes wait for a core
    # several times that): the minimum effect asks for 20x the median; the slow node is 150 ms a
    # call, over 20x any median below 7.5 ms.
    done = run_cli(["fleet", "qualify", str(fleet), "--min-effect-pct", "1900", "--junit", str(junit),
                    "--prometheus", str(prom), "--json", str(report), "--wide"])
    assert done.returncode == 1, done.stdout + done.stderr
    text = done.stdout
    assert f"-> FAIL: {SLOW}\n" in text, text
    assert f"FAIL {SLOW} (job {JOB}):\n  outlier_vs_fleet: fleet: testfaults:slow (eager fp32) latency vs group" in text
    assert [line.split()[0] for line in text.splitlines() if line.startswith("FAIL ")] == ["FAIL"]
    verdicts = json.loads(report.read_text())
    assert verdicts["failed_nodes"] == [SLOW]
    assert {n["node"]: n["reasons"] for n in verdicts["nodes"] if n["status"] == "FAIL"} == {SLOW: ["outlier_vs_fleet"]}
    failures = [(case.get("classname"), f.get("type")) for case in ET.parse(junit).iter("testcase")
                for f in case.iter("failure")]
    assert failures == [(f"commbench.fleet.{SLOW}.{JOB}", "outlier_vs_fleet")]
    assert len(list(ET.parse(junit).iter("testcase"))) == len(NODES) * 3   # node x check: two workload checks, one fleet
    lines = prom.read_text().splitlines()
    failed = [l for l in lines if l.startswith("commbench_node_check_failed")]
    assert len(failed) == 1 and f'node="{SLOW}"' in failed[0] and 'reason="outlier_vs_fleet"' in failed[0]
    qualified = [l for l in lines if l.startswith("commbench_node_qualified")]
    assert sorted(l.split()[-1] for l in qualified) == ["0"] + ["1"] * (len(NODES) - 1)
    assert [l for l in qualified if l.endswith(" 0")][0].startswith(f'commbench_node_qualified{{node="{SLOW}",'
                                                                   f'slurm_job_id="{JOB}",nranks="2"')
    assert any('backend="testfaults:slow"' in l and 'message_size="1024"' in l for l in lines)


@pytest.mark.procs
def test_the_fleet_modules_import_no_torch() -> None:
    modules = sorted(f"commbench.fleet.{p.stem}" for p in (REPO / "commbench" / "fleet").glob("*.py"))
    code = ("import sys\nsys.modules['torch'] = None\n" + "".join(f"import {m}\n" for m in modules)
            + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' and sys.modules[m] is not None))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
