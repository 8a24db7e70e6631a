"""PPO with a learned critic: per-token GAE advantages, a small value head and the clipped value loss.

The value head reads the policy's final hidden states (detached), so the critic costs no extra forward pass
and its gradients never disturb the policy; only the head's own parameters learn the values.
"""

from __future__ import annotations

import torch
from torch import nn

from polyrl.algorithms.losses import aggregate, masked_mean


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's outcome reward [B] on its last model token: a [B, T] per-token reward."""
    m = mask > 0
    t = mask.shape[-1]
    # Index of the last valid token; rows with no valid token get no reward.
    last = torch.where(m, torch.arange(t, device=mask.device), torch.full_like(mask, -1, dtype=torch.long))
    last = last.max(-1).values
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    has = last >= 0
    out[has.nonzero().squeeze(-1), last[has]] = rewards[has]
    return out


def gae(
    rewards_per_token: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> torch.Tensor:
    """Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", Eq. 16): A_t = sum_l (gamma lam)^l delta_{t+l},
    delta_t = r_t + gamma V_{t+1} - V_t, with V = 0 after a sequence's last valid token.

    Time runs over valid (mask 1) tokens only: positions with mask 0 (padding, environment turns between model
    turns) are skipped, so the step after a model token is the next model token. They get advantage 0 and
    their rewards are ignored. All inputs are [B, T]; returns the advantages [B, T]; returns are A + V.
    """
    b, t = values.shape
    adv = torch.zeros_like(values)
    next_value = torch.zeros(b, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    valid = mask > 0
    for i in reversed(range(t)):
        m = valid[:, i]
        delta = rewards_per_token[:, i] + gamma * next_value - values[:, i]
        a = delta + gamma * lam * next_adv
        adv[:, i] = torch.where(m, a, torch.zeros_like(a))
        next_value = torch.where(m, values[:, i], next_value)
        next_adv = torch.where(m, a, next_adv)
    return adv


class ValueHead(nn.Module):
    """A two-layer MLP from a hidden state to a scalar value; the output layer starts at zero so V = 0."""

    def __init__(self, hidden_size: int, width: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden_size, width), nn.Tanh(), nn.Linear(width, 1))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...]."""
        return self.net(hidden).squeeze(-1)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss (Schulman et al. 2017 as implemented in the PPO baselines):
    0.5 * max((V - R)^2, (old_V + clip(V - old_V, -clip, clip) - R)^2); ``clip`` None is the plain MSE.
    """
    err = (values - returns) ** 2
    if clip is None:
        per_token, clipped_frac = err, 0.0
    else:
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        err_clipped = (v_clipped - returns) ** 2
        per_token = torch.maximum(err, err_clipped)
        clipped_frac = masked_mean((err_clipped > err).to(values.dtype), mask)
    loss = 0.5 * aggregate(per_token, mask, agg, num_tokens)
    with torch.no_grad():
        m = mask > 0
        ret, val = returns[m], values.detach()[m]
        var = float(ret.var(correction=0)) if ret.numel() else 0.0
        explained = 1.0 - float((ret - val).var(correction=0)) / var if var > 0 else 0.0
        metrics = {
            "value/mean": float(val.mean()) if val.numel() else 0.0,
            "value/clip_frac": clipped_frac,
            "value/explained_var": explained,
        }
    return loss, metrics
