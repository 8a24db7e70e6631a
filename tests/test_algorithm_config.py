"""``algorithm`` grouped by what each key belongs to: the nested form, the bare-name shorthands, every key that
moved refused in one line naming its new place (in a file, on the command line, in a stage), and stage
overrides in the nested form."""

import pytest
import yaml
from conftest import SMOKE
from typer.testing import CliRunner

from polyrl.cli import app
from polyrl.config import MOVED_ALGORITHM_KEYS, AlgorithmConfig, ConfigError, apply_override, parse_config
from polyrl.config_check import load_config

TASKS = {"tasks": [{"name": "chain_sum"}]}

# Written out by hand (not read from the code): old top-level key -> its place under ``algorithm`` now.
MOVED = {
    "gamma": "critic.gamma", "lam": "critic.lam", "value_lr": "critic.lr", "value_clip": "critic.clip",
    "value_width": "critic.width",
    "advantage_kwargs": "advantage.kwargs", "task_norm": "advantage.task_norm",
    "reward_gate": "advantage.reward_gate",
    "loss_kwargs": "loss.kwargs", "clip_low": "loss.clip_low", "clip_high": "loss.clip_high", "loss_agg": "loss.agg",
    "pg_coef": "loss.pg_coef", "epochs": "loss.epochs", "mask_truncated": "loss.mask_truncated",
    "off_policy_kwargs": "off_policy.kwargs", "tis_cap": "off_policy.tis_cap", "m2po_tau": "off_policy.m2po_tau",
    "mismatch_band": "off_policy.mismatch_band",
    "kl_coef": "regularisers.kl_coef", "kl_in": "regularisers.kl_in", "kl_estimator": "regularisers.kl_estimator",
    "track_kl": "regularisers.track_kl", "entropy_coef": "regularisers.entropy_coef",
    "distill_coef": "regularisers.distill_coef",
    "dynamic_sampling": "sampling.dynamic", "max_extra_rounds": "sampling.max_extra_rounds",
    "overlong_buffer": "shaping.overlong_buffer", "overlong_penalty": "shaping.overlong_penalty",
    "gradient_surgery": "gradients.surgery", "task_grad_every": "gradients.task_grad_every",
}
# A valid value at each new place, to show it exists (the critic's keys make a critic).
VALUES = {"advantage.reward_gate": "{outcome: chain_sum}", "loss.agg": "seq-mean-token-sum",
          "regularisers.kl_in": "reward", "regularisers.kl_estimator": "k1", "gradients.surgery": "pcgrad"}


def test_the_moved_key_table_is_the_code_s():
    assert MOVED_ALGORITHM_KEYS == MOVED


def test_shorthands_name_the_estimator_the_loss_and_the_correction():
    algo = AlgorithmConfig(advantage="rloo", loss="gspo", off_policy="tis")
    assert algo.advantage.estimator == "rloo" and algo.advantage.kwargs == {} and not algo.advantage.task_norm
    assert algo.loss.name == "gspo" and algo.loss.clip_high == 0.2 and algo.loss.agg == "token-mean"
    assert algo.off_policy.correction == "tis" and algo.off_policy.tis_cap == 2.0
    assert algo == AlgorithmConfig(advantage={"estimator": "rloo"}, loss={"name": "gspo"},
                                   off_policy={"correction": "tis"})
    algo.loss = "cispo"  # assignment takes the shorthand too (validate_assignment)
    assert algo.loss.name == "cispo" and algo.loss.clip_high == 0.2


def test_the_nested_form_from_yaml():
    text = """
algorithm:
  advantage: {estimator: dr_grpo, kwargs: {eps: 1.0e-6}, task_norm: true}
  loss: {name: dual_clip, kwargs: {c: 3.0}, clip_low: 0.1, clip_high: 0.28, agg: seq-mean-token-sum, pg_coef: 0.5,
         epochs: 2, mask_truncated: true}
  off_policy: {correction: icepop, kwargs: {alpha: 0.5, beta: 5.0}, tis_cap: 1.5, m2po_tau: 0.01, mismatch_band: 0.1}
  regularisers: {kl_coef: 0.05, kl_in: reward, kl_estimator: k2, track_kl: false, entropy_coef: 0.01}
  sampling: {dynamic: true, max_extra_rounds: 1}
  shaping: {overlong_buffer: 4, overlong_penalty: 0.5}
  gradients: {surgery: pcgrad, task_grad_every: 3}
"""
    a = parse_config(None, data={**TASKS, **yaml.safe_load(text)}).algorithm
    assert (a.advantage.estimator, a.advantage.kwargs, a.advantage.task_norm) == ("dr_grpo", {"eps": 1e-6}, True)
    assert (a.loss.name, a.loss.kwargs, a.loss.clip_low, a.loss.clip_high) == ("dual_clip", {"c": 3.0}, 0.1, 0.28)
    assert (a.loss.agg, a.loss.pg_coef, a.loss.epochs, a.loss.mask_truncated) == ("seq-mean-token-sum", 0.5, 2, True)
    assert (a.off_policy.correction, a.off_policy.kwargs) == ("icepop", {"alpha": 0.5, "beta": 5.0})
    assert (a.off_policy.tis_cap, a.off_policy.m2po_tau, a.off_policy.mismatch_band) == (1.5, 0.01, 0.1)
    r = a.regularisers
    assert (r.kl_coef, r.kl_in, r.kl_estimator, r.track_kl, r.entropy_coef, r.distill_coef) == (
        0.05, "reward", "k2", False, 0.01, 0.0)
    assert (a.sampling.dynamic, a.sampling.max_extra_rounds) == (True, 1)
    assert (a.shaping.overlong_buffer, a.shaping.overlong_penalty) == (4, 0.5)
    assert (a.gradients.surgery, a.gradients.task_grad_every) == ("pcgrad", 3)
    # a dumped config (every field written out, as a run directory keeps it) loads back to the same
    dumped = parse_config(None, data={**TASKS, **yaml.safe_load(text)}).model_dump(mode="json")
    assert dumped["algorithm"]["loss"]["name"] == "dual_clip"
    assert parse_config(None, data=dumped).algorithm == a


def test_defaults_are_the_flat_section_s():
    a = AlgorithmConfig()
    assert (a.advantage.estimator, a.loss.name, a.off_policy.correction) == ("grpo", "ppo_clip", "none")
    assert (a.loss.clip_low, a.loss.clip_high, a.loss.agg, a.loss.pg_coef, a.loss.epochs) == (
        0.2, 0.2, "token-mean", 1.0, 1)
    assert (a.regularisers.kl_coef, a.regularisers.kl_in, a.regularisers.kl_estimator) == (0.0, "loss", "k3")
    assert a.regularisers.track_kl and a.critic is None and a.advantage.reward_gate is None
    assert (a.sampling.dynamic, a.sampling.max_extra_rounds, a.shaping.overlong_buffer) == (False, 3, 0)
    assert (a.gradients.surgery, a.gradients.task_grad_every, a.off_policy.mismatch_band) == ("none", 0, 0.2)


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_each_moved_key_is_refused_naming_its_new_place(old, new):
    with pytest.raises(ConfigError, match=rf"^config: algorithm\.{old}: moved to algorithm\.{new}$"):
        parse_config(None, data={**TASKS, "algorithm": {old: 1}})
    with pytest.raises(ConfigError, match=rf"^config: algorithm\.{old}: moved to algorithm\.{new}$"):
        parse_config(None, [f"algorithm.{old}=1"], {**TASKS})  # the same on the command line
    # ... and the new place is a key of the config
    section, key = new.split(".")
    default = getattr(getattr(AlgorithmConfig(critic={}), section), key)
    value = VALUES.get(new, yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("\n..."))
    got = getattr(getattr(parse_config(None, [f"algorithm.{new}={value}"], {**TASKS}).algorithm, section), key)
    assert (got.model_dump(exclude_defaults=True) if hasattr(got, "model_dump") else got) == yaml.safe_load(value)


def test_a_moved_key_on_the_command_line_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["train", str(SMOKE), "algorithm.clip_high=0.28", "-o", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output == f"error: {SMOKE}: algorithm.clip_high: moved to algorithm.loss.clip_high\n"
    with pytest.raises(ConfigError, match=r"algorithm\.kl_coef: moved to algorithm\.regularisers\.kl_coef$") as err:
        load_config(SMOKE, ["algorithm.kl_coef=0.1"])
    assert "\n" not in str(err.value)


def test_overrides_under_a_shorthand_write_it_out():
    data = {**TASKS, "algorithm": {"loss": "gspo", "off_policy": "tis"}}
    cfg = parse_config(None, ["algorithm.loss.clip_high=4e-4", "algorithm.off_policy.tis_cap=1.5"], data)
    assert (cfg.algorithm.loss.name, cfg.algorithm.loss.clip_high) == ("gspo", 4e-4)
    assert (cfg.algorithm.off_policy.correction, cfg.algorithm.off_policy.tis_cap) == ("tis", 1.5)
    # a bare name over a written-out section changes its name only
    data = {**TASKS, "algorithm": {"loss": {"name": "gspo", "clip_low": 3e-4, "clip_high": 4e-4}}}
    loss = parse_config(None, ["algorithm.loss=cispo"], data).algorithm.loss
    assert (loss.name, loss.clip_low, loss.clip_high) == ("cispo", 3e-4, 4e-4)
    # the same rule in a stage's overrides, and nowhere else
    nested = {"stages": [{"name": "a", "algorithm": {"loss": "gspo"}}], "rollout": {"loss": "x"}}
    apply_override(nested, "stages.0.algorithm.loss.clip_high=0.3")
    apply_override(nested, "rollout.loss=y")
    assert nested["stages"][0]["algorithm"] == {"loss": {"name": "gspo", "clip_high": 0.3}}
    assert nested["rollout"] == {"loss": "y"}


def test_a_stage_override_in_the_nested_form_is_accepted():
    stage = {"name": "rl", "steps": 1, "algorithm": {"loss": {"clip_high": 0.28}, "advantage": "rloo",
                                                      "regularisers": {"kl_coef": 0.01}}}
    data = {**TASKS, "algorithm": {"loss": {"name": "gspo", "clip_low": 3e-4}, "regularisers": {"track_kl": False}},
            "stages": [stage]}
    cfg = load_config(None, data=data)
    assert cfg.stages[0].algorithm == stage["algorithm"]
    from polyrl.config import merge_algorithm  # what the stage runs with: only the keys it names change

    merged = AlgorithmConfig.model_validate(merge_algorithm(cfg.algorithm.model_dump(), cfg.stages[0].algorithm))
    assert (merged.loss.name, merged.loss.clip_low, merged.loss.clip_high) == ("gspo", 3e-4, 0.28)
    assert merged.advantage.estimator == "rloo"
    assert (merged.regularisers.kl_coef, merged.regularisers.track_kl) == (0.01, False)


def test_a_stage_override_is_checked_at_its_own_key():
    def error(overrides: dict) -> str:
        with pytest.raises(ConfigError) as err:
            load_config(None, data={**TASKS, "stages": [{"name": "rl", "steps": 1, "algorithm": overrides}]})
        assert "\n" not in str(err.value)
        return str(err.value)

    assert error({"kl_coef": 0.1}) == (
        "config: stages.0.algorithm.kl_coef: moved to stages.0.algorithm.regularisers.kl_coef")
    assert error({"loss": {"clip_hi": 0.3}}) == "config: stages.0.algorithm.loss.clip_hi: unknown key"
    assert "stages.0.algorithm.loss.clip_high" in error({"loss": {"clip_high": -1}})
    assert "stages.0.algorithm: algorithm.loss: unknown policy loss 'ppo_clipp'" in error({"loss": "ppo_clipp"})


def test_the_critic_still_excludes_a_sample_level_estimator():
    with pytest.raises(ConfigError, match=r"algorithm\.advantage: gae is declared as a critic now"):
        parse_config(None, data={**TASKS, "algorithm": {"advantage": {"estimator": "gae"}}})
    with pytest.raises(ConfigError, match=r"algorithm\.advantage: 'rloo' is a sample-level estimator"):
        parse_config(None, data={**TASKS, "algorithm": {"advantage": "rloo", "critic": {}}})
    with pytest.raises(ConfigError, match=r"algorithm\.advantage\.task_norm: needs a sample-level estimator"):
        parse_config(None, data={**TASKS, "algorithm": {"advantage": {"task_norm": True}, "critic": {}}})
