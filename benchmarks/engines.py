"""Sampling throughput of the engines on SmolLM2-135M at the default group shape (G samples x T new tokens).

Each engine samples the same chat prompts ``--repeats`` times (after one warm-up call) with the rollout's
settings; tokens/s counts the tokens actually produced (a sample that stops early counts only its tokens).
The vLLM engine needs the vllm extra (its own environment, docs/systems.md); without it only hf runs.

    .venv-vllm/bin/python benchmarks/engines.py                            # hf and vllm, ~5 min on 2 cores
    python benchmarks/engines.py --engines hf --out /tmp/engines.json      # a check of the script itself

The machine's load average is recorded with the numbers: on a shared machine it moves them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "What is 17 + 25? Answer with just the number.",
    "Write one sentence about the sea.",
    "List three prime numbers.",
    "What is the capital of France?",
]


def _engine(kind: str, policy, tok, args):
    from polyrl import VllmConfig

    if kind == "hf":
        from polyrl import HFEngine

        return HFEngine(policy, tok, bf16=True, bf16_weights=True)
    from polyrl import VLLMEngine

    cfg = VllmConfig(dtype="bfloat16", max_model_len=1024, cpu_kv_cache_gib=1, enforce_eager=not args.compile)
    return VLLMEngine(policy, tok, "smollm2-135m-instruct", cfg, seed=0)


def measure(kind: str, args) -> dict:
    from polyrl import load_model, load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    policy = load_model("smollm2-135m-instruct")
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                return_dict=False)
        for q in QUESTIONS[: args.prompts]
    ]
    t0 = time.perf_counter()
    engine = _engine(kind, policy, tok, args)
    start_s = time.perf_counter() - t0
    engine.generate(prompts, args.group, 8, 1.0, 1.0, seed=0)  # warm-up
    runs = []
    for r in range(args.repeats):
        t = time.perf_counter()
        groups = engine.generate(prompts, args.group, args.tokens, 1.0, 1.0, seed=r + 1)
        seconds = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for g in groups for c in g)
        runs.append({"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)})
    t = time.perf_counter()
    engine.sync()
    sync_s = time.perf_counter() - t
    if hasattr(engine, "close"):
        engine.close()
    del engine, policy
    gc.collect()
    best = max(r["tokens_per_s"] for r in runs)
    return {"engine": kind, "start_s": round(start_s, 1), "sync_s": round(sync_s, 3), "runs": runs,
            "tokens_per_s_best": best,
            "tokens_per_s_median": sorted(r["tokens_per_s"] for r in runs)[len(runs) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--prompts", type=int, default=2, help="prompts per call (rollout.prompts_per_step)")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="vLLM without enforce_eager (compiled graphs)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "engines.json")
    args = parser.parse_args()
    results, vllm_version = [], None
    for kind in args.engines:
        if kind == "vllm":
            try:
                import vllm
            except ImportError:
                print("vllm is not installed here: skipping it (docs/systems.md)")
                continue
            vllm_version = vllm.__version__
        results.append(measure(kind, args))
        print(json.dumps(results[-1]))
    import torch

    meta = {
        "model": "smollm2-135m-instruct", "prompts": args.prompts, "group": args.group, "max_new_tokens": args.tokens,
        "temperature": 1.0, "repeats": args.repeats, "cpu_cores": os.cpu_count(), "platform": platform.platform(),
        "torch": torch.__version__, "load_average_at_end": os.getloadavg(),
        "vllm": vllm_version,
        "command": "python benchmarks/engines.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()
                                                               if k != "out"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
