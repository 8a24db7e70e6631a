"""Rollout time with and without the shared-prefix cache of the fused decode path, alternating in one process.

    python benchmarks/prefix_cache.py            # SmolLM2-135M, ~2 min; writes the JSON below

One "step" is what the quickstart's engine does between two weight updates: three dynamic-sampling rounds, each
sampling 2 new chain_sum prompts x 8 at temperature 1 (at most 64 new tokens). The chat template's system turn
(24 tokens of the ~45 in each prompt) is shared by every prompt; with the cache it is computed once per step
(the first round), and each round prefills only the prompts' own tokens. Also timed: the prefill alone, for
2 prompts (with the prefix still to compute, and already cached) and for a batch of 64 prompts.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
REPEATS = 7


def main() -> None:
    import roofline
    import torch

    from polyrl.engines import hf

    model, tokenizer, engine, _ = roofline.build("smollm2-135m-instruct", 16)

    def prompt(i: int) -> list[int]:
        question = f"State the sum of {i % 9 + 1} + {(i * 7) % 9}. Answer with just the number."
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    rounds = [[prompt(2 * r), prompt(2 * r + 1)] for r in range(3)]
    wide = [prompt(i) for i in range(64)]
    print("shared prefix:", len(hf.shared_prefix(rounds[0])), "of", [len(p) for p in rounds[0]], "tokens", flush=True)

    def step() -> None:
        engine.fast._prefix = None  # a new step starts with new weights: nothing cached
        for r, prompts in enumerate(rounds):
            engine.generate(prompts, n=8, max_new_tokens=64, temperature=1.0, seed=r)

    def prefill(prompts: list[list[int]], cold: bool = True) -> None:
        if cold:
            engine.fast._prefix = None
        engine.generate(prompts, n=1, max_new_tokens=1)

    cases = {"3 rounds of 2 prompts x 8 (a quickstart step)": step,
             "prefill of 2 prompts (cache cold: a step's first round)": lambda: prefill(rounds[0]),
             "prefill of 2 prompts (cache warm: its later rounds)": lambda: prefill(rounds[1], cold=False),
             "prefill of 64 prompts (cache cold)": lambda: prefill(wide)}
    default = hf.MIN_SHARED_PREFIX
    results = {}
    with torch.no_grad():
        for case, fn in cases.items():
            times: dict[str, list[float]] = {"without the prefix cache": [], "with it (default)": []}
            for i in range(2 * (REPEATS + 1)):
                name = list(times)[i % 2]
                hf.MIN_SHARED_PREFIX = 10**9 if i % 2 == 0 else default
                start = time.perf_counter()
                fn()
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
            results[case] = {k: statistics.median(v) for k, v in times.items()}
            print(case, {k: round(v, 4) for k, v in results[case].items()}, flush=True)
    hf.MIN_SHARED_PREFIX = default
    out = ROOT / "benchmarks" / "results" / "prefix_cache.json"
    out.write_text(json.dumps({"seconds_median": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
