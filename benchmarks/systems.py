"""Runtimes on one mixed workload: samples/s and tokens/s for sync, async eta=1, async eta=2 and Ray with two
rollout workers, plus reward per step at equal samples. Writes benchmarks/results/systems.json and the
table in docs/systems.md.

    python benchmarks/systems.py [--steps 8] [--model tiny-random]

The workload mixes a short-answer task (chain_sum, one turn) with a multi-turn tool task (tool_math, up to
three turns), so response lengths differ several-fold. Throughput counts steps 2.. only: step 1 includes
starting the rollout process or the Ray actors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "sync": ["runtime.kind=local"],
    "async_eta1": ["runtime.kind=async", "runtime.eta=1", "algorithm.off_policy=tis"],
    "async_eta2": ["runtime.kind=async", "runtime.eta=2", "algorithm.off_policy=tis"],
    "ray_2workers_eta1": ["runtime.kind=ray", "runtime.num_workers=2", "runtime.eta=1", "runtime.ray_num_cpus=2",
                          "algorithm.off_policy=tis"],
}
MARK = "<!-- systems-benchmark -->"


def config_data(model: str, steps: int) -> dict:
    return {
        "name": "systems",
        "model": {"name": model, "bf16": model != "tiny-random"},
        "tasks": [
            {"name": "chain_sum", "params": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
             "prompt_suffix": " Answer with just the number.", "eval_size": 8},
            {"name": "tool_math", "env": "tool_math", "max_turns": 3,
             "params": {"dataset": "chain_sum", "dataset_params": {"min_terms": 2, "max_terms": 3}}},
        ],
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 32},
        "optim": {"lr": 1e-5},
        "train": {"steps": steps, "seed": 0, "checkpoint_every": 0},
        "eval": {"before": False, "after": False},
        "logging": {"progress": False, "report": False, "tensorboard": False, "trajectories_per_group": 0},
    }


def measure(name: str, overrides: list[str], model: str, steps: int, out: Path) -> dict:
    from polyrl.config import load_config
    from polyrl.train.loop import train

    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(None, overrides, data=config_data(model, steps))
    t0 = time.perf_counter()
    train(cfg, run_dir, log=lambda *_: None)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:]
    seconds = sum(r["step_time_s"] for r in timed)
    samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    tokens = sum(r["response_length/mean"] * samples for r in timed)
    return {
        "samples_per_s": samples * len(timed) / seconds,
        "tokens_per_s": tokens / seconds,
        "wall_s": wall,
        "staleness_mean": sum(r.get("staleness/mean", 0.0) for r in rows) / len(rows),
        "curve": [{"samples": r["step"] * samples, "reward": r["reward/mean"]} for r in rows],
    }


def table(results: dict, model: str) -> str:
    base = results["sync"]["samples_per_s"]
    lines = [MARK, f"Measured by `python benchmarks/systems.py` on this 2-core CPU, model `{model}`:", "",
             "| runtime | samples/s | tokens/s | vs sync | mean staleness | wall s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['samples_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['samples_per_s'] / base:.2f}x | {r['staleness_mean']:.2f} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--only", nargs="*", default=list(RUNS))
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    out = ROOT / "runs" / "bench_systems"
    results_path = ROOT / "benchmarks" / "results" / "systems.json"
    results = json.loads(results_path.read_text())["runs"] if results_path.exists() else {}
    for name in args.only:
        results[name] = measure(name, RUNS[name], args.model, args.steps, out)
        print(name, {k: v for k, v in results[name].items() if k != "curve"}, flush=True)
    results = {k: results[k] for k in RUNS if k in results}
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps({"model": args.model, "steps": args.steps, "runs": results}, indent=2))
    if "sync" in results:
        doc = ROOT / "docs" / "systems.md"
        text = doc.read_text()
        start = text.find(MARK)
        if start < 0:
            text = text.rstrip() + "\n\n" + table(results, args.model)
        else:
            end = text.find("\n## ", start)
            text = text[:start] + table(results, args.model) + (text[end:] if end >= 0 else "")
        doc.write_text(text)


if __name__ == "__main__":
    main()
