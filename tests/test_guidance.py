"""Guidance for all-fail groups: LUFFY's shaped loss by hand, which groups get a reference and which never do,
the learner's handling of reference rows, and a run in which the policy learns the reference."""

import json
import math

import pytest
import torch
from algo_helpers import fake_trajectories, make_learner
from conftest import SMOKE

from polyrl.algorithms.guidance import shaped_reference_loss
from polyrl.config import AlgorithmConfig, GuidanceConfig, TaskConfig
from polyrl.config_check import load_config
from polyrl.envs.base import make_task
from polyrl.learner.advantage_stage import token_advantages
from polyrl.learner.batch import collate
from polyrl.train.guidance import Guidance
from polyrl.train.step import build_run, rl_step
from polyrl.types import Trajectory

SUM = {"name": "chain_sum", "params": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
       "prompt_suffix": " Answer with just the number.", "eval_size": 8}


def test_shaped_loss_worked_by_hand():
    # One reference token at probability 0.1, gamma 0.1: f = 0.1 / 0.2 = 0.5, so the loss is -A f = -1 for A = 2;
    # d f / d log p = p gamma / (p + gamma)^2 = 0.01 / 0.04 = 0.25, so d loss / d log p = -2 x 0.25.
    logp = torch.tensor([[math.log(0.1), 0.0]], requires_grad=True)
    loss, metrics = shaped_reference_loss(logp, torch.tensor([2.0]), torch.tensor([[1.0, 0.0]]), gamma=0.1)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.0)
    assert logp.grad[0].tolist() == pytest.approx([-0.5, 0.0])
    assert metrics == {"guidance/reference_prob": pytest.approx(0.1)}
    # The push is largest where the policy's probability is near gamma, not on tokens it already produces.
    pushes = []
    for p in (0.001, 0.1, 0.9):
        x = torch.tensor([[math.log(p)]], requires_grad=True)
        shaped_reference_loss(x, torch.tensor([1.0]), torch.ones(1, 1), gamma=0.1)[0].backward()
        pushes.append(-float(x.grad))
    assert pushes[1] > pushes[2] and pushes[1] > pushes[0]
    # No shaping: the reference weighed as if sampled, d loss / d log p = -A whatever p (value -A).
    unshaped = torch.tensor([[math.log(0.001)]], requires_grad=True)
    loss, _ = shaped_reference_loss(unshaped, torch.tensor([2.0]), torch.ones(1, 1), gamma=None)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-2.0) and float(unshaped.grad) == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="gamma > 0"):
        shaped_reference_loss(logp, torch.tensor([2.0]), torch.ones(1, 2), gamma=0.0)


def _group(task, index: int, gid: int, scores: list[float], tok) -> list[Trajectory]:
    from polyrl.rollout.multi_turn import start_episode

    prompt = start_episode(task, index, task.train_item(index), gid, tok).ids
    return [Trajectory(task=task.name, item_id=index, group_id=gid, input_ids=[*prompt, 10 + k, 2],
                       loss_mask=[0] * len(prompt) + [1, 1], logprobs=[0.0] * (len(prompt) + 2),
                       versions=[0] * (len(prompt) + 2), reward=s, info={"score": s}) for k, s in enumerate(scores)]


@pytest.fixture(scope="module")
def task(tok):
    return make_task(TaskConfig(**SUM), seed=0, tokenizer=tok)


def test_only_all_fail_groups_get_the_reference_and_it_is_the_items_answer(task, tok):
    trajectories = _group(task, 0, 0, [0.0, 0.0, 0.0], tok) + _group(task, 1, 1, [0.0, 1.0, 0.0], tok)
    before = list(trajectories)
    guided, metrics = Guidance(GuidanceConfig(reference=True), tok, 8, seed=0).mix_in(
        trajectories, {0: (task, 0, task.train_item(0)), 1: (task, 1, task.train_item(1))}, step=1)
    assert metrics == {"guidance/all_fail_groups": 1.0, "guidance/guided": 1.0, "guidance/unusable": 0.0}
    assert trajectories[:2] == before[:2] and trajectories[3:] == before[3:]  # only the last sample of group 0
    ref = trajectories[2]
    assert guided == [ref] and ref.guided and ref.group_id == 0 and ref.reward == 1.0
    assert ref.text == str(task.train_item(0)["answer"])
    # Same prompt tokens as the group's samples; only the reply (its tokens and stop token) is trained.
    n = before[0].prompt_len
    assert ref.input_ids[:n] == before[0].input_ids[:n] and ref.prompt_len == n
    assert tok.decode(ref.input_ids[n:], skip_special_tokens=True) == ref.text


def test_a_reference_the_env_does_not_score_a_success_is_never_mixed_in(tok):
    wrong = make_task(TaskConfig(**SUM, reference="{answer}1"), seed=0, tokenizer=tok)  # 7 -> "71"
    long = make_task(TaskConfig(**SUM, reference="{answer} " + "and so on " * 20), seed=0, tokenizer=tok)
    for t in (wrong, long):
        trajectories = _group(t, 0, 0, [0.0, 0.0], tok)
        guided, metrics = Guidance(GuidanceConfig(reference=True), tok, 8, seed=0).mix_in(
            trajectories, {0: (t, 0, t.train_item(0))}, step=1)
        assert guided == [] and metrics["guidance/unusable"] == 1.0 and not any(x.guided for x in trajectories)


def test_probability_anneals_to_zero_and_gates_groups(task, tok):
    g = Guidance(GuidanceConfig(reference=True, probability=0.8, anneal_steps=10), tok, 8, seed=0)
    assert [g.probability(s) for s in (1, 6, 11, 50)] == pytest.approx([0.8, 0.4, 0.0, 0.0])
    trajectories = [t for i in range(40) for t in _group(task, i, i, [0.0, 0.0], tok)]
    guided, _ = Guidance(GuidanceConfig(reference=True, probability=0.5), tok, 8, seed=0).mix_in(
        trajectories, {i: (task, i, task.train_item(i)) for i in range(40)}, step=1)
    assert 10 <= len(guided) <= 30  # a seeded coin per group


def test_reference_rows_leave_the_policy_loss_with_their_group_advantage():
    trajectories = fake_trajectories(2)
    trajectories[1].guided = True
    trajectories[1].advantage = 3.0
    mb = collate(trajectories, pad_id=2)
    old = torch.full(mb.loss_mask.shape, math.log(0.5))
    for mode in ("none", "tis"):  # a correction weighs sampled rows only; the reference has no behaviour policy
        adv = token_advantages(AlgorithmConfig(off_policy=mode), mb, torch.zeros(2), old, None, None,
                               torch.zeros(2, dtype=torch.bool), 2.0, 1.0)
        assert adv.pg_mask[1].sum() == 0 and adv.pg_mask[0].sum() == 3
        assert adv.guided_mask.tolist() == [[0, 0, 0], [1, 1, 1]]
        assert adv.advantages[1].expand(3).tolist() == [3.0, 3.0, 3.0]
        if mode == "tis":  # the sampled row is weighed by min(pi_old / mu, 2) = 0.5 / 1
            assert adv.advantages[0].tolist() == pytest.approx([-0.5] * 3)


@pytest.mark.slow
def test_a_learner_update_raises_the_reference_probability():
    learner = make_learner(lr=1e-2)
    trajectories = fake_trajectories(4)
    for t in trajectories:
        t.advantage = -0.5
    trajectories[3].guided, trajectories[3].advantage = True, 1.5
    probs = [learner.update(trajectories)["guidance/reference_prob"] for _ in range(4)]
    assert probs[-1] > probs[0] and "loss/guidance" in learner.update(trajectories)


@pytest.mark.slow
def test_rl_step_with_guidance_trains_on_references_and_logs_only_the_policys_rewards(tmp_path):
    cfg = load_config(SMOKE, ["guidance.reference=true", "logging.tensorboard=false", "rollout.max_new_tokens=6"])
    run = build_run(cfg, tmp_path)
    metrics, kept = rl_step(run, 1)
    guided = [t for t in kept if t.guided]
    assert metrics["guidance/guided"] == len(guided) > 0 and "loss/guidance" in metrics
    assert all(t.reward == 1.0 for t in guided)
    policy = [t for t in kept if not t.guided]
    assert metrics["reward/mean"] == pytest.approx(sum(t.reward for t in policy) / len(policy))


@pytest.mark.slow
def test_a_resumed_run_mixes_in_what_the_whole_run_did(tmp_path):
    from polyrl.run.loop import train

    def config(steps):
        return load_config(SMOKE, [f"train.steps={steps}", "guidance.reference=true", "eval.before=false",
                                   "eval.after=false", "logging.tensorboard=false", "logging.report=false",
                                   "rollout.max_new_tokens=6"])

    train(config(2), tmp_path / "a", log=lambda *_: None)
    train(config(1), tmp_path / "b", log=lambda *_: None)
    train(config(2), tmp_path / "b", resume=True, log=lambda *_: None)
    rows = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "ab"]
    keys = ("guidance/guided", "loss/guidance", "reward/mean")
    assert rows[0][-1]["guidance/guided"] > 0
    assert [[r[k] for k in keys] for r in rows[0]] == [[r[k] for k in keys] for r in rows[1]]
