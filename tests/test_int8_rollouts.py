"""Weight-only int8 rollouts (``engine.int8_weights``): the per-row quantisation, the native ``linear`` on int8
rows, the engine that samples from them and re-quantises at each sync, and the config's refusals.

Tolerances, and why:
- int8 ``linear`` against float64 on the de-quantised weights: the kernel computes the same products (each
  int8 widened exactly, the row's scale applied once to its float32 sum), so it agrees to float32 summation
  rounding, checked as in tests/test_native_f32.py at 1e-5 of the sum of the terms' magnitudes.
- against the float32 weights: each weight is off by at most scale / 2 = max|w_row| / 254, so an output is off
  by at most sum_k |x_k| * max|w_row| / 254; checked against exactly that bound.
- the decoder's logits against the transformers model's (LoRA merged): the tiny model's logits, of magnitude
  below 1, move by its weights' rounding, accumulated over two layers; checked below 0.05, ten times less
  than what the adapters themselves change.
- the engine's log-probs against the float32 engine's, where both sampled the same tokens: a mean absolute
  gap below 0.01 nats and a worst below 0.05 (the tiny model's distributions are flat, so these are small).

The kernels are built for whatever ``ATEN_CPU_CAPABILITY`` says: run this file under ``avx2`` too.
"""

from __future__ import annotations

import os

import pytest
import torch
import yaml
from conftest import SMOKE
from test_native_f32 import PROMPTS, randn

from polyrl.config import ConfigError, LoraConfig
from polyrl.config_check import load_config
from polyrl.engines import native
from polyrl.engines.hf import HFEngine
from polyrl.engines.int8 import Int8Weights, quantise_int8
from polyrl.engines.llama_decode import LlamaDecoder
from polyrl.models.loading import load_model, load_tokenizer

if os.environ.get("POLYRL_NATIVE") == "0":
    pytest.skip("native kernels switched off (POLYRL_NATIVE=0)", allow_module_level=True)


@pytest.fixture(scope="module")
def ops():
    assert native.available(), "the native kernels did not build (see the warning logged above)"
    return native.ops()


def test_quantisation_round_trip_is_within_half_a_step_per_element():
    w = randn(37, 53, seed=1) * torch.linspace(0.01, 3.0, 37)[:, None]  # rows of very different ranges
    w[5] = 0.0  # an all-zero row stays exact
    qw = quantise_int8(w)
    assert qw.q.dtype == torch.int8 and qw.scale.dtype == torch.float32 and qw.q.shape == w.shape
    assert qw.q.abs().max() == 127 and qw.q.min() >= -127
    err = (qw.dequantise() - w).abs()
    assert (err <= qw.scale[:, None] / 2 * (1 + 1e-6)).all()
    assert err[5].max() == 0 and qw.q[5].abs().max() == 0
    assert torch.allclose(qw.scale[6], w[6].abs().max() / 127)
    with pytest.raises(ValueError, match="\\[out, in\\]"):
        quantise_int8(randn(4))


@pytest.mark.parametrize("rows,inputs,outputs", [(16, 576, 960), (5, 40, 7), (3, 13, 4), (70, 64, 50),
                                                  (64, 100, 13)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_matches_a_float64_matmul_of_the_dequantised_weights(ops, rows, inputs, outputs, with_bias):
    """Row and output counts off the tile sizes, widths off the vector width (the scalar tail), more rows than
    one block of 64."""
    x = randn(rows, inputs, seed=2)
    w = randn(outputs, inputs, seed=3)
    qw = quantise_int8(w)
    bias = randn(outputs, seed=4) if with_bias else None
    got = ops.linear(x, [qw.q], bias, qw.scale)
    deq = qw.dequantise().double()
    want = x.double() @ deq.T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ deq.abs().T + (0 if bias is None else bias.double().abs())
    err = (got.double() - want).abs()
    assert (err <= 1e-5 * magnitude + 1e-30).all(), f"worst {(err / (1e-5 * magnitude)).max():.2f}x the bound"
    # Against the float32 weights: within the quantisation's own bound, sum |x| * max|w_row| / 254.
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    bound = x.double().abs().sum(1, keepdim=True) * (w.abs().amax(1).double() / 254)[None, :]
    gap = (got.double() - exact).abs()
    assert (gap <= bound * (1 + 1e-4) + 1e-5 * magnitude).all()
    assert gap.max() > 0  # the weights were rounded: the check compared something


def test_int8_linear_rejects_bad_input(ops):
    x = randn(4, 32, seed=5)
    qw = quantise_int8(randn(6, 32, seed=6))
    with pytest.raises(RuntimeError, match="scale"):
        ops.linear(x, [qw.q], None)
    with pytest.raises(RuntimeError, match="scale"):
        ops.linear(x, [qw.q], None, qw.scale[:5])
    with pytest.raises(RuntimeError, match="scale"):
        ops.linear(x, [qw.q.float()], None, qw.scale)


def test_int8_decoder_logits_follow_the_model_with_lora_merged(ops):
    policy = load_model("tiny-random", LoraConfig(r=4, alpha=8), seed=1)
    for name, p in policy.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would hide a missing delta
            torch.nn.init.normal_(p, std=0.1)
    head = policy.get_output_embeddings().weight.detach().float().clone()
    dec = LlamaDecoder(policy, head, torch.float32, weight_dtype=torch.int8)
    ids = torch.tensor([[2, 2, 1, 2, 3], [4, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    got, _ = dec.prefill(ids, mask, positions)
    with torch.no_grad():
        want = policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
        with policy.disable_adapter():
            plain = policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
    err = (got - want).abs().max()
    assert 0 < err < 0.05 and (plain - want).abs().max() > 10 * err


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", None, seed=0)


def test_the_int8_engine_holds_quantised_copies(ops, tiny):
    engine = HFEngine(tiny, load_tokenizer("tiny-random"), bf16=False, bf16_weights=False, int8_weights=True)
    fast = engine.fast
    assert fast is not None and fast.native and fast.dtype == torch.float32 and not fast.shares_weights
    layer = fast.layers[0]
    for w in (layer.qkv, layer.o, layer.gate_up, layer.down, fast.head_low):
        assert isinstance(w, Int8Weights) and w.q.dtype == torch.int8
    q = tiny.get_decoder().layers[0].self_attn.q_proj.weight
    assert torch.equal(layer.qkv.q[: q.shape[0]], quantise_int8(q).q)
    assert engine.head_weight.dtype == torch.float32  # the head's largest logits are rescored in float32
    assert engine.head_weight.data_ptr() != tiny.get_output_embeddings().weight.data_ptr()
    matrices = sum(m.weight.numel() for layer in tiny.get_decoder().layers for m in layer.modules()
                   if isinstance(m, torch.nn.Linear))
    head = tiny.get_output_embeddings().weight.numel()
    assert matrices + head <= fast.nbytes() < 1.2 * (matrices + head)  # a byte a weight, plus scales and norms


@pytest.mark.slow
def test_the_int8_engine_samples_close_to_the_float32_engine(ops, tiny):
    """Both engines sample with one seed; over each row's prefix where both drew the same tokens (the same
    contexts), their behaviour log-probs are compared."""
    tok = load_tokenizer("tiny-random")
    f32 = HFEngine(tiny, tok, bf16=False, bf16_weights=False)
    int8 = HFEngine(tiny, tok, bf16=False, bf16_weights=False, int8_weights=True)
    assert f32.fast.shares_weights and int8.fast.weight_dtype == torch.int8
    a = sum(f32.generate(PROMPTS, n=4, max_new_tokens=12, temperature=1.0, seed=7), [])
    b = sum(int8.generate(PROMPTS, n=4, max_new_tokens=12, temperature=1.0, seed=7), [])
    gaps, differ = [], 0
    for x, y in zip(a, b, strict=True):
        assert all(lp <= 0 for lp in y.logprobs)
        same = 0  # the shared prefix: same tokens so far, so the same context for both log-probs
        while same < min(len(x.token_ids), len(y.token_ids)) and x.token_ids[same] == y.token_ids[same]:
            same += 1
        gaps += [abs(p - q) for p, q in zip(x.logprobs[:same], y.logprobs[:same], strict=True)]
        differ += x.token_ids != y.token_ids
    assert len(gaps) >= 24, f"only {len(gaps)} tokens shared: nothing much compared"
    mean = sum(gaps) / len(gaps)
    assert 0 < mean < 0.01 and max(gaps) < 0.05, (mean, max(gaps), differ)


@pytest.mark.slow
def test_a_sync_requantises_the_engine_weights(ops):
    """Change the policy's weights as the optimiser does (in place), sync: the engine's int8 rows follow, and
    greedy tokens match those of a fresh int8 engine on the new weights, not the old ones."""
    tok = load_tokenizer("tiny-random")
    policy = load_model("tiny-random", None, seed=0)
    engine = HFEngine(policy, tok, bf16=False, bf16_weights=False, int8_weights=True)
    before = engine.generate(PROMPTS, n=2, max_new_tokens=8, temperature=0.0)
    old_q = engine.fast.layers[0].qkv.q.clone()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.release_memory()
    engine.sync()
    q = policy.get_decoder().layers[0].self_attn.q_proj.weight
    assert torch.equal(engine.fast.layers[0].qkv.q[: q.shape[0]], quantise_int8(q).q)
    assert not torch.equal(engine.fast.layers[0].qkv.q, old_q)
    assert torch.equal(engine.head_weight, policy.get_output_embeddings().weight)
    after = engine.generate(PROMPTS, n=2, max_new_tokens=8, temperature=0.0)
    fresh = HFEngine(policy, tok, bf16=False, bf16_weights=False, int8_weights=True)
    want = fresh.generate(PROMPTS, n=2, max_new_tokens=8, temperature=0.0)
    tokens = [[c.token_ids for g in out for c in g] for out in (before, after, want)]
    assert tokens[1] == tokens[2] and tokens[1] != tokens[0]


def test_the_engine_refuses_int8_without_the_fused_path(tiny):
    tok = load_tokenizer("tiny-random")
    for kwargs in ({"fast_decode": False}, {"native_kernels": False}):
        with pytest.raises(ValueError, match="engine.int8_weights: needs the fused decode path"):
            HFEngine(tiny, tok, bf16=False, bf16_weights=False, int8_weights=True, **kwargs)


def _config_error(tmp_path, overrides: list[str], model_type: str | None = None) -> str:
    data = yaml.safe_load(SMOKE.read_text())
    if model_type is not None:
        model_dir = tmp_path / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
        data["model"]["name"] = str(model_dir)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as exc:
        load_config(path, ["engine.int8_weights=true", *overrides])
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(str(path))
    return msg


@pytest.mark.parametrize("override,key", [
    ("engine.kind=vllm", "engine.kind"),
    ("engine.fast_decode=false", "engine.fast_decode"),
    ("engine.native_kernels=false", "engine.native_kernels"),
    ("engine.bf16_weights=true", "engine.bf16_weights"),
    ("train.device=cuda", "train.device"),
])
def test_the_config_refuses_what_int8_cannot_run_on(tmp_path, override, key):
    assert f"engine.int8_weights: samples through the fused decode path's native int8 kernels on the CPU; it " \
           f"needs {key}:" in _config_error(tmp_path, [override])


def test_the_config_refuses_int8_on_a_model_the_fused_path_does_not_cover(tmp_path):
    msg = _config_error(tmp_path, [], model_type="gpt2")
    assert "engine.int8_weights: model.name" in msg and "'gpt2' model" in msg and "llama, mistral, qwen2" in msg


def test_the_config_accepts_int8_with_tis(tmp_path):
    cfg = load_config(SMOKE, ["engine.int8_weights=true", "algorithm.off_policy=tis"])
    assert cfg.engine.int8_weights and cfg.engine.kind == "hf"
    llama_dir = tmp_path / "llama"
    llama_dir.mkdir()
    (llama_dir / "config.json").write_text('{"model_type": "llama"}')
    assert load_config(SMOKE, ["engine.int8_weights=true", f"model.name={llama_dir}"]).engine.int8_weights
