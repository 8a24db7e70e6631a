"""Supervised fine-tuning on the batch's verified successes, interleaved with the RL loss: a pure function.

RAFT (Dong et al. 2023, "RAFT: Reward rAnked FineTuning for Generative Foundation Model Alignment") fine-tunes
on the samples its reward ranks best; SRFT (Fu et al. 2025, "SRFT: A Single-Stage Method with Supervised and
Reinforcement Fine-Tuning for Reasoning") adds a supervised likelihood term on demonstrations to the RL
objective of the same step. Here the rows that count are those whose reward reaches a threshold: the
policy's own successes, whose push does not vanish when every sample of their group succeeded (a group
baseline gives them zero advantage), and references mixed in by guidance.
"""

from __future__ import annotations

import torch

from polyrl.algorithms.losses import aggregate


def success_nll_loss(
    logp: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    min_reward: float,
    agg: str = "token-mean",
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """-agg(log pi_t) over the tokens of rows whose reward is at least ``min_reward``.

    ``logp`` [B, T] the policy's log-probs (with gradient), ``rewards`` [B], ``mask`` [B, T] 0/1 over the
    tokens the model produced. ``agg`` and ``num_tokens`` are the policy loss's, so under token-mean the term
    is the successes' summed negative log-likelihood over every loss token of the batch: its weight grows with
    the share of the batch that succeeded. Metrics: ``sft/success_share``, the share of rows that counted.
    """
    success = (rewards >= min_reward).to(mask.dtype)
    loss = -aggregate(logp, mask * success[:, None], agg, num_tokens)
    return loss, {"sft/success_share": float(success.mean())}
