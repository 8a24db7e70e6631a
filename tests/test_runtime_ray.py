"""The Ray runtime on a local 2-CPU Ray: rollout workers as actors; a worker killed mid-run is replaced and
its shard redone, with nothing lost or counted twice; weights reach the workers through the object store or a
collective group, from one learner or two ranks. Slow (minutes on 2 cores): each actor imports and builds its
own run. Learner ranks as actors: tests/test_kill_resume_two_ranks.py, tests/test_ray_learner_ranks.py."""

import collections
import json
import os

import pytest

from polyrl.checkpoint.faults import KILL_AT
from polyrl.config_check import load_config
from polyrl.run.loop import train
from tests.conftest import SMOKE

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

ray = pytest.importorskip("ray")

BASE = [
    "eval.before=false", "eval.after=false", "logging.report=false", "logging.tensorboard=false",
    "train.checkpoint_every=0", "train.steps=3", "algorithm.regularisers.entropy_coef=0.05", "optim.lr=0.01",
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


@pytest.fixture(scope="module")
def object_store_run(local_ray, tmp_path_factory):
    """One Ray run at world size 1 with the weights sent through the object store."""
    run_dir = tmp_path_factory.mktemp("object_store") / "run"
    train(load_config(SMOKE, BASE), run_dir, log=lambda *_: None)
    return run_dir


def _comparable(row: dict) -> dict:
    """A metrics row without times, speeds and the engines' sync record (which differ by design)."""
    return {k: v for k, v in row.items() if not k.endswith(("_s", "tokens_per_s")) and not k.startswith("sync/")}


def _samples(run_dir) -> list:
    """Every stored sample's tokens and the log-probs its sampler gave them, in a fixed order."""
    return sorted((r["step"], r["group_id"], r["input_ids"], r["logprobs"])
                  for r in _lines(run_dir, "trajectories.jsonl"))


def test_a_killed_worker_is_replaced_and_its_shard_redone(object_store_run):
    metrics = _lines(object_store_run, "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[-1]["ray/worker_restarts"] == 1  # the kill happened, and only once
    rows = _lines(object_store_run, "trajectories.jsonl")
    for step in (1, 2, 3):
        mine = [r for r in rows if r["step"] == step]
        groups = sorted({r["group_id"] for r in mine})
        assert groups == [0, 1, 2, 3]  # every group of the step, once each: none lost
        assert len(mine) == 4 * 4  # none counted twice
        assert all(v == step - 1 for r in mine for v, m in zip(r["versions"], r["loss_mask"], strict=True) if m)


def test_collective_weight_sync_gives_the_object_store_run(object_store_run, tmp_path):
    """The same run with the weights broadcast from the learner to the workers through a gloo group: the
    workers sample the same tokens and the learner takes the same updates (a worker killed at step 2 again
    joins the group re-formed with its replacement)."""
    train(load_config(SMOKE, [*BASE, "runtime.weight_sync=collective"]), tmp_path / "run", log=lambda *_: None)
    ref, rows = _lines(object_store_run, "metrics.jsonl"), _lines(tmp_path / "run", "metrics.jsonl")
    assert [_comparable(r) for r in rows] == [_comparable(r) for r in ref]
    assert _samples(tmp_path / "run") == _samples(object_store_run)
    assert rows[-1]["ray/worker_restarts"] == 1
    assert [r["sync/engines_version"] for r in rows[:-1]] == [1, 2]  # no sync after the last update
    assert all(r["sync/engines_bytes"] > 0 and r["sync/engines_failed"] == 0 for r in rows[:-1])


def test_sharded_learner_with_disaggregated_workers_survives_a_worker_lost_in_a_sync(object_store_run, tmp_path,
                                                                                     polyrl_cli):
    """learner.world_size 2 under Ray with disaggregated workers: rank 0 drives the workers, both ranks
    gather the weights for the collective sync. Worker 1 dies inside step 2's sync: every worker is
    replaced with the weights of version 2, and the run follows the world-size-1 run (the samplers' log-probs
    and the updates within float32 reduction order)."""
    env = {"RAY_AUTH_MODE": "disabled", KILL_AT: "worker1.0.sync:2"}
    # Rank 1 waits in a collective while rank 0 starts two replacement workers: on a loaded 2-core machine that
    # has taken over a minute, so the hang guard gets three.
    args = [*BASE, "runtime.engines=disaggregated", "learner.world_size=2", "runtime.ray_num_cpus=4",
            "learner.timeout_s=180"]
    run = polyrl_cli.run(["train", str(SMOKE), "-o", str(tmp_path / "run"), *args], env)  # conftest: one thread
    assert run.returncode == 0, run.stderr[-3000:]
    rows, ref = _lines(tmp_path / "run", "metrics.jsonl"), _lines(object_store_run, "metrics.jsonl")
    assert [r["sync/engines_failed"] for r in rows[:-1]] == [0, 1]
    assert rows[-1]["ray/worker_restarts"] == 2  # both workers replaced after the failed sync
    # After an update the two runs' weights differ in float32's last digits (the ranks sum the gradients in
    # another order), which can flip a near-tie in sampling. Until a sample's tokens part from the reference's,
    # its sampler's log-probs are the reference's: every worker, the replacements too, sampled from the
    # learner's weights of that step's version. The first step's weights are the same to the bit.
    ref_samples, samples = _samples_by_place(object_store_run), _samples_by_place(tmp_path / "run")
    assert samples.keys() == ref_samples.keys()
    parted_steps = set()
    for place, want in ref_samples.items():
        got = samples[place]
        shared = _shared_prefix(got["input_ids"], want["input_ids"])
        assert shared > got["loss_mask"].index(1), place  # the prompt and at least one sampled token
        assert got["logprobs"][:shared] == pytest.approx(want["logprobs"][:shared], abs=1e-4), place
        assert all(v == place[0] - 1 for v, m in zip(got["versions"], got["loss_mask"], strict=True) if m), place
        if got["input_ids"] != want["input_ids"]:
            parted_steps.add(place[0])
    assert 1 not in parted_steps
    # The learner scored every sample as its sampler did: no worker sampled from other weights.
    assert all(r["mismatch/abs_log_ratio/max"] < 1e-4 for r in rows), [r["mismatch/abs_log_ratio/max"] for r in rows]
    for a, b in zip(ref, rows, strict=True):
        if a["step"] in parted_steps:  # the update's inputs differ
            continue
        for key in ("loss", "grad_norm", "reward/mean"):
            # tests/test_sharded_learner.py holds one update to 1e-5; two steps on, the gap is about that size
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-9), (a["step"], key)


def _samples_by_place(run_dir) -> dict:
    """Every stored sample by (step, group, its place in the group)."""
    places, seen = {}, collections.Counter()
    for row in _lines(run_dir, "trajectories.jsonl"):
        group = (row["step"], row["group_id"])
        places[(*group, seen[group])] = row
        seen[group] += 1
    return places


def _shared_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_ray_temp_dir_stays_short_enough_for_unix_sockets(tmp_path):
    from polyrl.runtime.ray_ import _MAX_RAY_TEMP_LEN, _ray_temp_dir

    deep = tmp_path / ("d" * 60) / "run"
    chosen = _ray_temp_dir(deep)
    # Ray adds about 65 characters of session/socket path below the temp dir; Unix sockets allow 107 bytes.
    assert len(chosen) <= _MAX_RAY_TEMP_LEN and os.path.isdir(chosen)
    assert len(chosen + "/session_2026-11-30_08-56-45_437273_29596/sockets/plasma_store") <= 107
