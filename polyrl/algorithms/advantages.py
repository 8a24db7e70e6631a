"""Outcome advantage estimators: pure functions of per-sample rewards and group ids.

Every estimator shares one signature, ``(rewards [N], group_ids [N], **kwargs) -> advantages [N]``: equal ids
are samples of the same prompt, and each sample's scalar advantage is broadcast over its tokens by the loss.
PPO's per-token advantages come from a critic instead (``algorithm.critic``, ``polyrl.algorithms.gae``).
"""

from __future__ import annotations

import torch

from polyrl.algorithms.registry import Registry

ADVANTAGES = Registry("advantage estimator")


def _group_stats(
    rewards: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased group std and group size (scatter over ids, no Python loops)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.double()
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, r)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return mean[inverse], std[inverse], count[inverse]


def _batch_whiten(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over the whole batch, population std (REINFORCE++'s global normalisation)."""
    if x.numel() == 0:
        return x
    return (x - x.mean()) / (x.std(correction=0) + eps)


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath, Eq. 3 outcome supervision): A_i = (r_i - mean_g) / (std_g + eps).

    The std is the unbiased sample std of the group, as in the reference implementations.
    """
    mean, std, _ = _group_stats(rewards, group_ids)
    return ((rewards.double() - mean) / (std + eps)).to(rewards.dtype)


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", the Dr.GRPO objective):
    A_i = r_i - mean_g.

    This is the "no std normalisation" half of Dr.GRPO: dividing by the group std up-weights prompts that are
    almost always solved or almost never solved. The other half, "no length normalisation", is the loss
    aggregation: pair this estimator with ``algorithm.loss.agg: seq-mean-token-sum`` so each sequence's token
    losses are summed, not averaged over its length (the paper divides by a constant instead, which differs
    only by a constant factor that Adam and gradient clipping make immaterial).
    """
    mean, _, _ = _group_stats(rewards, group_ids)
    return (rewards.double() - mean).to(rewards.dtype)


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics", the RLOO estimator; Kool et al. 2019):
    A_i = r_i - mean_{j != i} r_j.

    The leave-one-out baseline equals G/(G-1) * (r_i - mean_g) for a group of size G. A group of one sample
    has no other sample to form a baseline from, so its advantage is 0.
    """
    mean, _, count = _group_stats(rewards, group_ids)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return (scale * (rewards.double() - mean)).to(rewards.dtype)


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-4
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++", global advantage normalisation): A_i = (r_i - mean_B) / std_B.

    No critic and no per-prompt baseline: the outcome reward is normalised over the whole batch B (population
    std). ``group_ids`` is unused; it is part of the common signature.
    """
    del group_ids
    return _batch_whiten(rewards.double(), eps).to(rewards.dtype)


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-4
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025, the group-baseline variant): subtract the group mean, then
    normalise over the batch: A_i = (a_i - mean_B(a)) / std_B(a) with a_i = r_i - mean_g.

    Unlike GRPO, the scale comes from the whole batch, so a group with a small reward spread is not blown up.
    """
    mean, _, _ = _group_stats(rewards, group_ids)
    return _batch_whiten(rewards.double() - mean, eps).to(rewards.dtype)


@ADVANTAGES.register("maxrl")
def maxrl_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """MaxRL (Tajwar et al. 2026, "Maximum Likelihood Reinforcement Learning", the MaxRL estimator): the
    gradient of the log pass rate, grad log p = grad p / p, estimated from a group as the mean of
    grad log pi over its successful samples. With the group mean as a control variate that is

        A_i = (r_i - mean_g) / mean_g,

    GRPO's baseline with the group mean in place of the std: a prompt solved 1 time in 8 gives its success an
    advantage of 7, one solved 7 times in 8 gives 1/7, so hard prompts weigh more, as maximum likelihood
    asks. A group with mean reward <= ``eps`` (nothing solved) has no gradient: advantage 0. Rewards are meant
    to be in [0, 1] (pass/fail).
    """
    mean, _, _ = _group_stats(rewards, group_ids)
    r = rewards.double()
    solved = mean > eps
    return torch.where(solved, (r - mean) / mean.clamp(min=eps), torch.zeros_like(r)).to(rewards.dtype)


MULTI_REWARD = frozenset({"gdpo"})
"""Estimators that take each reward component ([N, K]) instead of the summed reward ([N])."""


@ADVANTAGES.register("gdpo")
def gdpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    weights: list[float] | None = None,
    eps: float = 1e-4,
    batch_norm: bool = True,
) -> torch.Tensor:
    """GDPO (Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward
    RL Optimization", the GDPO advantage): each of the K reward components is normalised within its group
    before they are summed,

        A_i = sum_k w_k (r_ik - mean_g(r_k)) / (std_g(r_k) + eps),   then   A <- (A - mean_B) / (std_B + eps),

    where GRPO normalises the sum r_i = sum_k r_ik, so a component with a wide spread (say a length bonus)
    drowns a rarely-won one (correctness) and distinct reward combinations collapse to the same advantage.
    ``rewards`` is [N, K] (components in columns; the learner passes the trajectories' reward components) or
    [N] (one component); ``weights`` defaults to 1 each. ``batch_norm`` is the final whitening over the batch.
    """
    r = rewards.double()
    if r.dim() == 1:
        r = r[:, None]
    w = torch.ones(r.shape[1], dtype=torch.float64) if weights is None else torch.tensor(weights, dtype=torch.float64)
    if w.shape != (r.shape[1],):
        raise ValueError(f"gdpo: {len(w)} weights for {r.shape[1]} reward components")
    total = torch.zeros(r.shape[0], dtype=torch.float64)
    for k in range(r.shape[1]):
        mean, std, _ = _group_stats(r[:, k], group_ids)
        total += w[k] * (r[:, k] - mean) / (std + eps)
    out = _batch_whiten(total, eps) if batch_norm else total
    return out.to(rewards.dtype)


def _all_fail_chance(m: torch.Tensor, c: torch.Tensor, j: torch.Tensor, k_max: int) -> torch.Tensor:
    """C(m - c, j) / C(m, j), element-wise: the chance that j of m samples, c of them successes, drawn without
    replacement are all failures, as prod_{i < j} (m - c - i) / (m - i) (0 once m - c < j; 1 for j = 0).
    ``j`` <= ``m`` and ``j`` <= ``k_max``."""
    i = torch.arange(k_max, dtype=torch.float64)
    factors = (m[:, None] - c[:, None] - i).clamp(min=0) / (m[:, None] - i).clamp(min=1)
    return torch.where(i < j[:, None], factors, torch.ones_like(factors)).prod(dim=1)


@ADVANTAGES.register("pass_at_k")
def pass_at_k_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, k: int, success_score: float = 1.0
) -> torch.Tensor:
    """Pass@k Training (Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration and
    Exploitation of Large Reasoning Models", arXiv 2508.10751, the analytical advantage): each sample's
    advantage for the pass@k reward, which a k-subset of the group earns when any of its samples succeeds.
    GRPO's pass@1 reward pushes toward the one answer the policy already finds; pass@k pays a group for having
    a success anywhere among k tries, so a rare success is worth more and a failure beside it costs less,
    which keeps the policy exploring.

    Derivation, for a group of n samples with c successes (a success: reward >= ``success_score``, the
    threshold the rest of polyrl uses, on the training reward, so a penalty or a monitor's zeroing unmakes a
    success; binary rewards pass through unchanged). Of its C(n, k) k-subsets,
    C(n - c, k) hold no success, so the group's pass@k is R = 1 - C(n - c, k) / C(n, k), and as a subset's
    reward is 0 or 1 its std over the subsets is s = sqrt(R (1 - R)). A sample's advantage is the mean reward
    of the C(n - 1, k - 1) subsets that contain it, minus R, over s:

    - a success: every subset containing it earns 1, so A+ = (1 - R) / s;
    - a failure: its subsets earn 0 when their other k - 1 samples, drawn from the other n - 1, all fail,
      so A- = (1 - C(n - c - 1, k - 1) / C(n - 1, k - 1) - R) / s.

    At k = 1 these are (1 - p) / s and -p / s with p = c / n and s the population std of the binary rewards:
    GRPO's mean-centred, std-normalised advantage. A group with s = 0 (all fail, or so few failures that
    every k-subset holds a success, n - c < k) has advantage 0. A group smaller than k (a dropped episode) is
    scored at k = n. ``k`` is refused at config load outside 1 <= k <= rollout.group_size.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"pass_at_k needs a whole number k >= 1, got {k!r}")
    success = rewards.double() >= success_score
    rate, _, n = _group_stats(success.double(), group_ids)
    c, kk = torch.round(rate * n), n.clamp(max=k)
    fail_all = _all_fail_chance(n, c, kk, k)  # C(n - c, k) / C(n, k) = 1 - R
    fail_others = _all_fail_chance(n - 1, c, kk - 1, k)  # C(n - c - 1, k - 1) / C(n - 1, k - 1)
    std = torch.sqrt(fail_all * (1 - fail_all))
    scored = torch.where(success, fail_all, fail_all - fail_others) / std.clamp(min=1e-300)
    return torch.where(std > 0, scored, torch.zeros_like(scored)).to(rewards.dtype)
