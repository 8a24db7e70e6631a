"""The native kernels' float32 path (polyrl/engines/native: f32_kernels.cpp, linear_kernel.cpp, the sampler)
against torch in float32, and the fused decoder and engine that run on it.

Tolerance: each kernel computes what the torch operations compute, in float32, with sums taken in another
order (vector lanes, then a reduction). Elementwise kernels agree to a few float32 roundings (relative 1e-6,
checked at 1e-5); kernels that sum n terms (the norm's statistics, attention, the matmul) agree to about
n * 2^-24 of the terms' magnitude, checked against a float64 reference at 1e-5 of the sum of the terms'
magnitudes (the bound no float32 summation order exceeds for these sizes).

The kernels are built for whatever ``ATEN_CPU_CAPABILITY`` says (AVX-512, AVX2 or the portable loops; the
module's first test names it): run this file under each cap to test each build. A build under each cap, in a
process of its own: tests/test_native_capped_builds.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from test_llama_decode import qwen2_with_bias

from polyrl.engines import native
from polyrl.engines.decode_kv import KVBuffers, PromptSharedKV
from polyrl.engines.hf import HFEngine
from polyrl.engines.llama_decode import LlamaDecoder
from polyrl.models.loading import load_model, load_tokenizer

if os.environ.get("POLYRL_NATIVE") == "0":
    pytest.skip("native kernels switched off (POLYRL_NATIVE=0)", allow_module_level=True)

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]  # unequal lengths: left padding is exercised


@pytest.fixture(scope="module")
def ops():
    # Not a skip: on a machine with a C++ compiler (every CI machine) a build failure must fail the suite.
    assert native.available(), "the native kernels did not build (see the warning logged above)"
    return native.ops()


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def assert_sum_close(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    """``got`` (float32) within 1e-5 of ``magnitude`` (the sum of the absolute terms of each entry) of the
    float64 ``want``."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs()
    bound = 1e-5 * magnitude + 1e-30
    assert (err <= bound).all(), f"worst error {(err / bound).max():.2f}x the bound"


def test_the_build_names_its_instruction_set(ops):
    want = {"avx2": "avx2", "default": "portable"}.get(native.isa_cap())
    assert ops.isa() in ("avx512", "avx2", "portable")
    if want:
        assert ops.isa() == want


@pytest.mark.parametrize("rows,inputs,outputs", [(16, 576, [960]), (5, 40, [7, 13]), (3, 13, [4, 3, 5]),
                                                  (70, 64, [50])])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_a_float64_matmul(ops, rows, inputs, outputs, weight_dtype, with_bias):
    """Row and output counts off the kernel's tile sizes, widths off its vector width, several matrices whose
    outputs are concatenated, bf16 weights widened exactly, more rows than one block."""
    x = randn(rows, inputs, seed=1)
    weights = [randn(o, inputs, seed=2 + i).to(weight_dtype) for i, o in enumerate(outputs)]
    bias = randn(sum(outputs), seed=9) if with_bias else None
    got = ops.linear(x, weights, bias)
    w = torch.cat(weights).double()
    want = F.linear(x.double(), w, None if bias is None else bias.double())
    magnitude = x.double().abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    assert_sum_close(got, want, magnitude)


def test_linear_reads_strided_rows_and_rejects_bad_input(ops):
    x = randn(6, 48, seed=3)
    wide = randn(10, 64, seed=4)
    w = wide[:, :48]  # rows 64 apart
    assert torch.allclose(ops.linear(x, [w], None), x @ w.T, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear(x.double(), [w], None)
    with pytest.raises(RuntimeError, match="\\[O, I\\]"):
        ops.linear(x, [randn(4, 47)], None)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.linear(x, [w.contiguous(), w.to(torch.bfloat16)], None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear(x, [w.contiguous()], randn(3))


@pytest.mark.parametrize("rows,width", [(16, 576), (5, 40), (3, 7)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(ops, rows, width, with_delta):
    x, delta, weight = randn(rows, width, seed=1) * 3, randn(rows, width, seed=2), randn(width, seed=3)
    want_x = x + delta if with_delta else x
    want = weight.double() * F.rms_norm(want_x.double(), (width,), eps=1e-5)
    got_x = x.clone()
    got = ops.add_rms_norm(got_x, delta if with_delta else None, weight, 1e-5)
    assert torch.equal(got_x, want_x)  # the residual stream is updated in place, exactly
    # Elementwise after one sum of squares (relative error ~ width * 2^-24 of a positive sum).
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,heads,kv_heads,head_dim", [(16, 9, 3, 64), (5, 4, 2, 8), (3, 2, 1, 24)])
def test_rope_write_matches_torch(ops, rows, heads, kv_heads, head_dim):
    d, cap, position = head_dim, 32, 13
    qkv = randn(rows, (heads + 2 * kv_heads) * d, seed=4)
    cos, sin = randn(rows, 1, d, seed=5), randn(rows, 1, d, seed=6)
    qk = qkv[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d)
    half = d // 2
    rotated = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin
    kv = KVBuffers(1, rows, kv_heads, cap - 1, d, torch.float32, torch.float32, transposed_keys=True)
    got = qkv.clone()
    ops.rope_write(got, cos, sin, kv.keys[0], kv.values[0], position, heads, kv_heads)
    # x cos + rot sin: two products and a sum, each rounded once (a fused multiply-add rounds one less).
    assert torch.allclose(got[:, : heads * d].view(rows, heads, d), rotated[:, :heads], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[:, heads * d :], qkv[:, heads * d :])  # keys and values are not rotated in place
    assert torch.allclose(kv.keys[0][..., position], rotated[:, heads:], rtol=1e-5, atol=1e-6)
    assert torch.equal(kv.values[0][:, :, position], qkv[:, (heads + kv_heads) * d :].view(rows, kv_heads, d))
    others = torch.ones(cap, dtype=torch.bool)
    others[position] = False
    assert not kv.keys[0][..., others].any() and not kv.values[0][:, :, others].any()


@pytest.mark.parametrize("rows,inner", [(16, 1536), (3, 40), (2, 9)])
def test_silu_mul_matches_torch(ops, rows, inner):
    gate_up = randn(rows, 2 * inner, seed=11) * 4
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert torch.allclose(ops.silu_mul(gate_up).double(), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def attention_reference(q, keys, values, bias, scale):
    """Float64 attention of one query per row: q [B, kvh, g, d], keys/values [B, kvh, T, d], bias [B, T]; also
    the magnitude of each output's sum (for the tolerance)."""
    scores = (q.double() * scale) @ keys.double().transpose(-1, -2) + bias.double()[:, None, None, :]
    p = torch.softmax(scores, -1)
    return p @ values.double(), p @ values.double().abs()


@pytest.mark.parametrize(
    "rows,heads,kv_heads,head_dim,length",
    [(16, 9, 3, 64, 40), (7, 6, 2, 64, 64), (5, 4, 2, 8, 19), (3, 2, 2, 48, 5), (4, 8, 1, 128, 33), (2, 3, 3, 12, 9)],
)
def test_attention_matches_float64(ops, rows, heads, kv_heads, head_dim, length):
    d, g = head_dim, heads // kv_heads
    kv = KVBuffers(1, rows, kv_heads, length - 1, d, torch.float32, torch.float32, transposed_keys=True)
    keys, values = randn(rows, kv_heads, length, d, seed=7), randn(rows, kv_heads, length, d, seed=8)
    kv.store_prompt(0, keys, values)
    q = randn(rows, heads * d, seed=9)
    qkv = torch.cat([q, randn(rows, 2 * kv_heads * d, seed=10)], 1)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[: rows // 2, : length // 3] = 0  # left padding on some rows
    kv.length = length - 1
    bias = kv.attention_bias(mask).view(rows, -1)
    got = ops.attention(qkv, None, None, None, None, kv.keys[0], kv.values[0], bias, length, d**-0.5, heads, kv_heads)
    want, magnitude = attention_reference(q.view(rows, kv_heads, g, d), keys, values, bias[:, :length], d**-0.5)
    assert_sum_close(got, want.reshape(rows, -1), magnitude.reshape(rows, -1) + want.abs().reshape(rows, -1))


@pytest.mark.parametrize("head_dim,prompt_len,own", [(64, 21, 7), (64, 32, 1), (8, 5, 18), (64, 3, 0)])
def test_attention_over_a_shared_prompt_equals_attention_over_copies(ops, head_dim, prompt_len, own):
    prompts, group, heads, kv_heads, d = 3, 4, 6, 2, head_dim
    rows = prompts * group
    mask = torch.ones(prompts, prompt_len, dtype=torch.long)
    mask[1, : prompt_len // 2] = 0  # one left-padded prompt
    shared = PromptSharedKV(1, mask, kv_heads, d, torch.float32)
    pk, pv = randn(prompts, kv_heads, prompt_len, d, seed=20), randn(prompts, kv_heads, prompt_len, d, seed=21)
    shared.store_prompt(0, pk, pv)
    shared.batch_repeat_interleave(group)
    shared.own.reserve(own + 1)
    ok, ov = randn(rows, kv_heads, own + 1, d, seed=22), randn(rows, kv_heads, own + 1, d, seed=23)
    shared.own.store_prompt(0, ok, ov)
    keep = torch.tensor([0, 2, 3, 5, 9, 11])  # rows leave unevenly
    shared.batch_select_indices(keep)
    q = randn(len(keep), heads * d, seed=24)
    got = ops.attention(q, shared.prefix_keys[0], shared.prefix_values[0], shared.prefix_bias, shared.row_prompt,
                        shared.own.keys[0], shared.own.values[0], None, own + 1, d**-0.5, heads, kv_heads)
    rp = shared.row_prompt
    keys, values = torch.cat([pk[rp], ok[keep]], 2), torch.cat([pv[rp], ov[keep]], 2)
    bias = torch.cat([shared.prefix_bias[rp], torch.zeros(len(keep), own + 1)], 1)
    want, magnitude = attention_reference(q.view(-1, kv_heads, heads // kv_heads, d), keys, values, bias, d**-0.5)
    assert_sum_close(got, want.reshape(len(keep), -1), (magnitude + want.abs()).reshape(len(keep), -1))


@pytest.mark.parametrize("vocab,temperature", [(49152, 1.0), (1000, 0.7)])
def test_the_sampler_of_this_build_matches_the_torch_sampler(ops, vocab, temperature):
    from polyrl.engines.hf import sample_tokens

    logits = randn(64, vocab, seed=14) * 3
    logits[:, ::5] = float("-inf")  # entries without weight are never chosen
    draws = {}
    for native_kernel in (False, True):
        gen = torch.Generator().manual_seed(15)
        draws[native_kernel] = sample_tokens(logits, temperature, 1.0, gen, native_kernel=native_kernel)
    (want, _), (got, got_lp) = draws[False], draws[True]
    same = got == want  # a draw within rounding of a boundary may go the other way
    assert same.float().mean() > 0.95
    assert torch.isfinite(logits.gather(1, got[:, None])).all()
    logp = torch.log_softmax(logits / temperature, -1).gather(1, got[:, None]).squeeze(-1)
    assert torch.allclose(got_lp, logp, atol=1e-4)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", None, seed=0)


def test_the_float32_engine_decodes_on_the_policy_weights_in_place(ops, tiny):
    engine = HFEngine(tiny, load_tokenizer("tiny-random"), bf16=False, bf16_weights=False)
    assert engine.fast is not None and engine.fast.native and engine.fast.shares_weights
    q = tiny.get_decoder().layers[0].self_attn.q_proj.weight
    assert engine.fast.layers[0].qkv[0].data_ptr() == q.data_ptr()
    assert engine.head_weight.data_ptr() == tiny.get_output_embeddings().weight.data_ptr()
    params = sum(p.numel() * p.element_size() for p in tiny.parameters())
    assert engine.fast.nbytes() < params / 20  # the norms' copies only
    # A bf16 engine keeps its own copy, as before.
    assert HFEngine(tiny, load_tokenizer("tiny-random"), bf16=True, bf16_weights=True).fast.nbytes() > params / 4


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_float32_engine_generates_what_the_transformers_engine_generates(ops, tiny, temperature):
    """Group sharing, rows that finish and are dropped, a stop predicate: the same tokens as the engine on the
    transformers model, log-probs and entropies to float32 rounding."""
    tok = load_tokenizer("tiny-random")
    fast = HFEngine(tiny, tok, bf16=False, bf16_weights=False)
    ref = HFEngine(tiny, tok, bf16=False, bf16_weights=False, fast_decode=False)
    assert fast.fast is not None and ref.fast is None
    fast.stop_ids = ref.stop_ids = set(range(0, len(tok), 40))

    def stop(rows, tokens, logprobs, entropies):
        return [t % 97 == 0 for t in tokens]

    a = fast.generate(PROMPTS, n=4, max_new_tokens=20, temperature=temperature, seed=3, stop=stop, entropy=True)
    b = ref.generate(PROMPTS, n=4, max_new_tokens=20, temperature=temperature, seed=3, stop=stop, entropy=True)
    lengths = set()
    for x, y in zip(sum(a, []), sum(b, []), strict=True):
        assert (x.token_ids, x.finished, x.stopped) == (y.token_ids, y.finished, y.stopped)
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)
        assert torch.allclose(torch.tensor(x.entropies), torch.tensor(y.entropies), atol=1e-4)
        lengths.add(len(x.token_ids))
    if temperature:
        assert len(lengths) > 1, "no row ended early: the row-dropping path was not exercised"


@pytest.mark.slow
def test_the_float32_engine_sees_updates_without_a_copy(ops):
    tok = load_tokenizer("tiny-random")
    policy = load_model("tiny-random", None, seed=0)
    engine = HFEngine(policy, tok, bf16=False, bf16_weights=False)
    before = engine.generate(PROMPTS, n=2, max_new_tokens=8, temperature=0.0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # in place, as the optimizer steps
    engine.release_memory()
    engine.sync()
    after = engine.generate(PROMPTS, n=2, max_new_tokens=8, temperature=0.0)
    ref = HFEngine(policy, tok, bf16=False, bf16_weights=False, fast_decode=False)
    want = ref.generate(PROMPTS, n=2, max_new_tokens=8, temperature=0.0)
    assert [c.token_ids for g in after for c in g] == [c.token_ids for g in want for c in g]
    assert [c.token_ids for g in after for c in g] != [c.token_ids for g in before for c in g]


def prefill_and_decode_against_the_model(dec: LlamaDecoder, model, ids: torch.Tensor, mask: torch.Tensor,
                                         next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's logits for a prefill of ``ids`` and one decode step of ``next_ids``, [B, 2, V], and the
    transformers model's logits at those two positions of the whole sequence."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    first, kv = dec.prefill(ids, mask, positions)
    full_mask = torch.cat([mask, torch.ones(len(ids), 1, dtype=torch.long)], 1)
    second = dec.decode(next_ids, full_mask, positions[:, -1] + 1, kv)
    with torch.no_grad():
        full = torch.cat([ids, next_ids[:, None]], 1)
        want = model(input_ids=full, attention_mask=full_mask,
                     position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits.float()[:, -2:]
    return torch.stack([first, second], 1), want


def test_bf16_weights_widened_stay_within_bf16_rounding_of_the_float32_model(ops, tiny):
    """A bf16 copy of the matrices read by the float32 kernels: logits within the bf16 weights' rounding of the
    transformers model (as the bf16 path), the head's 32 largest per row recomputed exactly in float32."""
    head = tiny.get_output_embeddings().weight.detach()
    dec = LlamaDecoder(tiny, head, torch.float32, weight_dtype=torch.bfloat16)
    assert dec.native and not dec.shares_weights and dec.head_low.dtype == torch.bfloat16
    assert dec.layers[0].qkv.dtype == torch.bfloat16
    ids = torch.tensor([[2, 2, 1, 2, 3], [4, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    got, want = prefill_and_decode_against_the_model(dec, tiny, ids, mask, torch.tensor([9, 10]))
    err = (got - want).abs().max()
    assert 1e-6 < err < 0.05  # the weights were rounded to bf16, and the logits (magnitude ~1) moved by that only
    hidden = randn(4, head.shape[1], seed=30)
    logits = dec._logits(hidden)
    exact = hidden @ head.T
    top = exact.topk(dec.exact_top, dim=-1).indices[:, :8]  # well inside the rescored set
    assert torch.allclose(logits.gather(1, top), exact.gather(1, top), atol=1e-5)
    assert (logits - exact).abs().max() < 0.05


@pytest.mark.parametrize("weight_dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
def test_an_untied_head_and_qkv_biases_on_the_float32_kernels(ops, weight_dtype, tolerance):
    """Qwen2: q/k/v biases, a head of its own and an embedding table of its own (shared in float32, a bf16 copy
    with bf16 weights)."""
    model = qwen2_with_bias()
    dec = LlamaDecoder(model, model.get_output_embeddings().weight.detach(), torch.float32, weight_dtype=weight_dtype)
    assert dec.native and dec.embed.dtype == weight_dtype
    assert (dec.embed.data_ptr() == model.get_input_embeddings().weight.data_ptr()) == dec.shares_weights
    ids, mask = torch.tensor([[2, 2, 11, 12, 13], [14, 15, 16, 17, 18]]), torch.tensor([[0, 0, 1, 1, 1], [1] * 5])
    got, want = prefill_and_decode_against_the_model(dec, model, ids, mask, torch.tensor([19, 20]))
    assert (got - want).abs().max() < tolerance


def test_bf16_weights_without_native_bf16_take_the_widened_path(ops, tiny, monkeypatch):
    from polyrl.engines import llama_decode

    tok = load_tokenizer("tiny-random")
    assert HFEngine(tiny, tok, bf16=False, bf16_weights=True).fast.dtype == (
        torch.bfloat16 if llama_decode.computes_bf16() else torch.float32)
    monkeypatch.setattr(llama_decode, "computes_bf16", lambda: False)  # an AVX2 CPU
    engine = HFEngine(tiny, tok, bf16=False, bf16_weights=True)
    assert engine.fast.dtype == torch.float32 and engine.fast.weight_dtype == torch.bfloat16
    assert engine.head_weight.data_ptr() != tiny.get_output_embeddings().weight.data_ptr()  # a snapshot
    out = engine.generate(PROMPTS, n=2, max_new_tokens=6, temperature=1.0, seed=1)
    assert all(len(c.token_ids) for g in out for c in g)
    assert all(lp <= 0 for g in out for c in g for lp in c.logprobs)


def test_without_the_native_kernels_the_float32_engine_keeps_the_transformers_model(tiny):
    engine = HFEngine(tiny, load_tokenizer("tiny-random"), bf16=False, bf16_weights=False, native_kernels=False)
    assert engine.fast is None and engine.model is tiny
    dec = LlamaDecoder(tiny, tiny.get_output_embeddings().weight.detach(), torch.float32, native_kernels=False)
    assert not dec.native and not dec.shares_weights
