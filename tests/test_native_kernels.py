"""The fused decode path's C++ kernels (polyrl/engines/native) against the torch operations they replace.

Each kernel rounds to bf16 where the torch operations do, so outputs agree to the last bit except where a
float32 sum taken in another order lands on the other side of a bf16 rounding boundary: at most one bf16
step, on a small fraction of entries. Shapes cover the vectorised paths (SmolLM2's head_dim 64, widths that are
multiples of 16) and the scalar ones (head_dim 8, odd widths). Then the decoder as a whole, native against its
torch path, teacher-forced through buffer growth and dropped rows.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from polyrl.engines import decode_kv, native
from polyrl.engines.decode_kv import KVBuffers
from polyrl.engines.llama_decode import LlamaDecoder, rms_norm, rotate_half

if os.environ.get("POLYRL_NATIVE") == "0":
    pytest.skip("native kernels switched off (POLYRL_NATIVE=0)", allow_module_level=True)


@pytest.fixture(scope="module")
def ops():
    # Not a skip: on a machine with a C++ compiler (every CI machine) a build failure must fail the suite.
    assert native.available(), "the native kernels did not build (see the warning logged above)"
    return native.ops()


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, max_mismatch: float = 0.01) -> None:
    """Equal but for at most one bf16 step (relative 2^-7) on at most ``max_mismatch`` of the entries. An entry
    near zero is the difference of larger terms, so summing them in another order (another vector width: AVX2
    against AVX-512) may move it by a rounding of those terms: a floor of 2^-16 of the largest entry allows
    that, far below any real error."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    g, w = got.float(), want.float()
    bound = w.abs() * 2**-7 + w.abs().max() * 2**-16
    off = (g - w).abs() > bound
    assert not off.any(), f"got {g[off][:4].tolist()}, want {w[off][:4].tolist()}"
    assert (got != want).float().mean() <= max_mismatch


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("rows,width", [(16, 576), (5, 40), (3, 7)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(ops, rows, width, with_delta):
    x, delta, weight = randn(rows, width, seed=1) * 3, randn(rows, width, seed=2), randn(width, seed=3)
    want_x = x + delta if with_delta else x
    want = rms_norm(want_x, weight, 1e-5)
    got_x = x.clone()
    got = ops.add_rms_norm(got_x, delta if with_delta else None, weight, 1e-5)
    assert torch.equal(got_x, want_x)  # the residual stream is updated in place, exactly
    assert_bf16_close(got, want)


@pytest.mark.parametrize("rows,heads,kv_heads,head_dim", [(16, 9, 3, 64), (5, 4, 2, 8), (3, 2, 1, 24)])
def test_rope_write_matches_torch(ops, rows, heads, kv_heads, head_dim):
    d, cap, position = head_dim, 32, 13
    qkv = randn(rows, (heads + 2 * kv_heads) * d, seed=4)
    cos, sin = randn(rows, 1, d, seed=5), randn(rows, 1, d, seed=6)
    qk = qkv[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d)
    rotated = qk * cos + rotate_half(qk) * sin
    kv = KVBuffers(1, rows, kv_heads, cap - 1, d, torch.bfloat16, torch.bfloat16, transposed_keys=True)
    got = qkv.clone()
    ops.rope_write(got, cos, sin, kv.keys[0], kv.values[0], position, heads, kv_heads)
    assert torch.equal(got[:, : heads * d].view(rows, heads, d), rotated[:, :heads])
    assert torch.equal(got[:, heads * d :], qkv[:, heads * d :])  # keys and values are not rotated in place
    assert torch.equal(kv.keys[0][..., position], rotated[:, heads:])
    assert torch.equal(kv.values[0][:, :, position], qkv[:, (heads + kv_heads) * d :].view(rows, kv_heads, d))
    others = torch.ones(cap, dtype=torch.bool)
    others[position] = False
    assert not kv.keys[0][..., others].any() and not kv.values[0][:, :, others].any()


@pytest.mark.parametrize(
    "rows,heads,kv_heads,head_dim,length",
    [(16, 9, 3, 64, 40), (7, 6, 2, 64, 64), (5, 4, 2, 8, 19), (3, 2, 2, 48, 5), (4, 8, 1, 128, 33)],
)
def test_decode_attention_matches_the_torch_attention(ops, rows, heads, kv_heads, head_dim, length):
    d = head_dim
    reference = KVBuffers(1, rows, kv_heads, length - 1, d, torch.bfloat16)  # float32 keys, matmul attention
    fused = KVBuffers(1, rows, kv_heads, length - 1, d, torch.bfloat16, torch.bfloat16, transposed_keys=True)
    keys, values = randn(rows, kv_heads, length, d, seed=7), randn(rows, kv_heads, length, d, seed=8)
    for kv in (reference, fused):
        kv.store_prompt(0, keys, values)
        kv.length = length - 1  # the query sees every stored position, its own (the last) included
    q = randn(rows, heads * d, seed=9)
    qkv = torch.cat([q, randn(rows, 2 * kv_heads * d, seed=10)], 1)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[: rows // 2, : length // 3] = 0  # left padding on some rows
    want = reference.attend(0, q.view(rows, kv_heads, heads // kv_heads, d), reference.attention_bias(mask), d**-0.5)
    bias = fused.attention_bias(mask).view(rows, -1)
    got = ops.attention(qkv, None, None, None, None, fused.keys[0], fused.values[0], bias, length, d**-0.5, heads,
                        kv_heads)
    assert_bf16_close(got, want.reshape(rows, heads * d))


@pytest.mark.parametrize("head_dim,prompt_len,own", [(64, 21, 7), (64, 32, 1), (8, 5, 18), (64, 3, 0)])
def test_attention_over_a_shared_prompt_equals_attention_over_copies(ops, head_dim, prompt_len, own):
    """Each prompt stored once and read by its group's rows gives what the rows' own copies of it give."""
    prompts, group, heads, kv_heads, d = 3, 4, 6, 2, head_dim
    rows = prompts * group
    mask = torch.ones(prompts, prompt_len, dtype=torch.long)
    mask[1, : prompt_len // 2] = 0  # one left-padded prompt
    shared = decode_kv.PromptSharedKV(1, mask, kv_heads, d, torch.bfloat16)
    pk, pv = randn(prompts, kv_heads, prompt_len, d, seed=20), randn(prompts, kv_heads, prompt_len, d, seed=21)
    shared.store_prompt(0, pk, pv)
    shared.batch_repeat_interleave(group)
    shared.own.reserve(own + 1)
    ok, ov = randn(rows, kv_heads, own + 1, d, seed=22), randn(rows, kv_heads, own + 1, d, seed=23)
    shared.own.store_prompt(0, ok, ov)
    keep = torch.tensor([0, 2, 3, 5, 9, 11])  # rows leave unevenly
    shared.batch_select_indices(keep)
    copies = KVBuffers(1, len(keep), kv_heads, prompt_len + own, d, torch.bfloat16)  # float32 keys, torch attention
    copies.store_prompt(
        0, torch.cat([pk[shared.row_prompt], ok[keep]], 2), torch.cat([pv[shared.row_prompt], ov[keep]], 2)
    )
    copies.length = prompt_len + own
    full_mask = torch.cat([mask[shared.row_prompt], torch.ones(len(keep), own + 1, dtype=torch.long)], 1)
    q = randn(len(keep), heads * d, seed=24)
    want = copies.attend(0, q.view(-1, kv_heads, heads // kv_heads, d), copies.attention_bias(full_mask), d**-0.5)
    got = ops.attention(q, shared.prefix_keys[0], shared.prefix_values[0], shared.prefix_bias, shared.row_prompt,
                        shared.own.keys[0], shared.own.values[0], None, own + 1, d**-0.5, heads, kv_heads)
    assert_bf16_close(got, want.reshape(len(keep), heads * d))


@pytest.mark.parametrize("rows,inner", [(16, 1536), (3, 40), (2, 9)])
def test_silu_mul_matches_torch(ops, rows, inner):
    gate_up = randn(rows, 2 * inner, seed=11) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert_bf16_close(ops.silu_mul(gate_up), F.silu(gate) * up)


def small_llama(head_dim: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=500, hidden_size=3 * head_dim, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=3, num_key_value_heads=1, head_dim=head_dim, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 8])
def test_native_decoder_tracks_the_torch_decoder(ops, monkeypatch, head_dim):
    """Teacher-forced decoding of two prompts sampled twice each, with buffers that grow and rows that leave:
    the native decoder's logits stay within bf16 rounding of the torch path's, as close to the float32 model
    as the torch path is."""
    monkeypatch.setattr(decode_kv, "KV_CHUNK", 4)  # growth during the run
    model = small_llama(head_dim)
    head = model.get_output_embeddings().weight.detach().clone()
    prompts = torch.randint(3, 500, (2, 6), generator=torch.Generator().manual_seed(1))
    cont = torch.randint(3, 500, (4, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0  # one left-padded prompt
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    full_mask = torch.cat([mask.repeat_interleave(2, 0), torch.ones_like(cont)], 1)
    outputs = {}
    for use_native in (False, True):
        dec = LlamaDecoder(model, head, torch.bfloat16, native_kernels=use_native)
        assert dec.native is use_native
        _, kv = dec.prefill(prompts, mask, positions)
        kv.batch_repeat_interleave(2)  # rows 0, 1 sample prompt 0; rows 2, 3 prompt 1
        rows, steps = torch.arange(4), []
        start = positions[:, -1].repeat_interleave(2) + 1
        for j in range(cont.shape[1]):
            if j == 7:  # rows 1 and 2 finish: the cache keeps rows 0 and 3
                rows = torch.tensor([0, 3])
                kv.batch_select_indices(rows)
            logits = dec.decode(cont[rows, j], full_mask[rows], start[rows] + j, kv)
            steps.append(logits if len(rows) == 4 else torch.zeros(4, logits.shape[1]).index_copy(0, rows, logits))
        assert (kv.own if use_native else kv).capacity > 4 + (0 if use_native else prompts.shape[1])  # it grew
        outputs[use_native] = torch.stack(steps, 1)
    with torch.no_grad():
        ref = model(input_ids=torch.cat([prompts.repeat_interleave(2, 0), cont], 1), attention_mask=full_mask,
                    position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits.float()[:, prompts.shape[1] :]
    alive = torch.ones(4, cont.shape[1], dtype=torch.bool)
    alive[[1, 2], 7:] = False
    torch_path, native_path, ref = outputs[False][alive], outputs[True][alive], ref[alive]
    assert (native_path - torch_path).abs().max() < 0.05
    assert (native_path - ref).abs().max() < 2 * (torch_path - ref).abs().max() + 0.01


def test_a_failed_build_keeps_the_torch_path(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(**_):
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(native, "_state", {})  # forget the build of this process
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    assert not native.available()
    assert "native decode kernels unavailable" in caplog.text and "c++: command not found" in caplog.text
    model = small_llama(8)
    dec = LlamaDecoder(model, model.get_output_embeddings().weight.detach().clone(), torch.bfloat16)
    assert not dec.native


@pytest.mark.parametrize("vocab,width", [(49152, 64), (300, 40)])  # blocked search / whole-row search
def test_rescore_head_recomputes_a_top_k_in_float32(ops, vocab, width):
    rows, k = 6, 32
    head = torch.randn(vocab, width, generator=torch.Generator().manual_seed(12))
    hidden = randn(rows, width, seed=13)
    low = (hidden.float() @ head.T).to(torch.bfloat16)  # what the bf16 head gives, to bf16 rounding
    got = ops.rescore_head(low, hidden, head, k)
    exact = hidden.float() @ head.T
    rescored = got != low.float()
    assert (rescored.sum(-1) == k).all()
    assert torch.allclose(got[rescored], exact[rescored], rtol=1e-5, atol=1e-5)
    # The rescored entries are a top k of the bf16 logits (ties at the k-th value may go either way).
    kth = low.float().topk(k, dim=-1).values[:, -1:]
    assert (low.float()[rescored].view(rows, k) >= kth).all()
    assert torch.equal(got[~rescored], low.float()[~rescored])


@pytest.mark.parametrize("vocab,temperature", [(49152, 1.0), (1000, 0.7)])  # 1000: a partial last block
def test_native_sampler_matches_the_torch_sampler(ops, vocab, temperature):
    from polyrl.engines.hf import sample_tokens

    rows = 256
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(14)) * 3
    logits[:, ::5] = float("-inf")  # entries without weight are never chosen
    logits[:, -7:] = float("-inf")  # nor past the last weighted one, even at u close to 1
    draws = {}
    for native_kernel in (False, True):
        gen = torch.Generator().manual_seed(15)
        draws[native_kernel] = sample_tokens(logits, temperature, 1.0, gen, native_kernel=native_kernel)
    (want, want_lp), (got, got_lp) = draws[False], draws[True]
    # Float sums in another order can move a draw across a boundary only when u lands within rounding of it.
    same = got == want
    assert same.float().mean() > 0.98
    assert torch.allclose(got_lp[same], want_lp[same], atol=1e-4)
    assert torch.isfinite(logits.gather(1, got[:, None])).all()
    logp = torch.log_softmax(logits / temperature, -1).gather(1, got[:, None]).squeeze(-1)
    assert torch.allclose(got_lp, logp, atol=1e-4)  # the reported log-prob is the chosen token's
    edge = ops.sample_inverse_cdf(logits[:2].contiguous(), torch.tensor([0.0, 1.0 - 1e-7]), temperature)[0]
    assert edge[0] == 1 and edge[1] == torch.isfinite(logits[1]).nonzero().max()


def test_native_sampler_follows_the_softmax(ops):
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(16)) * 2
    gen = torch.Generator().manual_seed(17)
    n = 20000
    u = torch.rand(n, generator=gen)
    draws = ops.sample_inverse_cdf(logits.expand(n, -1).contiguous(), u, 1.0)[0]
    freq = torch.bincount(draws, minlength=12).float() / n
    # Binomial standard error at n=20000 is at most 0.0036; 5 sigma.
    assert (freq - torch.softmax(logits[0], -1)).abs().max() < 0.018
