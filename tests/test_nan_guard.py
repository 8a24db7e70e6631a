"""NaN/inf guard: a poisoned update is skipped and logged, and too many in a row stop the run cleanly with a
usable last checkpoint. The poison is a policy loss registered with the ``LOSSES`` decorator, as a user would."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import SMOKE
from safetensors.torch import load_file
from typer.testing import CliRunner

from polyrl.algorithms import LOSSES
from polyrl.algorithms.losses import PolicyLossInputs
from polyrl.checkpoint.store import latest_checkpoint, load_checkpoint, verify_checkpoint
from polyrl.cli import app
from polyrl.config_check import load_config
from polyrl.learner.learner import Learner
from polyrl.models.loading import load_model
from polyrl.run.loop import train
from polyrl.train.step import NonFiniteError

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

POISON = {"value": math.nan, "steps": set(), "always": False, "update": 0}


if "test_poisoned" not in LOSSES:

    @LOSSES.register("test_poisoned")
    def poisoned_loss(x: PolicyLossInputs, **kwargs):
        """PPO-clip, times NaN (or inf) on the updates listed in POISON: every gradient becomes non-finite."""
        loss, metrics = LOSSES["ppo_clip"](x, **kwargs)
        if POISON["always"] or POISON["update"] in POISON["steps"]:
            loss = loss + (x.logp * x.mask).sum() * POISON["value"]
        return loss, metrics


@pytest.fixture(autouse=True)
def count_updates(monkeypatch):
    """Number the learner's updates (1, 2, ...) so the loss knows which step it is poisoning."""
    original = Learner.update

    def update(self, trajectories):
        POISON["update"] += 1
        return original(self, trajectories)

    monkeypatch.setattr(Learner, "update", update)
    POISON.update(value=math.nan, steps=set(), always=False, update=0)
    yield


OVERRIDES = ["eval.before=false", "eval.after=false", "logging.tensorboard=false", "logging.report=false",
             "rollout.group_size=2", "algorithm.loss=test_poisoned", "algorithm.regularisers.entropy_coef=0.01",
             "train.keep_checkpoints=5", "algorithm.regularisers.track_kl=false"]


def _weights(ckpt):
    return load_file(ckpt / "model.safetensors")


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("value", "steps"), [(math.nan, 3), (math.inf, 2)])
def test_a_poisoned_update_is_skipped_and_logged(tmp_path, value, steps):
    POISON.update(value=value, steps={2})
    run = tmp_path / "run"
    cfg = load_config(SMOKE, [*OVERRIDES, f"train.steps={steps}", "train.max_skipped_updates=2"])
    train(cfg, run, log=lambda m: 0)
    rows = _metrics(run)
    assert [r["skipped_updates"] for r in rows] == [0.0, 1.0, 0.0][:steps]
    assert rows[1]["grad_norm"] is None  # non-finite, written as null
    assert rows[0]["grad_norm"] > 0
    ckpts = run / "checkpoints"
    assert _same(_weights(ckpts / "step-1"), _weights(ckpts / "step-2"))  # the weights never saw it
    if steps == 3:  # and training carries on afterwards
        assert rows[2]["grad_norm"] > 0
        w3 = _weights(ckpts / "step-3")
        assert not _same(_weights(ckpts / "step-2"), w3) and all(torch.isfinite(t).all() for t in w3.values())


def test_too_many_in_a_row_stop_with_one_line_and_a_usable_checkpoint(tmp_path):
    POISON["steps"] = {2, 3, 4, 5}
    run = tmp_path / "run"
    cfg = load_config(SMOKE, [*OVERRIDES, "train.steps=5", "train.max_skipped_updates=2"])
    with pytest.raises(NonFiniteError) as err:
        train(cfg, run, log=lambda m: 0)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("2 updates in a row had NaN/inf loss or gradients (step 3); stopping.")
    assert str(run / "checkpoints") in message
    assert [r["skipped_updates"] for r in _metrics(run)] == [0.0, 1.0, 1.0]
    last = latest_checkpoint(run)
    assert last.name == "step-2" and verify_checkpoint(last) is None
    assert _same(_weights(last), _weights(run / "checkpoints" / "step-1"))  # only good updates in it
    model = load_model("tiny-random", seed=5)
    optimizer_state, state = load_checkpoint(last, model)
    assert state["step"] == 2 and "optimizer" in optimizer_state
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_cli_reports_the_stop_on_one_line(tmp_path):
    POISON["always"] = True
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["train", str(SMOKE), "--output", str(out), *OVERRIDES, "train.steps=4", "train.max_skipped_updates=2"]
    )
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        f"error: 2 updates in a row had NaN/inf loss or gradients (step 2); stopping. The last good checkpoint "
        f"is in {out / 'checkpoints'}"
    ]
    assert "Traceback" not in result.stderr
    assert latest_checkpoint(out).name == "step-1"
