"""Runs that repeat: the same config and seed on the same machine give the same metrics.jsonl line for line
(timing keys aside: those ending in ``_s``, seconds or per-second rates), the same trajectories.jsonl and
bit-identical weights. The default path is exercised: bf16 autocast, the fused decode kernels where they build,
packed micro-batches, the machine's own thread count, TensorBoard's writer thread."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from conftest import SMOKE

from tests.forkserver import ForkServer

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

STEPS = 3
ARGS = [f"train.steps={STEPS}", "model.bf16=true", "eval.before=false", "eval.after=false", "logging.report=false",
        "rollout.group_size=4", "rollout.max_new_tokens=16", "algorithm.regularisers.entropy_coef=0.01",
        "algorithm.regularisers.kl_coef=0.01"]


def timing_free(rows: list[dict]) -> list[dict]:
    """A metrics row without its timing keys (``*_s``: durations and rates that vary run to run)."""
    return [{k: v for k, v in row.items() if not k.endswith("_s")} for row in rows]


def _result(out):
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    weights = hashlib.sha256((out / "checkpoints" / f"step-{STEPS}" / "model.safetensors").read_bytes()).hexdigest()
    return metrics, (out / "trajectories.jsonl").read_text(), weights


def _run(out, *extra):
    """A fresh interpreter (its own hash seed, its own imports)."""
    res = subprocess.run([sys.executable, "-m", "polyrl", "train", str(SMOKE), "--output", str(out), *ARGS, *extra],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return _result(out)


@pytest.fixture(scope="module")
def forked():
    """Runs forked from a server that imported polyrl once (tests/forkserver.py), on the machine's threads."""
    server = ForkServer()

    def run(out, *extra):
        res = server.run(["train", str(SMOKE), "--output", str(out), *ARGS, *extra])
        assert res.returncode == 0, res.stderr[-3000:]
        return _result(out)

    yield run
    server.close()


@pytest.fixture(scope="module")
def seed0(tmp_path_factory, forked):
    """Two runs with seed 0: one in a fresh interpreter, one forked from the server (another interpreter, so
    another hash seed: set and dict orders that depended on it would show)."""
    root = tmp_path_factory.mktemp("seed0")
    return _run(root / "a"), forked(root / "b")


def test_two_runs_with_the_same_seed_are_identical(seed0):
    (m1, t1, w1), (m2, t2, w2) = seed0
    assert len(m1) == STEPS and [r["step"] for r in m2] == list(range(1, STEPS + 1))
    assert timing_free(m1) == timing_free(m2)
    assert t1 == t2
    assert w1 == w2
    # the comparison has teeth: the updates moved the weights, and the timing keys do differ between runs
    assert all(r["grad_norm"] > 0 for r in m1)
    assert any(m1[i][k] != m2[i][k] for i in range(STEPS) for k in m1[i] if k.endswith("_s"))


@pytest.mark.parametrize("seed", [1])
def test_another_seed_gives_another_run(tmp_path, seed0, forked, seed):
    """The check above could pass on a run that ignored its inputs; a different seed must change the result."""
    (m1, _, w1), (m2, _, w2) = seed0[0], forked(tmp_path / "b", f"train.seed={seed}")
    assert timing_free(m1) != timing_free(m2) and w1 != w2
