"""The loss on reference replies that no policy sampled (``guidance``): a pure function of per-token log-probs.

LUFFY (Yan et al. 2025, "Learning to Reason under Off-Policy Guidance", Eq. 6 and Sec. 3.3) mixes off-policy
reference solutions into GRPO's groups. Their importance ratio pi_theta / pi_phi takes the reference's
behaviour probability pi_phi as 1 (it was not sampled), and plain ratios would then push hardest on tokens
the policy already finds likely; *policy shaping* replaces the ratio by f(pi) = pi / (pi + gamma), whose
gradient gamma / (pi + gamma)^2 * grad pi is largest for tokens of probability near gamma, so the rare tokens
the policy cannot yet produce (a minus sign, a step it never takes) get the push. No clipping: the reference
is not the policy, so there is no trust region around it to keep.
"""

from __future__ import annotations

import torch

from polyrl.algorithms.losses import aggregate


def shaped_reference_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    gamma: float | None,
    agg: str = "token-mean",
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """LUFFY's shaped objective on reference tokens: loss = -agg(A_t * f(pi_t)), f(p) = p / (p + gamma).

    ``gamma`` None: the reference is weighed as if the policy had sampled it, f(pi) = pi / sg(pi) (value 1,
    gradient A_t * grad log pi, an advantage-weighted likelihood step), the strongest push for tokens the
    policy finds unlikely: shaping's push falls to about pi / gamma of it as pi goes to 0.

    ``logp`` [B, T] the policy's log-probs (with gradient), ``advantages`` [B] or [B, T], ``mask`` [B, T] 0/1
    over the reference tokens that count. Metrics (none without reference tokens): the policy's mean
    probability of the reference tokens (``guidance/reference_prob``), how far it is from producing them.
    """
    if gamma is not None and gamma <= 0:
        raise ValueError(f"policy shaping needs gamma > 0, got {gamma}")
    per_token_adv = advantages[:, None] if advantages.dim() == 1 else advantages
    prob = logp.float().exp()
    shaped = prob / (prob + gamma) if gamma is not None else torch.exp(logp.float() - logp.detach().float())
    loss = -aggregate(per_token_adv * shaped, mask, agg, num_tokens)
    valid = mask > 0
    metrics = {"guidance/reference_prob": float(prob.detach()[valid].mean())} if valid.any() else {}
    return loss, metrics
