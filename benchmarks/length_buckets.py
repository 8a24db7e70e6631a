"""Learner update time with responses of mixed lengths, two ways, alternating in one process (so a machine
whose speed drifts affects both alike): one padded response pass, and responses in length buckets (the default);
the output head runs on response tokens only in both.

    python benchmarks/length_buckets.py            # SmolLM2-135M, ~3 min; writes the JSON below

Batches: the quickstart's 2 prompts x 8 samples with response lengths taken from its own steps (step 10:
fifteen 5-8 token answers and one of 33; step 4: 2 to 64 tokens) and 16 answers of 64 tokens.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

CASES = {
    "quickstart step 10": [5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 8, 33],
    "quickstart step 4": [2, 2, 3, 7, 8, 8, 8, 10, 13, 16, 18, 21, 22, 31, 50, 64],
    "all 64 tokens": [64] * 16,
}


def quickstart_learner(checkpointing: bool = False):
    """SmolLM2's learner set up as in the quickstart (``checkpointing``: with its activation checkpointing), and a
    maker of 2-prompt x 8 batches with the given response lengths (random tokens, random advantages)."""
    import roofline

    from polyrl import Trajectory

    model, tokenizer, engine, learner = roofline.build("smollm2-135m-instruct", 16, checkpointing=checkpointing)
    del engine
    prompt = roofline.prompt_ids(tokenizer)
    prompts = [prompt, prompt[:-3] + [1000, 1001, 1002]]
    rng = random.Random(0)

    def trajectories(lengths: list[int]) -> list:
        out = []
        for i, n in enumerate(lengths):
            g = i // 8
            ids = prompts[g] + [rng.randint(100, 40000) for _ in range(n)]
            out.append(Trajectory(
                task="bench", item_id=g, group_id=g, input_ids=ids, loss_mask=[0] * len(prompts[g]) + [1] * n,
                logprobs=[0.0] * len(ids), versions=[0] * len(ids), advantage=rng.uniform(-1, 1),
            ))
        return out

    return learner, trajectories


def main() -> None:
    from polyrl import pass_costs

    learner, trajectories = quickstart_learner()
    never = 10**9  # a bucket cost no padding can repay: one response pass
    # bucket_overhead for each variant (None: the learner's own); packing off in both (packed_attention 0), as
    # packing (benchmarks/packing.py) came after this comparison
    variants = {
        "one padded pass, head on response tokens": never,
        "length buckets, head on response tokens (default)": None,
    }
    results = {}
    for case, lengths in CASES.items():
        batch = trajectories(lengths)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for i in range(len(variants) * 7):
            name = list(variants)[i % len(variants)]
            with pass_costs(bucket_overhead=variants[name], packed_attention=0):
                start = time.perf_counter()
                learner.update(batch)
                took = time.perf_counter() - start
            if i >= 2 * len(variants):  # warm-up rounds
                times[name].append(took)
        results[case] = {"response_lengths": lengths, **{k: statistics.median(v) for k, v in times.items()}}
        print(case, {k: round(v, 3) for k, v in results[case].items() if k != "response_lengths"}, flush=True)
    out = ROOT / "benchmarks" / "results" / "length_buckets.json"
    out.write_text(json.dumps({"seconds_per_update_median": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
