"""Policy losses: pure functions of per-token log-probs, advantages and the loss mask.

All tensors are [B, T] over response positions; ``mask`` is 1 on tokens the model produced and 0 elsewhere
(prompt, padding, environment tokens). Each returns ``(loss, metrics)`` where metrics are detached floats.
"""

from __future__ import annotations

import torch

from polyrl.algorithms.registry import Registry

LOSSES = Registry("policy loss")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: float | None = None) -> torch.Tensor:
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


@LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip (Schulman et al. 2017, Eq. 7) with asymmetric bounds (clip-higher, DAPO Eq. 10).

    loss_t = -min(rho_t * A, clip(rho_t, 1 - clip_low, 1 + clip_high) * A),  rho_t = exp(logp_t - old_logp_t).
    ``advantages`` is [B] (one per sequence) or [B, T].
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, agg, num_tokens)
    with torch.no_grad():
        was_clipped = (clipped < unclipped).to(logp.dtype)
        metrics = {
            "clip_frac": masked_mean(was_clipped, mask),
            "ratio/mean": masked_mean(ratio, mask),
        }
    return loss, metrics
