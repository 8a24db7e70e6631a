"""Cascade RL over three domains, then multi-teacher on-policy distillation, on SmolLM2-135M-Instruct.

Runs the pipeline of configs/cascade.yaml (one RL stage per domain: chain_sum, one-digit products, syllogisms;
then a distill stage teaching every domain from its best checkpoint in the registry) and reports the
domain x stage table of held-out accuracy, and whether every domain ends within ``--tolerance`` points of
its best stage. Results go to benchmarks/results/cascade.json and the "## Cascade RL and distillation"
section of docs/multidomain.md.

    python benchmarks/cascade.py                                  # configs/cascade.yaml, ~35 min on 2 cores
    python benchmarks/cascade.py --config configs/cascade.yaml --scale 0.2 --eval 20 \
        --json /tmp/cascade.json --doc /tmp/multidomain.md        # a quick check of the script itself
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Cascade RL and distillation"
INTRO = ("# Many tasks and domains\n\nTraining one policy on several domains: task mixtures and their "
         "normalisation, and pipelines of stages with distillation between them.\n")


def _config(path: Path, scale: float, eval_n: int | None, max_new: int | None):
    from polyrl.config import load_config

    base = load_config(path)
    overrides = [f"stages.{i}.steps={max(1, round(s.steps * scale))}" for i, s in enumerate(base.stages)]
    if eval_n is not None:
        overrides += [f"tasks.{i}.eval_size={eval_n}" for i in range(len(base.tasks))]
    if max_new is not None:
        overrides += [f"rollout.max_new_tokens={max_new}"]
    return load_config(path, overrides), overrides


def section(result: dict) -> str:
    """The doc section: what ran, the table, and what it shows."""
    ok = result["every_domain_within_tolerance"]
    tol = result["tolerance_points"]
    lines = [
        HEADING, "",
        "`stages:` in a config declares a pipeline that `polyrl train` runs stage by stage (`sft`, `rl`, "
        "`distill`), each a normal run in RUN_DIR/stages/<i>-<name>/ starting from the previous stage's "
        "checkpoint, resumable with `--resume`. After every stage each task of the pipeline is evaluated "
        "held-out; RUN_DIR/stages.md and stages.json hold the task x stage table and RUN_DIR/registry.json the "
        "best checkpoint per task. A task that falls more than `pipeline.regression_threshold` below its best "
        "is reported, and with `pipeline.on_regression: distill` a distill stage is inserted that teaches it "
        "from that best checkpoint. A distill stage is multi-teacher on-policy distillation: the student "
        "samples on each task's prompts and minimises the per-token reverse KL to that task's teacher "
        "(`algorithms/distill.py`, GKD; `algorithm.distill_coef` also adds it to an RL loss).",
        "",
        f"Measured with `python benchmarks/cascade.py {' '.join(result['args'])}`".rstrip() + " on "
        f"{result['machine']} ({result['wall_minutes']:.1f} min wall, the CPU shared with other jobs): "
        f"{result['config']}, model {result['model']}, greedy held-out accuracy (%) on "
        f"{result['eval_size']} items per task; stage steps {result['steps']}.",
        "",
        result["table"].rstrip(),
        "",
        f"Every domain ends within {tol:g} points of its best stage: **{'yes' if ok else 'no'}** "
        f"(final minus best: {', '.join(f'{k} {v:+.1f}' for k, v in result['final_minus_best_points'].items())}).",
        "",
    ]
    return "\n".join(lines) + "\n" + result.get("notes", "") + "\n"


def write_section(doc: Path, text: str) -> None:
    """Replace this section of the doc (up to the next ``## `` heading), keeping every other section."""
    current = doc.read_text() if doc.exists() else INTRO
    pattern = re.compile(rf"^{re.escape(HEADING)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(current):
        updated = pattern.sub(lambda _m: text, current, count=1)
    else:
        updated = current.rstrip("\n") + "\n\n" + text
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(updated)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "cascade.yaml")
    ap.add_argument("--scale", type=float, default=1.0, help="Multiply every stage's steps.")
    ap.add_argument("--eval", type=int, default=None, help="Held-out items per task (default: the config's).")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--tolerance", type=float, default=2.0, help="Points a domain may end below its best.")
    ap.add_argument("--run-dir", type=Path, default=None, help="Keep the run here (default: a temp dir).")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "cascade.json")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "multidomain.md")
    ap.add_argument("--notes", type=str, default="", help="A paragraph on what the numbers show.")
    args, argv = ap.parse_args(), []
    if args.config != ap.get_default("config"):
        argv += ["--config", str(args.config)]
    for flag in ("scale", "eval", "max_new_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) != ap.get_default(flag):
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]

    from polyrl.train.pipeline import registry, run_pipeline, table_markdown

    config, _ = _config(args.config, args.scale, args.eval, args.max_new_tokens)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="cascade-"))
    t0 = time.perf_counter()
    state = run_pipeline(config, run_dir, resume=args.resume, log=lambda m: print(m, flush=True))
    wall = (time.perf_counter() - t0) / 60
    best = registry(state["rows"])
    gaps = {t: round(g * 100, 1) for t, g in state["final_gap"].items()}
    result = {
        "args": argv,
        "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
        "model": config.model.name,
        "machine": f"{platform.machine()} CPU",
        "wall_minutes": wall,
        "eval_size": {t.name: t.eval_size for t in config.tasks},
        "steps": {s.name: s.steps for s in config.stages},
        "accuracy": {r["label"]: r["eval"] for r in state["rows"]},
        "train_time_s": {r["label"]: r.get("train_time_s") for r in state["rows"][1:]},
        "regressions": {r["label"]: r.get("regressions", {}) for r in state["rows"][1:]},
        "registry": {t: {"stage": v["stage"], "accuracy": v["accuracy"]} for t, v in best.items()},
        "final_minus_best_points": gaps,
        "tolerance_points": args.tolerance,
        "every_domain_within_tolerance": all(g >= -args.tolerance for g in gaps.values()),
        "table": table_markdown(state, config.pipeline.regression_threshold),
        "notes": args.notes,
    }
    sizes = set(result["eval_size"].values())
    result["eval_size"] = sizes.pop() if len(sizes) == 1 else result["eval_size"]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    write_section(args.doc, section(result))
    print(result["table"])
    print(json.dumps({k: result[k] for k in ("final_minus_best_points", "every_domain_within_tolerance")}))


if __name__ == "__main__":
    main()
