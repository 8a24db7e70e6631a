"""The algorithms side by side: each trains the same config for the same training-time budget.

Every algorithm starts from the same model and seed, trains in this process until its budget of training
time is spent (evaluation excluded), and is evaluated greedily on the held-out items at evenly spaced points
in training time. The table and an accuracy-vs-time plot go into docs/results/algorithms-time-budget.md
(between the benchmark markers) and docs/results/algorithms.png; the raw numbers into
benchmarks/results/algorithms.json. A sweep's table goes into docs/algorithms.md (``--block quickstart``) or
docs/results/algorithms-<block>.md.

    pip install -e ".[bench]"
    python benchmarks/algorithms.py --minutes 3                    # the embedded default, ~35 min in all
    python benchmarks/algorithms.py --config configs/smoke.yaml --minutes 0.1 \
        --doc /tmp/algorithms.md --png /tmp/algorithms.png         # a check of the script itself
    python benchmarks/algorithms.py --steps 20 --lrs 1e-5 3e-5 1e-4 --seeds 0 1 \
        --json benchmarks/results/algorithms_sweep.json             # the learning-rate sweep (hours on 2 cores)
    python benchmarks/algorithms.py --merge part1.json part2.json \
        --json benchmarks/results/algorithms_sweep.json             # a sweep split over processes (--only
                                                                    # or --seeds), or resumed with --resume

With one epoch per batch the importance ratio is exactly 1, where PPO-clip, GSPO and CISPO give the same
gradient; so gspo and cispo run two epochs per batch here, where their ratios differ.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import traceback
from pathlib import Path

from cascade import machine
from doc_block import replace_block

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- benchmark:start -->", "<!-- benchmark:end -->"

# name -> overrides on top of the config (the benchmark's own settings come after these)
ALGORITHMS: dict[str, list[str]] = {
    "grpo": ["algorithm.advantage=grpo", "algorithm.loss=ppo_clip"],
    "dr_grpo": ["algorithm.advantage=dr_grpo", "algorithm.loss.agg=seq-mean-token-sum"],
    "rloo": ["algorithm.advantage=rloo"],
    "reinforce_pp": ["algorithm.advantage=reinforce_pp"],
    "gspo": ["algorithm.loss=gspo", "algorithm.loss.agg=seq-mean-token-mean", "algorithm.loss.clip_low=3e-4",
             "algorithm.loss.clip_high=4e-4", "algorithm.loss.epochs=2"],
    "cispo": ["algorithm.loss=cispo", "algorithm.loss.clip_high=0.28", "algorithm.loss.epochs=2"],
    "dapo": ["algorithm.loss.clip_high=0.28", "algorithm.sampling.dynamic=true",
             "algorithm.sampling.max_extra_rounds=2", "algorithm.shaping.overlong_buffer={buffer}"],
    "ppo_gae": ["algorithm.critic.lam=0.95", "algorithm.critic.gamma=1.0"],
    "maxrl": ["algorithm.advantage=maxrl"],
    "dppo": ["algorithm.loss=dppo"],
    "sapo": ["algorithm.loss=sapo"],
}


def _config(path: Path, name: str, eval_n: int | None, steps: int | None = None, extra: list[str] | None = None):
    """The config of one run. With ``steps`` the run is that long, so a decaying learning-rate schedule
    reaches 0 at its end as in a real run; without, ``train.steps`` is huge and the schedule stays flat."""
    from polyrl import load_config

    base = load_config(path)
    buffer = max(1, base.rollout.max_new_tokens // 4)
    overrides = [o.format(buffer=buffer) for o in ALGORITHMS[name]] + (extra or [])
    overrides += ["eval.before=false", "eval.after=false", "logging.progress=false",
                  f"train.steps={steps or 1000000}", "train.max_minutes=null"]
    if eval_n is not None:
        overrides += [f"tasks.{i}.eval_size={eval_n}" for i in range(len(base.tasks))]
    return load_config(path, overrides), overrides


def _accuracy(run) -> float:
    from polyrl import evaluate_all

    scores = evaluate_all(run)
    return sum(scores.values()) / len(scores)


def run_one(
    path: Path, name: str, minutes: float, points: int, eval_n: int | None, base_acc: float | None
) -> dict:
    """Train ``name`` for ``minutes`` of training time; accuracy at 0 and at ``points`` even intervals."""
    from polyrl import build_run, rl_step

    cfg, overrides = _config(path, name, eval_n)
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(cfg, Path(tmp))
        budget = minutes * 60
        due = [budget * (i + 1) / points for i in range(points)]
        start = base_acc if base_acc is not None else _accuracy(run)
        curve = [{"train_time_s": 0.0, "step": 0, "accuracy": start}]
        train_time, step, rewards = 0.0, 0, []
        while due:
            step += 1
            metrics, _ = rl_step(run, step)
            train_time += metrics["step_time_s"]
            # the task's own reward: the overlong penalty is shaping, not success
            rewards.append(metrics["reward/mean"] - metrics.get("reward/overlong", 0.0))
            while due and train_time >= due[0] - 1e-9:
                due.pop(0)
                curve.append({"train_time_s": train_time, "step": step, "accuracy": _accuracy(run)})
        del run
    gc.collect()  # free this run's model and optimizer before the next one is built
    return {"overrides": overrides, "steps": step, "train_time_s": train_time, "curve": curve,
            "mean_train_reward": sum(rewards) / len(rewards)}


def run_steps(path: Path, name: str, steps: int, points: int, eval_n: int | None, extra: list[str],
              base_acc: float | None) -> dict:
    """Train ``name`` for ``steps`` updates with the config's own schedule over them; accuracy at the start and
    at ``points`` evenly spaced steps."""
    from polyrl import build_run, rl_step

    cfg, overrides = _config(path, name, eval_n, steps, extra)
    due = sorted({max(1, round(steps * (i + 1) / points)) for i in range(points)})
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(cfg, Path(tmp))
        curve = [{"step": 0, "accuracy": base_acc if base_acc is not None else _accuracy(run)}]
        train_time = 0.0
        for step in range(1, steps + 1):
            metrics, _ = rl_step(run, step)
            train_time += metrics["step_time_s"]
            if step in due:
                curve.append({"step": step, "train_time_s": train_time, "accuracy": _accuracy(run)})
        del run
    gc.collect()
    return {"overrides": overrides, "steps": steps, "train_time_s": train_time, "curve": curve}


def sweep_markdown(results: dict) -> str:
    """Per algorithm: the learning rate with the best final accuracy (mean over seeds), that mean, the
    spread over seeds at that rate, and the mean final accuracy at every rate."""
    lrs = results["lrs"]
    head = ["algorithm", "best lr", "final acc (mean)", "seeds' range", *[f"lr {lr:g}" for lr in lrs], "s/step"]
    items = results["eval_n"] or "the config's"
    starts = {r["curve"][0]["accuracy"] for by_lr in results["sweep"].values() for runs in by_lr.values()
              for r in runs.values() if "curve" in r}
    start = f", {100 * min(starts):.1f}% before training" if len(starts) == 1 else ""
    lines = [
        f"Config `{results['config']}`, {results['steps']} updates per run with the config's schedule over them, "
        f"learning rates {', '.join(f'{lr:g}' for lr in lrs)}, seeds {', '.join(map(str, results['seeds']))}; "
        f"held-out accuracy (greedy, {items} items) after the last update{start}; "
        f"{results['machine']}, {results['date']}.",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---" for _ in head) + " |",
    ]
    for name, by_lr in results["sweep"].items():
        finals = {lr: [r["curve"][-1]["accuracy"] for r in by_lr.get(str(lr), {}).values() if "curve" in r]
                  for lr in lrs}
        means = {lr: sum(v) / len(v) for lr, v in finals.items() if v}
        if not means:
            lines.append(f"| {name} | failed |" + " |" * (len(head) - 2))
            continue
        best = max(means, key=means.get)
        done = sum(len(v) for v in finals.values())
        if done < len(lrs) * len(results["seeds"]):
            name = f"{name} ({done} of {len(lrs) * len(results['seeds'])} runs)"
        runs = [r for r in by_lr[str(best)].values() if "curve" in r]
        per_step = sum(r["train_time_s"] for r in runs) / sum(r["steps"] for r in runs)
        cells = [name, f"{best:g}", f"{100 * means[best]:.1f}%",
                 f"{100 * min(finals[best]):.1f}-{100 * max(finals[best]):.1f}%",
                 *[f"{100 * means[lr]:.1f}%" if lr in means else "failed" if str(lr) in by_lr else "not run"
                   for lr in lrs], f"{per_step:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main_sweep(args: argparse.Namespace, results: dict) -> None:
    """Every algorithm at every learning rate and seed for ``args.steps`` updates."""
    results.update({"steps": args.steps, "lrs": args.lrs, "seeds": args.seeds, "eval_n": args.eval_n,
                    "sweep": {}})
    done = _finished_runs(args.resume, results) if args.resume else {}
    base_acc = None
    for name in args.only or list(ALGORITHMS):
        for lr in args.lrs:
            for seed in args.seeds:
                if (name, str(lr), str(seed)) in done:
                    results["sweep"].setdefault(name, {}).setdefault(str(lr), {})[str(seed)] = \
                        done[name, str(lr), str(seed)]
                    continue
                t0 = time.perf_counter()
                try:
                    res = run_steps(args.config, name, args.steps, args.points, args.eval_n,
                                    [f"optim.lr={lr}", f"train.seed={seed}"], base_acc)
                    base_acc = res["curve"][0]["accuracy"]
                except Exception as exc:  # one failing run must not lose the others' results
                    traceback.print_exc()
                    res = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
                results["sweep"].setdefault(name, {}).setdefault(str(lr), {})[str(seed)] = res
                final = f"{100 * res['curve'][-1]['accuracy']:.1f}%" if "curve" in res else res["error"]
                print(f"{name} lr {lr:g} seed {seed}: {final} ({time.perf_counter() - t0:.0f}s wall)", flush=True)
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=2))  # a partial sweep survives an interruption
    table = sweep_markdown(results)
    replace_block(args.doc, f"<!-- sweep:{args.block}:start -->", f"<!-- sweep:{args.block}:end -->", table,
                  f"Learning-rate sweep ({args.block})")
    print(table)


SWEEP_SETTINGS = ("config", "steps", "lrs", "eval_n")


def _finished_runs(path: Path, results: dict) -> dict[tuple[str, str, str], dict]:
    """The runs that finished in an earlier sweep file of the same settings, by (algorithm, lr, seed)."""
    earlier = json.loads(path.read_text())
    if any(earlier.get(k) != results.get(k) for k in SWEEP_SETTINGS):
        raise SystemExit(f"{path}: another sweep's settings ({', '.join(SWEEP_SETTINGS)} differ)")
    return {(name, lr, seed): run for name, by_lr in earlier["sweep"].items() for lr, runs in by_lr.items()
            for seed, run in runs.items() if "curve" in run}


def merge_sweeps(paths: list[Path], out: Path, doc: Path, block: str) -> None:
    """One sweep from several partial ones of the same settings (split by algorithm or by seed): each run
    from whichever file finished it, its JSON and its table."""
    parts = [json.loads(p.read_text()) for p in paths]
    for path, part in zip(paths, parts, strict=True):
        if any(part.get(k) != parts[0].get(k) for k in SWEEP_SETTINGS):
            raise SystemExit(f"{path}: another sweep's settings ({', '.join(SWEEP_SETTINGS)} differ from "
                             f"{paths[0]})")
    seeds = sorted({seed for part in parts for seed in part["seeds"]})
    merged = {**parts[0], "seeds": seeds, "sweep": {}, "merged_from": [p.name for p in paths]}
    for part in parts:
        for name, by_lr in part["sweep"].items():
            for lr, runs in by_lr.items():
                for seed, run in runs.items():
                    slot = merged["sweep"].setdefault(name, {}).setdefault(lr, {})
                    if "curve" in run or seed not in slot:  # a finished run wins over a failed one
                        slot[seed] = run
    order = [*ALGORITHMS, *sorted(set(merged["sweep"]) - set(ALGORITHMS))]  # the table in the usual order
    merged["sweep"] = {name: merged["sweep"][name] for name in order if name in merged["sweep"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=2))
    table = sweep_markdown(merged)
    replace_block(doc, f"<!-- sweep:{block}:start -->", f"<!-- sweep:{block}:end -->", table,
                  f"Learning-rate sweep ({block})")
    print(table)


def markdown(results: dict) -> str:
    points = max(len(r.get("curve", [])) for r in results["algorithms"].values())
    times = [f"acc @ {results['minutes'] * i / (points - 1):.3g} min" for i in range(points)]
    head = ["algorithm", "steps", "s/step", *times, "train reward"]
    lines = [
        f"Config `{results['config']}`, {results['minutes']} min of training time per algorithm "
        f"(evaluation excluded), held-out accuracy (greedy, fully correct) at evenly spaced times; "
        f"{results['machine']}, {results['date']}.",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---" for _ in head) + " |",
    ]
    for name, r in results["algorithms"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} |" + " |" * (len(head) - 2))
            continue
        accs = [f"{100 * c['accuracy']:.1f}%" for c in r["curve"]] + [""] * (points - len(r["curve"]))
        per_step = r["train_time_s"] / max(r["steps"], 1)
        cells = [name, str(r["steps"]), f"{per_step:.1f}", *accs, f"{r['mean_train_reward']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "![accuracy vs training time](algorithms.png)", ""]
    return "\n".join(lines)


def write_doc(doc: Path, table: str) -> None:
    replace_block(doc, START, END, table, "Benchmark results")


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("matplotlib is needed for the plot: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in results["algorithms"].items():
        if "curve" in r:
            xs = [c["train_time_s"] / 60 for c in r["curve"]]
            ax.plot(xs, [100 * c["accuracy"] for c in r["curve"]], marker="o", label=name)
    ax.set_xlabel("training time (min, evaluation excluded)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Algorithms on {Path(results['config']).name}, same training-time budget")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    p.add_argument("--minutes", type=float, default=3.0, help="training-time budget per algorithm")
    p.add_argument("--points", type=int, default=3, help="evaluations per run after the start, evenly spaced")
    p.add_argument("--eval-n", type=int, default=None, help="held-out items per task (default: the config's)")
    p.add_argument("--only", nargs="*", choices=list(ALGORITHMS), help="a subset of the algorithms")
    p.add_argument("--doc", type=Path, default=None, help="default: where the docs keep this mode's table")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "results" / "algorithms.png")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "algorithms.json")
    p.add_argument("--steps", type=int, default=None,
                   help="a sweep: this many updates per run (the schedule decays over them), at every --lrs and "
                        "--seeds; the table goes between the sweep:<--block> markers")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 3e-5, 1e-4])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--block", default="quickstart", help="the sweep table's marker name in --doc")
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="only join these sweep JSONs (e.g. runs split with --only over processes) into --json "
                        "and write their table")
    p.add_argument("--resume", type=Path, default=None,
                   help="a sweep: take the runs this earlier sweep JSON of the same settings finished instead "
                        "of running them again")
    args = p.parse_args()
    if args.doc is None:
        sweep = args.steps is not None or args.merge
        page = "algorithms.md" if sweep and args.block == "quickstart" else (
            f"results/algorithms-{args.block}.md" if sweep else "results/algorithms-time-budget.md")
        args.doc = ROOT / "docs" / page
    if args.merge:
        merge_sweeps(args.merge, args.json, args.doc, args.block)
        return
    if args.points < 1 or args.minutes <= 0:
        raise SystemExit("--points must be >= 1 and --minutes > 0")

    results = {
        "config": str(args.config.resolve().relative_to(ROOT) if args.config.resolve().is_relative_to(ROOT)
                      else args.config),
        "minutes": args.minutes,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "algorithms": {},
    }
    if args.steps is not None:
        main_sweep(args, results)
        return
    base_acc = None  # every algorithm starts from the same weights: evaluate the start once
    for name in args.only or list(ALGORITHMS):
        t0 = time.perf_counter()
        try:
            res = run_one(args.config, name, args.minutes, args.points, args.eval_n, base_acc)
            base_acc = res["curve"][0]["accuracy"]
        except Exception as exc:  # one failing algorithm must not lose the others' results
            traceback.print_exc()
            res = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        results["algorithms"][name] = res
        final = f"{100 * res['curve'][-1]['accuracy']:.1f}%" if "curve" in res else res["error"]
        print(f"{name}: {final} ({time.perf_counter() - t0:.0f}s wall)", flush=True)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    plot(results, args.png)
    table = markdown(results).replace("(algorithms.png)", f"({args.png.name})")
    write_doc(args.doc, table)
    print(table)


if __name__ == "__main__":
    main()
