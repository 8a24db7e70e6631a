"""The pass@k advantage (Chen et al. 2025) against its definition: k-subsets of a group enumerated by hand, not
the closed form the estimator uses."""

import itertools
import math

import pytest
import torch
from algo_helpers import fake_trajectories
from conftest import SMOKE

from polyrl.algorithms import ADVANTAGES
from polyrl.config import AgentsConfig, AlgorithmConfig, ConfigError
from polyrl.config_check import load_config
from polyrl.learner.advantage_stage import assign_advantages

PASS_AT_K = ADVANTAGES["pass_at_k"]


def by_subsets(success: list[bool], k: int) -> list[float]:
    """The definition: a k-subset earns 1 when it holds a success; a sample's advantage is the mean reward of
    the subsets containing it, minus the mean over all subsets, over the std of the subsets' rewards (0 when
    that std is 0)."""
    subsets = list(itertools.combinations(range(len(success)), k))
    reward = {s: float(any(success[i] for i in s)) for s in subsets}
    mean = sum(reward.values()) / len(subsets)
    std = math.sqrt(sum((r - mean) ** 2 for r in reward.values()) / len(subsets))
    if std == 0:
        return [0.0] * len(success)
    return [(sum(reward[s] for s in subsets if i in s) / sum(i in s for s in subsets) - mean) / std
            for i in range(len(success))]


def test_one_success_in_four_at_k_2_worked_by_hand():
    # C(4, 2) = 6 pairs; the 3 holding sample 0 earn 1, the other 3 earn 0: mean 1/2, std 1/2.
    # Sample 0's pairs all earn 1: (1 - 1/2) / (1/2) = 1. Sample 1's pairs {0,1}, {1,2}, {1,3} earn 1, 0, 0:
    # (1/3 - 1/2) / (1/2) = -1/3.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert by_subsets([True, False, False, False], 2) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    got = PASS_AT_K(rewards, torch.zeros(4, dtype=torch.long), k=2)
    assert got.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-6)
    assert got.dtype == rewards.dtype


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8])
def test_every_group_and_k_matches_the_subsets(n):
    for c in range(n + 1):
        success = [i < c for i in range(n)]
        rewards = torch.tensor([float(s) for s in success], dtype=torch.float64)
        for k in range(1, n + 1):
            got = PASS_AT_K(rewards, torch.zeros(n, dtype=torch.long), k=k)
            assert got.tolist() == pytest.approx(by_subsets(success, k), abs=1e-9), (n, c, k)


def test_all_fail_and_all_pass_groups_have_no_advantage():
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    for k in (1, 2, 4):
        assert PASS_AT_K(rewards, groups, k=k).tolist() == [0.0] * 8


def test_a_group_with_fewer_failures_than_k_is_saturated():
    # 3 of 4 solved at k = 2: every pair holds a success, so pass@2 is 1 whatever a sample did.
    assert PASS_AT_K(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long), k=2).tolist() == [0.0] * 4


def test_k_1_is_the_mean_centred_std_normalised_advantage():
    # Two mixed groups: 2 of 4 and 1 of 3 solved. At k = 1 the subsets are the samples: (r - mean) / std with
    # the population std, GRPO's advantage with its unbiased std put back to the population one.
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    p = 1 / 3
    expected = [1.0, -1.0, 1.0, -1.0, -p / math.sqrt(p * (1 - p)), (1 - p) / math.sqrt(p * (1 - p)),
                -p / math.sqrt(p * (1 - p))]
    got = PASS_AT_K(rewards, groups, k=1)
    assert got.tolist() == pytest.approx(expected, abs=1e-12)
    grpo = ADVANTAGES["grpo"](rewards, groups, eps=0.0)
    n = torch.tensor([4.0, 4, 4, 4, 3, 3, 3], dtype=torch.float64)
    assert got.tolist() == pytest.approx((grpo * torch.sqrt(n / (n - 1))).tolist(), abs=1e-12)


def test_success_is_a_reward_at_or_above_success_score():
    # Partial credit 0.5 and a format bonus 1.2: successes are the rewards >= 1.0 (the default), as guidance and
    # prompt selection count them; with success_score 0.5 the partial credit counts too.
    groups = torch.zeros(4, dtype=torch.long)
    rewards = torch.tensor([1.2, 0.5, 0.0, 0.0])
    assert PASS_AT_K(rewards, groups, k=2).tolist() == pytest.approx(by_subsets([True, False, False, False], 2))
    assert PASS_AT_K(rewards, groups, k=2, success_score=0.5).tolist() == pytest.approx(
        by_subsets([True, True, False, False], 2))


def test_a_group_smaller_than_k_is_scored_at_its_size():
    # a group that lost a sample (2 left) at k = 3 is scored at k = 2; the full group beside it at k = 3
    groups = torch.tensor([0, 0, 1, 1, 1])
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])
    got = PASS_AT_K(rewards, groups, k=3).tolist()
    assert got[:2] == pytest.approx(by_subsets([True, False], 2))
    assert got[2:] == pytest.approx(by_subsets([True, False, False], 3)) == [0.0] * 3


def test_the_learner_s_advantage_stage_uses_it():
    ts = fake_trajectories()  # rewards 0, 1, 0, 1 in one group
    assign_advantages(ts, AlgorithmConfig(advantage={"estimator": "pass_at_k", "kwargs": {"k": 2}}), AgentsConfig())
    assert [t.advantage for t in ts] == pytest.approx(by_subsets([False, True, False, True], 2), abs=1e-6)


@pytest.mark.parametrize("kwargs", ["{}", "{k: 0}", "{k: 5}", "{k: 2.0}", "{k: true}"])
def test_k_outside_one_to_the_group_size_is_refused_naming_the_key(kwargs):
    # smoke.yaml's groups hold 4 samples
    with pytest.raises(ConfigError) as err:
        load_config(SMOKE, ["algorithm.advantage=pass_at_k", f"algorithm.advantage.kwargs={kwargs}"])
    assert "algorithm.advantage.kwargs.k: pass_at_k needs a whole number 1 <= k <= rollout.group_size (4)" in str(
        err.value)
    assert "\n" not in str(err.value)


def test_k_is_checked_against_a_stage_s_own_group_size():
    assert load_config(SMOKE, ["algorithm.advantage=pass_at_k", "algorithm.advantage.kwargs={k: 4}"])
    stage = {"name": "rl", "kind": "rl", "steps": 1, "rollout": {"group_size": 2}}
    with pytest.raises(ConfigError, match=r"stages.0.algorithm: algorithm.advantage.kwargs.k: .* \(2\), got 4"):
        load_config(SMOKE, ["algorithm.advantage=pass_at_k", "algorithm.advantage.kwargs={k: 4}",
                            f"stages=[{stage}]"])
