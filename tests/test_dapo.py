"""DAPO pieces: overlong shaping (Eq. 13), dynamic sampling, truncation masking, with worked numbers."""

import pytest
import torch
from algo_helpers import fake_trajectories, make_learner

from polyrl.algorithms.dapo import group_has_variance, overlong_penalty
from polyrl.algorithms.reward_shaping import shape_rewards
from polyrl.config import AgentsConfig, AlgorithmConfig
from polyrl.data.dynamic_sampling import dynamic_sample
from polyrl.learner.advantage_stage import assign_advantages
from polyrl.types import Trajectory


def traj(group: int, reward: float, n_tokens: int = 2, truncated: bool = False) -> Trajectory:
    return Trajectory(
        task="t", item_id=group, group_id=group, input_ids=[5] + [9] * n_tokens,
        loss_mask=[0] + [1] * n_tokens, logprobs=[0.0] * (n_tokens + 1), versions=[-1] + [0] * n_tokens,
        reward=reward, truncated=truncated,
    )


def test_overlong_penalty_is_a_linear_ramp_over_the_buffer():
    # L_max 8, L_cache 4: free up to 4 tokens, then (4 - |y|) / 4: 5 -> -0.25, 6 -> -0.5, 8 -> -1; beyond: -1
    got = overlong_penalty(torch.tensor([3, 4, 5, 6, 8, 9]), max_new_tokens=8, buffer=4)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert overlong_penalty(torch.tensor([8]), 8, 0).tolist() == [0.0]  # buffer 0: off


def test_shape_rewards_adds_the_scaled_penalty_and_records_it():
    ts = [traj(0, 1.0, n_tokens=4), traj(0, 1.0, n_tokens=7), traj(1, 0.0, n_tokens=8)]
    algo = AlgorithmConfig(shaping={"overlong_buffer": 4, "overlong_penalty": 0.5})
    m = shape_rewards(ts, algo, max_new_tokens=8)
    # penalties 0, 0.5 * -0.75, 0.5 * -1
    assert [t.reward for t in ts] == pytest.approx([1.0, 0.625, -0.5])
    assert [t.rewards["overlong"] for t in ts] == pytest.approx([0.0, -0.375, -0.5])
    assert m["reward/overlong"] == pytest.approx(-0.875 / 3)
    assert shape_rewards(ts, AlgorithmConfig(), 8) == {}  # off by default, rewards untouched
    assert ts[0].reward == 1.0


def test_assign_advantages_uses_the_configured_estimator_and_kwargs():
    ts = [traj(0, 1.0), traj(0, 0.0), traj(0, 0.0), traj(0, 1.0)]
    assign_advantages(ts, AlgorithmConfig(advantage="rloo"), AgentsConfig())
    assert [t.advantage for t in ts] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # grpo with a huge eps: (r - 0.5) / (0.577 + 1000) is about +-0.0005
    assign_advantages(ts, AlgorithmConfig(advantage={"estimator": "grpo", "kwargs": {"eps": 1000.0}}), AgentsConfig())
    assert abs(ts[0].advantage) < 1e-3 and ts[0].advantage > 0


def test_group_has_variance():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 3.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # group 3 has one sample: no variance
    assert group_has_variance(r, g).tolist() == [False, False, True, True, False, False, False]


def scripted(rounds: list[list[list[float]]]):
    """A sample_round that returns the scripted reward groups of each round and records its calls."""
    calls = []

    def sample_round(k: int, n: int, first_id: int) -> list[Trajectory]:
        calls.append((k, n, first_id))
        groups = rounds[k][:n]
        return [traj(first_id + i, r) for i, g in enumerate(groups) for r in g]

    return sample_round, calls


def test_dynamic_sampling_refills_with_informative_groups():
    # want 2. Round 0: [0,0] dropped, [1,0] kept; rate 1/2, shortfall 1 -> draw ceil(1 / 0.5) = 2 prompts.
    # Round 1 (ids 2, 3): [1,1] dropped, [0,1] kept -> groups 1 and 3; 2 of 4 groups had zero variance.
    fn, calls = scripted([[[0, 0], [1, 0]], [[1, 1], [0, 1]]])
    out = dynamic_sample(fn, want=2, enabled=True, max_extra_rounds=3)
    assert calls == [(0, 2, 0), (1, 2, 2)]
    assert sorted({t.group_id for t in out.kept}) == [1, 3]
    assert len(out.sampled) == 8 and out.rounds == 2 and out.zero_variance_groups == 0.5
    assert out.metrics() == {"sampling/rounds": 2.0, "sampling/kept_groups": 2.0}


def test_dynamic_sampling_stops_after_the_extra_rounds():
    # no extra rounds allowed: train on the one informative group
    fn, calls = scripted([[[0, 0], [1, 0]]])
    out = dynamic_sample(fn, want=2, enabled=True, max_extra_rounds=0)
    assert calls == [(0, 2, 0)] and [t.group_id for t in out.kept] == [1, 1]
    # nothing informative in 2 rounds: the first `want` groups are kept so the step still runs
    fn, calls = scripted([[[0, 0], [1, 1]], [[0, 0], [0, 0]]])
    out = dynamic_sample(fn, want=2, enabled=True, max_extra_rounds=1)
    assert calls == [(0, 2, 0), (1, 2, 2)]  # rate 0 -> a full batch of prompts
    assert [t.group_id for t in out.kept] == [0, 0, 1, 1] and out.zero_variance_groups == 1.0


def test_dynamic_sampling_off_keeps_everything_and_still_measures():
    fn, calls = scripted([[[0, 0], [1, 0]]])
    out = dynamic_sample(fn, want=2, enabled=False, max_extra_rounds=3)
    assert calls == [(0, 2, 0)] and out.kept == out.sampled and out.zero_variance_groups == 0.5
    assert out.metrics() == {}


@pytest.mark.slow
def test_mask_truncated_removes_truncated_samples_from_the_loss():
    ts = fake_trajectories()
    for t in ts:
        t.truncated = True
    masked = make_learner(loss={"mask_truncated": True}, regularisers={"track_kl": False}).update(ts)
    assert masked["loss/pg"] == 0.0 and masked["grad_norm"] == 0.0
    kept = make_learner(loss={"mask_truncated": False}, regularisers={"track_kl": False}).update(fake_trajectories())
    assert kept["grad_norm"] > 0.0
