"""Learner update time: responses in length buckets against all responses packed into one row (its attention
under the dense mask, or one segment at a time), and the choice ``response_hidden`` makes between them,
alternating in one process (so a drifting machine affects all alike).

    python benchmarks/packing.py                    # SmolLM2-135M, ~8 min; writes the JSON below
    python benchmarks/packing.py --checkpointing    # as the quickstart runs it: layers recomputed in the backward
                                                    # pass, where only the packed row and plain padded rows apply

Batches: 2 prompts x 8 samples (the quickstart's shape). Response lengths from the quickstart's own steps
(step 10: fifteen 5-8 token answers and one of 33; step 4: 2 to 64 tokens) and 16 equal answers of 16, 24,
32 and 64 tokens, where the packed row's attention (growing with its squared length) decides.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

CASES = {
    "quickstart step 10": [5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 8, 33],
    "quickstart step 4": [2, 2, 3, 7, 8, 8, 8, 10, 13, 16, 18, 21, 22, 31, 50, 64],
    "16 x 16 tokens": [16] * 16,
    "16 x 24 tokens": [24] * 16,
    "16 x 32 tokens": [32] * 16,
    "16 x 64 tokens": [64] * 16,
    "16 x 128 tokens": [128] * 16,
}
ROUNDS = 5  # per variant and case; the first two are warm-up


HUGE = 10**12


def main() -> None:
    import argparse

    from length_buckets import quickstart_learner
    from machine_facts import label, machine

    from polyrl import pass_costs, record_passes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpointing", action="store_true", help="the quickstart's activation checkpointing")
    args = ap.parse_args()
    learner, trajectories = quickstart_learner(checkpointing=args.checkpointing)
    # pass_costs for each variant (packed_attention 0 never packs, HUGE always does where it applies; segment
    # overhead HUGE keeps the dense mask, -HUGE takes segments); None keeps the cost model's own value
    variants = {
        "length buckets": {"packed_attention": 0},
        "one packed row, dense mask": {"packed_attention": HUGE, "segment_overhead": HUGE},
        "one packed row, segments": {"packed_attention": HUGE, "segment_overhead": -HUGE},
        "default (the cheapest by the cost model)": {},
    }
    if args.checkpointing:  # no KV cache through recomputed layers: buckets do not apply (plain padded rows do)
        variants = {("plain padded rows" if k == "length buckets" else k): v for k, v in variants.items()}
    results = {}
    for case, lengths in CASES.items():
        batch = trajectories(lengths)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for i in range(len(variants) * ROUNDS):
            name = list(variants)[i % len(variants)]
            with pass_costs(**variants[name]), record_passes() as passes:
                start = time.perf_counter()
                learner.update(batch)
                took = time.perf_counter() - start
            if i >= 2 * len(variants):
                times[name].append(took)
            if name.startswith("default"):
                default_took = sorted({p.layout for p in passes if p.with_grad})
        results[case] = {"response_lengths": lengths, **{k: statistics.median(v) for k, v in times.items()},
                         "default took": default_took}
        print(case, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in results[case].items()
                     if k != "response_lengths"}, flush=True)
    name = "packing_checkpointed.json" if args.checkpointing else "packing.json"
    out = ROOT / "benchmarks" / "results" / name
    out.write_text(json.dumps({"machine": label(machine()), "checkpointing": args.checkpointing,
                               "seconds_per_update_median": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
