"""Forward passes shared by the engine and the learner: the transformer body under optional bf16 autocast,
the output head in float32 on only the positions that are needed.

Keeping the head in float32 matters: bf16 logits of magnitude ~20 are quantised in steps of 0.125, which
would blur the log-probs that the PPO ratio and KL are computed from.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from polyrl.models.device import bf16_autocast
from polyrl.models.packed_attention import PackedSegments, segment_attention

FLOAT32_SDPA = "sdpa_float32"


def float32_sdpa(module, query, key, value, attention_mask, packed_segments: PackedSegments | None = None, **kwargs):
    """transformers' SDPA attention, run in float32 on a CPU where it would run in bf16 (under bf16 autocast, or
    on bf16 weights), for more than one query position. With ``packed_segments`` (a packed row's layout, passed
    to the model's forward), one segment at a time (``packed_attention.py``); ``attention_mask`` is not read.

    torch's CPU flash-attention kernel runs float32 faster than bf16 at these sizes, forward and backward
    (16 rows, 9 heads over 3 key/value heads, 64 queries x 108 keys: 9.7 against 18.4 ms; 256 x 256: 29.6
    against 34.6 ms), and more exactly; the casts cost far less. Single-token decoding keeps bf16: there the
    whole cached keys and values would be cast for one query."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_segments is not None:
        return segment_attention(float32_sdpa, module, query, key, value, packed_segments, **kwargs)
    device_type = query.device.type
    autocast = device_type == "cpu" and torch.is_autocast_enabled(device_type)
    low = autocast or query.dtype != torch.float32
    if device_type != "cpu" or query.shape[2] == 1 or not low:  # GPU kernels run bf16 attention well
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast(device_type, enabled=False):
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    # Under autocast the next matmul casts for itself; bf16 weights need bf16 input.
    return (out if autocast else out.to(query.dtype)), weights


def use_float32_attention(model: PreTrainedModel) -> bool:
    """Route ``model``'s SDPA attention through ``float32_sdpa``; False (unchanged) for other implementations."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(FLOAT32_SDPA, float32_sdpa)
    # The same masks as SDPA's: an attention name without a mask function gets no mask at all (padding unseen).
    AttentionMaskInterface.register(FLOAT32_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(FLOAT32_SDPA)
    return True


def full_attention_only(model: PreTrainedModel) -> bool:
    """True when no layer of ``model`` uses windowed (local) attention."""
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False
    if getattr(cfg, "attention_chunk_size", None):
        return False
    return set(getattr(cfg, "layer_types", None) or ["full_attention"]) == {"full_attention"}


def autocast_context(bf16: bool, device_type: str = "cpu"):
    """bf16 autocast (or nothing) on ``device_type``: the device the computation's tensors are on."""
    return bf16_autocast(device_type, bf16)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant checkpoints), through
    transformers' own switch: ``activation_checkpointing_enable``, or its older name."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def checkpointing_active(model: torch.nn.Module) -> bool:
    """Whether a forward of ``model`` now runs checkpointed layers (transformers flags each such layer, and
    checkpoints only in training mode)."""
    return model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def decoder_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    bf16: bool,
    past_key_values=None,
    use_cache: bool = False,
    packed_segments: PackedSegments | None = None,
):
    """Return (last hidden states [B, T, H], KV cache or None) from the model's decoder body; ``bf16`` is
    autocast on the device ``input_ids`` are on (the model's). ``packed_segments`` reaches ``float32_sdpa``."""
    extra = {} if packed_segments is None else {"packed_segments": packed_segments}
    with autocast_context(bf16, input_ids.device.type):
        out = model.get_decoder()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            **extra,
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
