"""Learner update time with responses of mixed lengths, three ways, alternating in one process (so a machine
whose speed drifts affects all three alike): one padded response pass with the output head on every padded
position (before), the head on response tokens only, and responses in length buckets as well (the default).

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


def quickstart_learner():
    """SmolLM2's learner set up as in the quickstart, and a maker of 2-prompt x 8 batches with the given
    response lengths (random tokens, random advantages)."""
    import roofline

    from polyrl.types import Trajectory

    model, tokenizer, engine, learner = roofline.build("smollm2-135m-instruct", 16)
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
    from polyrl.learner import forward_pass
    from polyrl.learner import learner as learner_module

    learner, trajectories = quickstart_learner()
    forward_pass.PACKED_ATTENTION = 0  # buckets only: packing (benchmarks/packing.py) came after this comparison

    bucketed_forward = learner_module.Learner._forward

    def padded_head_forward(self, batch, entropy_grad=False):  # the head on every padded position
        hidden = forward_pass.response_hidden(self.model, batch, self.bf16, self.share_prefix)
        return (*learner_module.chunked_logprobs(
            self.model, hidden, batch.targets, self.temperature, entropy_grad, bf16_backward=self.bf16,
        ), None, None)

    never = 10**9  # a bucket cost no padding can repay: one response pass
    variants = {
        "one padded pass, head on padding (before)": (padded_head_forward, never),
        "one padded pass, head on response tokens": (bucketed_forward, never),
        "length buckets, head on response tokens (default)": (bucketed_forward, forward_pass.BUCKET_OVERHEAD),
    }
    results = {}
    for case, lengths in CASES.items():
        batch = trajectories(lengths)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for i in range(len(variants) * 7):
            name = list(variants)[i % len(variants)]
            learner_module.Learner._forward, forward_pass.BUCKET_OVERHEAD = variants[name]
            start = time.perf_counter()
            learner.update(batch)
            if i >= 2 * len(variants):  # warm-up rounds
                times[name].append(time.perf_counter() - start)
        results[case] = {"response_lengths": lengths, **{k: statistics.median(v) for k, v in times.items()}}
        print(case, {k: round(v, 3) for k, v in results[case].items() if k != "response_lengths"}, flush=True)
    out = ROOT / "benchmarks" / "results" / "length_buckets.json"
    out.write_text(json.dumps({"seconds_per_update_median": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
