"""Held-out evaluation time: the transformers model in float32 against the fused decode path in float32 (the
policy's own weights, with the shared-prefix cache), alternating in one process.

    python benchmarks/evaluation.py            # SmolLM2-135M, ~2 min; writes the JSON below

The quickstart's evaluation: 200 chain_sum items, greedy, at most 64 new tokens, batches of 64. Also records
whether both give the same accuracy and mean answer length.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 2


def main() -> None:
    import tempfile

    from polyrl.config import load_config
    from polyrl.engines.hf import HFEngine
    from polyrl.rollout.multi_turn import evaluate
    from polyrl.train.loop import build_run

    cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    run = build_run(cfg, Path(tempfile.mkdtemp()))
    task = run.tasks["chain_sum"]
    engines = {
        "transformers model, float32": HFEngine(run.model, run.tokenizer, bf16=False),
        "fused path, float32 (default)": HFEngine(run.model, run.tokenizer, bf16=False, fused_float32=True),
    }
    times: dict[str, list[float]] = {k: [] for k in engines}
    results = {}
    for _ in range(REPEATS):
        for name, engine in engines.items():
            start = time.perf_counter()
            results[name] = evaluate(engine, task, task.config.eval_size, cfg.rollout.max_new_tokens,
                                     cfg.eval.batch_size)
            times[name].append(time.perf_counter() - start)
            print(name, round(times[name][-1], 1), "s", flush=True)
    a, b = results.values()
    out = {
        "seconds_median": {k: statistics.median(v) for k, v in times.items()},
        "accuracy": {k: r["accuracy"] for k, r in results.items()},
        "mean_response_length": {k: r["response_length"] for k, r in results.items()},
        "same_accuracy_and_length": a["accuracy"] == b["accuracy"] and a["response_length"] == b["response_length"],
    }
    print(out)
    (ROOT / "benchmarks" / "results" / "evaluation.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
