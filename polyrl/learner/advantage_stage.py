"""Where a token's advantage is made, in two stages.

1. ``assign_advantages`` (once per step, in ``produce_batch``): each trajectory's episode advantage from the
   group estimator, normalised within each task, then spread per turn (step credit) and over ARPO's shared
   prefixes; the result sits on the trajectories (``advantage``, ``token_advantages``).
2. ``token_advantages`` (once per micro-batch, in the learner): what needs the learner's forward pass: GAE from
   the critic's values, the KL penalty in the reward, importance weights of cross-policy and replayed rows,
   and the off-policy corrections. It returns the advantages and the mask the policy loss sees.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from polyrl.algorithms import kl_estimate, kl_penalty_to_go
from polyrl.algorithms.advantages import ADVANTAGES, MULTI_REWARD
from polyrl.algorithms.corrections import correct_off_policy, truncated_importance_weight
from polyrl.algorithms.gae import gae, terminal_rewards
from polyrl.algorithms.step_credit import apply_step_credit, attribute_tree_advantages
from polyrl.algorithms.task_norm import task_normalise
from polyrl.config import AgentsConfig, AlgorithmConfig
from polyrl.learner.batch import Batch
from polyrl.types import Trajectory


def assign_advantages(trajectories: list[Trajectory], algo: AlgorithmConfig, agents: AgentsConfig) -> dict[str, float]:
    """Set each trajectory's advantage: ``algo.advantage.estimator`` over the rewards (or reward components) and
    group ids (with a critic, the outcome reward itself, from which the learner's GAE makes per-token
    advantages), normalised within each task when ``algo.advantage.task_norm``; then per-turn credit
    (``agents.step_credit``) and ARPO's shared-prefix attribution (``agents.arpo``), which set
    ``token_advantages``. Returns ``arpo/branch_leaves`` (leaves that were branches) when ARPO is on."""
    if trajectories:
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        if algo.advantage.estimator in MULTI_REWARD:
            rewards = reward_components(trajectories)
        groups = torch.tensor([t.group_id for t in trajectories])
        if algo.critic is not None:  # the outcome reward, unchanged: the learner's GAE propagates it per token
            advantages = rewards.clone()
        else:
            advantages = ADVANTAGES[algo.advantage.estimator](rewards, groups, **algo.advantage.kwargs)
        if algo.advantage.task_norm:
            names = sorted({t.task for t in trajectories})
            advantages = task_normalise(advantages, torch.tensor([names.index(t.task) for t in trajectories]))
        for t, a in zip(trajectories, advantages.tolist(), strict=True):
            t.advantage = a
    sc = agents.step_credit
    apply_step_credit(trajectories, sc.mode, sc.weight, sc.gamma)
    if not agents.arpo.enabled:
        return {}
    return {"arpo/branch_leaves": float(attribute_tree_advantages(trajectories))}


def reward_components(trajectories: list[Trajectory]) -> torch.Tensor:
    """[N, K] reward components, one column per name in any trajectory's ``rewards`` (sorted; 0 where a
    trajectory lacks it: components belong to a task, and groups never mix tasks). Trajectories that record
    no component give their summed reward as the one column."""
    names = sorted({k for t in trajectories for k in t.rewards})
    if not names:
        return torch.tensor([[t.reward] for t in trajectories], dtype=torch.float32)
    return torch.tensor([[t.rewards.get(k, 0.0) for k in names] for t in trajectories], dtype=torch.float32)


class TokenAdvantages(NamedTuple):
    """What the policy loss of one micro-batch sees."""

    advantages: torch.Tensor
    """[B], or [B, T] once anything is per token."""
    pg_mask: torch.Tensor
    """[B, T] 0/1: the tokens the policy loss counts (corrections may drop some)."""
    ratio_logp: torch.Tensor
    """[B, T] the log-probs the policy ratio is taken against: the learner's own at the update's start, or
    the behaviour policy's (m2po)."""
    returns: torch.Tensor | None
    """[B, T] GAE's value targets for the critic; None without one."""
    metrics: dict[str, float]
    guided_mask: torch.Tensor | None = None
    """[B, T] 0/1: the reference tokens (``guidance``) that the shaped reference loss counts instead of the
    policy loss; their advantages are the group's, uncorrected (no behaviour policy sampled them)."""


def token_advantages(
    algo: AlgorithmConfig,
    mb: Batch,
    rewards: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    old_values: torch.Tensor | None,
    cross: torch.Tensor,
    cross_cap: float,
    replay_cap: float,
) -> TokenAdvantages:
    """The advantages of micro-batch ``mb`` from its episode advantages (``mb.advantages``), its rewards and
    the learner's no-grad quantities: ``old_logp`` (the policy at the update's start), ``ref_logp`` (the KL
    reference's, when kept), ``old_values`` (the critic's, for GAE) and ``cross`` ([B] bool, rows another
    policy sampled). Under ``algo.off_policy.correction`` none, cross-policy rows are weighted by min(pi_old / mu,
    ``cross_cap``) and replayed rows by min(pi_old / mu, ``replay_cap``) (truncated IS, Yao et al. 2025);
    otherwise the correction (``algorithms/corrections.py``) treats every row. Reference rows (``mb.guided``)
    leave the policy loss's mask for ``guided_mask`` with their advantages as the group gave them."""
    advantages, returns = _reward_advantages(algo, mb, rewards, old_logp, ref_logp, old_values)
    guided_mask = None
    if bool(mb.guided.any()):
        guided_mask = mb.loss_mask * mb.guided[:, None]
        reference_advantages = advantages
        mb = dataclasses.replace(mb, loss_mask=mb.loss_mask * ~mb.guided[:, None])
    metrics: dict[str, float] = {}
    off = algo.off_policy
    if off.correction == "none" and bool(cross.any()):
        advantages, metrics = cross_policy_advantages(mb, cross, old_logp, advantages, cross_cap)
    if off.correction == "none" and bool(mb.replayed.any()):  # stored samples of an older policy (data/replay.py)
        w = truncated_importance_weight(old_logp, mb.behaviour_logp, replay_cap)
        w = torch.where(mb.replayed[:, None], w, torch.ones_like(w))
        advantages = (advantages[:, None] if advantages.dim() == 1 else advantages) * w
    if off.correction == "none":
        pg_mask, ratio_logp = mb.loss_mask, old_logp
    else:
        ratio_logp, advantages, pg_mask, off_metrics = correct_off_policy(
            off.correction, old_logp, mb.behaviour_logp, advantages, mb.loss_mask, off.tis_cap, off.m2po_tau,
            off.kwargs)
        metrics.update(off_metrics)
    if guided_mask is not None:
        advantages = _with_rows(advantages, reference_advantages, mb.guided, mb.loss_mask.shape)
    return TokenAdvantages(advantages, pg_mask, ratio_logp, returns, metrics, guided_mask)


def _with_rows(advantages: torch.Tensor, other: torch.Tensor, rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``advantages`` with ``other``'s on ``rows``; [B] when both are, else [B, T]."""
    if advantages.dim() == 1 and other.dim() == 1:
        return torch.where(rows, other, advantages)
    per_token = [a[:, None].expand(shape) if a.dim() == 1 else a.expand(shape) for a in (advantages, other)]
    return torch.where(rows[:, None], per_token[1], per_token[0])


def _reward_advantages(
    algo: AlgorithmConfig,
    mb: Batch,
    rewards: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    old_values: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The episode advantages with the KL penalty in the reward (``regularisers.kl_in: reward``), or GAE's
    (Schulman et al. 2016) from the critic's ``old_values`` over the terminal reward; and GAE's returns."""
    kl, reg = None, algo.regularisers
    if reg.kl_in == "reward" and reg.kl_coef > 0 and ref_logp is not None:
        kl = kl_estimate(old_logp, ref_logp, reg.kl_estimator).detach()
    if old_values is None:
        if kl is None:
            return mb.advantages, None
        per_token = mb.advantages if mb.advantages.dim() == 2 else mb.advantages[:, None]
        return per_token + kl_penalty_to_go(kl, mb.loss_mask, reg.kl_coef), None
    token_rewards = terminal_rewards(rewards, mb.loss_mask)
    if kl is not None:
        token_rewards = token_rewards - reg.kl_coef * kl * mb.loss_mask
    advantages = gae(token_rewards, old_values, mb.loss_mask, algo.critic.gamma, algo.critic.lam)
    return advantages, advantages + old_values


def cross_policy_advantages(
    mb: Batch, rows: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token advantages with truncated importance weights min(pi_old / mu, cap) on the rows another policy
    sampled (``rollout.cross_policy``); the learner's own rows keep weight 1. Metrics are over the
    cross-policy tokens."""
    weights = truncated_importance_weight(old_logp, mb.behaviour_logp, cap)
    weights = torch.where(rows[:, None] & (mb.loss_mask > 0), weights, torch.ones_like(weights))
    per_token = advantages[:, None] if advantages.dim() == 1 else advantages
    valid = (mb.loss_mask > 0) & rows[:, None]
    w = weights[valid]
    metrics = {"cross_policy/is_weight": float(w.mean()) if w.numel() else 1.0,
               "cross_policy/capped_frac": float((w >= cap).float().mean()) if w.numel() else 0.0}
    return per_token * weights, metrics
