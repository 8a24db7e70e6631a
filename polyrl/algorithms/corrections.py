"""Off-policy corrections for stale or engine-mismatched samples: pure functions of per-token log-probs.

Three policies meet in an asynchronous update: the behaviour policy mu that sampled a token (its log-prob is
stored in the trajectory, possibly several versions old, possibly from another engine's numerics), the
proximal policy pi_prox (the learner's weights at the start of the update, log-probs recomputed by the
learner), and the policy being trained pi. Every function here takes [B, T] tensors over response positions
and a 0/1 ``mask`` of the tokens that count. None of them carries a gradient: they produce weights and masks
that the policy loss multiplies in.
"""

from __future__ import annotations

from typing import Any

import torch

from polyrl.algorithms.mismatch import CORRECTIONS


def importance_weight(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """The decoupled PPO behaviour weight w_t = pi_prox(y_t) / mu(y_t), detached.

    Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization", Eq. 2; used for
    asynchronous RL by AReaL, Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System
    for Language Reasoning", Eq. 5): the loss on token t is -w_t * min(r_t A, clip(r_t) A) with
    r_t = pi / pi_prox, so the trust region is centred on the recent proximal policy while w_t corrects for
    the token having been sampled by the older mu.
    """
    return torch.exp(proximal_logp.detach() - behaviour_logp.detach())


def truncated_importance_weight(
    proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"): w_t = min(pi_prox(y_t) / mu(y_t), C), detached.

    The paper caps the weight between the trainer's and the sampler's probabilities (C = 2 in its runs) so
    that a few tokens the sampler found much less likely than the trainer does cannot dominate the update.
    Reusable for any sample whose behaviour policy is not the proximal one (stale, replayed, cross-policy).
    """
    if cap <= 0:
        raise ValueError(f"truncated importance sampling needs cap > 0, got {cap}")
    return importance_weight(proximal_logp, behaviour_logp).clamp(max=cap)


def m2po_mask(log_ratio: torch.Tensor, mask: torch.Tensor, tau: float = 0.04) -> torch.Tensor:
    """M2PO's second-moment mask (Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL
    Reach with Stale Data on LLMs?", the M2 constraint and its greedy masking).

    M2 = mean over kept tokens of (log r_t)^2, with r_t = pi(y_t) / mu(y_t). Tokens are dropped from the
    largest (log r)^2 down until M2 <= ``tau``; the rest keep their full weight, so only the few tokens that
    blow up the variance of the importance-weighted gradient are removed (not every token past a clip range).
    Returns the new 0/1 mask (a subset of ``mask``), detached.
    """
    if tau < 0:
        raise ValueError(f"m2po needs tau >= 0, got {tau}")
    valid = mask > 0
    sq = log_ratio.detach().float().pow(2)
    values = sq[valid]
    n = values.numel()
    if n == 0:
        return mask.clone()
    ordered, _ = values.sort()  # ascending: keeping the k smallest is dropping the n - k largest
    prefix_mean = ordered.cumsum(0) / torch.arange(1, n + 1, dtype=ordered.dtype)
    ok = (prefix_mean <= tau).nonzero()
    keep = int(ok.max()) + 1 if len(ok) else 0  # prefix means rise with k (sorted), so the largest ok k
    out = torch.zeros_like(mask)
    if keep > 0:
        threshold = ordered[keep - 1]
        out = (valid & (sq <= threshold)).to(mask.dtype)
        # Ties at the threshold could keep more than ``keep`` tokens; drop the surplus in a fixed order.
        surplus = int(out.sum()) - keep
        if surplus > 0:
            tied = (valid & (sq == threshold)).flatten().nonzero().flatten()
            out.view(-1)[tied[-surplus:]] = 0
    return out


def correct_off_policy(
    mode: str,
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tis_cap: float = 2.0,
    m2po_tau: float = 0.04,
    kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """Apply one correction ahead of a PPO-family loss; returns (old_logp for the loss's ratio, advantages,
    mask, metrics).

    - ``decoupled``: ratio to the proximal policy, advantages times pi_prox / mu per token (AReaL).
    - ``tis``: the same with the weight truncated at ``tis_cap`` (Yao et al. 2025).
    - ``m2po``: ratio to the behaviour policy mu; tokens dropped by ``m2po_mask`` (Zheng et al. 2025).
    - ``mis``, ``icepop``, ``geo_mask``, ``prob_mask`` (``polyrl.algorithms.mismatch``, settings in
      ``kwargs``): ratio to the proximal policy, advantages times the correction's weights, and tokens whose
      weight is 0 (masked token or masked sequence) left out of the mask.

    A non-negative per-token weight on the advantage equals a weight on PPO's per-token objective, since
    min(r w A, clip(r) w A) = w min(r A, clip(r) A) for w >= 0; so the losses themselves stay unchanged.
    Metrics: importance weight pi_prox / mu over counted tokens (``off_policy/is_weight``, ``.../max``) and
    the fraction of counted tokens masked (``off_policy/masked_frac``).
    """
    valid = mask > 0
    raw = importance_weight(proximal_logp, behaviour_logp)
    metrics = {
        "off_policy/is_weight": float(raw[valid].mean()) if valid.any() else 1.0,
        "off_policy/is_weight/max": float(raw[valid].max()) if valid.any() else 1.0,
        "off_policy/masked_frac": 0.0,
    }
    per_token = advantages[:, None] if advantages.dim() == 1 else advantages
    if mode in ("decoupled", "tis"):
        w = raw if mode == "decoupled" else truncated_importance_weight(proximal_logp, behaviour_logp, tis_cap)
        if mode == "tis":
            metrics["off_policy/truncated_frac"] = float((raw[valid] > tis_cap).float().mean()) if valid.any() else 0.0
        return proximal_logp.detach(), per_token * w, mask, metrics
    if mode == "m2po":
        kept = m2po_mask(proximal_logp.detach() - behaviour_logp, mask, m2po_tau)
        metrics["off_policy/masked_frac"] = float(1 - kept.sum() / valid.sum()) if valid.any() else 0.0
        return behaviour_logp.detach(), advantages, kept, metrics
    if mode in CORRECTIONS:
        weights = CORRECTIONS[mode](proximal_logp, behaviour_logp, mask, **(kwargs or {}))
        kept = mask * (weights > 0).to(mask.dtype)
        metrics["off_policy/masked_frac"] = float(1 - kept.sum() / valid.sum()) if valid.any() else 0.0
        seqs = valid.any(-1)
        if seqs.any():
            metrics["off_policy/seq_masked_frac"] = float((~(kept > 0).any(-1))[seqs].float().mean())
        return proximal_logp.detach(), per_token * weights, kept, metrics
    valid_modes = ", ".join(["none", "decoupled", "tis", "m2po", *CORRECTIONS.names()])
    raise ValueError(f"unknown off-policy correction '{mode}' ({valid_modes})")
