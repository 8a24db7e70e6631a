"""Per-token KL estimators between the policy and a reference (Schulman 2020, "Approximating KL divergence").

With log r = ref_logp - logp (tokens sampled from the policy):
k1 = -log r (unbiased, high variance), k2 = (log r)^2 / 2, k3 = (r - 1) - log r (unbiased, non-negative).
"""

from __future__ import annotations

import torch


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        # Clamp keeps exp() finite when the policy has drifted far; the estimate stays non-negative.
        log_ratio = log_ratio.clamp(-20, 20)
        return torch.exp(log_ratio) - 1 - log_ratio
    raise ValueError(f"unknown KL estimator '{estimator}'")


def kl_penalty_to_go(kl: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """KL in the reward (Ouyang et al. 2022, InstructGPT Eq. 2, per token as in Stiennon et al. 2020): each
    token's reward gets -coef * KL_t, so with gamma = 1 the return from token t changes by
    -coef * sum_{s >= t} KL_s.

    Returns that change [B, T] (0 on masked positions), to add to per-sequence advantages broadcast over the
    tokens. ``kl`` is the per-token estimate under the behaviour policy; no gradient flows through it.
    """
    m = mask.to(kl.dtype)
    per_token = kl.detach() * m
    to_go = per_token.flip(-1).cumsum(-1).flip(-1)
    return -coef * to_go * m
