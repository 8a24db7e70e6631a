"""The Ray runtime on a local 2-CPU Ray: rollout workers as actors; a worker killed mid-run is replaced and
its shard redone, with nothing lost or counted twice. Slow (about 2 minutes on 2 cores): each actor imports
and builds its own run."""

import json
import os

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
