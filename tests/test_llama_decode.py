"""The fused Llama decode path (polyrl/engines/llama_decode.py) against the transformers model it replaces:
float32 logits to 1e-4, the engine's tokens and log-probs through group sharing and row dropping, LoRA deltas
merged, refresh after an update, and the bf16 path (packed or not) within bf16 rounding of the reference."""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from polyrl.config import LoraConfig
from polyrl.engines import decode_kv, llama_decode
from polyrl.engines.hf import HFEngine
from polyrl.engines.llama_decode import LlamaDecoder
from polyrl.engines.rescored_head import blocked_topk
from polyrl.models.loading import load_model, load_tokenizer

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]  # unequal lengths: left padding is exercised


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), 2)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def reference_logits(model, ids, mask, positions) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()


def decoder_logits(model, dtype=torch.float32, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill PROMPTS, then teacher-force 6 tokens; return (fused decoder logits, reference logits) [B, 7, V]."""
    ids, mask, positions = left_pad(PROMPTS)
    cont = torch.randint(3, 200, (len(PROMPTS), 6), generator=torch.Generator().manual_seed(0))
    head = model.get_output_embeddings().weight.detach().clone()
    dec = LlamaDecoder(model, head, dtype, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_kv, "KV_CHUNK", 2)  # small: the buffers grow during the 6 steps
        first, kv = dec.prefill(ids, mask, positions)
        full_mask = torch.cat([mask, torch.ones_like(cont)], 1)
        out = [first]
        for j in range(cont.shape[1]):
            out.append(dec.decode(cont[:, j], full_mask, positions[:, -1] + 1 + j, kv))
        # It did grow (the native kernels' cache grows only its rows' own positions, from KV_CHUNK).
        assert kv.capacity > ids.shape[1] + (2 if isinstance(kv, decode_kv.PromptSharedKV) else 1)
    full_ids = torch.cat([ids, cont], 1)
    ref = reference_logits(model, full_ids, full_mask, (full_mask.cumsum(-1) - 1).clamp(min=0))
    return torch.stack(out, 1), ref[:, ids.shape[1] - 1 :]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", None, seed=0)


def qwen2_with_bias() -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    for layer in model.model.layers:  # biases start at zero: make them count
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)
    return model


def test_float32_logits_match_transformers(tiny):
    got, want = decoder_logits(tiny)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_untied_head_and_qkv_bias_match_transformers():
    got, want = decoder_logits(qwen2_with_bias())
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


@pytest.mark.slow
def test_lora_deltas_are_merged_and_refreshed():
    policy = load_model("tiny-random", LoraConfig(r=4, alpha=8), seed=1)
    for name, p in policy.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would hide a missing delta
            torch.nn.init.normal_(p, std=0.1)
    got, want = decoder_logits(policy)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    ids, mask, positions = left_pad(PROMPTS)
    with policy.disable_adapter():  # without the deltas the logits differ: the adapters matter here
        plain = reference_logits(policy, ids, mask, positions)[:, -1]
    assert not torch.allclose(plain, got[:, 0], atol=1e-3)

    head = policy.get_output_embeddings().weight.detach().clone()
    dec = LlamaDecoder(policy, head, torch.float32)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_A" in name:
                p.mul_(-1.5)
    dec.refresh(policy)
    after, _ = dec.prefill(ids, mask, positions)
    assert torch.allclose(after, reference_logits(policy, ids, mask, positions)[:, -1], atol=1e-4)


@pytest.mark.slow
def test_bf16_logits_are_within_bf16_rounding(tiny):
    got, want = decoder_logits(tiny, torch.bfloat16)
    assert (got - want).abs().max() < 0.05  # logits of magnitude ~1: a few bf16 steps accumulated over layers
    exact, _ = decoder_logits(tiny, torch.bfloat16, exact_top=0)
    # The rescored head (bf16 for all, float32 for the 32 largest per row) equals the float32 head there,
    # and the largest logit of every row is among them.
    same = (got - exact).abs() < 1e-5
    assert (same.sum(-1) >= 32).all()
    assert torch.allclose(got.max(-1).values, exact.max(-1).values, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not llama_decode.packing_available(), reason="no oneDNN bf16 weight packing on this CPU")
def test_packed_weights_give_the_same_logits(tiny, monkeypatch):
    packed, _ = decoder_logits(tiny, torch.bfloat16)
    monkeypatch.setattr(llama_decode, "packing_available", lambda: False)
    plain, _ = decoder_logits(tiny, torch.bfloat16)
    assert torch.allclose(packed, plain, atol=1e-6)


def test_blocked_topk_finds_the_largest_entries():
    gen = torch.Generator().manual_seed(0)
    for vocab in (49152, 1000):  # blocked, and the plain-topk fallback (not a multiple of the block)
        x = torch.randn((16, vocab), generator=gen)
        x[3, :64] = 10.0  # all of one row's top entries in a single block
        got = blocked_topk(x, 32)
        assert torch.equal(got.sort(-1).values, x.topk(32, dim=-1).indices.sort(-1).values)


def test_rms_norm_on_bf16_rounds_once_like_transformers():
    x = torch.randn((64, 576), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    weight = torch.rand(576).to(torch.bfloat16) + 0.5
    want = weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(llama_decode.rms_norm(x, weight, 1e-5), want)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_generates_what_the_reference_engine_generates(tiny, temperature):
    """Group sharing, row dropping and the stop predicate on the fused path (float32, so the comparison is
    tight): the same tokens and log-probs as the engine on the transformers model."""
    tok = load_tokenizer("tiny-random")
    fast = HFEngine(tiny, tok, bf16=False, bf16_weights=True)
    assert fast.fast is not None
    fast.fast = LlamaDecoder(tiny, fast.head_weight, torch.float32)
    ref = HFEngine(tiny, tok, bf16=False, bf16_weights=False)
    fast.stop_ids = ref.stop_ids = set(range(0, len(tok), 40))  # rows finish and are dropped mid-way
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


def test_engine_sync_takes_updated_weights(tiny):
    tok = load_tokenizer("tiny-random")
    policy = load_model("tiny-random", None, seed=0)
    engine = HFEngine(policy, tok, bf16=False, bf16_weights=True)
    before = engine.generate(PROMPTS, n=2, max_new_tokens=8, temperature=0.0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.sync()
    after = engine.generate(PROMPTS, n=2, max_new_tokens=8, temperature=0.0)
    fresh = HFEngine(policy, tok, bf16=False, bf16_weights=True).generate(PROMPTS, n=2, max_new_tokens=8,
                                                                          temperature=0.0)
    assert [c.token_ids for g in after for c in g] == [c.token_ids for g in fresh for c in g]
    assert [c.token_ids for g in after for c in g] != [c.token_ids for g in before for c in g]


@pytest.mark.slow
def test_released_weights_are_rebuilt_by_sync(tiny):
    # The learner's update runs without the engine's copy of the weights (release_memory), and the sync after
    # it rebuilds them: generation afterwards equals a fresh engine's on the updated policy.
    tok = load_tokenizer("tiny-random")
    policy = load_model("tiny-random", None, seed=0)
    engine = HFEngine(policy, tok, bf16=True, bf16_weights=True)
    held = engine.fast.nbytes()
    engine.release_memory()
    engine.release_memory()  # twice in a row (an update with nothing to learn) is harmless
    assert engine.fast.nbytes() < held / 10 and engine.head_weight is None
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(PROMPTS, n=1, max_new_tokens=2)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.sync()
    assert engine.fast.nbytes() == held
    after = engine.generate(PROMPTS, n=2, max_new_tokens=8, temperature=1.0, seed=1)
    fresh = HFEngine(policy, tok, bf16=True, bf16_weights=True).generate(PROMPTS, n=2, max_new_tokens=8,
                                                                         temperature=1.0, seed=1)
    assert [c.token_ids for g in after for c in g] == [c.token_ids for g in fresh for c in g]
    assert [c.logprobs for g in after for c in g] == [c.logprobs for g in fresh for c in g]


@pytest.mark.slow
def test_weights_released_until_used_are_rebuilt_by_the_next_decode(tiny):
    # Evaluation releases the copy while a task may still sample from the engine (a self-play opponent).
    tok = load_tokenizer("tiny-random")
    policy = load_model("tiny-random", None, seed=0)
    engine = HFEngine(policy, tok, bf16=True, bf16_weights=True)
    before = engine.generate(PROMPTS, n=2, max_new_tokens=6, temperature=1.0, seed=2)
    engine.release_memory(until_used=True)
    assert engine.head_weight is None
    after = engine.generate(PROMPTS, n=2, max_new_tokens=6, temperature=1.0, seed=2)
    assert [c.token_ids for g in after for c in g] == [c.token_ids for g in before for c in g]
    engine.release_memory()  # the learner's release: a decode before the sync is an error again
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(PROMPTS, n=1, max_new_tokens=2)


def test_unsupported_architectures_keep_the_transformers_path(tiny):
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu")
    assert llama_decode.supports(tiny)
    assert not llama_decode.supports(LlamaForCausalLM(cfg))
    tok = load_tokenizer("tiny-random")
    assert HFEngine(tiny, tok, bf16_weights=True, fast_decode=False).fast is None


@pytest.mark.slow
def test_held_out_evaluation_runs_without_the_sampling_copy(monkeypatch, tmp_path):
    # evaluate_all decodes on the policy's own weights: the engine's copy is released for it (its caches would
    # come on top) and rebuilt afterwards, so sampling goes on exactly as before.
    import polyrl.train.step as step_module
    from polyrl.config_check import load_config

    config = load_config(ROOT / "configs" / "smoke.yaml", ["model.bf16=true", "engine.bf16_weights=true"])
    run = step_module.build_run(config, tmp_path)
    held = run.engine.fast.nbytes()
    before = run.engine.generate(PROMPTS, n=2, max_new_tokens=6, temperature=1.0, seed=3)
    during = []
    real_evaluate = step_module.evaluate

    def watched(engine, *args, **kwargs):
        during.append((engine is run.engine, run.engine.fast.nbytes()))
        return real_evaluate(engine, *args, **kwargs)

    monkeypatch.setattr(step_module, "evaluate", watched)
    step_module.evaluate_all(run)
    assert during and all(not same and n < held / 10 for same, n in during)
    assert run.engine.fast.nbytes() == held
    after = run.engine.generate(PROMPTS, n=2, max_new_tokens=6, temperature=1.0, seed=3)
    assert [c.token_ids for g in after for c in g] == [c.token_ids for g in before for c in g]
    assert [c.logprobs for g in after for c in g] == [c.logprobs for g in before for c in g]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_rows_equal_the_rotary_module(tiny, dtype):
    """A decode step's cos and sin come from a table of the model's rotary module over all positions: each row
    is what the module gives for that position alone, also after the table grows past its first size."""
    dec = LlamaDecoder(tiny, tiny.get_output_embeddings().weight.detach().clone(), dtype)
    x = torch.zeros(4, tiny.config.hidden_size, dtype=dtype)
    for positions in (torch.tensor([0, 5, 17, 3]), torch.tensor([511, 700, 2, 1025])):
        got = dec._rope_at(x, positions)
        want = dec._rope(x, positions[:, None])
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert dec._rope_table[0].shape[1] >= 1026
