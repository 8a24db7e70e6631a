"""Off-policy correction for replayed samples: a pure function of per-token log-probs."""

from __future__ import annotations

import torch


def truncated_is_weight(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weight w_t = min(pi_old(y_t) / mu(y_t), c), detached.

    ``mu`` is the behaviour policy that sampled a replayed token (its stored log-prob) and ``pi_old`` the
    policy at the start of this update. PPO's clipped ratio pi / pi_old then stays on-policy while w_t
    re-weights the sample from mu to pi_old: the decoupled PPO objective (Hilton et al. 2022, "Batch
    size-invariance for policy optimization", Eq. 2), with the weight truncated at c as in IMPALA's V-trace
    (Espeholt et al. 2018) so one stale sample cannot dominate. The loss on a replayed token is
    -w_t * min(r_t A, clip(r_t) A), r_t = pi / pi_old.
    """
    return torch.exp(old_logp.detach() - behaviour_logp).clamp(max=cap)
