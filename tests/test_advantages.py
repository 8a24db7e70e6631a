"""Advantage estimators and GAE against small examples worked out by hand."""

import math

import pytest
import torch
from algo_helpers import fake_trajectories, make_learner

from polyrl.algorithms import ADVANTAGES
from polyrl.algorithms.gae import ValueHead, gae, terminal_rewards, value_loss
from polyrl.algorithms.kl import kl_penalty_to_go
from polyrl.config import AgentsConfig, AlgorithmConfig, ConfigError, parse_config
from polyrl.learner.advantage_stage import assign_advantages, token_advantages
from polyrl.learner.batch import collate

R = torch.tensor([1.0, 0.0, 0.0, 1.0])
ONE_GROUP = torch.tensor([0, 0, 0, 0])


def close(got: torch.Tensor, want: list[float], tol: float = 1e-6) -> None:
    assert got.shape == (len(want),)
    expected = torch.tensor(want, dtype=torch.float64)
    assert torch.allclose(got.double(), expected, atol=tol), (got.tolist(), want)


def test_grpo_divides_by_unbiased_group_std():
    # mean 0.5; unbiased std = sqrt((4 * 0.25) / 3) = 1/sqrt(3); (1 - 0.5) * sqrt(3) = 0.866025
    a = math.sqrt(3) / 2
    close(ADVANTAGES["grpo"](R, ONE_GROUP, eps=0.0), [a, -a, -a, a])


def test_dr_grpo_only_subtracts_the_group_mean():
    # groups {1, 0} and {0, 0.5}: means 0.5 and 0.25
    r = torch.tensor([1.0, 0.0, 0.0, 0.5])
    close(ADVANTAGES["dr_grpo"](r, torch.tensor([0, 0, 1, 1])), [0.5, -0.5, -0.25, 0.25])


def test_rloo_uses_the_mean_of_the_other_samples():
    # r_0 = 1, others' mean (0 + 0 + 1) / 3 = 1/3 -> 2/3; r_1 = 0, others' mean 2/3 -> -2/3
    close(ADVANTAGES["rloo"](R, ONE_GROUP), [2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_rloo_two_groups_and_a_singleton():
    # group 0: {3, 1} -> 3 - 1 = 2 and 1 - 3 = -2; group 1 has one sample: no baseline, advantage 0
    r = torch.tensor([3.0, 1.0, 5.0])
    close(ADVANTAGES["rloo"](r, torch.tensor([7, 7, 9])), [2.0, -2.0, 0.0])


def test_reinforce_pp_normalises_over_the_batch_not_the_group():
    # batch mean 0.5, population std 0.5 -> [1, -1, -1, 1], whatever the groups are
    close(ADVANTAGES["reinforce_pp"](R, torch.tensor([0, 0, 1, 1]), eps=0.0), [1.0, -1.0, -1.0, 1.0])
    # rewards [2, 0, 0, 0]: mean 0.5, pop std sqrt((2.25 + 3 * 0.25) / 4) = sqrt(0.75)
    s = math.sqrt(0.75)
    got = ADVANTAGES["reinforce_pp"](torch.tensor([2.0, 0.0, 0.0, 0.0]), ONE_GROUP, eps=0.0)
    close(got, [1.5 / s, -0.5 / s, -0.5 / s, -0.5 / s])


def test_reinforce_pp_baseline_subtracts_group_mean_then_batch_normalises():
    # groups {1, 0} and {1, 1}: minus group means -> [0.5, -0.5, 0, 0]; batch mean 0, pop std sqrt(0.125)
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    s = math.sqrt(0.125)
    got = ADVANTAGES["reinforce_pp_baseline"](r, torch.tensor([0, 0, 1, 1]), eps=0.0)
    close(got, [0.5 / s, -0.5 / s, 0.0, 0.0])
    # GRPO would give the same groups [0.707, -0.707, 0, 0]: the scale differs, the sign pattern not
    assert torch.equal(torch.sign(got), torch.sign(ADVANTAGES["grpo"](r, torch.tensor([0, 0, 1, 1]))))


def test_maxrl_divides_by_the_group_mean_reward():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    # group 0: mean 1/4 -> (1 - 1/4) * 4 = 3 and -1; group 1: mean 3/4 -> 1/3 and -1; group 2: nothing solved
    close(ADVANTAGES["maxrl"](rewards, groups), [3, -1, -1, -1, 1 / 3, 1 / 3, 1 / 3, -1, 0, 0], tol=1e-5)


def test_gdpo_normalises_each_reward_component_within_its_group():
    # correctness [1, 0, 0, 0]: mean 1/4, unbiased std 1/2 -> [1.5, -0.5, -0.5, -0.5]
    # format [0, 1, 0, 1]: mean 1/2, std 1/sqrt(3) -> [-0.866, 0.866, -0.866, 0.866]
    parts = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    a = math.sqrt(3) / 2
    summed = [1.5 - a, -0.5 + a, -0.5 - a, -0.5 + a]
    close(ADVANTAGES["gdpo"](parts, ONE_GROUP, eps=0.0, batch_norm=False), summed)
    # GRPO on the summed reward [1, 1, 0, 1] gives samples 0 and 1 the same advantage; GDPO ranks the
    # correct one higher
    grpo = ADVANTAGES["grpo"](parts.sum(-1), ONE_GROUP)
    assert grpo[0] == pytest.approx(grpo[1].item())
    s = torch.tensor(summed, dtype=torch.float64)
    close(ADVANTAGES["gdpo"](parts, ONE_GROUP, eps=0.0), ((s - s.mean()) / s.std(correction=0)).tolist())
    close(ADVANTAGES["gdpo"](parts, ONE_GROUP, weights=[2.0, 0.0], eps=0.0, batch_norm=False),
          [3.0, -1.0, -1.0, -1.0])
    with pytest.raises(ValueError, match="3 weights for 2 reward components"):
        ADVANTAGES["gdpo"](parts, ONE_GROUP, weights=[1.0, 1.0, 1.0])


def test_gdpo_reads_the_trajectories_reward_components():
    from polyrl.config import AgentsConfig, AlgorithmConfig
    from polyrl.learner.advantage_stage import assign_advantages

    ts = fake_trajectories()
    for t, (c, f) in zip(ts, [(1.0, 0.0), (0.0, 1.0), (0.0, 0.0), (0.0, 1.0)], strict=True):
        t.rewards, t.reward = {"correct": c, "format": f}, c + f
    assign_advantages(ts, AlgorithmConfig(advantage={"estimator": "gdpo", "kwargs": {"eps": 0.0, "batch_norm": False}}),
                      AgentsConfig())
    a = math.sqrt(3) / 2
    close(torch.tensor([t.advantage for t in ts]), [1.5 - a, -0.5 + a, -0.5 - a, -0.5 + a], tol=1e-5)


def test_every_estimator_keeps_shape_and_dtype():
    required = {"pass_at_k": {"k": 2}}  # keywords without a default
    for name in ADVANTAGES.names():
        out = ADVANTAGES[name](R, ONE_GROUP, **required.get(name, {}))
        assert out.shape == R.shape and out.dtype == R.dtype, name
        assert torch.isfinite(out).all(), name


def test_a_critic_hands_the_outcome_reward_to_the_learner():
    # with a critic there is no sample-level estimate: the learner's GAE makes the per-token advantages
    ts = fake_trajectories()
    assign_advantages(ts, AlgorithmConfig(critic={}), AgentsConfig())
    assert [t.advantage for t in ts] == [t.reward for t in ts] == [0.0, 1.0, 0.0, 1.0]
    assign_advantages(ts, AlgorithmConfig(), AgentsConfig())  # GRPO's, for contrast: centred in the group
    assert [t.advantage for t in ts] != [t.reward for t in ts]


def test_critic_keys_moved_out_of_algorithm_are_refused_with_their_new_place():
    task = {"tasks": [{"name": "chain_sum"}]}
    for old, new in [("value_lr", "critic.lr"), ("gamma", "critic.gamma"), ("value_width", "critic.width")]:
        with pytest.raises(ConfigError, match=rf"^config: algorithm\.{old}: moved to algorithm\.{new}$"):
            parse_config(None, data={**task, "algorithm": {old: 1}})
    with pytest.raises(ConfigError, match=r"algorithm\.advantage: gae is declared as a critic now"):
        parse_config(None, [], {**task, "algorithm": {"advantage": "gae"}})
    with pytest.raises(ConfigError, match=r"algorithm\.advantage: 'rloo' is a sample-level estimator"):
        parse_config(None, ["algorithm.critic={}"], {**task, "algorithm": {"advantage": "rloo"}})
    cfg = parse_config(None, ["algorithm.critic.lam=0.9"], {**task, "algorithm": {"critic": {}}})
    assert cfg.algorithm.critic.lam == 0.9 and cfg.algorithm.critic.width == 128
    # a dumped config (every field written out, as a run directory keeps it) loads back
    assert parse_config(None, data=cfg.model_dump(mode="json")).algorithm.critic == cfg.algorithm.critic


def test_gae_lambda_one_is_return_minus_value():
    # rewards [0, 0, 1], V = 0.5 everywhere, gamma = lam = 1: deltas [0, 0, 0.5] -> A = [0.5, 0.5, 0.5]
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.full((1, 3), 0.5)
    close(gae(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0)[0], [0.5, 0.5, 0.5])


def test_gae_with_lambda_and_gamma():
    # lam = 0.5, gamma = 1: A_2 = 0.5, A_1 = 0 + 0.5 * 0.5 = 0.25, A_0 = 0.125
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.full((1, 3), 0.5)
    close(gae(r, v, torch.ones(1, 3), gamma=1.0, lam=0.5)[0], [0.125, 0.25, 0.5])
    # gamma = 0.5, lam = 1, V = 0: A_2 = 1, A_1 = 0.5 * 1 = 0.5, A_0 = 0.25 (discounted return)
    close(gae(r, torch.zeros(1, 3), torch.ones(1, 3), gamma=0.5, lam=1.0)[0], [0.25, 0.5, 1.0])


def test_gae_skips_masked_positions():
    # tokens at 0, 2 (position 1 is an env token, 3 is padding): the step after 0 is 2.
    # V = [1, 9, 2, 9]; r_2 = 3. delta_2 = 3 - 2 = 1; delta_0 = 0 + V_2 - V_0 = 1; lam = 1: A_0 = 2.
    r = torch.tensor([[0.0, 5.0, 3.0, 0.0]])
    v = torch.tensor([[1.0, 9.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    close(gae(r, v, mask, gamma=1.0, lam=1.0)[0], [2.0, 0.0, 1.0, 0.0])


def test_terminal_rewards_land_on_the_last_valid_token():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    out = terminal_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert out.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [0.0, 0.0, 0.0]]


def test_value_loss_clips_like_ppo():
    # old V 0, new V 1, return 2, clip 0.2: unclipped err (1-2)^2 = 1, clipped V 0.2 -> (0.2-2)^2 = 3.24
    # max = 3.24, loss = 0.5 * 3.24 = 1.62
    v = torch.tensor([[1.0]], requires_grad=True)
    loss, m = value_loss(v, torch.zeros(1, 1), torch.full((1, 1), 2.0), torch.ones(1, 1), clip=0.2)
    assert loss.item() == pytest.approx(1.62)
    assert m["value/clip_frac"] == 1.0
    loss.backward()
    assert v.grad.item() == 0.0  # the clipped branch is constant in V
    plain, _ = value_loss(v, torch.zeros(1, 1), torch.full((1, 1), 2.0), torch.ones(1, 1), clip=None)
    assert plain.item() == pytest.approx(0.5)


def test_value_head_starts_at_zero_and_learns():
    torch.manual_seed(0)
    head = ValueHead(4, width=8)
    h = torch.randn(3, 5, 4)
    assert torch.equal(head(h), torch.zeros(3, 5))
    target = torch.ones(3, 5)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(100):
        opt.zero_grad()
        loss, _ = value_loss(head(h), torch.zeros(3, 5), target, torch.ones(3, 5), clip=None)
        loss.backward()
        opt.step()
    assert (head(h) - target).abs().max() < 0.1


def test_kl_in_reward_is_a_reward_to_go():
    # KL per token [0.1, 0.2, 0.3, (pad)], coef 2: to-go sums [0.6, 0.5, 0.3, 0]
    # -> penalties [-1.2, -1.0, -0.6, 0]
    kl = torch.tensor([[0.1, 0.2, 0.3, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    close(kl_penalty_to_go(kl, mask, coef=2.0)[0], [-1.2, -1.0, -0.6, 0.0])


def test_learner_turns_rewards_into_gae_advantages_and_trains_the_critic():
    learner = make_learner(critic={"lr": 1e-2, "lam": 0.95, "gamma": 1.0}, regularisers={"track_kl": False})
    ts = fake_trajectories()  # rewards [0, 1, 0, 1], 3 response tokens each
    batch = collate(ts, pad_id=2)
    rewards = torch.tensor([t.reward for t in ts])
    # a fresh head predicts V = 0: A_t = (gamma lam)^(2 - t) R -> [0.9025, 0.95, 1] for R = 1, zeros for R = 0
    no_cross = torch.zeros(4, dtype=torch.bool)
    result = token_advantages(learner.algo, batch, rewards, torch.zeros(4, 3), None, torch.zeros(4, 3), no_cross,
                              2.0, 1.0)
    adv, returns = result.advantages, result.returns
    assert adv[1].tolist() == pytest.approx([0.9025, 0.95, 1.0]) and adv[0].tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(returns, adv)
    before = [p.detach().clone() for p in learner.value_head.parameters()]
    first = learner.update(ts)
    assert first["value/mean"] == 0.0 and first["loss/value"] > 0
    for _ in range(5):
        last = learner.update(fake_trajectories())
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.value_head.parameters(), strict=True))
    assert last["value/mean"] > 0.0  # moving toward the mean return 0.5
    assert last["loss/value"] < first["loss/value"]
    # the head's parameters sit in the optimizer (so they are checkpointed with it), at their own rate
    assert learner.optimizer.param_groups[1]["lr"] == pytest.approx(1e-2)


def test_the_critic_is_part_of_the_learner_state():
    # checkpoints store learner.state_dict(): a resumed PPO run must get its trained value head back
    trained = make_learner(critic={"lr": 1e-2}, regularisers={"track_kl": False})
    for _ in range(2):
        trained.update(fake_trajectories())
    fresh = make_learner(critic={"lr": 1e-2}, regularisers={"track_kl": False})
    h = torch.randn(2, 3, fresh.value_head.net[0].in_features)
    assert not torch.allclose(fresh.value_head(h), trained.value_head(h))
    fresh.load_state_dict(trained.state_dict())
    assert torch.equal(fresh.value_head(h), trained.value_head(h))
    with pytest.raises(ValueError, match="no value head"):
        fresh.load_state_dict(make_learner(regularisers={"track_kl": False}).state_dict())


def test_gated_shaping_pays_only_solved_episodes():
    from polyrl.algorithms.reward_shaping import gate_rewards

    ts = fake_trajectories(3)
    parts = [{"env": 1.0, "judge": 0.5, "overlong": -0.2}, {"env": 0.0, "judge": 0.8, "overlong": -0.1},
             {"env": 0.0, "judge": 0.0, "overlong": 0.0}]
    for t, p in zip(ts, parts, strict=True):
        t.rewards, t.reward = dict(p), 0.5 * p["env"] + p["judge"] + p["overlong"]
    m = gate_rewards(ts, outcome="env", threshold=1.0)
    # solved: unchanged (0.5 + 0.5 - 0.2 = 0.8); unsolved: the judge's 0.8 withheld, the penalty kept (-0.1)
    assert [t.reward for t in ts] == pytest.approx([0.8, -0.1, 0.0])
    assert ts[1].rewards == {"env": 0.0, "judge": 0.0, "overlong": -0.1}
    assert m["reward/gated_frac"] == pytest.approx(1 / 3)  # the third had nothing positive to withhold
    with pytest.raises(ValueError, match=r"algorithm.advantage.reward_gate.outcome: no reward component 'correct' in "
                                         r"task 't' \(its components: env, judge, overlong\)"):
        gate_rewards(ts, outcome="correct", threshold=1.0)


def test_reward_gate_through_shape_rewards():
    from polyrl.algorithms.reward_shaping import shape_rewards
    from polyrl.config import AlgorithmConfig

    ts = fake_trajectories(2)
    for t, (env, judge) in zip(ts, [(1.0, 0.4), (0.0, 0.4)], strict=True):
        t.rewards, t.reward = {"env": env, "judge": judge}, env + judge
    algo = AlgorithmConfig(advantage={"reward_gate": {"outcome": "env", "threshold": 0.5, "gated": ["judge"]}})
    # criteria as scored (before the gate), then the share of episodes whose shaping was withheld
    assert shape_rewards(ts, algo, max_new_tokens=64) == pytest.approx(
        {"reward/criterion/env": 0.5, "reward/criterion/judge": 0.4, "reward/gated_frac": 0.5})
    assert [t.reward for t in ts] == pytest.approx([1.4, 0.0])


def test_gating_on_a_reward_no_task_records_is_a_config_error():
    from polyrl.config import ConfigError
    from polyrl.config_check import load_config

    with pytest.raises(ConfigError) as err:
        load_config("configs/quickstart.yaml", ["algorithm.advantage.reward_gate={outcome: correct}"])
    text = str(err.value)
    assert ("algorithm.advantage.reward_gate.outcome: task 'chain_sum' has no reward 'correct'; its rewards: "
            "chain_sum") in text
    assert "\n" not in text
    cfg = load_config("configs/quickstart.yaml",
                      ["algorithm.advantage.reward_gate={outcome: chain_sum, threshold: 1.0}"])
    assert cfg.algorithm.advantage.reward_gate.outcome == "chain_sum"


def test_rubric_rule_criteria_names_and_per_criterion_means():
    from polyrl.algorithms.reward_shaping import criterion_means
    from polyrl.config import RewardComponentConfig, component_names
    from polyrl.envs.reward_mix import rule_scores

    assert rule_scores(r"^\s*-?\d+\s*$", ["42", " 7 \n", "the answer is 42", "-3"]) == [1.0, 1.0, 0.0, 1.0]
    comps = [RewardComponentConfig(kind="env"), RewardComponentConfig(kind="rule", name="just_a_number",
                                                                     pattern=r"^\d+$", weight=0.2),
             RewardComponentConfig(kind="judge"), RewardComponentConfig(kind="judge", reference=True)]
    assert component_names(comps) == ["env", "just_a_number", "judge_2", "judge_3"]
    ts = fake_trajectories(3)
    for t, (env, rule) in zip(ts, [(1.0, 1.0), (0.0, 1.0), (0.0, 0.0)], strict=True):
        t.rewards = {"env": env, "just_a_number": rule}
    ts[2].rewards["t"] = 5.0  # a task-named total is not a criterion
    assert criterion_means(ts) == pytest.approx({"reward/criterion/env": 1 / 3,
                                                 "reward/criterion/just_a_number": 2 / 3})


def test_rubric_config_errors_name_the_key():
    from polyrl.config import ConfigError
    from polyrl.config_check import load_config

    cases = {
        "tasks.0.reward_components=[{kind: rule}]": "tasks.0.reward_components.0.pattern: a rule component needs",
        "tasks.0.reward_components=[{kind: rule, pattern: '('}]": "tasks.0.reward_components.0.pattern: not a "
                                                                  "regular expression",
        "tasks.0.reward_components=[{kind: env, name: a}, {kind: rule, name: a, pattern: x}]":
            "tasks.0.reward_components: two components named 'a'",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config("configs/quickstart.yaml", [override])
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.slow
def test_rule_criterion_mixes_into_the_training_reward(tmp_path):
    import yaml
    from conftest import SMOKE

    from polyrl.config_check import load_config
    from polyrl.train.step import build_run, rl_step

    data = yaml.safe_load(SMOKE.read_text())
    data["tasks"][0]["reward_components"] = [{"kind": "env"}, {"kind": "rule", "name": "short",
                                                                "pattern": r"^.{0,5}$", "weight": 0.5}]
    run = build_run(load_config(None, data=data), tmp_path)
    metrics, kept = rl_step(run, 1)
    for t in kept:
        text = run.tokenizer.decode([i for i, m in zip(t.input_ids, t.loss_mask, strict=True) if m],
                                    skip_special_tokens=True)
        assert t.rewards["short"] == (1.0 if len(text) <= 5 and "\n" not in text else 0.0)
        assert t.reward == pytest.approx(t.rewards["env"] + 0.5 * t.rewards["short"])
    assert "reward/criterion/short" in metrics and "reward/criterion/env" in metrics


def test_judge_grades_against_a_reference_when_asked():
    from polyrl.envs.reward_mix import reference_of
    from polyrl.rewards.judge import Judge

    judge = Judge("tiny-random")
    plain = judge.tokenizer.decode(judge.prompt_ids("What is 2+2?", "4", "Is it right?"))
    graded = judge.tokenizer.decode(judge.prompt_ids("What is 2+2?", "4", "Is it right?", reference="4"))
    assert "Reference answer:\n4" in graded and "Reference answer" not in plain
    pairs = [("What is 2+2?", "4")]
    with_ref = judge.score(pairs, "Is it right?", ["4"])
    assert with_ref != judge.score(pairs, "Is it right?") and 0.0 < with_ref[0] < 1.0
    assert reference_of({"question": "q", "answer": 4}, "t") == "4"
    with pytest.raises(ValueError, match=r"tasks\[t\].reward_components: reference needs the item's 'answer'"):
        reference_of({"question": "q"}, "t")
