"""Log-probs of response tokens from a policy: the decoder body's pass (``learner/forward_pass.py``), then the
output head in float32 on the positions that predict response tokens, in chunks so the [B, R, V] logits never
exist whole (``chunked_logprobs``)."""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint
from transformers import PreTrainedModel

from polyrl.learner.batch import Batch
from polyrl.learner.forward_pass import response_hidden
from polyrl.learner.head_logprobs import head_logprobs
from polyrl.models.forward import head_logits


def token_logprobs(
    model: PreTrainedModel,
    batch: Batch,
    temperature: float,
    bf16: bool,
    entropy_grad: bool = False,
    share_prefix: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens under logits / temperature (the sampling distribution), and the
    per-token entropy of that distribution (differentiable only when ``entropy_grad``)."""
    return logprobs_from_logits(response_logits(model, batch, temperature, bf16, share_prefix), batch, entropy_grad)


def response_logits(
    model: PreTrainedModel, batch: Batch, temperature: float, bf16: bool, share_prefix: bool = True
) -> torch.Tensor:
    """Float32 logits / temperature at the positions that predict each response token, [B, R, V]."""
    return head_logits(model, response_hidden(model, batch, bf16, share_prefix)) / temperature


def logprobs_from_logits(
    logits: torch.Tensor, batch: Batch, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return _logprobs_of(logits, batch.targets, entropy_grad)


def _logprobs_of(
    logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    log_z = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - log_z
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():
        entropy = log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


HEAD_CHUNK = 16
"""Response positions per chunk of the float32 output head in ``chunked_logprobs``."""

KEPT_SOFTMAX_BYTES = 256 * 2**20
"""In float32 training ``chunked_logprobs`` keeps each chunk's float32 softmax for the backward pass (no
recompute of the head) while a batch's whole softmax fits in this many bytes, and recomputes it above."""


def _head_logprobs(
    model: PreTrainedModel, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _logprobs_of(head_logits(model, hidden) / temperature, targets, entropy_grad)


def chunked_logprobs(
    model: PreTrainedModel,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy_grad: bool = False,
    chunk: int = HEAD_CHUNK,
    bf16_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprobs_from_logits(head_logits(hidden) / temperature)`` over ``chunk`` positions at a time, so the
    float32 [B, R, V] logits (and their gradient) never exist whole.

    Under autograd each chunk keeps its softmax for the backward pass (``learner/head_logprobs.py``): in bf16,
    with the backward's matmuls in bf16, for bf16-autocast training (``bf16_backward``); in float32 otherwise,
    while the batch's softmax fits in ``KEPT_SOFTMAX_BYTES``. Above that, or with ``entropy_grad``, or a head
    that is not a plain bias-free linear layer, each chunk is checkpointed instead: only its hidden states are
    kept and its logits are recomputed in the backward pass (one more output-head matmul per position).
    """
    head = model.get_output_embeddings()
    grad = torch.is_grad_enabled() and hidden.requires_grad
    if grad and not entropy_grad and type(head) is torch.nn.Linear and head.bias is None:
        kept_float32 = hidden.shape[0] * hidden.shape[1] * head.weight.shape[0] * 4
        weight = head.weight.detach().to(torch.bfloat16) if bf16_backward else head.weight.detach()
        if bf16_backward or kept_float32 <= KEPT_SOFTMAX_BYTES:
            parts = [
                head_logprobs(hidden[:, i : i + chunk], head.weight, weight, targets[:, i : i + chunk], temperature)
                for i in range(0, hidden.shape[1], chunk)
            ]
            return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)
    logps, entropies = [], []
    for i in range(0, hidden.shape[1], chunk):
        args = (model, hidden[:, i : i + chunk], targets[:, i : i + chunk], temperature, entropy_grad)
        if grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_head_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _head_logprobs(*args)
        logps.append(lp)
        entropies.append(ent)
    return torch.cat(logps, dim=1), torch.cat(entropies, dim=1)


def response_token_logprobs(
    model: PreTrainedModel,
    hidden: torch.Tensor,
    batch: Batch,
    temperature: float,
    entropy_grad: bool = False,
    bf16_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunked_logprobs`` of ``hidden`` [B, R, H] (``response_hidden``'s) at ``batch``'s response tokens only,
    packed into one row so padding costs the head nothing; [B, R] log-probs and entropy, zeros at padding."""
    used = batch.attention_mask[:, -batch.response_len :].bool()
    logp, entropy = chunked_logprobs(model, hidden[used][None], batch.targets[used][None], temperature, entropy_grad,
                                     chunk=HEAD_CHUNK * len(used), bf16_backward=bf16_backward)
    return _unpack(logp[0], used), _unpack(entropy[0], used)


def _unpack(packed: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """Values of the ``used`` positions back in their [B, R] places, zeros elsewhere."""
    return packed.new_zeros(used.shape).masked_scatter(used, packed)
