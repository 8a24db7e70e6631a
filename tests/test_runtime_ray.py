"""The Ray runtime on a local 2-CPU Ray: rollout workers as actors; a worker killed mid-run is replaced and
its shard redone, with nothing lost or counted twice. Slow (about 2 minutes on 2 cores): each actor imports
and builds its own run."""

import json
import os
import subprocess
import sys

import pytest

from polyrl.config import load_config
from polyrl.train.faults import KILL_AT
from polyrl.train.loop import train
from tests.conftest import SMOKE

ray = pytest.importorskip("ray")

BASE = [
    "eval.before=false", "eval.after=false", "logging.report=false", "logging.tensorboard=false",
    "train.checkpoint_every=0", "train.steps=3", "algorithm.entropy_coef=0.05", "optim.lr=0.01",
    "engine.bf16_weights=false", "rollout.prompts_per_step=4", "logging.trajectories_per_group=4",
    "runtime.kind=ray", "runtime.num_workers=2",
]


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Worker processes inherit the environment at ray.init: worker 0's first actor kills itself at step 2.
    os.environ[KILL_AT] = "worker0.0:2"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield
    ray.shutdown()
    os.environ.pop(KILL_AT, None)


def _lines(path, name):
    return [json.loads(line) for line in (path / name).read_text().splitlines()]


def test_a_killed_worker_is_replaced_and_its_shard_redone(local_ray, tmp_path):
    cfg = load_config(SMOKE, BASE)
    train(cfg, tmp_path / "run", log=lambda *_: None)
    metrics = _lines(tmp_path / "run", "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[-1]["ray/worker_restarts"] == 1  # the kill happened, and only once
    rows = _lines(tmp_path / "run", "trajectories.jsonl")
    for step in (1, 2, 3):
        mine = [r for r in rows if r["step"] == step]
        groups = sorted({r["group_id"] for r in mine})
        assert groups == [0, 1, 2, 3]  # every group of the step, once each: none lost
        assert len(mine) == 4 * 4  # none counted twice
        assert all(v == step - 1 for r in mine for v, m in zip(r["versions"], r["loss_mask"], strict=True) if m)


def test_ray_temp_dir_stays_short_enough_for_unix_sockets(tmp_path):
    from polyrl.runtime.ray_ import _MAX_RAY_TEMP_LEN, _ray_temp_dir

    deep = tmp_path / ("d" * 60) / "run"
    chosen = _ray_temp_dir(deep)
    # Ray adds about 65 characters of session/socket path below the temp dir; Unix sockets allow 107 bytes.
    assert len(chosen) <= _MAX_RAY_TEMP_LEN and os.path.isdir(chosen)
    assert len(chosen + "/session_2026-11-30_08-56-45_437273_29596/sockets/plasma_store") <= 107


def test_learner_ranks_as_actors_restart_from_the_checkpoint_when_one_is_lost(tmp_path):
    """runtime.kind ray with learner.world_size 2: the ranks are actors in a placement group; one killed
    inside step 2's update takes every rank down, and the driver starts them again from step 1's checkpoint.
    The run ends with every step logged once and the same metrics as an uninterrupted local 2-rank run."""
    from polyrl.train.faults import KILL_ONCE

    args = ["eval.before=false", "eval.after=false", "logging.report=false", "logging.tensorboard=false",
            "train.steps=3", "train.checkpoint_every=1", "algorithm.entropy_coef=0.05", "optim.lr=0.01",
            "learner.world_size=2", "learner.timeout_s=60"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop(KILL_AT, None)
    ref = subprocess.run([sys.executable, "-m", "polyrl", "train", str(SMOKE), "-o", str(tmp_path / "ref"), *args],
                         capture_output=True, text=True, env=env, timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = {**env, KILL_AT: "update:2+0.01", KILL_ONCE: str(tmp_path / "killed-once")}
    run = subprocess.run([sys.executable, "-m", "polyrl", "train", str(SMOKE), "-o", str(tmp_path / "run"), *args,
                          "runtime.kind=ray", "runtime.ray_num_cpus=2"],
                         capture_output=True, text=True, env=killed, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "killed-once").exists()  # the kill happened
    assert "restarting all ranks from the newest checkpoint" in run.stdout + run.stderr
    rows = _lines(tmp_path / "run", "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    ref_rows = _lines(tmp_path / "ref", "metrics.jsonl")
    for a, b in zip(ref_rows, rows, strict=True):
        assert {k: v for k, v in a.items() if not k.endswith("_s")} == {k: v for k, v in b.items()
                                                                        if not k.endswith("_s")}
