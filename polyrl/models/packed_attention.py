"""Attention over a packed row, one segment at a time.

A packed row lays several sequences end to end ([prompt 0 | its responses | prompt 1 | ...]); a query sees only
its own prompt and its own earlier tokens. A dense [L, L] mask makes the attention kernel compute all L * L
scores and throw most away, which for long answers outweighs the rest of the pass. Here each segment (a prompt,
or a response) gathers its own queries and the keys it may see into a small padded batch, [segments, queries,
keys], runs the model's attention on that, and scatters the outputs back to the row. The work is the sum of
each segment's queries x keys instead of L * L; the result is the dense mask's up to the order of float sums,
and gradients flow through the gathers as through any index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class PackedSegments:
    """Where each segment of a packed row reads from: ``queries`` [S, Q] and ``keys`` [S, K] index the row
    (padding points at position 0), ``allowed`` [S, 1, Q, K] says which key each query sees, ``outputs`` [L]
    gives each row position's place in the flattened [S * Q] outputs. ``calls`` counts the attention layers
    that used them (a model whose layers drop the keyword would otherwise attend over the whole row)."""

    queries: torch.Tensor
    keys: torch.Tensor
    allowed: torch.Tensor
    outputs: torch.Tensor
    calls: list[int] = field(default_factory=lambda: [0])

    def to(self, device: torch.device) -> PackedSegments:
        move = {"device": device, "non_blocking": True}
        return PackedSegments(self.queries.to(**move), self.keys.to(**move), self.allowed.to(**move),
                              self.outputs.to(**move), self.calls)


def packed_segments(segments: Sequence[tuple[int, int, int, int]], length: int) -> PackedSegments:
    """Segments of a row of ``length`` positions, each ``(start, size, prefix_start, prefix_size)``: the
    queries ``start .. start + size - 1`` see every key of the prefix (their prompt; size 0 for a prompt's own
    segment) and, causally, their own positions. Every position must be the query of exactly one segment."""
    n_q = max(size for _, size, _, _ in segments)
    n_k = max(size + prefix for _, size, _, prefix in segments)
    queries = torch.zeros(len(segments), n_q, dtype=torch.long)
    keys = torch.zeros(len(segments), n_k, dtype=torch.long)
    allowed = torch.zeros(len(segments), 1, n_q, n_k, dtype=torch.bool)
    outputs = torch.full((length,), -1, dtype=torch.long)
    q_pos, k_pos = torch.arange(n_q), torch.arange(n_k)
    for s, (start, size, prefix_start, prefix) in enumerate(segments):
        queries[s, :size] = torch.arange(start, start + size)
        keys[s, :prefix] = torch.arange(prefix_start, prefix_start + prefix)
        keys[s, prefix : prefix + size] = queries[s, :size]
        # query t sees the prefix and its own keys 0..t; a padding query sees key 0 only (no row of -inf)
        allowed[s, 0, :size, : prefix + size] = k_pos[None, : prefix + size] <= prefix + q_pos[:size, None]
        allowed[s, 0, size:, 0] = True
        if (outputs[start : start + size] != -1).any():
            raise ValueError(f"packed_segments: position {start} is the query of two segments")
        outputs[start : start + size] = s * n_q + q_pos[:size]
    if (outputs == -1).any():
        raise ValueError(f"packed_segments: position {int((outputs == -1).nonzero()[0])} is in no segment")
    return PackedSegments(queries, keys, allowed, outputs)


def segment_work(prompt_sizes: Sequence[int], responses: Sequence[tuple[int, int]]) -> int:
    """The padded query-key pairs of ``packed_segments`` for prompts of ``prompt_sizes`` and responses given as
    (their prompt's size, their own size), without building it."""
    n_q = max([*prompt_sizes, *(size for _, size in responses)])
    n_k = max([*prompt_sizes, *(prefix + size for prefix, size in responses)])
    return (len(prompt_sizes) + len(responses)) * n_q * n_k


def segment_attention(
    attend: Callable, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    segments: PackedSegments, **kwargs,
) -> tuple[torch.Tensor, None]:
    """``attend`` (a transformers attention function) over each segment of one packed row: ``query`` [1, H, L, D]
    and ``key``/``value`` [1, H_kv, L, D] in, [1, L, H, D] out, as transformers' attention functions return."""
    if query.shape[0] != 1:
        raise ValueError(f"segment_attention: one packed row, got a batch of {query.shape[0]}")
    segments.calls[0] += 1
    # index_select, not advanced indexing: its backward adds rows (index_add) instead of sorting them
    n_s, n_q = segments.queries.shape
    q = query[0].index_select(1, segments.queries.flatten()).unflatten(1, (n_s, n_q)).transpose(0, 1)  # [S, H, Q, D]
    k = key[0].index_select(1, segments.keys.flatten()).unflatten(1, segments.keys.shape).transpose(0, 1)
    v = value[0].index_select(1, segments.keys.flatten()).unflatten(1, segments.keys.shape).transpose(0, 1)
    out, _ = attend(module, q, k, v, segments.allowed, **kwargs)  # [S, Q, H, D]
    return out.flatten(0, 1).index_select(0, segments.outputs)[None], None
