"""Weight-only int8 rollouts (``engine.int8_weights``) against float32 and bf16 weights: speed and learning.

Part 1 samples SmolLM2-135M with three engines in one process, alternating runs so that a change of the
machine's speed hits each alike: float32 (the fused decoder on the policy's own weights), bf16 (the engine's
bf16 copy: the bf16 fused path where the CPU computes bf16 natively, else the copy widened by the float32
kernels) and int8. It reports rollout tokens/s at 16, 64 and 256 rows (groups of 8, exactly 64 new tokens a
row), and each engine's behaviour log-prob gap to the float32 learner on the precision benchmark's prompts
(benchmarks/decode_precision.py).

    python benchmarks/int8_rollouts.py                 # SmolLM2-135M; minutes, longest at 256 rows
    python benchmarks/int8_rollouts.py --quick         # the tiny random model, 16 rows, a few seconds; no file

Part 2 (``--learning``) trains the quickstart for a fixed number of steps (no time budget, so runs on a busy
machine compare) for each seed, with ``engine.int8_weights=true algorithm.off_policy=tis`` and without
either, one ``polyrl train`` process at a time, and records held-out accuracy before and after, train time
and the engine-learner mismatch of the last steps.

    python benchmarks/int8_rollouts.py --learning --seeds 0 1 2 --steps 90

Both write (merge into) benchmarks/results/int8_rollouts.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from large_data import machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "int8_rollouts.json"
INT8 = ["engine.int8_weights=true", "algorithm.off_policy=tis"]
PROMPT = "What is 17 + 25? Answer with just the number."


def engines(model, tokenizer) -> dict:
    """The three engines, each sampling from ``model``: float32, bf16 and int8 weights."""
    from polyrl import HFEngine

    return {
        "float32": HFEngine(model, tokenizer, bf16=False, bf16_weights=False),
        "bf16": HFEngine(model, tokenizer, bf16=True, bf16_weights=True),
        "int8": HFEngine(model, tokenizer, bf16=False, bf16_weights=False, int8_weights=True),
    }


def tokens_per_s(engine, prompt: list[int], rows: int, new_tokens: int) -> float:
    """Generated tokens per second for ``rows`` rows (groups of 8) of exactly ``new_tokens`` tokens."""
    stop_ids, engine.stop_ids = engine.stop_ids, set()  # fixed length: every row decodes every step
    try:
        start = time.perf_counter()
        engine.generate([prompt] * max(1, rows // 8), n=min(8, rows), max_new_tokens=new_tokens, seed=0)
        return rows * new_tokens / (time.perf_counter() - start)
    finally:
        engine.stop_ids = stop_ids


def rollout(model_name: str, widths: list[int], repeats: int, new_tokens: int, gaps: bool) -> dict:
    from polyrl import keep_freed_memory, load_model, load_tokenizer

    keep_freed_memory()  # as every run does (runtime.keep_freed_memory)
    tokenizer = load_tokenizer(model_name)
    model = load_model(model_name, None, seed=0)
    built = engines(model, tokenizer)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    prompt = list(chat if isinstance(chat, list) else chat["input_ids"])
    paths = {name: {"decoder_dtype": str(e.fast.dtype), "weight_dtype": str(e.fast.weight_dtype),
                    "weight_bytes": e.fast.nbytes()} for name, e in built.items()}
    speed: dict[int, dict[str, float]] = {}
    for rows in widths:
        runs: dict[str, list[float]] = {name: [] for name in built}
        for engine in built.values():
            tokens_per_s(engine, prompt, rows, 8)  # warm-up at this width
        for _ in range(repeats):
            for name, engine in built.items():
                runs[name].append(tokens_per_s(engine, prompt, rows, new_tokens))
        speed[rows] = {name: statistics.median(v) for name, v in runs.items()}
        print(f"{rows:>4} rows: " + ", ".join(f"{n} {v:.0f} tok/s" for n, v in speed[rows].items()), flush=True)
    out = {"model": model_name, "paths": paths, "tokens_per_s": speed}
    if gaps:
        from decode_precision import logprob_gaps, sample_prompts

        prompts = sample_prompts(tokenizer)
        out["logprob_gap_to_float32_learner"] = {
            name: logprob_gaps(engine, model, prompts, bf16=False) for name, engine in built.items()}
        for name, gap in out["logprob_gap_to_float32_learner"].items():
            print(f"{name}: |engine - learner| log-prob mean {gap['mean']:.4f}, p99 {gap['p99']:.4f}, "
                  f"max {gap['max']:.4f} over {gap['tokens']} tokens", flush=True)
    return out


def mean_of(path: Path, key: str, last: int) -> float | None:
    """Mean of ``key`` over the last ``last`` records of a run's metrics.jsonl that have it."""
    values = [r[key] for r in map(json.loads, path.read_text().splitlines()) if key in r][-last:]
    return sum(values) / len(values) if values else None


def learning(seeds: list[int], steps: int, work: Path) -> list[dict]:
    """The quickstart for ``steps`` steps per seed, with int8 sampling (and tis) and without."""
    records = []
    for seed in seeds:
        for label, extra in (("baseline", []), ("int8_tis", INT8)):
            run_dir = work / f"{label}-seed{seed}"
            overrides = [f"train.seed={seed}", f"train.steps={steps}", "train.max_minutes=null",
                         "logging.report=false", *extra]
            cmd = [sys.executable, "-m", "polyrl", "train", str(ROOT / "configs" / "quickstart.yaml"),
                   *overrides, "--output", str(run_dir)]
            print(" ".join(cmd[2:]), flush=True)
            start = time.perf_counter()
            subprocess.run(cmd, check=True)
            summary = json.loads((run_dir / "summary.json").read_text())
            metrics = run_dir / "metrics.jsonl"
            records.append({
                "label": label, "seed": seed, "steps": steps, "overrides": extra,
                "eval_before": summary.get("eval_before"), "eval_after": summary.get("eval_after"),
                "train_time_s": summary.get("train_time_s"), "wall_s": round(time.perf_counter() - start, 1),
                "last10_reward_mean": mean_of(metrics, "reward/mean", 10),
                "last10_mismatch_kl": mean_of(metrics, "mismatch/kl", 10),
                "last10_mismatch_abs_log_ratio_max": mean_of(metrics, "mismatch/abs_log_ratio/max", 10),
                "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            })
            print(json.dumps(records[-1]), flush=True)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--repeats", type=int, default=3, help="alternating rollout runs per width and engine")
    ap.add_argument("--quick", action="store_true", help="tiny random model, 16 rows, nothing written")
    ap.add_argument("--learning", action="store_true", help="part 2 instead of part 1")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=90)
    ap.add_argument("--work", type=Path, default=Path("/tmp/polyrl-int8-rollouts"))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    from polyrl import SMOLLM2_ALIAS, TINY_ALIAS, native_kernels_available, native_ops

    if not native_kernels_available():
        raise SystemExit("the native kernels did not build on this machine (see the warning above); int8 "
                         "sampling runs on them")
    if args.quick:
        rollout(TINY_ALIAS, [16], 1, 16, gaps=False)
        return
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    part = "learning" if args.learning else "rollout"
    result.setdefault("machine", {})[part] = machine()  # each part may run on another machine or load
    if args.learning:
        new = learning(args.seeds, args.steps, args.work)
        done = {(r["label"], r["seed"], r["steps"]) for r in new}  # runs of other seeds are kept
        result["learning"] = [r for r in result.get("learning", [])
                              if (r["label"], r["seed"], r["steps"]) not in done] + new
    else:
        result["rollout"] = {"threads": torch.get_num_threads(), "isa": native_ops().isa(),
                             "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                             **rollout(SMOLLM2_ALIAS, args.rows, args.repeats, 64, gaps=True)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
