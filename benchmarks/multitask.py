"""Multi-task GRPO with and without task-advantage normalisation, against single-task specialists at equal
samples, on SmolLM2-135M-Instruct over reasoning-gym tasks the model partly solves.

- ``multi``: one policy on an equal mixture of the tasks for ``--steps`` steps.
- ``multi+task_norm``: the same with ``algorithm.advantage.task_norm: true`` (AgentRL).
- ``specialist/<task>``: one policy per task for ``--steps / n_tasks`` steps of the same batch size, so each
  specialist sees as many samples of its task as the mixture gives it on average (and all specialists
  together as many as one multi-task run).

Every run starts from the same weights and seed; held-out accuracy is greedy on the same items. Results go to
benchmarks/results/multitask.json and a table in docs/multidomain.md (between the multitask markers).

    python benchmarks/multitask.py                      # the defaults (3 tasks, 24 steps)
    python benchmarks/multitask.py --tasks chain_sum products --steps 12 --prompts 4 --group 6 --max-new 24 \\
        --eval-n 40                                     # what docs/multidomain.md reports (22 min per multi-task run
                                                        # on 2 heavily shared cores)
    python benchmarks/multitask.py --model tiny-random --steps 2 --eval-n 4 \\
        --json /tmp/mt.json --doc /tmp/mt.md             # a check of the script itself
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from doc_block import replace_block

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- multitask:start -->", "<!-- multitask:end -->"
ONE_DIGIT = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
TASKS = {
    "chain_sum": ONE_DIGIT,
    "basic_arithmetic": ONE_DIGIT,
    "products": ONE_DIGIT,
}


def make_config(model: str, tasks: list[str], steps: int, task_norm: bool, eval_n: int, args):
    from polyrl import load_config

    data = {
        "name": "multitask",
        "model": {"name": model, "bf16": model != "tiny-random"},
        "tasks": [{"name": n, "params": TASKS[n], "prompt_suffix": " Answer with just the number.",
                   "eval_size": eval_n} for n in tasks],
        "rollout": {"prompts_per_step": args.prompts, "group_size": args.group, "max_new_tokens": args.max_new},
        "algorithm": {"advantage": {"estimator": "grpo", "task_norm": task_norm},
                      "regularisers": {"track_kl": False}},
        "optim": {"lr": args.lr, "schedule": "linear"},
        "train": {"steps": steps, "seed": args.seed},
        "eval": {"max_new_tokens": args.max_new},
        "logging": {"progress": False, "tensorboard": False, "report": False},
    }
    return load_config(None, data=data)


def run_one(cfg, base: dict[str, float] | None) -> dict:
    """Train ``cfg.train.steps`` steps; held-out accuracy per task at the start (unless given) and end."""
    from polyrl import build_run, evaluate_all, rl_step

    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(cfg, Path(tmp))
        before = base if base is not None else evaluate_all(run)
        t0, rewards, counts = time.perf_counter(), [], {}
        for step in range(1, cfg.train.steps + 1):
            metrics, trajectories = rl_step(run, step)
            rewards.append(metrics["reward/mean"])
            for t in trajectories:
                counts[t.task] = counts.get(t.task, 0) + 1
        train_s = time.perf_counter() - t0
        after = evaluate_all(run)
        del run
    gc.collect()
    return {"steps": cfg.train.steps, "train_time_s": train_s, "before": before, "after": after,
            "samples": counts, "mean_train_reward": sum(rewards) / max(len(rewards), 1)}


def markdown(results: dict) -> str:
    tasks = results["tasks"]
    head = ["run", "steps", "samples", *[f"{t} before → after" for t in tasks], "mean", "train min"]
    lines = [
        f"Model `{results['model']}`, GRPO, {results['prompts']} prompts x {results['group']} "
        f"samples per step, greedy held-out accuracy on {results['eval_n']} items per task; "
        f"{results['machine']}, {results['date']}. Specialists train on one task for steps / {len(tasks)}.",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---" for _ in head) + " |",
    ]
    for name, r in results["runs"].items():
        accs = [f"{100 * r['before'][t]:.0f}% → {100 * r['after'][t]:.0f}%" if t in r["after"] else "—"
                for t in tasks]
        mean = sum(r["after"].values()) / len(r["after"])
        samples = ", ".join(f"{t}: {n}" for t, n in sorted(r["samples"].items()))
        lines.append("| " + " | ".join([name, str(r["steps"]), samples, *accs, f"{100 * mean:.0f}%",
                                         f"{r['train_time_s'] / 60:.1f}"]) + " |")
    spec = [results["runs"][f"specialist/{t}"]["after"][t] for t in tasks if f"specialist/{t}" in results["runs"]]
    if len(spec) == len(tasks):
        lines += ["", f"Specialists' mean (each on its own task): {100 * sum(spec) / len(spec):.0f}%."]
    return "\n".join(lines)


def write_doc(doc: Path, table: str) -> None:
    replace_block(doc, START, END, table, "Multi-task training")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--steps", type=int, default=24, help="steps of each multi-task run")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=6)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--eval-n", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", help="run only these (multi, multi+task_norm, specialist/<task>)")
    p.add_argument("--merge", type=Path, help="a results JSON of the same settings: reuse its start accuracy and "
                   "keep its runs (so runs can be split over processes)")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "multitask.json")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "multidomain.md")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    results = {"model": args.model, "tasks": args.tasks, "steps": args.steps, "prompts": args.prompts,
               "group": args.group, "max_new_tokens": args.max_new, "lr": args.lr, "eval_n": args.eval_n,
               "seed": args.seed, "machine": f"{platform.machine()}, {cores} cores",
               "date": time.strftime("%Y-%m-%d"), "runs": {}}
    wall0 = time.perf_counter()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    spec_steps = max(1, args.steps // len(args.tasks))
    plan = [("multi", args.tasks, args.steps, False), ("multi+task_norm", args.tasks, args.steps, True)]
    plan += [(f"specialist/{t}", [t], spec_steps, False) for t in args.tasks]
    base = None
    if args.merge is not None:
        earlier = json.loads(args.merge.read_text())
        results["runs"].update(earlier["runs"])
        base = next(iter(earlier["runs"].values()))["before"] if earlier["runs"] else None
    for name, tasks, steps, norm in plan:
        if args.only and name not in args.only:
            continue
        start = {t: base[t] for t in tasks} if base is not None else None
        res = run_one(make_config(args.model, tasks, steps, norm, args.eval_n, args), start)
        base = base or res["before"]
        results["runs"][name] = res
        results["wall_time_s"] = time.perf_counter() - wall0
        args.json.write_text(json.dumps(results, indent=2))  # after every run, so a cut-short run keeps its part
        print(f"{name}: {json.dumps(res['after'])} ({res['train_time_s']:.0f}s)", flush=True)
    table = markdown(results)
    write_doc(args.doc, table)
    print(table)


if __name__ == "__main__":
    main()
