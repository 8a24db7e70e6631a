"""Every advantage estimator and every policy loss through ``train`` on configs/smoke.yaml (1 step each)."""

import json
import math

import pytest
from conftest import SMOKE

from polyrl.config_check import load_config
from polyrl.run.loop import train

pytestmark = pytest.mark.slow  # seconds or more each: left out of the fast tier

FAST = ["eval.before=false", "eval.after=false", "train.steps=1", "train.checkpoint_every=0",
        "logging.tensorboard=false", "logging.report=false"]

# Each advantage once and each loss at least once, with the options that go with them.
CASES = {
    "grpo+ppo_clip+dapo": ["algorithm.advantage=grpo", "algorithm.loss=ppo_clip", "algorithm.loss.clip_high=0.28",
                           "algorithm.sampling.dynamic=true", "algorithm.sampling.max_extra_rounds=1",
                           "algorithm.shaping.overlong_buffer=4", "algorithm.loss.mask_truncated=true"],
    "dr_grpo+cispo": ["algorithm.advantage=dr_grpo", "algorithm.loss=cispo",
                      "algorithm.loss.agg=seq-mean-token-sum"],
    "rloo+gspo": ["algorithm.advantage=rloo", "algorithm.loss=gspo", "algorithm.loss.agg=seq-mean-token-mean",
                  "algorithm.loss.clip_low=3e-4", "algorithm.loss.clip_high=4e-4"],
    "reinforce_pp+dual_clip+kl_reward": ["algorithm.advantage=reinforce_pp", "algorithm.loss=dual_clip",
                                         "algorithm.loss.kwargs={c: 3.0}", "algorithm.regularisers.kl_coef=0.05",
                                         "algorithm.regularisers.kl_in=reward"],
    "reinforce_pp_baseline+ppo_clip+epochs": ["algorithm.advantage=reinforce_pp_baseline",
                                              "algorithm.loss.epochs=2"],
    "gae+ppo_clip+kl_reward": ["algorithm.critic={}", "algorithm.regularisers.kl_coef=0.05",
                               "algorithm.regularisers.kl_in=reward"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_algorithm_trains_one_step(name, tmp_path):
    cfg = load_config(SMOKE, FAST + CASES[name])
    summary = train(cfg, tmp_path / "run", log=lambda *_: None)
    assert summary["steps"] == 1
    (m,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "loss/pg", "clip_frac", "ratio/mean", "ratio/min", "ratio/max", "grad_norm"):
        assert isinstance(m[key], float) and math.isfinite(m[key]), (key, m.get(key))
    assert m["skipped_updates"] == 0.0
    assert m["ratio/min"] <= m["ratio/mean"] <= m["ratio/max"]
    if cfg.algorithm.critic is not None:
        assert math.isfinite(m["loss/value"]) and "value/explained_var" in m
    if cfg.algorithm.sampling.dynamic:
        # the tiny random model never answers correctly: every group has zero variance, so it draws once more
        assert m["zero_variance_groups"] == 1.0 and m["sampling/rounds"] == 2.0
        assert m["reward/overlong"] <= 0.0
