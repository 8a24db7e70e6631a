"""Policy losses that replace PPO's hard ratio clip: DPPO's divergence trust region and SAPO's soft gate.

Same signature and metrics as ``polyrl.algorithms.losses`` (registered in ``LOSSES``). DPPO also reads the
behaviour log-probs (``x.behaviour_logp``), since its trust region is measured against the policy that
sampled the tokens.
"""

from __future__ import annotations

import torch

from polyrl.algorithms.losses import LOSSES, PolicyLossInputs, _per_token, aggregate, masked_mean, ratio_metrics

PROB_FLOOR = 1e-6
"""Keeps log(1 - p) finite in the binary KL when a token's probability rounds to 1."""


def binary_divergence(logp: torch.Tensor, anchor_logp: torch.Tensor, kind: str = "tv") -> torch.Tensor:
    """DPPO's binary approximation (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement
    Learning", Sec. 4.1): both distributions collapsed onto {the sampled token y_t, every other token}, with
    p = pi(y_t), q = pi_anchor(y_t),

        tv: |p - q|        kl: q log(q / p) + (1 - q) log((1 - q) / (1 - p))   (KL(anchor || pi)).

    A lower bound of the full divergence that needs no more than the two log-probs already at hand. [B, T].
    """
    p, q = logp.exp(), anchor_logp.exp()
    if kind == "tv":
        return (p - q).abs()
    if kind == "kl":
        one_p, one_q = (1 - p).clamp(min=PROB_FLOOR), (1 - q).clamp(min=PROB_FLOOR)
        return q * (anchor_logp - logp) + one_q * (one_q.log() - one_p.log())
    raise ValueError(f"unknown divergence '{kind}' (tv, kl)")


def topk_divergence(
    logits: torch.Tensor, anchor_topk_ids: torch.Tensor, anchor_topk_logp: torch.Tensor, kind: str = "tv"
) -> torch.Tensor:
    """DPPO's top-K approximation (Qi et al. 2026, Sec. 4.2): the divergence between pi and the anchor over
    the anchor's K most likely tokens plus one bucket for all the rest,

        tv: 1/2 (sum_{j in K} |p_j - q_j| + |(1 - sum_K p) - (1 - sum_K q)|)
        kl: sum_{j in K ∪ rest} q_j log(q_j / p_j),

    from the current ``logits`` [B, T, V] and the anchor's top-K ids and log-probs [B, T, K] (stored once per
    position instead of the whole anchor distribution). Tighter than the binary bound; it sees a shift among
    the likely tokens even when the sampled token's probability did not move. [B, T].
    """
    logq = anchor_topk_logp
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, anchor_topk_ids)
    p, q = logp.exp(), logq.exp()
    p_rest = (1 - p.sum(-1)).clamp(min=PROB_FLOOR)
    q_rest = (1 - q.sum(-1)).clamp(min=PROB_FLOOR)
    if kind == "tv":
        return 0.5 * ((p - q).abs().sum(-1) + (p_rest - q_rest).abs())
    if kind == "kl":
        return (q * (logq - logp)).sum(-1) + q_rest * (q_rest.log() - p_rest.log())
    raise ValueError(f"unknown divergence '{kind}' (tv, kl)")


@LOSSES.register("dppo")
def dppo_loss(
    x: PolicyLossInputs,
    divergence: str = "tv",
    anchor: str = "behaviour",
    topk: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning", the DPPO objective
    with the binary approximation): PPO's ratio clip replaced by a trust region on the divergence D_t between
    pi and the anchor policy at the token,

        obj_t = M_t * rho_t * A_t,   rho_t = exp(logp_t - old_logp_t),
        M_t = 0 if A_t > 0 and p_t > q_t and D_t > clip_high,  or  A_t < 0 and p_t < q_t and D_t > clip_low,
        M_t = 1 otherwise,

    with p_t = pi(y_t), q_t = anchor(y_t) and D_t = ``binary_divergence`` (``divergence``: tv or kl). Only an
    update that would carry the token further out of the region loses its gradient. A ratio of a rare token
    (1e-4 -> 3e-4) is a tiny divergence and trains; a likely token's 0.9 -> 0.6 is a big one and stops.
    ``anchor``: behaviour (the sampling engine's log-probs, the paper's choice; it also bounds the
    engine/learner mismatch) or old (``old_logp``, the policy at the update's start). ``clip_low`` and
    ``clip_high`` are the region's size in the chosen divergence (for kl, much smaller than for tv).

    ``topk`` > 0: D_t is the top-K approximation (``topk_divergence``, Sec. 4.2) instead of the binary one,
    from the policy's ``logits`` [B, T, V] and the anchor's K most likely tokens ``anchor_topk`` (ids and
    log-probs, [B, T, K]), which the learner keeps from the update's first pass. Only ``anchor: old``: the
    engines return the sampled token's log-prob, not the behaviour policy's top K.
    """
    if divergence not in ("tv", "kl") or anchor not in ("behaviour", "old"):
        raise ValueError(f"dppo needs divergence tv|kl and anchor behaviour|old, got {divergence}, {anchor}")
    if topk < 0 or (topk > 0 and anchor != "old"):
        raise ValueError(f"dppo's topk must be >= 0 and needs anchor: old (the engines keep only the sampled "
                         f"token's log-prob), got topk={topk}, anchor={anchor}")
    if topk > 0 and (x.logits is None or x.anchor_topk is None):
        raise ValueError("dppo with topk > 0 needs the policy's logits and the anchor's top-k")
    ref = x.behaviour_logp if anchor == "behaviour" and x.behaviour_logp is not None else x.old_logp
    adv = _per_token(x.advantages).expand_as(x.logp)
    ratio = torch.exp(x.logp - x.old_logp)
    with torch.no_grad():
        if topk > 0:
            d = topk_divergence(x.logits.detach(), *x.anchor_topk, divergence)
        else:
            d = binary_divergence(x.logp.detach(), ref.detach(), divergence)
        up, down = x.logp.detach() > ref, x.logp.detach() < ref
        outside = ((adv > 0) & up & (d > x.clip_high)) | ((adv < 0) & down & (d > x.clip_low))
    obj = torch.where(outside, torch.zeros_like(ratio), ratio * adv)
    loss = aggregate(-obj, x.mask, x.agg, x.num_tokens)
    metrics = ratio_metrics(ratio, x.mask, outside)
    metrics["dppo/divergence"] = masked_mean(d, x.mask)
    return loss, metrics


@LOSSES.register("sapo")
def sapo_loss(
    x: PolicyLossInputs,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", the SAPO objective): a smooth gate on the
    ratio instead of a hard clip,

        obj_t = f(rho_t) * A_t,   f(r) = sigmoid(tau (r - 1)) * 4 / tau,   tau = tau_pos if A_t > 0 else tau_neg,

    whose gradient is w(r) * r * A_t * grad log pi with w(r) = 4 sigmoid(tau (r - 1)) (1 - sigmoid(...)):
    exactly the policy gradient at r = 1, fading smoothly as the ratio leaves 1 instead of dropping to 0 at
    1 +- eps. A larger tau_neg makes negative-advantage tokens fade faster (the paper: 1.0 and 1.05), since
    pushing down a token spreads its mass over the whole vocabulary. ``clip_low``/``clip_high`` are unused;
    ``clip_frac`` reports the tokens whose gate weight w(r) fell below 1/2.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo needs tau_pos, tau_neg > 0, got {tau_pos}, {tau_neg}")
    adv = _per_token(x.advantages).expand_as(x.logp)
    ratio = torch.exp(x.logp - x.old_logp)
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1))
    loss = aggregate(-(gate * 4 / tau) * adv, x.mask, x.agg, x.num_tokens)
    with torch.no_grad():
        weight = 4 * gate * (1 - gate)
    metrics = ratio_metrics(ratio, x.mask, weight < 0.5)
    metrics["sapo/gate_weight"] = masked_mean(weight, x.mask)
    return loss, metrics
