"""Token log-probs from the output head: forward in float32, the softmax kept for a backward without a recompute.

The learner needs exact log-probs (the PPO ratio and the KL are differences of them), so the head's forward
runs in float32. The backward needs the softmax: kept from the forward pass instead of recomputing the float32
logits as checkpointing would. Under bf16 autocast the gradient needs no more precision than the rest of the
backward pass, where every matmul already runs in bf16: the softmax is kept in bf16 and the backward's two
matmuls (into the hidden states and into the head weight) run in bf16 at twice the float32 rate. In float32
training both stay float32. For one chunk of 8 rows x 16 positions of a 49152-word vocabulary the softmax is
12.6 MB in bf16 (25.2 MB in float32) kept in place of one float32 head matmul recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, weight_backward, targets, temperature):
        logits = F.linear(hidden.float(), weight) / temperature
        log_z = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, targets[..., None]).squeeze(-1) - log_z
        probs = torch.exp(logits - log_z[..., None])
        entropy = log_z - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight_backward, targets, probs.to(weight_backward.dtype), logp)
        ctx.temperature = temperature
        ctx.weight_grad = weight.requires_grad
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight_backward, targets, probs, logp = ctx.saved_tensors
        dtype = weight_backward.dtype
        # d logp_t / d logits = onehot(t) - softmax, divided by the temperature.
        grad = probs * (-grad_logp / ctx.temperature).to(dtype)[..., None]
        # The target's entry from the float32 log-prob: 1 - p in bf16 would vanish as p nears 1.
        own = (grad_logp * -torch.expm1(logp) / ctx.temperature).to(dtype)
        grad.scatter_(-1, targets[..., None], own[..., None])
        grad_hidden = (grad @ weight_backward).to(hidden.dtype)
        grad_weight = None
        if ctx.weight_grad:
            rows = grad.reshape(-1, grad.shape[-1])
            grad_weight = (rows.t() @ hidden.reshape(-1, hidden.shape[-1]).to(dtype)).float()
        return grad_hidden, grad_weight, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    weight_backward: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target [B, R], entropy [B, R], not differentiable) under softmax(hidden W^T / T).

    ``weight_backward`` is what the backward's matmuls use, in the precision the softmax is kept in: ``weight``
    cast to bf16 once by the caller and shared by every chunk of a batch, or ``weight`` itself (float32)."""
    return _HeadLogprobs.apply(hidden, weight, weight_backward, targets, temperature)
