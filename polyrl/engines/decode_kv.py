"""Key/value buffers of the fused decode path and attention over them for one new position per row.

Why matmuls and not SDPA: torch's CPU SDPA kernel pays a fixed cost per (row, head), and batched matmuls on a
strided slice of a larger buffer take a slow path; two batched matmuls over whole contiguous buffers, with
unfilled and padding positions masked, take about 40 % less time in the decode loop at 64 rows. So buffers
keep their capacity close to their length: they grow by a quarter, at least ``KV_CHUNK`` positions, which
bounds both the copying on growth and the masked positions attended to by a constant fraction. Keys are kept in
float32 so the scores are float32, as in SDPA; the probabilities are rounded to the values' dtype for the
second matmul, as SDPA does.
"""

from __future__ import annotations

import torch

KV_CHUNK = 16  # buffers grow in multiples of this many positions


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _zeros(batch: int, kv_heads: int, capacity: int, head_dim: int, layers: int, dtype: torch.dtype):
    return [torch.zeros((batch, kv_heads, capacity, head_dim), dtype=dtype) for _ in range(layers)]


class KVBuffers:
    """Keys and values of every layer in ``[B, kv_heads, capacity, head_dim]`` buffers; positions below
    ``length`` are filled, the rest are zeros. Keys are float32 for ``attend``; the native kernels keep them
    in bf16 and transposed, ``[B, kv_heads, head_dim, capacity]`` (``transposed_keys``), so a query's scores
    are computed sixteen keys at a time without a reduction per key. Offers the two batch edits the engine
    makes: repeat each row n times (one prefill shared by a group) and keep a subset of rows (finished rows
    dropped)."""

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        length: int,
        head_dim: int,
        dtype: torch.dtype,
        key_dtype: torch.dtype = torch.float32,
        transposed_keys: bool = False,
    ):
        cap = _round_up(length + 1, KV_CHUNK)  # room for the first generated token
        self.transposed_keys = transposed_keys
        self.keys = _zeros(batch, kv_heads, cap, head_dim, layers, key_dtype)
        if transposed_keys:
            self.keys = [k.transpose(2, 3).contiguous() for k in self.keys]
        self.values = _zeros(batch, kv_heads, cap, head_dim, layers, dtype)
        self.length = 0

    @property
    def capacity(self) -> int:
        """Positions a row can hold before the buffers grow."""
        return self.values[0].shape[2]

    def store_prompt(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the first ``T`` positions' keys and values ``[B, kv_heads, T, head_dim]`` (prefill)."""
        t = keys.shape[2]
        if self.transposed_keys:
            self.keys[layer][..., :t] = keys.transpose(2, 3)
        else:
            self.keys[layer][:, :, :t] = keys
        self.values[layer][:, :, :t] = values

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` positions (growth amortised O(1) per token)."""
        have = self.capacity
        if capacity <= have:
            return
        new_cap = _round_up(max(capacity, have + have // 4), KV_CHUNK)
        n = self.length
        for i, old in enumerate(self.values):
            new = old.new_zeros((*old.shape[:2], new_cap, old.shape[-1]))
            new[:, :, :n] = old[:, :, :n]
            self.values[i] = new
        for i, old in enumerate(self.keys):
            if self.transposed_keys:
                new = old.new_zeros((*old.shape[:3], new_cap))
                new[..., :n] = old[..., :n]
            else:
                new = old.new_zeros((*old.shape[:2], new_cap, old.shape[-1]))
                new[:, :, :n] = old[:, :, :n]
            self.keys[i] = new

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the new position's keys and values ``[B, kv_heads, head_dim]`` (``reserve`` first; float32 keys:
        with transposed keys the native ``rope_write`` writes them)."""
        self.keys[layer][:, :, self.length] = keys
        self.values[layer][:, :, self.length] = values

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.keys = [k.repeat_interleave(repeats, dim=0) for k in self.keys]
        self.values = [v.repeat_interleave(repeats, dim=0) for v in self.values]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.keys = [k[indices] for k in self.keys]
        self.values = [v[indices] for v in self.values]

    def attention_bias(self, mask: torch.Tensor) -> torch.Tensor:
        """Float32 ``[B, 1, 1, capacity]``: 0 for the keys a row's next query may see (``mask`` [B, >= length + 1]
        marks real positions; the one being written counts), -inf for padding and unwritten positions."""
        t = self.length + 1
        bias = torch.full((mask.shape[0], self.capacity), float("-inf"))
        bias[:, :t].masked_fill_(mask[:, :t].bool(), 0.0)
        return bias[:, None, None, :]

    def attend(self, layer: int, q: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of one query position per row: ``q`` [B, kv_heads, g, d] (the g query heads sharing a
        key/value head as its rows), ``bias`` from ``attention_bias``; returns [B, kv_heads, g, d] in the
        values' dtype. (Float32 keys; the native ``attention`` kernel reads transposed ones.)"""
        values = self.values[layer]
        scores = torch.matmul(q.float() * scale, self.keys[layer].transpose(-1, -2))
        scores += bias
        return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)


class PromptSharedKV:
    """The native kernels' cache: each prompt's keys and values stored once and shared by the rows sampled
    from it (``row_prompt`` maps a row to its prompt), and each row's generated positions in its own
    ``KVBuffers`` (bf16, transposed keys). Repeating a prompt for a group copies nothing, and the attention
    kernel reads a group's prompt once for all its rows instead of once per row.

    ``prefix_keys`` [P, kv_heads, head_dim, T16] and ``prefix_values`` [P, kv_heads, T16, head_dim] per layer
    (T16: the prompt width rounded up to 16, zeros past it), ``prefix_bias`` [P, T] (0, or -inf on left
    padding); ``own.length`` counts the generated positions stored."""

    def __init__(self, layers: int, mask: torch.Tensor, kv_heads: int, head_dim: int, dtype: torch.dtype):
        """``mask`` [P, T]: 1 for the prompts' real tokens, 0 for their left padding."""
        prompts, width = mask.shape
        cap = _round_up(max(width, 1), KV_CHUNK)
        keys = _zeros(prompts, kv_heads, cap, head_dim, layers, dtype)
        self.prefix_keys = [k.transpose(2, 3).contiguous() for k in keys]
        self.prefix_values = _zeros(prompts, kv_heads, cap, head_dim, layers, dtype)
        self.prefix_bias = torch.zeros(mask.shape).masked_fill_(~mask.bool(), float("-inf"))
        self.row_prompt = torch.arange(prompts)
        self.own = KVBuffers(layers, prompts, kv_heads, 0, head_dim, dtype, dtype, transposed_keys=True)

    @property
    def capacity(self) -> int:
        """Positions a row can hold (its prompt's width included) before its own buffers grow."""
        return self.prefix_bias.shape[1] + self.own.capacity

    def store_prompt(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The prompts' keys and values ``[P, kv_heads, T, head_dim]`` (prefill)."""
        t = keys.shape[2]
        self.prefix_keys[layer][..., :t] = keys.transpose(2, 3)
        self.prefix_values[layer][:, :, :t] = values

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.row_prompt = self.row_prompt.repeat_interleave(repeats)
        self.own.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.row_prompt = self.row_prompt[indices]
        self.own.batch_select_indices(indices)
