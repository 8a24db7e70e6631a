"""The learner's pass through the decoder body: the hidden states that predict each response token.

Two ways to do less than one forward of the padded [prompt | response] rows, both computing the same thing
(tested to agree with the plain path); ``response_hidden`` takes the cheaper for each micro-batch:
- **buckets**: each distinct prompt runs once (the G samples of a group share it); its KV cache is indexed
  out to the rows that continue it, and gradients flow back through it. Responses run in buckets of similar
  length, each padded only to its own longest row: one 60-token answer no longer pads fifteen 8-token ones.
- **one packed row**: every distinct prompt and every response, unpadded, in a single sequence whose
  attention mask lets a response see its own prompt and its own earlier tokens only (shared-prefix packing).
  One pass through the layers instead of one per bucket plus one for the prompts, and no padding at all; but
  attention over the packed row grows with its squared length. It wins for short answers (quickstart-shaped
  updates: 1.34 -> 0.90 s) and loses for long ones (16 answers of 64 tokens: 4.1 -> 5.9 s).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from polyrl.learner.batch import Batch
from polyrl.models.device import to_device
from polyrl.models.forward import FLOAT32_SDPA, checkpointing_active, decoder_forward, full_attention_only
from polyrl.models.packed_attention import packed_segments, segment_work

BUCKET_OVERHEAD = 32
"""What one more bucket costs (another pass through every layer, forward and backward), in response
positions of a row; ``length_buckets`` opens a bucket only where it saves more padding than this."""


PACKED_ATTENTION = 3000
"""Attention over one packed row of L positions costs about L * L / PACKED_ATTENTION positions of the rest of
the pass (fitted to update times on SmolLM2-135M; ``benchmarks/packing.py``). 0 turns packing off."""

SEGMENT_OVERHEAD, SEGMENT_PAIR = 115_000, 1.25
"""Attention one segment at a time (``models/packed_attention.py``) costs about SEGMENT_OVERHEAD + SEGMENT_PAIR x
its padded query-key pairs, in pairs of the dense mask's kernel (forward and backward of one layer, timed on
SmolLM2-135M's attention shapes): the gathers and many small kernels cost more than a short row's whole
attention, so the learner takes the cheaper of the two."""


class DecoderPass(NamedTuple):
    """One pass through the decoder body that ``response_hidden`` made: ``layout`` is ``padded`` (the plain
    padded rows), ``prompts`` (each distinct prompt once), ``bucket`` (one length bucket of responses) or
    ``packed`` (one packed row); ``with_grad`` whether autograd recorded it."""

    layout: str
    with_grad: bool


_recorded: list[DecoderPass] | None = None


@contextlib.contextmanager
def record_passes() -> Iterator[list[DecoderPass]]:
    """Inside the block, every decoder pass the learner's forward makes is appended to the list it yields:
    how an update laid its micro-batches out, and how many passes autograd kept."""
    global _recorded
    outer, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = outer


@contextlib.contextmanager
def pass_costs(
    bucket_overhead: int | None = None, packed_attention: int | None = None, segment_overhead: int | None = None
) -> Iterator[None]:
    """Inside the block, the cost model that lays out the learner's passes uses ``bucket_overhead`` for
    ``BUCKET_OVERHEAD`` (a huge value: one response pass, no buckets), ``packed_attention`` for
    ``PACKED_ATTENTION`` (0: never one packed row; a huge value: packed wherever it applies) and
    ``segment_overhead`` for ``SEGMENT_OVERHEAD`` (a huge value: the packed row's dense mask; a hugely negative
    one: its segments, where the model's attention reads them); None keeps the value. The layouts agree on the
    log-probs and gradients (tests/test_length_buckets.py, tests/test_packed_attention.py), not on the time."""
    global BUCKET_OVERHEAD, PACKED_ATTENTION, SEGMENT_OVERHEAD
    saved = BUCKET_OVERHEAD, PACKED_ATTENTION, SEGMENT_OVERHEAD
    if bucket_overhead is not None:
        BUCKET_OVERHEAD = bucket_overhead
    if packed_attention is not None:
        PACKED_ATTENTION = packed_attention
    if segment_overhead is not None:
        SEGMENT_OVERHEAD = segment_overhead
    try:
        yield
    finally:
        BUCKET_OVERHEAD, PACKED_ATTENTION, SEGMENT_OVERHEAD = saved


def _decoder_pass(layout: str, *args, **kwargs) -> tuple[torch.Tensor, object]:
    """``decoder_forward``, recorded under ``record_passes``."""
    if _recorded is not None:
        _recorded.append(DecoderPass(layout, torch.is_grad_enabled()))
    return decoder_forward(*args, **kwargs)


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
        # The plan (distinct prompts, lengths, buckets or packing) is made on the host from the token ids.
        ids, mask = _on_host(batch.input_ids, batch.attention_mask)
        prompt_key = torch.cat([ids[:, :s], mask[:, :s]], dim=1)
        unique, inverse = torch.unique(prompt_key, dim=0, return_inverse=True)
        lengths = mask[:, s:].sum(-1).tolist()
        buckets = length_buckets(lengths, BUCKET_OVERHEAD)
        prompt_positions = int(unique[:, s:].sum())
        # A checkpointed layer drops its KV cache (transformers: a recompute would write it twice), so under
        # activation checkpointing only the paths without a cache are exact: packed rows, or plain padded rows.
        no_cache = checkpointing_active(model)
        if _packing_applies(model):
            packed = prompt_positions + sum(max(n - 1, 0) for n in lengths)
            pairs = packed * packed  # the dense mask's query-key pairs
            segmented = False
            if _segments_apply(model):
                sizes = unique[:, s:].sum(-1).tolist()
                responses = [(sizes[u], n - 1) for u, n in zip(inverse.tolist(), lengths, strict=True) if n > 1]
                segment_pairs = SEGMENT_OVERHEAD + SEGMENT_PAIR * segment_work(sizes, responses)
                segmented, pairs = segment_pairs < pairs, min(pairs, segment_pairs)
            packed_cost = packed + pairs / PACKED_ATTENTION + BUCKET_OVERHEAD
            padded = sum(len(b) * max(lengths[i] for i in b) for b in buckets)
            # without a cache the alternative is every row in full, its prompt included
            other = ids.numel() if no_cache else prompt_positions + padded + BUCKET_OVERHEAD * (len(buckets) + 1)
            if packed_cost < other:
                return _packed(model, batch, bf16, unique, inverse, lengths, ids, segmented)
        if not no_cache and (len(unique) < len(prompt_key) or len(buckets) > 1):
            return _bucketed(model, batch, bf16, unique, inverse, lengths, buckets)
    hidden, _ = _decoder_pass("padded", model, batch.input_ids, batch.attention_mask, batch.position_ids, bf16)
    return hidden[:, s - 1 : -1]


def _on_host(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two tensors on the host: themselves on the CPU, else one copy of both (one wait for the device)."""
    if input_ids.device.type == "cpu":
        return input_ids, attention_mask
    both = torch.cat([input_ids, attention_mask.to(input_ids.dtype)]).cpu()
    return both[: len(input_ids)], both[len(input_ids) :].to(attention_mask.dtype)


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
    device = batch.input_ids.device  # prompts and inverse come from the host plan
    prompts, inverse = prompts.to(device, non_blocking=True), inverse.to(device, non_blocking=True)
    p_ids, p_mask = prompts[:, :s], prompts[:, s:]
    # Full-length caches, also for sliding-window layers (Gemma 3): the cache a model makes for itself keeps only
    # a window's last positions, and a response continuing it would be masked as if the prompt were that short.
    p_hidden, cache = _decoder_pass(
        "prompts", model, p_ids, p_mask, (p_mask.cumsum(-1) - 1).clamp(min=0), bf16, DynamicCache(), use_cache=True
    )
    prompt_kv = [(layer.keys, layer.values) for layer in cache.layers]
    parts = []
    for rows in buckets:
        idx = to_device(rows, device)
        of_rows = inverse[idx]
        hidden = p_hidden[of_rows, -1:]  # the prompt's last position predicts the first response token
        width = max(lengths[i] for i in rows)
        if width > 1:  # the last response token predicts nothing: run the first width - 1
            kv = DynamicCache([(k[of_rows], v[of_rows]) for k, v in prompt_kv])
            cols = slice(s, s + width - 1)
            h, _ = _decoder_pass(
                "bucket", model, batch.input_ids[idx, cols], batch.attention_mask[idx, : s + width - 1],
                batch.position_ids[idx, cols], bf16, past_key_values=kv,
            )
            hidden = torch.cat([hidden, h], dim=1)
        parts.append(F.pad(hidden, (0, 0, 0, r - hidden.shape[1])))
    order = to_device([i for rows in buckets for i in rows], device)
    return torch.cat(parts)[torch.argsort(order)]


def _packing_applies(model: PreTrainedModel) -> bool:
    """Whether a custom attention mask computes ``model`` exactly: SDPA attention (which takes the boolean mask
    as it is) and no windowed attention (whose limit the packed mask would not carry)."""
    attention = getattr(model.config, "_attn_implementation", None)
    return bool(PACKED_ATTENTION) and attention in ("sdpa", FLOAT32_SDPA) and full_attention_only(model)


_segments_unused: set[type] = set()
"""Decoder classes whose layers turned out not to pass ``packed_segments`` on to their attention."""


def _segments_apply(model: PreTrainedModel) -> bool:
    """Whether the packed row's attention runs segment by segment: polyrl's SDPA attention function, which reads
    the layout (``models/packed_attention.py``); other implementations get the dense mask."""
    return (getattr(model.config, "_attn_implementation", None) == FLOAT32_SDPA
            and type(model.get_decoder()) not in _segments_unused)


def _packed(
    model: PreTrainedModel,
    batch: Batch,
    bf16: bool,
    prompts: torch.Tensor,
    inverse: torch.Tensor,
    lengths: list[int],
    host_ids: torch.Tensor | None = None,
    segmented: bool = False,
) -> torch.Tensor:
    """``response_hidden`` from one packed row: [prompt 0 | its responses | prompt 1 | ...], each response
    without its last token (it predicts nothing). Positions restart with each prompt as in the padded rows.
    ``prompts``, ``inverse`` and ``host_ids`` (``batch.input_ids`` on the host) lay the row out on the host.
    ``segmented``: attention one segment at a time where the model's attention can (else the dense mask)."""
    r = batch.response_len
    s = batch.input_ids.shape[1] - r
    device = batch.input_ids.device
    host_ids = batch.input_ids.cpu() if host_ids is None else host_ids
    ids, positions, prompt_of, response_of = [], [], [], []  # per packed position; response_of -1: a prompt
    prompt_last, response_start = [], [0] * len(lengths)
    segments = []  # (start, size, prompt start, prompt size): a prompt sees itself, a response its prompt too
    for u in range(len(prompts)):
        prompt = prompts[u, :s][prompts[u, s:].bool()].tolist()
        prompt_start = len(ids)
        segments.append((prompt_start, len(prompt), 0, 0))
        ids += prompt
        positions += range(len(prompt))
        prompt_of += [u] * len(prompt)
        response_of += [-1] * len(prompt)
        prompt_last.append(len(ids) - 1)
        for i in (inverse == u).nonzero().flatten().tolist():
            n = max(lengths[i] - 1, 0)
            response_start[i] = len(ids)
            if n:
                segments.append((len(ids), n, prompt_start, len(prompt)))
            ids += host_ids[i, s : s + n].tolist()
            positions += range(len(prompt), len(prompt) + n)
            prompt_of += [u] * n
            response_of += [i] * n
    gather = torch.zeros((len(lengths), r), dtype=torch.long)  # where each response position's hidden state is
    for i, n in enumerate(lengths):
        gather[i, 0] = prompt_last[int(inverse[i])]  # the prompt's last position predicts the first token
        gather[i, 1:n] = torch.arange(response_start[i], response_start[i] + n - 1)
    row_ids, row_positions = to_device([ids], device), to_device([positions], device)
    hidden = None
    if segmented and _segments_apply(model):
        layout = packed_segments(segments, len(ids)).to(device)
        hidden, _ = _decoder_pass("packed", model, row_ids, None, row_positions, bf16, packed_segments=layout)
        if layout.calls[0] == 0:  # the model's layers did not pass the layout on: remember, use the dense mask
            _segments_unused.add(type(model.get_decoder()))
            hidden = None
    if hidden is None:
        group, row = to_device(prompt_of, device), to_device(response_of, device)
        # Query a sees key b when b comes no later, under the same prompt, and is a prompt token or a's own response.
        allowed = torch.ones(len(ids), len(ids), dtype=torch.bool, device=device).tril_()
        allowed &= (group[:, None] == group[None]) & ((row[None] == -1) | (row[None] == row[:, None]))
        hidden, _ = _decoder_pass("packed", model, row_ids, allowed[None, None], row_positions, bf16)
    return hidden[0][gather.to(device, non_blocking=True)]
