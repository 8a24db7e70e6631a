"""Multi-task training: task-advantage normalisation, cross-policy sampling with truncated IS, curricula."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from polyrl.algorithms.task_norm import task_normalise
from polyrl.config import AgentsConfig, AlgorithmConfig, ConfigError, CurriculumConfig, TaskConfig
from polyrl.config_check import load_config
from polyrl.envs.curriculum import (
    Curriculum,
    learning_progress,
    level_config,
    phase_weights,
    progress_mixture,
    should_promote,
)
from polyrl.learner.advantage_stage import assign_advantages
from polyrl.train.multitask import cross_policy_split
from polyrl.types import Trajectory

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"


def _traj(task: str, group: int, reward: float, score: float | None = None) -> Trajectory:
    return Trajectory(task, 0, group, [1, 2], [0, 1], [0.0, -1.0], [-1, 0], reward=reward,
                      info={"score": reward if score is None else score})


def test_task_normalise_worked_numbers():
    # task 0: [1, -1] has mean 0 and population std 1; task 1: [3, 1] has mean 2 and std 1.
    adv = torch.tensor([1.0, -1.0, 3.0, 1.0])
    out = task_normalise(adv, torch.tensor([0, 0, 1, 1]), eps=0.0)
    assert out.tolist() == pytest.approx([1.0, -1.0, 1.0, -1.0])
    # task 1 alone with a wider spread: [0, 4, 8] -> mean 4, std sqrt(32/3)
    out = task_normalise(torch.tensor([0.0, 4.0, 8.0, 5.0]), torch.tensor([1, 1, 1, 7]), eps=0.0)
    s = (32 / 3) ** 0.5
    assert out.tolist() == pytest.approx([-4 / s, 0.0, 4 / s, 0.0])  # a task of one sample becomes 0


def test_task_normalise_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="must both be"):
        task_normalise(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_assign_advantages_normalises_within_each_task():
    # Task a: rewards 0/1 in one group; task b: rewards 0/10 in one group. GRPO gives both +-0.707 (the group
    # std absorbs the scale); after task_norm each task's advantages have mean 0 and std 1.
    trajs = [_traj("a", 0, r) for r in (0, 1, 1, 0)] + [_traj("b", 1, r) for r in (0, 10, 0, 0)]
    algo = AlgorithmConfig(advantage={"task_norm": True})
    assign_advantages(trajs, algo, AgentsConfig())
    for task in ("a", "b"):
        adv = torch.tensor([t.advantage for t in trajs if t.task == task])
        assert float(adv.mean()) == pytest.approx(0.0, abs=1e-6)
        assert float(adv.std(correction=0)) == pytest.approx(1.0, abs=1e-4)
    # b's single solved sample carries the group's whole signal: +sqrt(3) vs -1/sqrt(3) for the others
    assert [t.advantage for t in trajs if t.task == "b"] == pytest.approx([-(3**-0.5), 3**0.5, -(3**-0.5),
                                                                          -(3**-0.5)], abs=1e-4)


def test_task_norm_needs_a_sample_level_estimator():
    with pytest.raises(ValueError, match="algorithm.advantage.task_norm"):
        AlgorithmConfig(advantage={"task_norm": True}, critic={})


def test_cross_policy_split_leaves_the_learner_a_group():
    assert cross_policy_split(4, 0.25) == 1
    assert cross_policy_split(2, 1.0) == 1
    assert cross_policy_split(1, 1.0) == 1
    assert cross_policy_split(8, 0.0) == 0


def test_learner_weights_cross_policy_tokens_by_truncated_is():
    from types import SimpleNamespace

    from polyrl.learner.advantage_stage import cross_policy_advantages

    old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.5], [0.1, 0.4]]))  # row 1 was sampled by another policy
    mb = SimpleNamespace(loss_mask=torch.ones(2, 2), behaviour_logp=behaviour)  # the fields it reads
    adv, metrics = cross_policy_advantages(mb, torch.tensor([False, True]), old, torch.tensor([1.0, -2.0]), 2.0)
    # row 0 keeps weight 1; row 1: min(0.5 / 0.1, 2) = 2 and 0.5 / 0.4 = 1.25
    assert adv.flatten().tolist() == pytest.approx([1.0, 1.0, -4.0, -2.5])
    assert metrics["cross_policy/is_weight"] == pytest.approx(1.625)
    assert metrics["cross_policy/capped_frac"] == pytest.approx(0.5)


@pytest.mark.slow
def test_cross_policy_run_records_behaviour_and_weights(tmp_path):
    from polyrl.train.step import build_run, rl_step

    data = yaml.safe_load(SMOKE.read_text())
    data["rollout"]["cross_policy"] = {"model": "tiny-random", "share": 0.5, "is_cap": 2.0}
    cfg = load_config(None, data=data)
    run = build_run(cfg, tmp_path)
    # tiny-random loads with the run seed: give the other policy different weights so ratios differ from 1
    with torch.no_grad():
        for p in run.cross_policy.engine.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    metrics, kept = rl_step(run, 1)
    cross = [t for t in kept if t.info.get("cross_policy")]
    assert metrics["cross_policy/frac"] == 0.5 and len(cross) == cfg.rollout.group_size
    # the behaviour log-probs are the other policy's: they differ from the learner's on the same tokens
    assert 0.0 < metrics["cross_policy/is_weight"] <= 2.0
    assert metrics["cross_policy/is_weight"] != pytest.approx(1.0, abs=1e-6)


def test_cross_policy_rejects_another_vocabulary(tmp_path, monkeypatch):
    from polyrl.train import multitask

    data = yaml.safe_load(SMOKE.read_text())
    data["rollout"]["cross_policy"] = {"model": "tiny-random", "share": 0.5}
    cfg = load_config(None, data=data)

    class Other:
        def get_vocab(self):
            return {"a": 0}

    monkeypatch.setattr(multitask, "load_tokenizer", lambda name: Other())
    with pytest.raises(ValueError, match="rollout.cross_policy.model: .* different vocabulary"):
        multitask.load_cross_engine(cfg, type("Tok", (), {"get_vocab": lambda self: {"b": 0}})())


def test_phase_weights_follow_the_declared_order():
    cfg = CurriculumConfig(phases=[{"until_step": 2, "weights": {"a": 1}}, {"until_step": 5, "weights": {"b": 3}}])
    default = {"a": 1.0, "b": 1.0}
    assert phase_weights(cfg.phases, 1, default) == {"a": 1.0, "b": 0.0}
    assert phase_weights(cfg.phases, 3, default) == {"a": 0.0, "b": 3.0}
    assert phase_weights(cfg.phases, 99, default) == {"a": 0.0, "b": 3.0}  # the last phase runs on
    assert phase_weights([], 1, default) == default


def test_learning_progress_and_mixture_worked_numbers():
    assert learning_progress([0.1, 0.3, 0.5]) == pytest.approx(0.2)
    assert learning_progress([0.9, 0.6, 0.3]) == pytest.approx(0.3)  # forgetting counts as progress too
    assert learning_progress([0.5]) == 0.0
    mix = progress_mixture({"a": 0.3, "b": 0.1, "c": 0.0}, floor=0.3)
    assert mix == pytest.approx({"a": 0.1 + 0.7 * 0.75, "b": 0.1 + 0.7 * 0.25, "c": 0.1})
    assert progress_mixture({"a": 0.0, "b": 0.0}, 0.1) == {"a": 0.5, "b": 0.5}


def test_should_promote_needs_a_full_window_above_threshold():
    assert not should_promote([True] * 3, window=4, threshold=0.5)
    assert should_promote([False, True, True, True], window=4, threshold=0.5)
    assert not should_promote([True, True, False, False], window=4, threshold=0.5)


def _curriculum(**kw) -> Curriculum:
    tasks = [TaskConfig(name="chain_sum", params={"min_terms": 2}), TaskConfig(name="products")]
    cfg = CurriculumConfig(**kw)
    return Curriculum(cfg, tasks, build_task=lambda c: c)  # the "task" is its config: enough to check levels


def test_curriculum_promotes_on_pass_rate_and_resumes_exactly():
    cur = _curriculum(levels={"chain_sum": [{"min_terms": 3}, {"min_terms": 4}]}, promote_at=0.5, pass_window=4,
                      adaptive=True, progress_window=3)
    assert cur.task("chain_sum", "base") == "base"
    cur.observe(1, [_traj("chain_sum", 0, 1.0), _traj("chain_sum", 0, 0.0), _traj("products", 1, 0.0)])
    metrics = cur.observe(2, [_traj("chain_sum", 2, 1.0), _traj("chain_sum", 2, 1.0)])
    assert metrics["curriculum/level/chain_sum"] == 1.0  # 3 of 4 passed > 0.5
    assert cur.task("chain_sum", "base").params == {"min_terms": 3}
    assert "curriculum/pass_rate/chain_sum" not in metrics  # the window restarts at the new level
    state = json.loads(json.dumps(cur.state_dict()))  # checkpoints store it as JSON
    other = _curriculum(levels={"chain_sum": [{"min_terms": 3}, {"min_terms": 4}]}, promote_at=0.5,
                        pass_window=4, adaptive=True, progress_window=3)
    other.load_state_dict(state)
    assert other.state_dict() == cur.state_dict()
    assert other.weights(3) == cur.weights(3)


def test_adaptive_mixture_favours_the_task_that_is_moving():
    cur = _curriculum(adaptive=True, floor=0.2, progress_window=4)
    for step, (a, b) in enumerate([(0.1, 0.5), (0.4, 0.5), (0.7, 0.5)], start=1):
        cur.observe(step, [_traj("chain_sum", 0, a, 0.0), _traj("products", 1, b, 0.0)])
    w = cur.weights(4)
    assert w["chain_sum"] == pytest.approx(0.1 + 0.8) and w["products"] == pytest.approx(0.1)


def test_level_config_merges_over_the_task_params():
    t = TaskConfig(name="chain_sum", params={"min_terms": 2, "max_digits": 1})
    assert level_config(t, [{"max_digits": 2}], 1).params == {"min_terms": 2, "max_digits": 2}
    assert level_config(t, [{"max_digits": 2}], 0) is t


@pytest.mark.parametrize("section, message", [
    ({"phases": [{"until_step": 3, "weights": {"nope": 1}}]}, "curriculum.phases.0.weights.nope: no task"),
    ({"phases": [{"until_step": 3, "weights": {"chain_sum": 1}}, {"until_step": 2, "weights": {"chain_sum": 1}}]},
     "curriculum.phases.1.until_step"),
    ({"levels": {"nope": [{}]}}, "curriculum.levels.nope: no task"),
])
def test_curriculum_config_errors_name_the_key(section, message):
    data = yaml.safe_load(SMOKE.read_text())
    data["curriculum"] = section
    with pytest.raises(ConfigError, match=message):
        load_config(None, data=data)


@pytest.mark.slow
def test_curriculum_in_a_run_logs_levels_and_resumes(tmp_path):
    from polyrl.run.loop import train

    data = yaml.safe_load(SMOKE.read_text())
    data["tasks"].append({"name": "products", "params": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                         "max_digits": 1}, "eval_size": 4})
    data["curriculum"] = {"adaptive": True, "progress_window": 2, "pass_window": 2, "promote_at": 0.01,
                          "levels": {"chain_sum": [{"max_digits": 2}]}}
    data["train"]["steps"] = 3
    data["eval"] = {"before": False, "after": False}
    data["logging"].update(tensorboard=False, report=False)
    full = tmp_path / "full"
    train(load_config(None, data=data), full, log=lambda *_: None)
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert all("curriculum/level/chain_sum" in r and "curriculum/weight/products" in r for r in rows)
    # resume from step 2's checkpoint: step 3 must be what the uninterrupted run logged
    part = tmp_path / "part"
    data["train"]["steps"] = 2
    train(load_config(None, data=data), part, log=lambda *_: None)
    data["train"]["steps"] = 3
    train(load_config(None, data=data), part, resume=True, log=lambda *_: None)
    resumed = [json.loads(line) for line in (part / "metrics.jsonl").read_text().splitlines()]
    keys = [k for k in rows[-1] if k.startswith(("curriculum/", "task_ratio/", "reward/"))]
    assert {k: resumed[-1][k] for k in keys} == {k: rows[-1][k] for k in keys}


def test_curriculum_needs_the_local_runtime():
    data = yaml.safe_load(SMOKE.read_text())
    data["curriculum"] = {"adaptive": True}
    data["runtime"] = {"kind": "async"}
    with pytest.raises(ConfigError, match="curriculum: needs runtime.kind: local"):
        load_config(None, data=data)
