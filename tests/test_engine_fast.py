"""The engine's fast paths against their references: preallocated KV cache vs transformers' DynamicCache, and
inverse-CDF sampling vs the softmax distribution it must follow."""

from __future__ import annotations

import pytest
import torch

from polyrl.engines.hf import HFEngine, blocked_inverse_cdf, inverse_cdf, sample_tokens
from polyrl.models.loading import load_model, load_tokenizer


@pytest.fixture(scope="module")
def parts():
    return load_model("tiny-random", None, seed=0), load_tokenizer("tiny-random")


PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]  # unequal lengths: left padding is exercised


@pytest.mark.slow
@pytest.mark.parametrize("bf16_weights", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_preallocated_cache_matches_dynamic_cache(parts, bf16_weights, temperature):
    model, tok = parts
    # fast_decode off: the transformers model with each cache (the fused decoder has its own test file).
    fast = HFEngine(model, tok, bf16=False, bf16_weights=bf16_weights, fast_decode=False)
    ref = HFEngine(model, tok, bf16=False, bf16_weights=bf16_weights, preallocate_cache=False, fast_decode=False)
    # One id in 40 stops (random weights sample near-uniformly), so rows finish and get dropped mid-generation.
    fast.stop_ids = ref.stop_ids = set(range(0, len(tok), 40))
    a = fast.generate(PROMPTS, n=4, max_new_tokens=24, temperature=temperature, seed=3)
    b = ref.generate(PROMPTS, n=4, max_new_tokens=24, temperature=temperature, seed=3)
    lengths = set()
    for x, y in zip(sum(a, []), sum(b, []), strict=True):
        assert x.token_ids == y.token_ids and x.finished == y.finished
        # Same keys and values, same attention: log-probs agree to float rounding.
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
        lengths.add(len(x.token_ids))
    if temperature:
        assert len(lengths) > 1, "no row finished early: the row-dropping path was not exercised"


def test_preallocated_layer_grows_and_matches_concatenation():
    from polyrl.engines.kv_cache import PreallocatedLayer

    gen = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(3, 2, 4, 5, generator=gen), torch.randn(3, 2, 4, 5, generator=gen)
    layer, keys, values = PreallocatedLayer(k0, v0, capacity=5), k0, v0
    for _ in range(9):  # capacity 5 -> 10 -> 20
        k, v = torch.randn(3, 2, 1, 5, generator=gen), torch.randn(3, 2, 1, 5, generator=gen)
        got_k, got_v = layer.update(k, v)
        keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
        assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.keys, keys[[2, 0]]) and layer.get_seq_length() == 13


def test_bf16_copy_equals_deepcopy_then_cast(parts):
    import copy

    from polyrl.engines.hf import bf16_copy

    model, _ = parts
    ours, ref = bf16_copy(model), copy.deepcopy(model).to(torch.bfloat16)
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight  # still tied
    assert not any(p.requires_grad for p in ours.parameters())
    assert next(model.parameters()).dtype == torch.float32  # the policy itself is untouched


def test_inverse_cdf_picks_the_bucket_of_u():
    w = torch.tensor([[0.1, 0.0, 0.3, 0.6]])
    cases = {0.0: 0, 0.099: 0, 0.1: 2, 0.39: 2, 0.4: 3, 0.999999: 3}
    for u, want in cases.items():
        assert int(inverse_cdf(w, torch.tensor([[u]]), 3)) == want, u  # index 1 has no weight: never picked


@pytest.mark.parametrize("vocab", [1000, 1024])  # padded to whole blocks, and not
def test_blocked_inverse_cdf_picks_what_the_flat_one_picks(vocab):
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand((64, vocab), generator=gen) ** 8  # uneven, like a softmax
    weights[:, ::7] = 0.0  # entries without weight are never chosen
    weights[:, -3:] = 0.0  # nor past the last weighted one, even at u close to 1
    u = torch.rand((64, 1), generator=gen)
    u[0], u[1] = 0.0, 1.0 - 1e-7
    got, total = blocked_inverse_cdf(weights, u, block=64)
    want = inverse_cdf(weights, u, vocab - 1).squeeze(-1)
    # Float sums in another order can move a draw across a boundary only when u lands within rounding of it.
    assert (got == want).float().mean() > 0.95
    assert (weights.gather(1, got[:, None]) > 0).all()
    assert torch.allclose(total.squeeze(-1), weights.sum(-1), rtol=1e-5)


def test_sampling_follows_softmax_and_top_p():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    gen = torch.Generator().manual_seed(0)
    n = 20000
    draws = torch.cat([sample_tokens(logits.expand(500, -1), 1.0, 1.0, gen)[0] for _ in range(n // 500)])
    freq = torch.bincount(draws, minlength=12).float() / n
    probs = torch.softmax(logits[0], -1)
    # Binomial standard error at n=20000 is at most 0.0036; 5 sigma.
    assert (freq - probs).abs().max() < 0.018
    nucleus = probs.sort(descending=True)
    keep = nucleus.values.cumsum(0) - nucleus.values <= 0.7
    allowed = set(nucleus.indices[keep].tolist())
    tokens, logp = sample_tokens(logits.expand(4000, -1), 1.0, 0.7, gen)
    assert set(tokens.tolist()) == allowed
    # Reported log-probs are those of the full tempered softmax at the chosen token.
    assert torch.allclose(logp, torch.log(probs)[tokens], atol=1e-5)


@pytest.mark.slow
def test_sampling_is_deterministic_given_the_seed(parts):
    model, tok = parts
    engine = HFEngine(model, tok, bf16=False)
    a = engine.generate(PROMPTS, n=3, max_new_tokens=10, temperature=1.0, seed=11)
    b = engine.generate(PROMPTS, n=3, max_new_tokens=10, temperature=1.0, seed=11)
    c = engine.generate(PROMPTS, n=3, max_new_tokens=10, temperature=1.0, seed=12)
    assert [x.token_ids for x in sum(a, [])] == [x.token_ids for x in sum(b, [])]
    assert [x.token_ids for x in sum(a, [])] != [x.token_ids for x in sum(c, [])]
