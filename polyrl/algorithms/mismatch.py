"""Engine/learner mismatch: how far the sampler's token log-probs are from the learner's, and the sequence- and
token-level corrections that mask or reweight the tokens where they disagree.

The engine that samples (bf16 kernels, another attention implementation, a version or two behind in an
asynchronous run) does not compute the same distribution as the learner, even at the same weights. Every
function here takes [B, T] tensors over response positions: ``proximal_logp`` is the learner's log-prob of
each sampled token at the update's start (pi_train), ``behaviour_logp`` the engine's (mu, stored with the
trajectory), ``mask`` is 1 on the tokens that count. Log-ratios are log pi_train - log mu. Nothing here
carries a gradient.

A correction returns per-token weights (0 where a token or its whole sequence is masked) that multiply the
advantages ahead of the policy loss; ``polyrl.algorithms.corrections.correct_off_policy`` applies them.
"""

from __future__ import annotations

import math

import torch

from polyrl.algorithms.registry import Registry

CORRECTIONS = Registry("off-policy correction")
"""``algorithm.off_policy.correction`` values beyond decoupled/tis/m2po; each takes ``algorithm.off_policy.kwargs``."""

LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped here before exp(): a sequence's summed log-ratio can reach hundreds."""

MISMATCH_SUMS = ("tokens", "log_ratio", "beyond_band", "kl")


def mismatch_sums(
    learner_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, band: float
) -> dict[str, float]:
    """Sums over the counted tokens from which ``mismatch_metrics`` makes the step's means; sums, so that
    micro-batches and ranks add up to the whole batch's means.

    With log r_t = log pi_train(y_t) - log mu(y_t): the token count, sum of log r_t, the count of tokens with
    |r_t - 1| > ``band``, and sum of k3_t = r_t - 1 - log r_t. Tokens are sampled from mu, so the mean of k3 is
    an unbiased, non-negative estimate of KL(mu || pi_train) (Schulman 2020, "Approximating KL divergence").
    Also ``abs_log_ratio/max``, the largest |log r_t|.
    """
    valid = mask > 0
    log_r = (learner_logp.detach().float() - behaviour_logp.detach().float())[valid]
    if log_r.numel() == 0:
        return {"tokens": 0.0, "log_ratio": 0.0, "beyond_band": 0.0, "kl": 0.0, "abs_log_ratio/max": 0.0}
    clamped = log_r.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = clamped.exp()
    return {
        "tokens": float(log_r.numel()),
        "log_ratio": float(log_r.sum()),
        "beyond_band": float(((ratio - 1).abs() > band).sum()),
        "kl": float((ratio - 1 - clamped).sum()),
        "abs_log_ratio/max": float(log_r.abs().max()),
    }


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The ``mismatch/`` metrics from summed ``mismatch_sums``: mean log-ratio, largest |log-ratio|, fraction
    of tokens beyond the band, and the KL(mu || pi_train) estimate. Empty when no token was counted."""
    n = sums.get("tokens", 0.0)
    if not n:
        return {}
    return {
        "mismatch/log_ratio": sums["log_ratio"] / n,
        "mismatch/abs_log_ratio/max": sums["abs_log_ratio/max"],
        "mismatch/beyond_band_frac": sums["beyond_band"] / n,
        "mismatch/kl": sums["kl"] / n,
    }


def _log_ratio(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (proximal_logp.detach() - behaviour_logp.detach()) * (mask > 0).to(proximal_logp.dtype)


def sequence_log_ratio(
    proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """log of the sequence importance ratio pi_train(y | x) / mu(y | x) = sum_t log r_t over counted tokens, [B]."""
    return _log_ratio(proximal_logp, behaviour_logp, mask).sum(-1)


@CORRECTIONS.register("mis")
def mis_weights(
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    cap: float = 2.0,
    drop: bool = False,
) -> torch.Tensor:
    """Sequence-level truncated importance sampling (Liu, Li et al. 2025, "When Speed Kills Stability:
    Demystifying RL Collapse from the Training-Inference Mismatch", the sequence-level IS estimator and its
    masked variant MIS): one weight per sequence,

        w_i = min(rho_i, C),   rho_i = pi_train(y_i | x) / mu(y_i | x) = exp(sum_t log r_t),

    or, with ``drop``, w_i = rho_i if rho_i <= C else 0 (the sequence is masked instead of truncated). The
    sequence ratio is the correct importance weight for a sequence-level reward; the token-level weight of
    TIS is a biased stand-in for it. Returns [B, 1] weights (broadcast over the sequence's tokens).
    """
    if cap <= 0:
        raise ValueError(f"mis needs cap > 0, got {cap}")
    log_rho = sequence_log_ratio(proximal_logp, behaviour_logp, mask).clamp(max=LOG_RATIO_LIMIT)
    log_cap = math.log(cap)
    if drop:
        w = torch.where(log_rho <= log_cap, log_rho.exp(), torch.zeros_like(log_rho))
    else:
        w = log_rho.clamp(max=log_cap).exp()
    return w[:, None]


@CORRECTIONS.register("icepop")
def icepop_weights(
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    alpha: float = 0.5,
    beta: float = 5.0,
) -> torch.Tensor:
    """IcePop (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking
    Model", the IcePop objective): the token's calibration weight M(r_t) = r_t if alpha <= r_t <= beta, else
    0, with r_t = pi_train(y_t) / mu(y_t). Tokens where the two engines disagree by more than the band lose
    their gradient; the rest are importance-weighted. The paper uses alpha = 0.5, beta = 5. Returns [B, T].
    """
    if not 0 <= alpha <= beta:
        raise ValueError(f"icepop needs 0 <= alpha <= beta, got alpha={alpha}, beta={beta}")
    ratio = _log_ratio(proximal_logp, behaviour_logp, mask).clamp(max=LOG_RATIO_LIMIT).exp()
    return torch.where((ratio >= alpha) & (ratio <= beta), ratio, torch.zeros_like(ratio))


@CORRECTIONS.register("geo_mask")
def geometric_mean_mask(
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    low: float = 0.99,
    high: float = 1.01,
) -> torch.Tensor:
    """Geometric-mean sequence mask (Liu, Li et al. 2025, "When Speed Kills Stability", geometric rejection
    sampling): the length-normalised sequence ratio

        g_i = exp(mean_t log r_t)

    must lie in [low, high], else the whole sequence is masked. Unlike the sequence ratio itself, g_i does not
    grow with length, so one bound suits short and long answers; a few far-off tokens in a long sequence move
    it little, many small disagreements move it a lot. Kept sequences count as on-policy (weight 1).
    Returns [B, 1] 0/1 weights.
    """
    if not 0 < low <= 1 <= high:
        raise ValueError(f"geo_mask needs 0 < low <= 1 <= high, got low={low}, high={high}")
    m = (mask > 0).to(proximal_logp.dtype)
    mean_log = sequence_log_ratio(proximal_logp, behaviour_logp, mask) / m.sum(-1).clamp(min=1)
    keep = (mean_log >= math.log(low)) & (mean_log <= math.log(high))
    return keep.to(proximal_logp.dtype)[:, None]


@CORRECTIONS.register("prob_mask")
def probability_difference_mask(
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 0.2,
) -> torch.Tensor:
    """Mask by probability difference: a token counts only when |pi_train(y_t) - mu(y_t)| <= eps. The
    difference is the total variation between the two distributions collapsed onto {y_t, any other token}
    (the binary TV of Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning", Sec. 4):
    unlike the ratio, it does not flag a token at probability 1e-4 in one engine and 3e-4 in the other, and
    it does flag 0.9 against 0.6. Kept tokens count as on-policy (weight 1). Returns [B, T] 0/1 weights.
    """
    if eps < 0:
        raise ValueError(f"prob_mask needs eps >= 0, got {eps}")
    diff = (proximal_logp.detach().exp() - behaviour_logp.detach().exp()).abs()
    return (diff <= eps).to(proximal_logp.dtype)
