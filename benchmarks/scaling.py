"""Step time against group size and against max new tokens: do the curves grow faster than linearly?

One RL step is timed as its two halves: rollout (``HFEngine.generate``) and update (``Learner.update``) on the
samples it produced. Every sample decodes exactly ``max_new_tokens`` tokens (stop tokens are ignored), the
worst case, so the work grows linearly with both knobs; the log-log slope between the first and the last point
says how the time grows (1.0 is linear). Results: benchmarks/results/scaling.json and docs/performance_scaling.png.

    python benchmarks/scaling.py                       # SmolLM2-135M, both sweeps, ~5 min on 2 idle cores
    python benchmarks/scaling.py --sweep group         # one sweep only
    python benchmarks/scaling.py --model tiny-random --groups 2 4 --tokens 8 16 --out /tmp/s.json --png /tmp/s.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from roofline import build, prompt_ids, rollout_trajectories

ROOT = Path(__file__).resolve().parents[1]


def time_step(engine, learner, prompt: list[int], prompts: int, group: int, new_tokens: int, repeats: int) -> dict:
    """Median rollout and update seconds of one step with ``prompts`` x ``group`` samples of ``new_tokens``."""
    rollout, update = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        trajectories = rollout_trajectories(engine, prompt, prompts, group, new_tokens)
        t1 = time.perf_counter()
        learner.update(trajectories)
        engine.sync()
        t2 = time.perf_counter()
        rollout.append(t1 - t0)
        update.append(t2 - t1)
    r, u = statistics.median(rollout), statistics.median(update)
    return {"group": group, "new_tokens": new_tokens, "rollout_s": r, "update_s": u, "step_s": r + u}


def loglog_slope(points: list[dict], x: str, y: str) -> float:
    """Growth exponent between the first and last point: 1.0 is linear, above 1 faster than linear."""
    a, b = points[0], points[-1]
    return math.log(b[y] / a[y]) / math.log(b[x] / a[x])


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = [(k, x) for k, x in (("group", "group"), ("tokens", "new_tokens")) if results.get(k)]
    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.5 * len(sweeps), 4), squeeze=False)
    for ax, (key, x) in zip(axes[0], sweeps, strict=True):
        pts = results[key]
        xs = [p[x] for p in pts]
        for y, style in (("step_s", "o-"), ("rollout_s", "s--"), ("update_s", "^--")):
            ax.plot(xs, [p[y] for p in pts], style, label=f"{y[:-2]} (slope {loglog_slope(pts, x, y):.2f})")
        ax.plot(xs, [pts[0]["step_s"] * v / xs[0] for v in xs], ":", color="grey", label="linear from first point")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(v) for v in xs])
        ax.set_xlabel("group size" if key == "group" else "max new tokens")
        ax.set_ylabel("seconds per step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"{results['model']}: step time, {results['prompts']} prompt(s) per step")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sweep", choices=["group", "tokens", "both"], default="both")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--group-tokens", type=int, default=64, help="max new tokens in the group sweep")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--tokens-group", type=int, default=4, help="group size in the tokens sweep")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scaling.json")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "performance_scaling.png")
    args = ap.parse_args()

    _, tokenizer, engine, learner = build(args.model, args.micro_batch)
    prompt = prompt_ids(tokenizer)
    # Keep a sweep that is not rerun from an earlier result, so the plot always shows both.
    results = json.loads(args.out.read_text()) if args.out.exists() and args.sweep != "both" else {}
    results.update(model=args.model, prompts=args.prompts, threads=torch.get_num_threads(),
                   prompt_tokens=len(prompt))
    time_step(engine, learner, prompt, 1, 2, 4, 1)  # warm-up
    if args.sweep in ("group", "both"):
        results["group"] = []
        for g in args.groups:
            results["group"].append(time_step(engine, learner, prompt, args.prompts, g, args.group_tokens,
                                              args.repeats))
            print(results["group"][-1], flush=True)
            save(results, args.out)  # after every point: a run cut short keeps what it measured
    if args.sweep in ("tokens", "both"):
        results["tokens"] = []
        for t in args.tokens:
            results["tokens"].append(time_step(engine, learner, prompt, args.prompts, args.tokens_group, t,
                                               args.repeats))
            print(results["tokens"][-1], flush=True)
            save(results, args.out)
    for key, x in (("group", "group"), ("tokens", "new_tokens")):
        if results.get(key):
            ys = ("rollout_s", "update_s", "step_s")
            results[f"{key}_slopes"] = {y: loglog_slope(results[key], x, y) for y in ys}
            print(key, results[f"{key}_slopes"])
    save(results, args.out)
    plot(results, args.png)


def save(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
