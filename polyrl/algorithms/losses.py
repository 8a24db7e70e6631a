"""Policy losses: pure functions of one ``PolicyLossInputs`` (per-token log-probs, advantages, the loss mask
and the clip settings).

All tensors are [B, T] over response positions; ``mask`` is 1 on tokens the model produced and 0 elsewhere
(prompt, padding, environment tokens). ``advantages`` is [B] (one per sequence) or [B, T] (per token).
Every loss shares the signature

    loss(x: PolicyLossInputs, **extra) -> (loss, metrics)

where ``extra`` are the loss's own keyword arguments (``algorithm.loss.kwargs`` in the config), and metrics
are detached floats that always include ``clip_frac`` and ``ratio/mean``, ``ratio/min``, ``ratio/max``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl.algorithms.registry import Registry

LOSSES = Registry("policy loss")

ADVANTAGE_WEIGHTED = frozenset({"ppo_clip", "dual_clip", "gspo", "cispo", "dppo", "sapo"})
"""Built-in losses whose every term is a token's advantage times a function of its ratio: when all advantages
are 0 the loss is 0 for any weights, so its gradient is exactly 0 (``Learner`` then skips the passes)."""


@dataclass(frozen=True)
class PolicyLossInputs:
    """What the learner hands a policy loss for one micro-batch."""

    logp: torch.Tensor
    """[B, T] log-probs of the sampled tokens under the policy being trained (with gradient)."""
    old_logp: torch.Tensor
    """[B, T] log-probs the importance ratio is taken against (the policy at the update's start, or the
    proximal or behaviour policy under an off-policy correction)."""
    advantages: torch.Tensor
    """[B] or [B, T]."""
    mask: torch.Tensor
    """[B, T] 1 on the tokens that carry a loss."""
    clip_low: float = 0.2
    """The ratio is clipped at 1 - clip_low (gspo: about 3e-4; dppo: the trust region's size)."""
    clip_high: float = 0.2
    """... and at 1 + clip_high."""
    agg: str = "token-mean"
    """How token losses become one number (``aggregate``)."""
    num_tokens: float | None = None
    """token-mean's denominator shared by the micro-batches of an update; None: this micro-batch's tokens."""
    behaviour_logp: torch.Tensor | None = None
    """[B, T] the sampler's log-probs (DPPO's anchor)."""
    logits: torch.Tensor | None = None
    """[B, T, V] the policy's logits, given only to a loss asking for a top-k anchor (``topk`` in its kwargs)."""
    anchor_topk: tuple[torch.Tensor, torch.Tensor] | None = None
    """The update-start policy's k most likely tokens and their log-probs, [B, T, k] each, beside ``logits``."""


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: float | None = None
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    - ``token-mean``: sum over all valid tokens / number of valid tokens (DAPO, Yu et al. 2025, Eq. 12).
      ``num_tokens`` lets micro-batches share the global denominator.
    - ``seq-mean-token-mean``: mean over tokens within each sequence, then over sequences (GRPO, Eq. 3).
    - ``seq-mean-token-sum``: sum over tokens within each sequence, then mean over sequences (Dr.GRPO).
    """
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        denom = num_tokens if num_tokens is not None else mask.sum().clamp(min=1)
        return (per_token * mask).sum() / denom
    seq_sum = (per_token * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        return (seq_sum / mask.sum(-1).clamp(min=1)).mean()
    if mode == "seq-mean-token-sum":
        return seq_sum.mean()
    raise ValueError(f"unknown loss aggregation '{mode}'")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.to(x.dtype)
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def ratio_metrics(ratio: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor) -> dict[str, float]:
    """The metrics every loss reports: fraction of valid tokens clipped and the importance ratio's spread."""
    with torch.no_grad():
        valid = mask > 0
        if not bool(valid.any()):  # nothing to train on (e.g. every sample masked out): neutral values
            return {"clip_frac": 0.0, "ratio/mean": 1.0, "ratio/min": 1.0, "ratio/max": 1.0}
        r = ratio.detach()[valid]
        return {
            "clip_frac": masked_mean(clipped.to(ratio.dtype), mask),
            "ratio/mean": float(r.mean()),
            "ratio/min": float(r.min()),
            "ratio/max": float(r.max()),
        }


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


@LOSSES.register("ppo_clip")
def ppo_clip_loss(
    x: PolicyLossInputs,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip (Schulman et al. 2017, Eq. 7) with asymmetric bounds (clip-higher, DAPO Eq. 10).

    loss_t = -min(rho_t * A, clip(rho_t, 1 - clip_low, 1 + clip_high) * A),  rho_t = exp(logp_t - old_logp_t).
    """
    adv = _per_token(x.advantages)
    ratio = torch.exp(x.logp - x.old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - x.clip_low, 1.0 + x.clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, x.mask, x.agg, x.num_tokens)
    return loss, ratio_metrics(ratio, x.mask, clipped < unclipped)


@LOSSES.register("dual_clip")
def dual_clip_loss(
    x: PolicyLossInputs,
    c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", the dual-clip
    objective): for A < 0 the PPO-clip objective is bounded below by c * A,

        obj_t = max(min(rho_t A, clip(rho_t, 1 - clip_low, 1 + clip_high) A), c A)   if A < 0
        obj_t = min(rho_t A, clip(rho_t, 1 - clip_low, 1 + clip_high) A)             otherwise,

    loss_t = -obj_t. When stale data gives a huge ratio on a bad token, plain PPO's loss grows without bound;
    the second clip caps it (and zeroes the gradient there). ``c`` > 1 (3 in the paper).
    """
    if c <= 1.0:
        raise ValueError(f"dual-clip needs c > 1, got c={c}")
    adv = _per_token(x.advantages).expand_as(x.logp)
    ratio = torch.exp(x.logp - x.old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - x.clip_low, 1.0 + x.clip_high) * adv
    ppo_obj = torch.minimum(unclipped, clipped)
    floor = c * adv
    obj = torch.where(adv < 0, torch.maximum(ppo_obj, floor), ppo_obj)
    loss = aggregate(-obj, x.mask, x.agg, x.num_tokens)
    metrics = ratio_metrics(ratio, x.mask, clipped < unclipped)
    metrics["dual_clip_frac"] = masked_mean(((adv < 0) & (ppo_obj < floor)).to(x.logp.dtype), x.mask)
    return loss, metrics


@LOSSES.register("gspo")
def gspo_loss(
    x: PolicyLossInputs,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", the GSPO objective and its GSPO-token
    form): the importance ratio is the sequence's length-normalised likelihood ratio

        s_i = (pi(y_i | x) / pi_old(y_i | x)) ^ (1 / |y_i|) = exp(mean_t (logp_t - old_logp_t)),

    clipped per sequence: obj_i = min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i). It is computed in
    the GSPO-token form s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)], whose value is s_i on every token and whose
    gradient equals the sequence objective's; so per-token advantages also work. The paper's objective is a
    mean over sequences: use ``algorithm.loss.agg: seq-mean-token-mean``. Its clip range is tiny (3e-4, 4e-4
    in the paper) because s_i is a geometric mean over the sequence; set ``clip_low``/``clip_high`` to match.
    """
    adv = _per_token(x.advantages)
    m = x.mask.to(x.logp.dtype)
    log_s = ((x.logp - x.old_logp) * m).sum(-1) / m.sum(-1).clamp(min=1)  # [B]
    log_s_tok = log_s.detach().unsqueeze(-1) + x.logp - x.logp.detach()
    ratio = torch.exp(log_s_tok)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - x.clip_low, 1.0 + x.clip_high) * adv
    loss = aggregate(-torch.minimum(unclipped, clipped), x.mask, x.agg, x.num_tokens)
    return loss, ratio_metrics(ratio, x.mask, clipped < unclipped)


@LOSSES.register("cispo")
def cispo_loss(
    x: PolicyLossInputs,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax 2025, "MiniMax-M1", the CISPO objective): clip the importance weight, not the update,

        obj_t = sg[clip(rho_t, 1 - clip_low, 1 + clip_high)] * A_t * log pi(y_t),

    so every token keeps a gradient (PPO drops the gradient of clipped tokens entirely). The objective is
    written as sg[w_t] * A_t * exp(logp_t - sg[logp_t]): the same gradient, w_t A_t grad log pi, with a value
    (w_t A_t) comparable to PPO's loss instead of one that drifts with log pi. The paper aggregates with
    ``token-mean``.
    """
    adv = _per_token(x.advantages)
    ratio = torch.exp(x.logp - x.old_logp)
    weight = torch.clamp(ratio, 1.0 - x.clip_low, 1.0 + x.clip_high).detach()
    per_token = -weight * adv * torch.exp(x.logp - x.logp.detach())
    loss = aggregate(per_token, x.mask, x.agg, x.num_tokens)
    was_clipped = (ratio.detach() < 1.0 - x.clip_low) | (ratio.detach() > 1.0 + x.clip_high)
    return loss, ratio_metrics(ratio, x.mask, was_clipped)
