"""Decode attention of the fused path's KV buffers (polyrl/engines/decode_kv.py) against SDPA over each row's
keys: the same output within float rounding, through a group's shared prefill, buffer growth and dropped rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyrl.engines import decode_kv
from polyrl.engines.decode_kv import KVBuffers

KVH, G, D = 2, 3, 8  # key/value heads, query heads per key/value head, head dim


def reference(q, keys, values, visible) -> torch.Tensor:
    """SDPA over each row's full key list ([B, kvh, T, d]); ``visible`` [B, T] bool."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None, None, :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_sdpa_through_groups_growth_and_dropped_rows(monkeypatch, dtype):
    monkeypatch.setattr(decode_kv, "KV_CHUNK", 2)  # growth happens within the few steps below
    gen = torch.Generator().manual_seed(0)
    prompts, group, width = 3, 4, 5
    prompt_k = torch.randn(prompts, KVH, width, D, generator=gen).to(dtype)
    prompt_v = torch.randn(prompts, KVH, width, D, generator=gen).to(dtype)
    prompt_mask = torch.ones(prompts, width, dtype=torch.bool)
    prompt_mask[0, :2] = False  # left padding of a shorter prompt

    kv = KVBuffers(1, prompts, KVH, width, D, dtype)
    kv.keys[0][:, :, :width] = prompt_k
    kv.values[0][:, :, :width] = prompt_v
    kv.length = width
    kv.batch_repeat_interleave(group)

    rows = torch.arange(prompts * group)  # which sample each live row is
    full_k = prompt_k.repeat_interleave(group, 0)
    full_v = prompt_v.repeat_interleave(group, 0)
    mask = torch.cat([prompt_mask.repeat_interleave(group, 0), torch.ones(prompts * group, 8, dtype=torch.bool)], 1)
    for step in range(6):
        if step == 2:  # drop rows unevenly: one prompt loses all its samples, another one
            keep = torch.tensor([i for i, r in enumerate(rows.tolist()) if r // group != 1 and r != 9])
            kv.batch_select_indices(keep)
            rows, full_k, full_v, mask = rows[keep], full_k[keep], full_v[keep], mask[keep]
        b = len(rows)
        new_k = torch.randn(b, KVH, D, generator=gen).to(dtype)
        new_v = torch.randn(b, KVH, D, generator=gen).to(dtype)
        q = torch.randn(b, KVH, G, D, generator=gen).to(dtype)
        kv.reserve(kv.length + 1)
        bias = kv.attention_bias(mask)
        kv.write(0, new_k, new_v)
        out = kv.attend(0, q, bias, D**-0.5)
        full_k = torch.cat([full_k, new_k[:, :, None]], 2)
        full_v = torch.cat([full_v, new_v[:, :, None]], 2)
        kv.length += 1
        expected = reference(q.float(), full_k.float(), full_v.float(), mask[:, : kv.length])
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the probabilities are rounded before P @ V
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=0)
    assert kv.capacity > width + 2  # the buffers grew


def test_rows_without_shared_prefix_attend_over_their_own_buffer():
    gen = torch.Generator().manual_seed(1)
    kv = KVBuffers(1, 2, KVH, 3, D, torch.float32)
    keys, values = torch.randn(2, KVH, 3, D, generator=gen), torch.randn(2, KVH, 3, D, generator=gen)
    kv.keys[0][:, :, :3], kv.values[0][:, :, :3] = keys, values
    kv.length = 3
    mask = torch.ones(2, 4, dtype=torch.bool)
    q = torch.randn(2, KVH, G, D, generator=gen)
    new_k, new_v = torch.randn(2, KVH, D, generator=gen), torch.randn(2, KVH, D, generator=gen)
    bias = kv.attention_bias(mask)
    kv.write(0, new_k, new_v)
    out = kv.attend(0, q, bias, D**-0.5)
    full_k = torch.cat([keys, new_k[:, :, None]], 2)
    full_v = torch.cat([values, new_v[:, :, None]], 2)
    torch.testing.assert_close(out, reference(q, full_k, full_v, mask), atol=1e-5, rtol=0)
