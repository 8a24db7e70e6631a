"""Runtimes on one mixed workload: samples/s and tokens/s for sync, async eta=1, async eta=2 and Ray with two
rollout workers, plus reward per step at equal samples. Writes benchmarks/results/systems.json and the
table in docs/results/runtimes.md.

    python benchmarks/systems.py [--model smollm2-135m-instruct] [--steps 5] [--sft-steps 4] [--start-model CKPT]

The workload mixes three tasks whose response lengths and tool latencies differ several-fold:

- ``chain_sum``: one turn, no tool, a short numeric answer (a few tokens);
- ``calc_api``: tool_math (2-3 one-digit terms), up to 3 turns, each calculator call 0.2 s (a remote API);
- ``calc_sandbox``: tool_math (3 two-digit terms), up to 3 turns, each call 1.0 s (a code sandbox's start
  and run).

Neither base model calls tools on its own (docs/agents.md), so every runtime starts from one short SFT warm
start on the tasks' own demonstrations (untimed; ``--sft-steps``). Throughput counts steps 2.. only: step 1
includes starting the rollout process or the Ray actors. The load average before and after goes into the
results: the numbers only mean something on an otherwise idle machine. ``--model tiny-random`` checks the
plumbing in about a minute, but it never learns a tool call in a few SFT steps, so it measures no tool wait.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from doc_block import replace_block  # noqa: E402

RUNS = {
    "sync": ["runtime.kind=local"],
    "async_eta1": ["runtime.kind=async", "runtime.eta=1", "runtime.rollout_threads=1", "algorithm.off_policy=tis"],
    "async_eta2": ["runtime.kind=async", "runtime.eta=2", "runtime.rollout_threads=1", "algorithm.off_policy=tis"],
    "ray_2workers_eta1": ["runtime.kind=ray", "runtime.num_workers=2", "runtime.eta=1", "runtime.ray_num_cpus=2",
                          "algorithm.off_policy=tis"],
}
# Torch threads of the learner's process: both cores in every runtime (measured: giving async's learner one of
# them cost more than the overlap gained); the async rollout process takes 1 thread, each Ray actor 1 CPU.
LEARNER_THREADS = 2
LATENCY_S = {"calc_api": 0.2, "calc_sandbox": 1.0}
START, END = "<!-- systems-benchmark -->", "<!-- /systems-benchmark -->"


def config_data(model: str, steps: int, latency: bool = True) -> dict:
    """The mixed workload; ``latency=False`` for the warm start, whose demonstrations are not timed."""

    def tool_task(name: str, dataset_params: dict) -> dict:
        return {"name": name, "env": "tool_math", "max_turns": 3, "max_tokens": 192, "eval_size": 8,
                "tool_latency_s": LATENCY_S[name] if latency else 0.0,
                "params": {"dataset": "chain_sum", "dataset_params": dataset_params, "tool_error_penalty": 0.05}}

    return {
        "name": "systems",
        "model": {"name": model, "bf16": model != "tiny-random"},
        "tasks": [
            {"name": "chain_sum", "params": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
             "prompt_suffix": " Answer with just the number.", "eval_size": 8},
            tool_task("calc_api", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
            tool_task("calc_sandbox", {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2}),
        ],
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 48},
        "optim": {"lr": 2e-5},
        "train": {"steps": steps, "seed": 0, "checkpoint_every": 0},
        "eval": {"before": False, "after": False},
        "logging": {"progress": False, "report": False, "tensorboard": False, "trajectories_per_group": 0},
    }


def warm_start(model: str, sft_steps: int, out: Path) -> str:
    """SFT on the tasks' demonstrations (tool calls for the tool tasks, the gold answer for chain_sum); returns
    the checkpoint every runtime starts from."""
    from polyrl import latest_checkpoint, load_config, train_sft

    run_dir = out / f"sft-{model}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(None, [], data=config_data(model, sft_steps, latency=False))
    t0 = time.perf_counter()
    train_sft(cfg, run_dir, log=lambda *_: None)
    print(f"warm start: {sft_steps} SFT steps in {time.perf_counter() - t0:.0f} s", flush=True)
    return str(latest_checkpoint(run_dir))


def measure(name: str, overrides: list[str], model: str, steps: int, out: Path) -> dict:
    import torch

    from polyrl import load_config, run_training

    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(None, overrides, data=config_data(model, steps))
    torch.set_num_threads(LEARNER_THREADS)
    t0 = time.perf_counter()
    run_training(cfg, run_dir, log=lambda *_: None)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:]
    seconds = sum(r["step_time_s"] for r in timed)
    samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    tokens = sum(r["response_length/mean"] * samples for r in timed)
    tasks = [t.name for t in cfg.tasks]
    return {
        "samples_per_s": samples * len(timed) / seconds,
        "tokens_per_s": tokens / seconds,
        "step_s": seconds / len(timed),
        "wall_s": wall,
        "staleness_mean": mean(r.get("staleness/mean", 0.0) for r in rows),
        "tool_calls_mean": mean(r.get("tool_calls/mean") or 0.0 for r in rows),
        "response_length_mean": mean(r["response_length/mean"] for r in rows),
        "rollout_time_s": mean(r["rollout_time_s"] for r in timed),
        "update_time_s": mean(r["update_time_s"] for r in timed),
        "curve": [{"step": r["step"], "samples": r["step"] * samples, "reward": r["reward/mean"],
                   **{f"reward/{t}": r.get(f"reward/{t}") for t in tasks}} for r in rows],
    }


def task_profile(run_dir: Path) -> dict:
    """Per task, from the sync run's trajectories: model tokens and tool calls per sample."""
    path = run_dir / "trajectories.jsonl"
    if not path.exists():
        return {}
    by_task: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        t = json.loads(line)
        by_task.setdefault(t["task"], []).append(t)
    return {task: {"samples": len(ts),
                   "model_tokens": mean(sum(t["loss_mask"]) for t in ts),
                   "tool_calls": mean(t["info"].get("tool_calls", 0) for t in ts)} for task, ts in by_task.items()}


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def table(results: dict, meta: dict) -> str:
    base = results["sync"]["samples_per_s"]
    lat = ", ".join(f"{k} {v} s" for k, v in LATENCY_S.items())
    lines = [f"Measured by `{meta['command']}` on this 2-core CPU ({meta['date']}; tool latency per call: {lat}; "
             f"load average before / after: {meta['loadavg_before'][0]:.2f} / {meta['loadavg_after'][0]:.2f}):",
             "", "| runtime | samples/s | tokens/s | vs sync | s/step | mean staleness | tool calls/sample | "
             "wall s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['samples_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['samples_per_s'] / base:.2f}x | {r['step_s']:.1f} | {r['staleness_mean']:.2f} | "
                     f"{r['tool_calls_mean']:.2f} | {r['wall_s']:.0f} |")
    r, u = results["sync"]["rollout_time_s"], results["sync"]["update_time_s"]
    lines += ["", f"Sync's step splits into rollout {r:.1f} s (tool waits included) and update {u:.1f} s, so even a "
              f"perfect overlap of the two could reach at most (R + U) / max(R, U) = {(r + u) / max(r, u):.2f}x."]
    steps = len(results["sync"]["curve"])
    samples = results["sync"]["curve"][0]["samples"]
    lines += ["", f"Reward per step (mean over the step's {samples} samples; equal samples per step in every "
              "runtime):", "", "| runtime | " + " | ".join(str(i + 1) for i in range(steps)) + " | mean |",
              "| --- |" + " --- |" * (steps + 1)]
    for name, r in results.items():
        rewards = [c["reward"] for c in r["curve"]]
        cells = " | ".join(f"{x:.2f}".replace("-0.00", "0.00") for x in rewards)
        lines.append(f"| {name} | {cells} | {mean(rewards):.2f} |")
    if meta.get("profile"):
        lines += ["", "Per task (sync run, all steps): model tokens and tool calls per sample:", "",
                  "| task | tool latency | model tokens | tool calls |", "| --- | --- | --- | --- |"]
        for task, p in meta["profile"].items():
            lines.append(f"| {task} | {LATENCY_S.get(task, 0.0)} s | {p['model_tokens']:.1f} | {p['tool_calls']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--sft-steps", type=int, default=4, help="tool-call warm start before every runtime")
    parser.add_argument("--start-model", help="a warm-start checkpoint to reuse instead of the SFT steps")
    parser.add_argument("--only", nargs="*", default=list(RUNS))
    parser.add_argument("--no-doc", action="store_true", help="write the results file only")
    parser.add_argument("--latency-scale", type=float, default=1.0,
                        help="multiply every tool latency (a sensitivity check: how much waiting async can hide)")
    parser.add_argument("--tag", default="", help="write benchmarks/results/systems_TAG.json and leave the doc alone")
    args = parser.parse_args()
    for task in LATENCY_S:
        LATENCY_S[task] = round(LATENCY_S[task] * args.latency_scale, 3)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    out = ROOT / "runs" / "bench_systems"
    meta = {"command": " ".join(["python", "benchmarks/systems.py", *sys.argv[1:]]),
            "model": args.model, "steps": args.steps, "sft_steps": args.sft_steps, "latency_s": LATENCY_S,
            "learner_threads": LEARNER_THREADS,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg_before": loadavg()}
    start_model = args.start_model or (warm_start(args.model, args.sft_steps, out) if args.sft_steps else args.model)
    meta["start_model"] = start_model
    results = {}
    for name in args.only:
        overrides = [*RUNS[name], f"model.name={start_model}"]
        if name == "sync":  # the per-task profile reads this run's trajectories
            overrides.append("logging.trajectories_per_group=100")
        results[name] = measure(name, overrides, args.model, args.steps, out)
        print(name, {k: v for k, v in results[name].items() if k != "curve"}, flush=True)
    meta["loadavg_after"] = loadavg()
    meta["profile"] = task_profile(out / "sync")
    results_path = ROOT / "benchmarks" / "results" / (f"systems_{args.tag}.json" if args.tag else "systems.json")
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps({**meta, "runs": results}, indent=2))
    if "sync" in results and not args.no_doc and not args.tag:
        replace_block(ROOT / "docs" / "results" / "runtimes.md", START, END, table(results, meta), "Throughput")


if __name__ == "__main__":
    main()
