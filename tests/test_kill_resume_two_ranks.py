"""Two learner ranks (FSDP2 over gloo, sharded checkpoints) killed inside a run end it bit-identical to an
uninterrupted run of the same seed: a rank SIGKILLed then ``--resume`` (as tests/test_kill_resume.py requires of
a single process), and under ``runtime.kind ray`` a rank actor lost inside an update, after which the driver
restarts every rank from the newest checkpoint. Both compare against one uninterrupted local 2-rank run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import SMOKE
from test_kill_resume import ARGS, ENV, comparable

from polyrl.checkpoint.faults import KILL_AT, KILL_ONCE
from polyrl.checkpoint.sharded import read_model_tensors
from tests.forkserver import ForkServer

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

STEPS = 3  # enough for both kill points
# No kill here lands inside a generation (the single-process test's long rollouts are for that): short ones.
WS2_ARGS = [*ARGS, f"train.steps={STEPS}", "learner.world_size=2", "learner.timeout_s=60", "rollout.max_new_tokens=32"]
WS2_KILL_POINTS = ["update:2+0.01", "ckpt_manifest:3"]  # inside an update, and inside a sharded save


@pytest.fixture(scope="module")
def polyrl():
    """``polyrl train SMOKE`` at world size 2 into ``out``, forked from one server (the launcher is forked; it
    spawns its ranks as a plain run does)."""
    server = ForkServer({**ENV, "RAY_AUTH_MODE": "disabled"})

    def run(out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
        argv = ["train", str(SMOKE), "--output", str(out), *WS2_ARGS, *extra]
        return server.run(argv, {KILL_AT: None, **(env or {})})

    yield run
    server.close()


@pytest.fixture(scope="module")
def reference(polyrl, tmp_path_factory) -> Path:
    """The uninterrupted local 2-rank run both tests end equal to."""
    out = tmp_path_factory.mktemp("two_ranks") / "reference"
    done = polyrl(out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(r["grad_norm"] > 0 for r in comparable(out / "metrics.jsonl"))  # every update moved the weights
    return out


def test_sigkill_of_two_ranks_resumes_bit_exactly(polyrl, reference, tmp_path):
    """A rank killed at any of these points ends the run with one line, and ``--resume`` continues it to the
    uninterrupted run's metrics, samples and weights, bit for bit."""
    run_dir = tmp_path / "run"
    for n, spec in enumerate(WS2_KILL_POINTS):
        done = polyrl(run_dir, *(["--resume"] if n else []), env={KILL_AT: spec})
        assert done.returncode == 2, f"{spec}: exit {done.returncode}\n{done.stderr[-2000:]}"
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("error: learner rank") and "SIGKILL" in last, last
    final = polyrl(run_dir, "--resume")
    assert final.returncode == 0, final.stderr[-3000:]

    ref_rows, rows = comparable(reference / "metrics.jsonl"), comparable(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for ref_row, row in zip(ref_rows, rows, strict=True):
        assert row == ref_row, f"step {row['step']} differs after resume"
    assert (run_dir / "trajectories.jsonl").read_text() == (reference / "trajectories.jsonl").read_text()
    last = f"checkpoints/step-{STEPS}"
    ref_weights, weights = read_model_tensors(reference / last), read_model_tensors(run_dir / last)
    assert ref_weights.keys() == weights.keys()
    assert all(torch.equal(ref_weights[k], weights[k]) for k in weights)


def test_learner_ranks_as_ray_actors_restart_from_the_checkpoint_when_one_is_lost(polyrl, reference, tmp_path):
    """runtime.kind ray: the ranks are actors in a placement group; one killed inside step 2's update takes
    every rank down, and the driver starts them again from step 1's checkpoint. The run ends with every step
    logged once and the uninterrupted local run's metrics and samples."""
    pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    killed = {KILL_AT: "update:2+0.01", KILL_ONCE: str(tmp_path / "killed-once")}
    run = polyrl(run_dir, "runtime.kind=ray", "runtime.ray_num_cpus=2", env=killed)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "killed-once").exists()  # the kill happened
    assert "restarting all ranks from the newest checkpoint" in run.stdout + run.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert comparable(run_dir / "metrics.jsonl") == comparable(reference / "metrics.jsonl")
    assert (run_dir / "trajectories.jsonl").read_text() == (reference / "trajectories.jsonl").read_text()
