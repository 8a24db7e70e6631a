"""The learner's pass through the decoder body: the hidden states that predict each response token.

Two savings over one forward of the padded [prompt | response] rows, both computing the same thing (tested to
agree with the plain path):
- each distinct prompt runs once (the G samples of a group share it); its KV cache is indexed out to the
  rows that continue it, and gradients flow back through it;
- responses run in buckets of similar length, each padded only to its own longest row: one 60-token answer
  no longer pads fifteen 8-token ones to 60 (what sequence packing saves, without attention across samples).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from polyrl.models.forward import decoder_forward
from polyrl.train.batch import Batch

BUCKET_OVERHEAD = 32
"""What one more bucket costs (another pass through every layer, forward and backward), in response
positions of a row; ``length_buckets`` opens a bucket only where it saves more padding than this."""


def length_buckets(lengths: list[int], overhead: int = BUCKET_OVERHEAD) -> list[list[int]]:
    """Row indices grouped into buckets that minimise the padded positions (rows x longest length, summed over
    buckets) plus ``overhead`` per bucket. The best split of the rows sorted by length is contiguous, so a
    dynamic programme over the sorted rows finds it."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    best = [0.0] + [math.inf] * len(order)  # best[j]: least cost of the j longest rows
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):  # rows i..j-1 form the last bucket, as long as its first (longest) row
            cost = best[i] + (j - i) * lengths[order[i]] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], len(order)
    while j > 0:
        buckets.append(sorted(order[cut[j] : j]))
        j = cut[j]
    return buckets[::-1]


def response_hidden(model: PreTrainedModel, batch: Batch, bf16: bool, share_prefix: bool = True) -> torch.Tensor:
    """Hidden states that predict each response token, [B, R, H]; positions past a row's response hold
    whatever its padding computed (zeros in bucketed rows) and must stay masked.

    With ``share_prefix`` (the learner's default) prompts run once each and responses in length buckets
    (module docstring); without it, one plain forward of the padded rows."""
    r = batch.response_len
    s = batch.input_ids.shape[1] - r
    if share_prefix and s > 0:
        prompt_key = torch.cat([batch.input_ids[:, :s], batch.attention_mask[:, :s]], dim=1)
        unique, inverse = torch.unique(prompt_key, dim=0, return_inverse=True)
        lengths = batch.attention_mask[:, s:].sum(-1).tolist()
        buckets = length_buckets(lengths, BUCKET_OVERHEAD)
        if len(unique) < len(prompt_key) or len(buckets) > 1:
            return _bucketed(model, batch, bf16, unique, inverse, lengths, buckets)
    hidden, _ = decoder_forward(model, batch.input_ids, batch.attention_mask, batch.position_ids, bf16)
    return hidden[:, s - 1 : -1]


def _bucketed(
    model: PreTrainedModel,
    batch: Batch,
    bf16: bool,
    prompts: torch.Tensor,
    inverse: torch.Tensor,
    lengths: list[int],
    buckets: list[list[int]],
) -> torch.Tensor:
    r = batch.response_len
    s = batch.input_ids.shape[1] - r
    p_ids, p_mask = prompts[:, :s], prompts[:, s:]
    p_hidden, cache = decoder_forward(
        model, p_ids, p_mask, (p_mask.cumsum(-1) - 1).clamp(min=0), bf16, use_cache=True
    )
    prompt_kv = [(layer.keys, layer.values) for layer in cache.layers]
    parts = []
    for rows in buckets:
        idx = torch.tensor(rows)
        of_rows = inverse[idx]
        hidden = p_hidden[of_rows, -1:]  # the prompt's last position predicts the first response token
        width = max(lengths[i] for i in rows)
        if width > 1:  # the last response token predicts nothing: run the first width - 1
            kv = DynamicCache([(k[of_rows], v[of_rows]) for k, v in prompt_kv], config=model.config)
            cols = slice(s, s + width - 1)
            h, _ = decoder_forward(
                model, batch.input_ids[idx, cols], batch.attention_mask[idx, : s + width - 1],
                batch.position_ids[idx, cols], bf16, past_key_values=kv,
            )
            hidden = torch.cat([hidden, h], dim=1)
        parts.append(F.pad(hidden, (0, 0, 0, r - hidden.shape[1])))
    order = torch.tensor([i for rows in buckets for i in rows])
    return torch.cat(parts)[torch.argsort(order)]
