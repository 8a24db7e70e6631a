"""The Ray runtime's learner ranks: a cluster too small for the ranks and workers is one line before Ray
starts. Runs are forked from the tests' server (conftest ``polyrl_cli``), one thread each. A rank actor lost
inside an update: tests/test_kill_resume_two_ranks.py; rollout workers under Ray: tests/test_runtime_ray.py."""

import pytest
from conftest import SMOKE
from test_runtime_ray import BASE

from polyrl.checkpoint.faults import KILL_AT

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

pytest.importorskip("ray")


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
