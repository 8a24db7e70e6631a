"""The learner's forward pass as one module: log-probs, entropy, values and (for distillation) logits of a
batch's response tokens. Every pass of the learner goes through ``PolicyPass.forward``, so under a sharded
learner (``parallel/fsdp.py``) it is the FSDP root: the parameters outside the decoder layers (embeddings,
the tied output head, the final norm, the critic) are gathered for the pass and their gradients reduced."""

from __future__ import annotations

import contextlib

import torch
from transformers import PreTrainedModel

from polyrl.algorithms.gae import ValueHead
from polyrl.learner.batch import Batch
from polyrl.learner.forward_pass import response_hidden
from polyrl.learner.logprobs import logprobs_from_logits, response_token_logprobs, token_logprobs
from polyrl.models.forward import autocast_context, head_logits

PassOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""(log-probs [B, R], entropy [B, R], values [B, R] or None, logits [B, R, V] or None)."""


class PolicyPass(torch.nn.Module):
    """``policy`` (and the critic ``value_head``, if any) as used by the learner."""

    def __init__(
        self,
        policy: PreTrainedModel,
        temperature: float,
        bf16: bool,
        value_head: ValueHead | None = None,
        share_prefix: bool = True,
    ) -> None:
        super().__init__()
        self.policy = policy
        self.value_head = value_head
        self.temperature = temperature
        self.bf16 = bf16
        self.share_prefix = share_prefix
        """Run a group's shared prompt once (``response_hidden``); off only to measure what that saves."""

    def forward(self, batch: Batch, entropy_grad: bool = False, logits: bool = False,
                reference: bool = False) -> PassOutput:
        """The policy's pass over ``batch``. ``logits``: also return the [B, R, V] logits (distillation compares
        whole distributions); otherwise the output head runs in chunks of positions (``chunked_logprobs``).
        ``reference``: the KL reference's log-probs and entropy from the whole logits (under LoRA, the same
        weights with the adapters off)."""
        if reference:
            adapters_off = self.policy.disable_adapter() if hasattr(self.policy, "disable_adapter") else None
            with adapters_off or contextlib.nullcontext():
                logp, entropy = token_logprobs(self.policy, batch, self.temperature, self.bf16,
                                               share_prefix=self.share_prefix)
            return logp, entropy, None, None
        # One autocast region around the body's passes (a shared prompt, then response buckets): each weight is
        # cast to bf16 once and that copy serves every pass and their backward, instead of one copy per pass.
        with autocast_context(self.bf16, batch.input_ids.device.type):
            hidden = response_hidden(self.policy, batch, self.bf16, self.share_prefix)
        values = None
        if self.value_head is not None:  # the critic reads the head's (detached) float32 input
            values = self.value_head(hidden.detach().float())
        if logits:
            full = head_logits(self.policy, hidden) / self.temperature
            return (*logprobs_from_logits(full, batch, entropy_grad), values, full)
        logp, entropy = response_token_logprobs(self.policy, hidden, batch, self.temperature, entropy_grad,
                                                bf16_backward=self.bf16)
        return logp, entropy, values, None
