"""The output head at bf16 cost with float32 logits where the probability mass is: all logits from the bf16 head,
then the largest few of each row recomputed in float32 (the fused decode path's ``_head``; the native kernel
``rescore_head`` does the same in two passes a row).

bf16 logits are rounded to 1/128 of their magnitude, too coarse for the tokens that carry the probability;
recomputing the top 32 of each row makes the sampled distribution and its recorded log-probs exact there.
"""

from __future__ import annotations

import torch


def blocked_topk(x: torch.Tensor, k: int, block: int = 64) -> torch.Tensor:
    """Indices of the ``k`` largest entries of each row of ``x`` [B, V], like ``x.topk(k).indices`` (ties may
    resolve differently). Each of them lies in one of the ``k`` blocks with the largest maxima (a block holding
    one has its maximum at least that large, and at most k - 1 larger entries lie elsewhere), so the search
    runs over k * block candidates instead of the whole 49k vocabulary: 2.2x faster at 16-64 rows."""
    b, v = x.shape
    if v % block or v < 4 * k * block:
        return x.topk(k, dim=-1).indices
    blocks = x.view(b, v // block, block)
    chosen = blocks.amax(-1).topk(k, dim=-1).indices  # [B, k]
    candidates = blocks.gather(1, chosen[:, :, None].expand(-1, -1, block)).view(b, k * block)
    picked = candidates.topk(k, dim=-1).indices
    return chosen.gather(1, picked // block) * block + picked % block


def rescore_top(low: torch.Tensor, hidden: torch.Tensor, head_weight: torch.Tensor, k: int) -> torch.Tensor:
    """Float32 logits [B, V] from the bf16 head's ``low`` [B, V], the ``k`` largest of each row recomputed in
    float32 from ``hidden`` [B, H] and the float32 ``head_weight`` [V, H] (the native ``rescore_head``)."""
    logits = low.float()
    top = blocked_topk(logits, k)
    exact = torch.bmm(head_weight[top], hidden.float()[:, :, None]).squeeze(-1)
    return logits.scatter_(1, top, exact)
