"""Entropy held at a target (Skywork-OR1's adaptive entropy control): the coefficient's rule worked by hand, a
learner on a tiny model moving it by the entropy it measures, its config errors, and checkpoints that carry it
so a resumed run goes on as the whole run did."""

import json
import math

import pytest
from algo_helpers import fake_trajectories, make_learner
from conftest import SMOKE

from polyrl.algorithms.entropy_control import adaptive_entropy_coef
from polyrl.config import ConfigError
from polyrl.config_check import load_config

NO_KL = {"track_kl": False}


def test_the_coefficient_follows_the_entropy_worked_by_hand():
    # target 0.5, step 0.005, cap 0.02, from 0.01: below the target it climbs to the cap and stays there, above
    # it falls to 0 and stays there; on the target, or with no finite measurement, it holds.
    entropies = [0.3, 0.3, 0.3, 0.5, 0.7, 0.7, float("nan"), None, 0.7, 0.7, 0.7]
    want = [0.015, 0.02, 0.02, 0.02, 0.015, 0.01, 0.01, 0.01, 0.005, 0.0, 0.0]
    coef, got = 0.01, []
    for e in entropies:
        coef = adaptive_entropy_coef(coef, e, target=0.5, step=0.005, max_coef=0.02)
        got.append(coef)
    assert got == pytest.approx(want, abs=1e-15)
    assert got[-1] == 0.0  # floored at 0, never negative
    assert adaptive_entropy_coef(0.0, math.inf, 0.5, 0.005, 0.02) == 0.0


def test_the_learner_raises_the_coefficient_while_the_entropy_is_below_the_target():
    # a 64-token vocabulary holds at most log 64 = 4.16 nats: always below a target of 10
    learner = make_learner(regularisers={"entropy_target": 10.0, "entropy_coef_step": 0.01, **NO_KL})
    used = []
    for _ in range(3):
        m = learner.update(fake_trajectories())
        used.append(m["entropy_control/coef"])
        assert 0 < m["entropy_control/entropy"] < math.log(64)
        assert m["entropy_control/entropy"] == pytest.approx(m["entropy"])  # token-mean aggregation: the same
        # the loss's entropy term is the coefficient the step used: loss = pg - coef * entropy
        assert m["loss"] == pytest.approx(m["loss/pg"] - used[-1] * m["entropy"], abs=1e-7)
    assert used == pytest.approx([0.0, 0.01, 0.02]) and learner.entropy_coef == pytest.approx(0.03)


def test_the_learner_lowers_it_above_the_target_down_to_zero():
    learner = make_learner(regularisers={"entropy_target": 0.0, "entropy_coef": 0.012, "entropy_coef_step": 0.005,
                                         **NO_KL})
    used = [learner.update(fake_trajectories())["entropy_control/coef"] for _ in range(4)]
    assert used == pytest.approx([0.012, 0.007, 0.002, 0.0]) and learner.entropy_coef == 0.0


def test_the_measured_entropy_is_per_token_whatever_the_loss_aggregation():
    # seq-mean-token-sum logs `entropy` per sequence (3 tokens each here); the controller still reads nats/token
    learner = make_learner(regularisers={"entropy_target": 10.0, **NO_KL}, loss={"agg": "seq-mean-token-sum"})
    m = learner.update(fake_trajectories())
    assert m["entropy"] == pytest.approx(3 * m["entropy_control/entropy"], rel=0.2)
    assert m["entropy_control/entropy"] < math.log(64)


def test_a_batch_without_gradient_is_still_measured():
    # every advantage 0 and no other term: the learner would skip the passes, but the controller needs the entropy
    def flat():
        ts = fake_trajectories()
        for t in ts:
            t.advantage = 0.0
        return ts

    assert make_learner(regularisers=NO_KL).update(flat())["zero_gradient"] == 1.0
    learner = make_learner(regularisers={"entropy_target": 10.0, **NO_KL})
    m = learner.update(flat())
    assert m["zero_gradient"] == 0.0 and m["entropy_control/entropy"] > 0
    assert learner.entropy_coef == pytest.approx(0.005)


def test_off_by_default_nothing_new_is_logged_or_saved():
    learner = make_learner(regularisers={"entropy_coef": 0.01, **NO_KL})
    m = learner.update(fake_trajectories())
    assert not [k for k in m if k.startswith("entropy_control/")]
    assert "entropy_coef" not in learner.state_dict() and learner.entropy_coef == 0.01


def test_the_coefficient_is_part_of_the_learner_state():
    # checkpoints store learner.state_dict(): a resumed run must get the coefficient it had reached
    cfg = {"entropy_target": 10.0, "entropy_coef_step": 0.01, **NO_KL}
    trained = make_learner(regularisers=cfg)
    for _ in range(2):
        trained.update(fake_trajectories())
    assert trained.state_dict()["entropy_coef"] == pytest.approx(0.02)
    fresh = make_learner(regularisers=cfg)
    fresh.load_state_dict(trained.state_dict())
    assert fresh.entropy_coef == trained.entropy_coef
    assert fresh.update(fake_trajectories())["entropy_control/coef"] == pytest.approx(0.02)
    # a checkpoint from a run without the controller starts it at entropy_coef; a run without it stays fixed
    fresh = make_learner(regularisers=cfg)
    fresh.load_state_dict(make_learner(regularisers=NO_KL).state_dict())
    assert fresh.entropy_coef == 0.0
    fixed = make_learner(regularisers={"entropy_coef": 0.001, **NO_KL})
    fixed.load_state_dict(trained.state_dict())
    assert fixed.entropy_coef == 0.001


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.regularisers.entropy_target=-0.1"], "algorithm.regularisers.entropy_target: "),
    (["algorithm.regularisers.entropy_target=0.5", "algorithm.regularisers.entropy_coef_step=0"],
     "algorithm.regularisers.entropy_coef_step: "),
    (["algorithm.regularisers.entropy_target=0.5", "algorithm.regularisers.entropy_coef=0.1"],
     "algorithm.regularisers.entropy_coef: with entropy_target it is the starting coefficient, between 0 and "
     "entropy_coef_max (0.05); got 0.1"),
    (["algorithm.regularisers.entropy_target=0.5", "algorithm.regularisers.entropy_coef=-0.01"],
     "algorithm.regularisers.entropy_coef: with entropy_target"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(SMOKE, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)
    # without a target, a negative bonus (an entropy penalty) stays allowed as before
    assert load_config(SMOKE, ["algorithm.regularisers.entropy_coef=-0.01"])


@pytest.mark.slow
def test_a_resumed_run_goes_on_with_the_coefficient_it_had_reached(tmp_path):
    from polyrl.run.loop import train

    def config(steps):
        return load_config(SMOKE, [f"train.steps={steps}", "eval.before=false", "eval.after=false",
                                   "logging.tensorboard=false", "logging.report=false", "rollout.max_new_tokens=4",
                                   "algorithm.regularisers.entropy_target=100.0",
                                   "algorithm.regularisers.entropy_coef_step=0.01"])

    def metrics(run):
        return [{k: v for k, v in json.loads(x).items() if not k.endswith("_s")}
                for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    train(config(3), tmp_path / "a", log=lambda *_: None)
    train(config(1), tmp_path / "b", log=lambda *_: None)
    train(config(3), tmp_path / "b", resume=True, log=lambda *_: None)
    whole = metrics("a")
    assert [m["entropy_control/coef"] for m in whole] == pytest.approx([0.0, 0.01, 0.02])
    assert metrics("b") == whole  # step 2 of the resumed run used the coefficient step 1 had left
