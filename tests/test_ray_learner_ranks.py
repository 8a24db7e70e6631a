"""The Ray runtime's learner ranks: ``runtime.kind ray`` with ``learner.world_size`` 2 places the ranks as
actors; one lost inside an update restarts every rank from the newest checkpoint, and the run ends as an
uninterrupted local run. A cluster too small for the ranks and workers is one line before Ray starts. Runs are
forked from the tests' server (conftest ``polyrl_cli``), one thread each. Rollout workers under Ray:
tests/test_runtime_ray.py."""

import json

import pytest
from conftest import SMOKE
from test_runtime_ray import BASE

from polyrl.checkpoint.faults import KILL_AT

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

pytest.importorskip("ray")


def _lines(path, name):
    return [json.loads(line) for line in (path / name).read_text().splitlines()]


def test_learner_ranks_as_actors_restart_from_the_checkpoint_when_one_is_lost(tmp_path, polyrl_cli):
    """runtime.kind ray with learner.world_size 2: the ranks are actors in a placement group; one killed
    inside step 2's update takes every rank down, and the driver starts them again from step 1's checkpoint.
    The run ends with every step logged once and the same metrics as an uninterrupted local 2-rank run."""
    from polyrl.checkpoint.faults import KILL_ONCE

    args = ["eval.before=false", "eval.after=false", "logging.report=false", "logging.tensorboard=false",
            "train.steps=3", "train.checkpoint_every=1", "algorithm.regularisers.entropy_coef=0.05", "optim.lr=0.01",
            "learner.world_size=2", "learner.timeout_s=60"]
    env = {"RAY_AUTH_MODE": "disabled", KILL_AT: None}  # forked runs (conftest polyrl_cli), one thread each
    ref = polyrl_cli.run(["train", str(SMOKE), "-o", str(tmp_path / "ref"), *args], env)
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = {**env, KILL_AT: "update:2+0.01", KILL_ONCE: str(tmp_path / "killed-once")}
    run = polyrl_cli.run(["train", str(SMOKE), "-o", str(tmp_path / "run"), *args, "runtime.kind=ray",
                          "runtime.ray_num_cpus=2"], killed)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "killed-once").exists()  # the kill happened
    assert "restarting all ranks from the newest checkpoint" in run.stdout + run.stderr
    rows = _lines(tmp_path / "run", "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    ref_rows = _lines(tmp_path / "ref", "metrics.jsonl")
    for a, b in zip(ref_rows, rows, strict=True):
        assert {k: v for k, v in a.items() if not k.endswith("_s")} == {k: v for k, v in b.items()
                                                                        if not k.endswith("_s")}


def test_a_cluster_too_small_for_the_ranks_and_workers_is_one_line_not_a_hang(tmp_path, polyrl_cli):
    """Two learner rank actors and a rollout worker on a 2-CPU Ray cluster cannot all be placed: the run says
    so in one line before placing anything, instead of waiting on the worker forever."""
    from polyrl.placement import capacity_problem

    assert capacity_problem({"CPU": 4.0}, 2, 2, gpu=False) is None
    assert capacity_problem({"CPU": 2.0}, 0, 2, gpu=False) is None
    assert "2 learner ranks and 1 rollout workers need 3 CPUs" in capacity_problem({"CPU": 2.0}, 2, 1, gpu=False)
    assert "need 2 GPUs" in capacity_problem({"CPU": 8.0, "GPU": 1.0}, 1, 1, gpu=True)
    env = {"RAY_AUTH_MODE": "disabled", KILL_AT: None}
    run = polyrl_cli.run(["train", str(SMOKE), "-o", str(tmp_path / "run"), *BASE, "runtime.engines=disaggregated",
                          "runtime.num_workers=1", "learner.world_size=2", "runtime.ray_num_cpus=2"], env)
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert lines == [f"error: {SMOKE}: runtime: 2 learner ranks and 1 rollout workers need 3 CPUs (one each at "
                     "least), a local Ray on this machine has 2: lower learner.world_size or runtime.num_workers, or "
                     "add nodes"]  # refused before Ray starts (the same check runs on a cluster once connected)
