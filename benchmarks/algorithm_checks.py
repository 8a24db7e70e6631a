"""Three checks of the second wave of algorithms, each a few short runs of SmolLM2-135M-Instruct at equal steps.

- ``try-again``: the quickstart task trained with ``tasks[].attempts: k`` (a wrong answer gets feedback and
  another attempt) against plain single-attempt training; held-out accuracy at 1 and at k attempts, before
  and after.
- ``pcgrad``: two tasks in one run with ``algorithm.gradients.surgery`` none and pcgrad at equal samples; the
  per-task gradient norms and their cosine (``task_grad/``) every step, held-out accuracy per task.
- ``off-policy``: the quickstart made off-policy (``runtime.kind: async``, ``eta`` 2: rollouts sampled up to
  two policy versions behind, by the bf16 engine against the float32 learner) under each correction; the
  ``mismatch/`` metrics and held-out accuracy.

Each writes benchmarks/results/algorithm_checks/<check>.json and its table between the
``<!-- check:<check>:start/end -->`` markers of docs/results/<check>.md (``--table-only`` rewrites the table from
the JSON).

    python benchmarks/algorithm_checks.py try-again                 # ~15 min on 2 cores
    python benchmarks/algorithm_checks.py pcgrad
    python benchmarks/algorithm_checks.py off-policy
    python benchmarks/algorithm_checks.py pcgrad --set model.name=tiny-random --steps 2 --eval-n 4 \
        --out /tmp/checks --doc /tmp/checks.md                      # a check of the script itself
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cascade import machine
from doc_block import replace_block

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["eval.before=false", "eval.after=false", "logging.progress=false", "logging.report=false",
         "logging.tensorboard=false"]
CORRECTIONS = ["none", "tis", "mis", "icepop", "geo_mask", "prob_mask"]


def config(path: Path, overrides: list[str], keep_tasks: list[str] | None = None):
    """``path`` with ``overrides``; ``keep_tasks`` keeps only those tasks (and drops a pipeline's stages)."""
    from polyrl import load_config

    if keep_tasks is None:
        return load_config(path, overrides)
    data = load_config(path).model_dump(mode="json", exclude={"stages", "pipeline"})
    missing = set(keep_tasks) - {t["name"] for t in data["tasks"]}
    if missing:
        raise SystemExit(f"{path}: no task named {', '.join(sorted(missing))}")
    data["tasks"] = [t for t in data["tasks"] if t["name"] in keep_tasks]
    return load_config(str(path), overrides, data=data)


def train_and_read(cfg, run_dir: Path) -> tuple[dict, list[dict], str]:
    """Train ``cfg`` into ``run_dir``: its summary, its metrics rows and its final checkpoint."""
    from polyrl import latest_checkpoint, run_training

    summary = run_training(cfg, run_dir, log=lambda *_: None)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, str(latest_checkpoint(run_dir))


def accuracy(cfg, model: str) -> dict[str, float]:
    from polyrl import evaluate_domains

    return evaluate_domains(cfg, model)


def series(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if isinstance(r.get(key), int | float)]


def check_try_again(args, tmp: Path) -> dict:
    k = args.attempts
    base = {n: config(args.config, args.common + [f"tasks.0.attempts={n}"]) for n in (1, k)}
    start = base[1].model.name
    result = {"attempts": k, "before": {f"at_{n}": accuracy(cfg, start) for n, cfg in base.items()}, "runs": {}}
    for name, n in (("single attempt", 1), (f"try again ({k} attempts)", k)):
        cfg = config(args.config, args.common + [f"tasks.0.attempts={n}"] + QUIET)
        summary, rows, ckpt = train_and_read(cfg, tmp / f"attempts-{n}")
        result["runs"][name] = {
            "train_attempts": n, "steps": summary["steps"], "train_time_s": summary["train_time_s"],
            "turns_mean": statistics.mean(series(rows, "turns/mean") or [1.0]),
            "after": {f"at_{m}": accuracy(c, ckpt) for m, c in base.items()},
        }
    return result


def table_try_again(result: dict) -> str:
    k = result["attempts"]
    head = f"| trained with | steps | turns per episode | training s | accuracy at 1 attempt | at {k} attempts |"
    mean = lambda acc: 100 * statistics.mean(acc.values())  # noqa: E731
    lines = [head, "| --- | --- | --- | --- | --- | --- |",
             f"| (before training) | 0 | | | {mean(result['before']['at_1']):.1f}% | "
             f"{mean(result['before'][f'at_{k}']):.1f}% |"]
    for name, r in result["runs"].items():
        lines.append(f"| {name} | {r['steps']} | {r['turns_mean']:.2f} | {r['train_time_s']:.0f} | "
                     f"{mean(r['after']['at_1']):.1f}% | {mean(r['after'][f'at_{k}']):.1f}% |")
    return "\n".join(lines)


def check_pcgrad(args, tmp: Path) -> dict:
    result = {"tasks": args.tasks, "runs": {}}
    base = config(args.config, args.common, args.tasks)
    result["before"] = accuracy(base, base.model.name)
    for surgery in ("none", "pcgrad"):
        cfg = config(args.config, args.common + QUIET + [f"algorithm.gradients.surgery={surgery}",
                                                         "algorithm.gradients.task_grad_every=1"], args.tasks)
        summary, rows, ckpt = train_and_read(cfg, tmp / surgery)
        cos = {k: series(rows, k) for k in sorted({k for r in rows for k in r if k.startswith("task_grad/cos/")})}
        norms = {k: series(rows, k) for k in sorted({k for r in rows for k in r if k.startswith("task_grad/norm/")})}
        samples = summary["steps"] * cfg.rollout.prompts_per_step * cfg.rollout.group_size
        result["runs"][surgery] = {
            "steps": summary["steps"], "samples": samples, "train_time_s": summary["train_time_s"],
            "cosine": cos, "norms": norms, "after": accuracy(cfg, ckpt),
        }
    return result


def both_moved(run: dict) -> list[float]:
    """The cosines of the steps where both tasks had a gradient (a task whose groups all agreed, or that was
    not drawn, has none, and its cosine is logged as 0)."""
    (cos,) = run["cosine"].values()
    norms = list(run["norms"].values())
    return [c for i, c in enumerate(cos) if all(n[i] > 0 for n in norms)]


def table_pcgrad(result: dict) -> str:
    names = result["tasks"]
    head = ["gradient surgery", "samples", "training s", "steps with both tasks' gradients",
            "cosine mean (min, max)", "of them cosine < 0", *[f"{n} before → after" for n in names]]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for surgery, r in result["runs"].items():
        values = both_moved(r)
        logged = len(next(iter(r["cosine"].values())))
        cos = (f"{statistics.mean(values):+.3f} ({min(values):+.3f}, {max(values):+.3f})" if values else "none")
        accs = [f"{100 * result['before'][n]:.1f} → {100 * r['after'][n]:.1f}%" for n in names]
        lines.append(f"| {surgery} | {r['samples']} | {r['train_time_s']:.0f} | {len(values)} of {logged} | {cos} | "
                     f"{sum(v < 0 for v in values)} | " + " | ".join(accs) + " |")
    return "\n".join(lines)


def check_off_policy(args, tmp: Path) -> dict:
    base = config(args.config, args.common)
    result = {"eta": args.eta, "before": accuracy(base, base.model.name), "runs": {}}
    for correction in args.corrections:
        cfg = config(args.config, args.common + QUIET + [
            "runtime.kind=async", f"runtime.eta={args.eta}", f"algorithm.off_policy={correction}"])
        try:
            summary, rows, ckpt = train_and_read(cfg, tmp / correction)
        except Exception as exc:  # a run that diverges is a result, not the end of the benchmark
            result["runs"][correction] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
            continue
        keys = ("mismatch/kl", "mismatch/beyond_band_frac", "mismatch/abs_log_ratio/max", "staleness/mean",
                "grad_norm", "entropy")
        result["runs"][correction] = {
            "steps": summary["steps"], "train_time_s": summary["train_time_s"],
            "skipped_updates": sum(series(rows, "skipped_updates")),
            "per_step": {k: series(rows, k) for k in keys}, "after": accuracy(cfg, ckpt),
        }
    return result


def table_off_policy(result: dict) -> str:
    lines = ["| off_policy | held-out after | mismatch KL (mean, max) | beyond band (mean) | max abs log-ratio "
             "| staleness (mean) | grad norm (max) | entropy (last) | skipped updates |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for correction, r in result["runs"].items():
        if "error" in r:
            lines.append(f"| {correction} | failed: {r['error']} | | | | | | | |")
            continue
        s = r["per_step"]
        stat = lambda key, how, s=s: f"{how(s[key]):.3g}" if s[key] else "n/a"  # noqa: E731
        acc = 100 * statistics.mean(r["after"].values())
        lines.append(f"| {correction} | {acc:.1f}% | {stat('mismatch/kl', statistics.mean)}, "
                     f"{stat('mismatch/kl', max)} | {stat('mismatch/beyond_band_frac', statistics.mean)} | "
                     f"{stat('mismatch/abs_log_ratio/max', max)} | {stat('staleness/mean', statistics.mean)} | "
                     f"{stat('grad_norm', max)} | {stat('entropy', lambda v: v[-1])} | {r['skipped_updates']:.0f} |")
    before = 100 * statistics.mean(result["before"].values())
    return f"Held-out before training: {before:.1f}%.\n\n" + "\n".join(lines)


CHECKS = {"try-again": (check_try_again, table_try_again), "pcgrad": (check_pcgrad, table_pcgrad),
          "off-policy": (check_off_policy, table_off_policy)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("check", choices=list(CHECKS))
    p.add_argument("--config", type=Path, default=None,
                   help="default: configs/quickstart.yaml (pcgrad: configs/cascade.yaml's first two tasks)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-n", type=int, default=None, help="held-out items per task (default: the config's)")
    p.add_argument("--attempts", type=int, default=3, help="try-again: attempts per episode")
    p.add_argument("--tasks", nargs=2, default=["chain_sum", "basic_arithmetic"], help="pcgrad: the two tasks")
    p.add_argument("--eta", type=int, default=2, help="off-policy: the async runtime's staleness bound")
    p.add_argument("--corrections", nargs="+", default=CORRECTIONS, help="off-policy: algorithm.off_policy values")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for every run")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "algorithm_checks")
    p.add_argument("--doc", type=Path, default=None, help="default: docs/results/<check>.md")
    p.add_argument("--table-only", action="store_true", help="only rewrite the doc's table from --out's JSON")
    args = p.parse_args()
    if args.doc is None:
        args.doc = ROOT / "docs" / "results" / f"{args.check}.md"
    if args.config is None:
        args.config = ROOT / "configs" / ("cascade.yaml" if args.check == "pcgrad" else "quickstart.yaml")
    cfg = config(args.config, args.set, args.tasks if args.check == "pcgrad" else None)
    args.common = [*args.set, f"train.steps={args.steps}", "train.max_minutes=null", f"train.seed={args.seed}"]
    if args.eval_n is not None:
        args.common += [f"tasks.{i}.eval_size={args.eval_n}" for i in range(len(cfg.tasks))]

    path = args.out / f"{args.check.replace('-', '_')}.json"
    run_check, make_table = CHECKS[args.check]
    if args.table_only:
        result = json.loads(path.read_text())
    else:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"{args.check}-") as tmp:
            result = run_check(args, Path(tmp))
        shown = args.config.resolve().relative_to(ROOT) if args.config.resolve().is_relative_to(ROOT) else args.config
        result.update(config=str(shown), steps=args.steps, seed=args.seed, eval_n=args.eval_n, machine=machine(),
                      date=time.strftime("%Y-%m-%d"), wall_s=time.perf_counter() - t0)
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
    items = f"{result['eval_n']} held-out items per task" if result["eval_n"] else "the config's held-out items"
    intro = (f"`python benchmarks/algorithm_checks.py {args.check}`: `{result['config']}`, {result['steps']} steps "
             f"per run, seed {result['seed']}, greedy accuracy on {items}; {result['machine']}, "
             f"{result['date']}.\n\n")
    table = make_table(result)
    replace_block(args.doc, f"<!-- check:{args.check}:start -->", f"<!-- check:{args.check}:end -->",
                  intro + table + "\n", f"Check: {args.check}")
    print(intro + table)


if __name__ == "__main__":
    main()
