"""The learner's loss, term by term: each a pure function of one micro-batch's forward pass (``LossInputs``)
returning its weighted loss, its logged part of the batch loss, and its metrics. The micro-batch's loss is
their sum, in the order of ``LOSS_TERMS``: policy gradient + reference guidance + SFT on successes + entropy
bonus + distillation + KL + value."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from polyrl.algorithms import LOSSES, aggregate, kl_estimate
from polyrl.algorithms.distill import reverse_kl_loss
from polyrl.algorithms.gae import value_loss
from polyrl.algorithms.guidance import shaped_reference_loss
from polyrl.algorithms.losses import PolicyLossInputs
from polyrl.algorithms.success_sft import success_nll_loss
from polyrl.config import AlgorithmConfig
from polyrl.learner.advantage_stage import TokenAdvantages
from polyrl.learner.batch import Batch


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch as its loss terms read it."""

    mb: Batch
    logp: torch.Tensor
    """[B, T] the policy's log-probs (with gradient)."""
    entropy: torch.Tensor
    values: torch.Tensor | None
    """[B, T] the critic's values (with gradient into the value head), when there is one."""
    logits: torch.Tensor | None
    """[B, T, V] the policy's logits, when distilling or when the loss reads the anchor's top-k."""
    ref_logp: torch.Tensor | None
    """[B, T] the KL reference's log-probs, when kept."""
    old_values: torch.Tensor | None
    advantages: TokenAdvantages
    teacher_logits: torch.Tensor | None
    """[B, T, V] each row's teacher's logits; zeros on rows whose task has no teacher."""
    teacher_rows: torch.Tensor | None
    """[B] 1 on rows whose task has a teacher."""
    num_tokens: float
    """The whole batch's loss tokens (token-mean normaliser)."""
    share: float
    """This micro-batch's weight in the batch loss: 1 under token-mean, its fraction of the rows otherwise."""
    anchor_topk: tuple[torch.Tensor, torch.Tensor] | None = None
    """([B, T, K] ids, [B, T, K] log-probs) of the policy at the update's start, when the loss reads them."""
    shaping_gamma: float | None = None
    """LUFFY's policy-shaping gamma for reference tokens (``guidance.shaping_gamma``); None: no shaping."""
    entropy_coef: float | None = None
    """The entropy bonus's weight this step: the learner's, which ``regularisers.entropy_target`` moves; None:
    ``regularisers.entropy_coef``."""
    rewards: torch.Tensor | None = None
    """[B] the rows' rewards, which ``regularisers.sft_coef`` reads."""


class Term(NamedTuple):
    loss: torch.Tensor | None
    """The weighted term; None when it is only measured."""
    logged: dict[str, float]
    """Its part of the batch loss as logged, summed over micro-batches."""
    metrics: dict[str, float]
    """Averaged over micro-batches."""


def policy_term(algo: AlgorithmConfig, x: LossInputs) -> Term:
    """``LOSSES[algo.loss.name]`` (PPO-clip, GSPO, CISPO, ...) on the token advantages, weighted by
    ``loss.pg_coef``."""
    adv, loss = x.advantages, algo.loss
    inputs = PolicyLossInputs(
        x.logp, adv.ratio_logp, adv.advantages, adv.pg_mask, loss.clip_low, loss.clip_high, loss.agg,
        x.num_tokens, behaviour_logp=x.mb.behaviour_logp,
        logits=x.logits if x.anchor_topk is not None else None, anchor_topk=x.anchor_topk,
    )
    pg_loss, metrics = LOSSES[loss.name](inputs, **loss.kwargs)
    return Term(loss.pg_coef * pg_loss * x.share, {"loss/pg": float(pg_loss.detach()) * x.share}, metrics)


def guidance_term(algo: AlgorithmConfig, x: LossInputs) -> Term:
    """Reference replies in all-fail groups (``guidance``): their tokens trained as if sampled, or with LUFFY's
    shaping (``guidance.shaping_gamma``), in place of the policy loss, weighted by ``loss.pg_coef`` like it."""
    adv = x.advantages
    if adv.guided_mask is None:
        return Term(None, {}, {})
    g_loss, metrics = shaped_reference_loss(x.logp, adv.advantages, adv.guided_mask, x.shaping_gamma,
                                            algo.loss.agg, x.num_tokens)
    return Term(algo.loss.pg_coef * g_loss * x.share, {"loss/guidance": float(g_loss.detach()) * x.share}, metrics)


def success_sft_term(algo: AlgorithmConfig, x: LossInputs) -> Term:
    """SFT on the batch's successes (``regularisers.sft_coef``, RAFT / SRFT): the negative log-likelihood of the
    tokens of rows whose reward reaches ``sft_min_reward``, references included."""
    reg = algo.regularisers
    if reg.sft_coef == 0 or x.rewards is None:
        return Term(None, {}, {})
    s_loss, metrics = success_nll_loss(x.logp, x.rewards, x.mb.loss_mask, reg.sft_min_reward, algo.loss.agg,
                                       x.num_tokens)
    return Term(reg.sft_coef * s_loss * x.share, {"loss/sft": float(s_loss.detach()) * x.share}, metrics)


def entropy_term(algo: AlgorithmConfig, x: LossInputs) -> Term:
    """The entropy bonus: -coefficient x the aggregated token entropy (logged whatever the weight). The
    coefficient is ``regularisers.entropy_coef``, or the learner's current one (``x.entropy_coef``) under
    ``regularisers.entropy_target``, whose controller reads the token-mean entropy, in nats per token whatever
    ``loss.agg`` is: ``entropy_control/entropy``, this micro-batch's share of the whole batch's."""
    reg = algo.regularisers
    coef = reg.entropy_coef if x.entropy_coef is None else x.entropy_coef
    ent = aggregate(x.entropy, x.mb.loss_mask, algo.loss.agg, x.num_tokens) * x.share
    logged = {"entropy": float(ent.detach())}
    if reg.entropy_target is not None:
        token_mean = aggregate(x.entropy.detach(), x.mb.loss_mask, "token-mean", x.num_tokens)
        logged["entropy_control/entropy"] = float(token_mean)
    return Term(-(coef * ent), logged, {})


def distill_term(algo: AlgorithmConfig, x: LossInputs) -> Term:
    """Multi-teacher on-policy distillation: reverse KL to each row's task teacher, weighted by
    ``regularisers.distill_coef``; rows without a teacher count for nothing."""
    if x.teacher_logits is None or x.logits is None or x.teacher_rows is None:
        return Term(None, {}, {})
    d_loss, metrics = reverse_kl_loss(x.logits, x.teacher_logits, x.mb.loss_mask * x.teacher_rows[:, None],
                                      algo.loss.agg, x.num_tokens)
    d_logged = {"loss/distill": float(d_loss.detach()) * x.share}
    return Term(algo.regularisers.distill_coef * d_loss * x.share, d_logged, metrics)


def kl_term(algo: AlgorithmConfig, x: LossInputs) -> Term:
    """KL to the reference policy (``regularisers.kl_estimator``): in the loss with ``kl_coef`` when ``kl_in:
    loss``, else only measured (``kl_in: reward`` puts it in the token advantages instead)."""
    if x.ref_logp is None:
        return Term(None, {}, {})
    reg = algo.regularisers
    kl = aggregate(kl_estimate(x.logp, x.ref_logp, reg.kl_estimator), x.mb.loss_mask, algo.loss.agg, x.num_tokens)
    in_loss = reg.kl_coef > 0 and reg.kl_in == "loss"
    return Term(reg.kl_coef * kl * x.share if in_loss else None, {"kl": float(kl.detach()) * x.share}, {})


def value_term(algo: AlgorithmConfig, x: LossInputs) -> Term:
    """PPO's clipped value loss of the critic against GAE's returns (the head sees detached features: this
    trains the head only)."""
    if x.values is None or x.old_values is None or x.advantages.returns is None:
        return Term(None, {}, {})
    v_loss, metrics = value_loss(x.values, x.old_values, x.advantages.returns, x.mb.loss_mask, algo.critic.clip,
                                 algo.loss.agg, x.num_tokens)
    return Term(v_loss * x.share, {"loss/value": float(v_loss.detach()) * x.share}, metrics)


LOSS_TERMS: tuple[Callable[[AlgorithmConfig, LossInputs], Term], ...] = (
    policy_term, guidance_term, success_sft_term, entropy_term, distill_term, kl_term, value_term,
)
"""The loss of a micro-batch is the sum of these terms, in this order."""
