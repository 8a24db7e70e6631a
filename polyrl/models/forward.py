"""Forward passes shared by the engine and the learner: the transformer body under optional bf16 autocast,
the output head in float32 on only the positions that are needed.

Keeping the head in float32 matters: bf16 logits of magnitude ~20 are quantised in steps of 0.125, which
would blur the log-probs that the PPO ratio and KL are computed from.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import PreTrainedModel


def autocast_context(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def decoder_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    bf16: bool,
    past_key_values=None,
    use_cache: bool = False,
):
    """Return (last hidden states [B, T, H], KV cache or None) from the model's decoder body."""
    with autocast_context(bf16):
        out = model.get_decoder()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
        )
    return out.last_hidden_state, out.past_key_values if use_cache else None


def head_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits from hidden states."""
    return model.get_output_embeddings()(hidden.float())


def forward_logits(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    keep: int,
    bf16: bool,
    past_key_values=None,
    use_cache: bool = False,
):
    """Return (float32 logits of the last ``keep`` positions [B, keep, V], the KV cache or None)."""
    hidden, cache = decoder_forward(
        model, input_ids, attention_mask, position_ids, bf16, past_key_values, use_cache
    )
    return head_logits(model, hidden[:, -keep:]), cache
