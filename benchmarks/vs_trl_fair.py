"""The TRL comparison made fair: TRL given the best of a learning-rate sweep, both sides over seeds, in two tables:
like for like (TRL's algorithm settings on both sides, the same learning rate) and each at its best.

Every arm is one ``benchmarks/vs_trl.py`` run (its own process per framework, the same task, prompts, reward,
evaluator and training-time budget), written under its own tag; this script chooses the arms and reads them back.

    python benchmarks/vs_trl_fair.py sweep --lrs 5e-6 1e-5 3e-5 5e-5   # TRL at each rate, seed 0 (~10 min each)
    python benchmarks/vs_trl_fair.py seeds --seeds 0 1 2                # the best TRL rate, polyrl's recipe, and
                                                                        # polyrl like for like, per seed
                                                                        # (--arms: some of them)
    python benchmarks/vs_trl_fair.py table                              # docs/results/vs-trl-fair.md and
                                                                        # the README's two tables

TRL's linear schedule is set to reach 0 at the step it gets to in the budget (``--trl-decay-steps``, by default
the budget over TRL's median step in the sweep, or before the sweep in benchmarks/results/vs_trl.json), as
polyrl's reaches 0 at ``train.steps``.
Both sides run bf16 where the CPU computes it natively (TRL's default; polyrl's ``auto``); ``--fp32`` runs TRL in
float32 for a CPU without it. ``--avx2`` runs the like-for-like arms on the float32 path of a CPU without native
bf16, on any x86 machine: both sides in float32, every library capped at AVX2 (as benchmarks/avx2_path.py does),
under arm names of their own (``avx2_trl_best``, ``avx2_polyrl_like_for_like``); give ``--trl-decay-steps``.
Results: benchmarks/results/vs_trl_fair.json. Run on an idle machine: the budget is wall-clock training time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_block import replace_block  # noqa: E402
from machine_facts import label, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SUMMARY = RESULTS / "vs_trl_fair.json"
DOC = ROOT / "docs" / "results" / "vs-trl-fair.md"
README = ROOT / "README.md"
ARMS = {"trl_best": "TRL `GRPOTrainer`", "polyrl_like_for_like": "polyrl", "polyrl_recipe": "polyrl"}
NAMES = {**ARMS, "avx2_trl_best": ARMS["trl_best"], "avx2_polyrl_like_for_like": "polyrl"}
FLOAT32_PATH = ("Like for like on the float32 path of a CPU without native bf16 (both sides float32, every library "
                "capped at AVX2)")
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def run_arm(tag: str, kind: str, args: argparse.Namespace, extra: list[str]) -> dict:
    """One vs_trl.py run of one framework under ``tag`` (with ``--avx2``, in float32 under the AVX2 caps); its
    summary."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--only", kind, "--tag", tag, "--points", "1",
           "--minutes", str(args.minutes), "--eval-n", str(args.eval_n),
           "--out", str(RESULTS / "vs_trl_runs" / tag), *extra]
    if args.avx2:
        cmd.append("--trl-fp32" if kind == "trl" else "--polyrl-fp32")
    subprocess.run(cmd, check=True, env={**os.environ, **(AVX2_CAPS if args.avx2 else {})})
    written = RESULTS / f"vs_trl_{tag}.json"  # kept whole in the summary instead of one file per arm
    result = json.loads(written.read_text())
    written.unlink()
    return {**result["frameworks"][kind], "accuracy_before": result["accuracy_before"], "flags": cmd[2:],
            "machine": label(machine()), "caps": AVX2_CAPS if args.avx2 else {}}


def trl_decay_steps(args: argparse.Namespace, summary: dict) -> int:
    """The step TRL reaches in the budget: from the sweep's own TRL runs once there are any (this machine, this
    day), else from the last benchmarks/results/vs_trl.json."""
    if args.trl_decay_steps:
        return args.trl_decay_steps
    sweep = summary.get("sweep", {})
    if sweep:
        step = statistics.median(r["median_step_s"] for r in sweep.values())
    else:
        step = json.loads((RESULTS / "vs_trl.json").read_text())["frameworks"]["trl"]["median_step_s"]
    return max(1, int(args.minutes * 60 / step))


def trl_flags(args: argparse.Namespace, decay_steps: int, lr: float, seed: int) -> list[str]:
    return ["--trl-lr", str(lr), "--seed", str(seed), "--trl-decay-steps", str(decay_steps),
            *(["--trl-fp32"] if args.fp32 else [])]


def best_trl_lr(summary: dict) -> float:
    sweep = summary.get("sweep", {})
    if not sweep:
        raise SystemExit("no sweep yet: run `python benchmarks/vs_trl_fair.py sweep` first")
    return float(max(sweep, key=lambda lr: sweep[lr]["final_accuracy"]))


def seeded(runs: dict) -> tuple[list[float], float]:
    """An arm's held-out accuracy per seed (percent, in seed order) and its median step over the seeds."""
    return ([100 * runs[s]["final_accuracy"] for s in sorted(runs)],
            statistics.median(r["median_step_s"] for r in runs.values()))


def table(summary: dict) -> str:
    lines = [f"TRL's learning-rate sweep (seed 0, {summary.get('minutes', '?')} minutes of training each):", "",
             "| lr | steps | median step | held-out accuracy |", "| --- | --- | --- | --- |"]
    for lr, r in sorted(summary.get("sweep", {}).items(), key=lambda kv: float(kv[0])):
        lines.append(f"| {lr} | {r['steps']} | {r['median_step_s']:.2f} s | {100 * r['final_accuracy']:.1f} % |")
    for title, arms in (("Like for like (TRL's algorithm settings on both sides, TRL's best rate)",
                         ("trl_best", "polyrl_like_for_like")),
                        ("Each at its best", ("trl_best", "polyrl_recipe")),
                        (FLOAT32_PATH, ("avx2_trl_best", "avx2_polyrl_like_for_like"))):
        if not any(summary.get(arm) for arm in arms):
            continue
        lines += ["", title + ":", "", "| | seeds | median step | held-out accuracy per seed | median |",
                  "| --- | --- | --- | --- | --- |"]
        for arm in arms:
            runs = summary.get(arm, {})
            if not runs:
                continue
            accs, step = seeded(runs)
            lines.append(f"| {arm} | {len(runs)} | {step:.2f} s | {' / '.join(f'{a:.1f} %' for a in accs)} | "
                         f"{statistics.median(accs):.1f} % |")
    return "\n".join(lines)


def readme_tables(summary: dict) -> str:
    """The README's two tables over the seeded arms: like for like, and each at its best, with the machine and
    the median step of each polyrl arm as a multiple of TRL's."""
    def row(arm: str, trl_step: float | None) -> str:
        runs = summary[arm]
        accs, step = seeded(runs)
        steps = statistics.median(r["steps"] for r in runs.values())
        minutes = statistics.median(r["snapshots"][-1]["train_time_s"] / 60 for r in runs.values())
        faster = f" (**{trl_step / step:.1f}x** shorter)" if trl_step else ""
        return (f"| {NAMES[arm]} | {step:.2f} s{faster} | {steps:.0f} in {minutes:.1f} min | "
                f"{' / '.join(f'{a:.1f} %' for a in accs)} | **{statistics.median(accs):.1f} %** |")

    if not all(summary.get(arm) for arm in ARMS):
        return "(the seeded arms have not run yet: `python benchmarks/vs_trl_fair.py seeds`)"
    trl_step = seeded(summary["trl_best"])[1]
    machines = sorted({r.get("machine", "?") for arm in ARMS for r in summary[arm].values()})
    head = ["| | median step | steps, training time | held-out accuracy per seed | median |",
            "| --- | --- | --- | --- | --- |"]
    wrap = partial(textwrap.fill, width=115, break_on_hyphens=False)
    trl_steps = statistics.median(r["steps"] for r in summary["trl_best"].values())
    recipe_steps = statistics.median(r["steps"] for r in summary["polyrl_recipe"].values())
    like_steps = statistics.median(r["steps"] for r in summary["polyrl_like_for_like"].values())
    lines = [
        wrap("Like for like: TRL's algorithm settings on both sides (one sampling round, no guidance, clip 0.2 "
             f"both ways, Adam's default betas) at TRL's best learning rate, {best_trl_lr(summary):g}:"), "", *head,
        row("trl_best", None), row("polyrl_like_for_like", trl_step), "",
        wrap("Each at its best: TRL at its best rate; polyrl's `configs/quickstart.yaml` (lr 3e-5, clip-higher, "
             "dynamic sampling, reference guidance):"), "", *head, row("trl_best", None),
        row("polyrl_recipe", trl_step), "",
        wrap(f"{len(summary['trl_best'])} seeds per arm, a budget of {summary.get('minutes', 7.5):g} minutes of "
             f"training each (TRL's schedule ends at step {trl_steps:.0f}, polyrl's at {like_steps:.0f} like for like "
             f"and {recipe_steps:.0f} in its recipe); held-out accuracy before "
             f"training {100 * next(iter(summary['trl_best'].values()))['accuracy_before']:.1f} %. "
             f"Machine: {'; '.join(machines)}, no GPU.")]
    if summary.get("avx2_trl_best") and summary.get("avx2_polyrl_like_for_like"):
        f32_trl_step = seeded(summary["avx2_trl_best"])[1]
        seeds = len(summary["avx2_trl_best"])
        lines += ["", wrap(f"{FLOAT32_PATH}, the same rate, {seeds} seed{'s' if seeds > 1 else ''}:"), "", *head,
                  row("avx2_trl_best", None), row("avx2_polyrl_like_for_like", f32_trl_step)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["sweep", "seeds", "table"])
    p.add_argument("--lrs", type=float, nargs="+", default=[5e-6, 1e-5, 3e-5, 5e-5])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--minutes", type=float, default=7.5)
    p.add_argument("--eval-n", type=int, default=200)
    p.add_argument("--trl-decay-steps", type=int, default=None)
    p.add_argument("--fp32", action="store_true", help="TRL in float32 (a CPU without native bf16)")
    p.add_argument("--avx2", action="store_true", help="the like-for-like arms in float32 under the AVX2 caps")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS),
                   help="seeds: run only these arms (e.g. polyrl's again after a change of polyrl)")
    args = p.parse_args()
    summary = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}
    summary["minutes"] = args.minutes
    decay_steps = trl_decay_steps(args, summary)  # once per part: every arm of it decays alike
    if args.avx2 and not args.trl_decay_steps:
        raise SystemExit("--avx2: give --trl-decay-steps (the steps TRL takes in the budget on the float32 path)")
    if args.part == "sweep":
        for lr in args.lrs:
            run = run_arm(f"fair-trl-lr{lr}-s0", "trl", args, trl_flags(args, decay_steps, lr, 0))
            summary.setdefault("sweep", {})[str(lr)] = run
            SUMMARY.write_text(json.dumps(summary, indent=2))
    elif args.part == "seeds":
        lr = best_trl_lr(summary)
        for seed in args.seeds:
            like = ["--seed", str(seed), "--like-for-like", "--polyrl-lr", str(lr)]
            arms = {"trl_best": ("trl", trl_flags(args, decay_steps, lr, seed)),
                    "polyrl_recipe": ("polyrl", ["--seed", str(seed)]),
                    "polyrl_like_for_like": ("polyrl", like)}
            arms = {arm: arms[arm] for arm in args.arms}
            if args.avx2:  # the float32 path: like for like only, under names of its own
                arms = {f"avx2_{arm}": arms[arm] for arm in ("trl_best", "polyrl_like_for_like") if arm in arms}
            for arm, (kind, flags) in arms.items():
                summary.setdefault(arm, {})[str(seed)] = run_arm(f"fair-{arm}-s{seed}", kind, args, flags)
                SUMMARY.write_text(json.dumps(summary, indent=2))
    replace_block(DOC, "<!-- vs-trl-fair:start -->", "<!-- vs-trl-fair:end -->", table(summary), "Results")
    replace_block(README, "<!-- vs-trl:start -->", "<!-- vs-trl:end -->", readme_tables(summary),
                  "polyrl against TRL")
    print(table(summary))


if __name__ == "__main__":
    main()
