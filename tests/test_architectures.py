"""Architectures beyond the bundled SmolLM2 (polyrl/models/synthetic.py): a tiny random Llama-3, Qwen2, Qwen3,
Gemma and Gemma 3 written as HF directories load through polyrl's loader, train one update, generate on both
engine paths with behaviour log-probs the learner agrees with, take the fused decode path only where it computes
them exactly, and run `polyrl train` end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import SMOKE
from typer.testing import CliRunner

from polyrl.cli import app
from polyrl.config import AlgorithmConfig, OptimConfig
from polyrl.engines import llama_decode
from polyrl.engines.hf import HFEngine
from polyrl.learner.batch import collate
from polyrl.learner.learner import Learner
from polyrl.learner.logprobs import token_logprobs
from polyrl.models.loading import load_model, load_tokenizer
from polyrl.models.synthetic import ARCHITECTURES, write_random_model
from polyrl.types import Trajectory

FUSED = {"llama3": True, "qwen2": True, "qwen3": False, "gemma": False, "gemma3": False}
CLASSES = {"llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "gemma": "GemmaForCausalLM", "gemma3": "Gemma3ForCausalLM"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("archs")
    return {arch: str(write_random_model(arch, root / arch, "tiny", seed=1)) for arch in ARCHITECTURES}


def prompts(tok) -> list[list[int]]:
    """Two chat prompts of different lengths (left padding), both longer than the tiny Gemma 3's window."""
    texts = ["What is 2 + 3?", "Add the numbers 14, 27 and 5, then say the result."]
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
             for t in texts]
    return [tok(c)["input_ids"] for c in chats]


def trajectories(prompt_ids, groups, advantages=None) -> list[Trajectory]:
    out = []
    for g, (prompt, completions) in enumerate(zip(prompt_ids, groups, strict=True)):
        for j, c in enumerate(completions):
            n = len(c.token_ids)
            out.append(Trajectory(
                task="t", item_id=g, group_id=g, input_ids=prompt + c.token_ids,
                loss_mask=[0] * len(prompt) + [1] * n, logprobs=[0.0] * len(prompt) + c.logprobs,
                versions=[0] * (len(prompt) + n), advantage=advantages[j % len(advantages)] if advantages else 0.0,
            ))
    return out


@pytest.mark.slow
def test_registry_and_loader(model_dirs):
    assert set(FUSED) == set(ARCHITECTURES)
    for arch, path in model_dirs.items():
        model, tok = load_model(path), load_tokenizer(path)
        assert type(model).__name__ == CLASSES[arch]
        assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id
        # float32 attention is registered for every one of them (all use SDPA, Gemma 3 with sliding windows)
        assert model.config._attn_implementation == "sdpa_float32", arch
        assert llama_decode.supports(model) == FUSED[arch], arch
        assert (HFEngine(model, tok, bf16_weights=True).fast is not None) == FUSED[arch], arch


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_generate_and_learner_logprobs_agree(model_dirs, arch):
    """Behaviour log-probs of sampled tokens, on the policy's float32 weights and on the engine's bf16 copy (the
    fused path where it applies), against the learner's log-probs of the same tokens; then one update."""
    model, tok = load_model(model_dirs[arch]), load_tokenizer(model_dirs[arch])
    ids = prompts(tok)
    for bf16_weights, tol in ((False, 1e-4), (True, 0.02)):
        engine = HFEngine(model, tok, bf16=False, bf16_weights=bf16_weights)
        engine.stop_ids = set()  # random weights: every completion the same length, none cut by a stray eos
        groups = engine.generate(ids, n=2, max_new_tokens=6, temperature=1.0, seed=0)
        assert all(len(c.token_ids) == 6 for g in groups for c in g)
        trajs = trajectories(ids, groups)
        batch = collate(trajs, pad_id=tok.pad_token_id)
        with torch.no_grad():
            learner_lp, _ = token_logprobs(model, batch, 1.0, bf16=False)
        behaviour = torch.tensor([t.logprobs[-6:] for t in trajs])
        gap = (learner_lp - behaviour).abs().max().item()
        assert gap < tol, (arch, bf16_weights, gap)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    learner = Learner(model, AlgorithmConfig(regularisers={"kl_coef": 0.1}), OptimConfig(lr=1e-2), 1.0, False,
                      pad_id=tok.pad_token_id)
    metrics = learner.update(trajectories(ids, groups, advantages=[1.0, -1.0]))
    assert math.isfinite(metrics["loss"]) and metrics.get("skipped_updates", 0.0) == 0.0
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before), set(before) - set(changed)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a, fused in FUSED.items() if fused])
def test_fused_path_logits_match_transformers(model_dirs, arch):
    """Prefill and three decode steps of the fused path against the model's own forward: float32 to 1e-4
    (Llama-3's scaled rotary frequencies and Qwen2's q/k/v biases included), bf16 within its rounding."""
    model = load_model(model_dirs[arch]).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [2, 2, 11, 12, 13, 14]])
    mask = (ids != 2).long()
    cont = torch.tensor([[20, 21, 22], [23, 24, 25]])
    full_mask = torch.cat([mask, torch.ones_like(cont)], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = model(input_ids=torch.cat([ids, cont], 1), attention_mask=full_mask,
                     position_ids=positions).logits[:, ids.shape[1] - 1 :]
    assert want.std() > 0.05  # logits spread far beyond the tolerance, so a wrong path would show
    head = model.get_output_embeddings().weight.detach().clone()
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
        dec = llama_decode.LlamaDecoder(model, head, dtype)
        got, kv = dec.prefill(ids, mask, positions[:, : ids.shape[1]])
        out = [got]
        for j in range(cont.shape[1] - 1):
            out.append(dec.decode(cont[:, j], full_mask[:, : ids.shape[1] + j + 1], positions[:, ids.shape[1] + j], kv))
        gap = (torch.stack(out, 1) - want[:, : len(out)]).abs().max().item()
        assert gap < tol, (arch, dtype, gap)


def test_fused_path_declines_an_output_projection_bias():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    assert llama_decode.supports(LlamaForCausalLM(cfg))
    cfg.attention_bias = True  # biases on q, k, v and o: the fused path applies the first three only
    assert not llama_decode.supports(LlamaForCausalLM(cfg))


def test_softcapped_logits_are_refused(tmp_path):
    """Gemma 2 softcaps its logits after the head, which polyrl's head does not: loading says so in one line."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    Gemma2ForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        load_model(str(tmp_path))


@pytest.mark.slow
def test_make_model_then_train_through_the_cli(tmp_path, polyrl_cli):
    out_dir = tmp_path / "qwen3"
    res = CliRunner().invoke(app, ["make-model", "qwen3", str(out_dir), "--seed", "2"])
    assert res.exit_code == 0, res.output
    assert (out_dir / "model.safetensors").exists() and (out_dir / "tokenizer_config.json").exists()
    assert CliRunner().invoke(app, ["make-model", "gemma9", str(tmp_path / "x")]).exit_code == 2

    run = tmp_path / "run"
    proc = polyrl_cli.run(["train", str(SMOKE), "--output", str(run), f"model.name={out_dir}", "train.steps=1",
                           "tasks.0.eval_size=2", "logging.report=false"])  # the command line, forked (conftest)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1] and math.isfinite(lines[0]["loss"])
    saved = json.loads((run / "checkpoints" / "step-1" / "config.json").read_text())
    assert saved["model_type"] == "qwen3"
