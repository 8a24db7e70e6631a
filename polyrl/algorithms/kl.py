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
