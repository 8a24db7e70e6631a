"""A KV cache written into preallocated buffers.

transformers' ``DynamicCache`` appends each decoded token with ``torch.cat``, which copies the whole cache of
every layer at every step: O(T) bytes per token, O(T^2) per completion. Here each layer writes the new key and
value into a buffer and hands attention views of the filled part, so a step copies only the new token. A full
buffer doubles (amortised O(1) per token), so memory follows the length actually reached rather than
max_new_tokens. Attention reads exactly the same keys and values as with the dynamic cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in ``[B, heads, capacity, head_dim]`` buffers; ``length`` of them are filled."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        super().__init__()
        b, h, t, d = keys.shape
        self.dtype, self.device = keys.dtype, keys.device
        self.key_buf = keys.new_empty((b, h, capacity, d))
        self.value_buf = values.new_empty((b, values.shape[1], capacity, values.shape[-1]))
        self.key_buf[:, :, :t] = keys
        self.value_buf[:, :, :t] = values
        self.length = t
        self.is_initialized = True
        self._expose()

    def _expose(self) -> None:
        # Views, not copies: anything that reads ``keys``/``values`` sees the filled part only.
        self.keys = self.key_buf[:, :, : self.length]
        self.values = self.value_buf[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self.key_buf.shape[2]:
            self._grow(max(end, 2 * self.key_buf.shape[2]))
        self.key_buf[:, :, self.length : end] = key_states
        self.value_buf[:, :, self.length : end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def _grow(self, capacity: int) -> None:
        for name in ("key_buf", "value_buf"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], capacity, old.shape[-1]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self.length

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.key_buf = self.key_buf.repeat_interleave(repeats, dim=0)
        self.value_buf = self.value_buf.repeat_interleave(repeats, dim=0)
        self._expose()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.key_buf = self.key_buf[indices]
        self.value_buf = self.value_buf[indices]
        self._expose()


def preallocate(cache: DynamicCache, capacity: int) -> DynamicCache:
    """Move a filled dynamic cache (e.g. after prefill) into buffers that first hold ``capacity`` positions.

    Only plain full-attention layers move: a sliding-window layer (Gemma 3's local layers) keeps just its last
    window of positions and the mask is built from its own bookkeeping, so it stays as transformers made it."""
    cache.layers = [
        PreallocatedLayer(layer.keys, layer.values, capacity) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache
