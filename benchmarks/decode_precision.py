"""How far the engine's behaviour log-probs are from the learner's, per decode path.

Samples 4 chain_sum prompts x 8 from SmolLM2-135M with each engine path, then recomputes every sampled token's
log-prob the way the learner does (float32 weights under bf16 autocast, float32 head) and reports the mean,
99th percentile and maximum of |engine - learner|. The engine-learner gap is what the PPO ratio sees as noise
at the first step on a batch; a fast path should not widen it.

    python benchmarks/decode_precision.py     # ~1 min; prints a table, writes benchmarks/results/decode_precision.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def sample_prompts(tok) -> list[list[int]]:
    """The 4 chain_sum prompts (2-3 terms, up to 2 digits) the precision benchmarks sample from, as chat ids."""
    import reasoning_gym

    data = reasoning_gym.create_dataset("chain_sum", size=4, seed=5, min_terms=2, max_terms=3, max_digits=2)
    prompts = []
    for item in data:
        chat = [{"role": "user", "content": item["question"] + " Answer with just the number."}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


def logprob_gaps(engine, model, prompts: list[list[int]], bf16: bool) -> dict[str, float]:
    """8 samples of up to 48 tokens per prompt from ``engine``; |engine - learner| over every sampled token, the
    learner's log-prob computed as the learner does (under bf16 autocast or not): count, mean, p99, max."""
    from polyrl import forward_logits

    def learner_logprobs(prompt: list[int], tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits, _ = forward_logits(model, ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None],
                                       len(tokens) + 1, bf16=bf16)
        return torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)

    groups = engine.generate(prompts, n=8, max_new_tokens=48, temperature=1.0, seed=7)
    gaps = torch.cat([(torch.tensor(c.logprobs) - learner_logprobs(p, c.token_ids)).abs()
                      for p, group in zip(prompts, groups, strict=True) for c in group])
    return {"tokens": len(gaps), "mean": gaps.mean().item(), "p99": gaps.quantile(0.99).item(),
            "max": gaps.max().item()}


def main() -> None:
    from polyrl import SMOLLM2_ALIAS, HFEngine, load_model, load_tokenizer

    tok, model = load_tokenizer(SMOLLM2_ALIAS), load_model(SMOLLM2_ALIAS)
    prompts = sample_prompts(tok)
    paths = {
        "transformers model, bf16 copy": dict(fast_decode=False, native_kernels=False),
        "fused, float32 head": dict(exact_top=0),
        "fused, bf16 head + float32 top-32, torch operations": dict(native_kernels=False),
        "fused, bf16 head + float32 top-32, native kernels (default)": dict(),
    }
    results = {}
    for label, kw in paths.items():
        engine = HFEngine(model, tok, bf16=True, bf16_weights=True, fast_decode=kw.get("fast_decode", True),
                          native_kernels=kw.get("native_kernels", True))
        if kw.get("exact_top") == 0:
            engine.fast.exact_top, engine.fast.head_low = 0, None
        r = results[label] = logprob_gaps(engine, model, prompts, bf16=True)
        print(f"{label:<60} tokens {r['tokens']:>4}  mean {r['mean']:.4f}  p99 {r['p99']:.4f}  "
              f"max {r['max']:.4f}", flush=True)
    out = ROOT / "benchmarks" / "results" / "decode_precision.json"
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
