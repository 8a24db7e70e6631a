"""SIGKILL and resume under the runtimes that overlap rollouts with updates (async with eta 1 and 2, Ray's
driver): no sample lost and none trained twice, counted by id against an uninterrupted run; the staleness
bound holds; the metrics continue step by step. Bit-exactness is not the promise when eta > 0 (which policy
version sampled a batch depends on timing): every step trains on the same drawn items as the uninterrupted
run, each once. Worker and learner-rank kills under Ray are in tests/test_runtime_ray.py."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import SMOKE

from polyrl.checkpoint.faults import KILL_AT
from tests.forkserver import ForkServer

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

STEPS, GROUP = 5, 2
ARGS = [
    f"train.steps={STEPS}", "train.checkpoint_every=1", "eval.before=false", "eval.after=false",
    "logging.tensorboard=false", "logging.report=false", "logging.progress=false",
    f"rollout.group_size={GROUP}", f"logging.trajectories_per_group={GROUP}",  # every sample on file
    "algorithm.regularisers.entropy_coef=0.01",
]
@pytest.fixture(scope="module")
def cli():
    """``polyrl`` runs forked from one server (tests/forkserver.py): real processes, real kills."""
    server = ForkServer({"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", KILL_AT: None})
    yield server
    server.close()


def _train(cli, run_dir, extra: list[str], kill_at: str | None = None, resume: bool = False,
           env: dict | None = None) -> subprocess.CompletedProcess:
    argv = ["train", str(SMOKE), "-o", str(run_dir), *ARGS, *extra, *(["--resume"] if resume else [])]
    return cli.run(argv, {**({KILL_AT: kill_at} if kill_at else {}), **(env or {})})


def _rows(run_dir, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def _draws(run_dir) -> dict[int, Counter]:
    """Per step, how many samples of each (group, task, item) were trained on."""
    out: dict[int, Counter] = {}
    for r in _rows(run_dir, "trajectories.jsonl"):
        out.setdefault(r["step"], Counter())[(r["group_id"], r["task"], r["item_id"])] += 1
    return out


def _started_with(marker: str) -> list[int]:
    """Processes alive (zombies count as ended) whose environment at start held ``marker``: what a run started."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            state = (proc / "stat").read_text().rsplit(") ", 1)[1][0]
            if state != "Z" and marker.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except (OSError, IndexError, ValueError):  # not a process, or one that ended meanwhile
            pass
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cli):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    done = _train(cli, run_dir, [])
    assert done.returncode == 0, done.stderr[-2000:]
    return _draws(run_dir)


CASES = {
    "async eta 1, killed inside an update": (["runtime.kind=async", "runtime.eta=1"], "update:3+0.01", 1),
    "async eta 2, killed before a checkpoint": (["runtime.kind=async", "runtime.eta=2"], "logged:2", 2),
    "ray driver eta 1, killed inside an update": (
        ["runtime.kind=ray", "runtime.eta=1", "runtime.num_workers=1", "runtime.ray_num_cpus=2"], "update:3+0.01", 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_run_resumes_with_nothing_lost_or_repeated(case, cli, reference, tmp_path):
    extra, kill_at, eta = CASES[case]
    run_dir = tmp_path / "run"
    marker = f"POLYRL_TEST_RUN={tmp_path}"
    killed = _train(cli, run_dir, extra, kill_at=kill_at, env={"POLYRL_TEST_RUN": str(tmp_path)})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]  # the kill landed
    if "runtime.kind=async" in extra:  # the rollout process sees its learner gone and ends, and its fork server
        deadline = time.monotonic() + 30
        while _started_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _started_with(marker), "the killed learner's rollout process lingers"
    resumed = _train(cli, run_dir, extra, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr

    assert [m["step"] for m in _rows(run_dir, "metrics.jsonl")] == list(range(1, STEPS + 1))
    draws = _draws(run_dir)
    assert draws == reference  # the same items at every step, each sample once: none lost, none twice
    assert all(n == GROUP for step in draws.values() for n in step.values())
    for r in _rows(run_dir, "trajectories.jsonl"):  # the staleness bound, across the restart too
        versions = [v for v, m in zip(r["versions"], r["loss_mask"], strict=True) if m]
        assert min(versions) >= r["step"] - 1 - eta and max(versions) <= r["step"] - 1, r["step"]
