"""Cascade RL over several domains with retention, against the plain cascade, on SmolLM2-135M-Instruct.

Runs the pipeline of a cascade config (configs/cascade.yaml: chain_sum, one-digit products, syllogisms;
configs/cascade_alt.yaml: letter counting, gcd, linear equations; configs/cascade_guided.yaml: four domains at
reasoning-gym's default difficulty with the guided recipe) for one seed and writes
benchmarks/results/cascade/<config>-<variant>-s<seed>.json: the domain x stage table of held-out accuracy,
whether every domain ends within ``--tolerance`` points of its best stage, what each gained over the base
model, the final mean over domains
against the best single stage's, and the cost (samples, wall time). ``--plain`` runs the same stages without
the retention mechanisms (no replay or retention KL, a distill stage of a fixed step count at the RL stages'
rate and rollout), the baseline of the cost. ``--table-only`` rewrites the block of docs/results/cascade.md from
every JSON there.

    python benchmarks/cascade.py --seed 0                                  # tens of minutes on 2 cores
    python benchmarks/cascade.py --config configs/cascade_alt.yaml --seed 1 --plain
    python benchmarks/cascade.py --table-only
    python benchmarks/cascade.py --scale 0.2 --eval 20 --out /tmp/c       # a quick check of the script itself
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_block import replace_block
from machine_facts import label, machine

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "cascade"
START, END = "<!-- cascade:start -->", "<!-- cascade:end -->"


def plain_stage(stage: dict) -> dict:
    """A stage of the plain cascade: no replay, no retention KL, no early stopping, and a distill stage run
    as the RL stages run (their rate and rollout, the configured task mix)."""
    retention = ("replay", "replay_from", "retain_coef", "until_within", "keep_best", "eval_every", "focus", "lr",
                 "rollout")
    return {k: v for k, v in stage.items() if k not in retention}


def load(path: Path, seed: int, scale: float, eval_n: int | None, plain: bool):
    from polyrl import load_config

    data = load_config(path).model_dump(mode="json")
    data["train"]["seed"] = seed
    for stage in data["stages"]:
        stage["steps"] = max(1, round(stage["steps"] * scale))
    if plain:
        data["stages"] = [plain_stage(s) for s in data["stages"]]
    if eval_n is not None:
        for task in data["tasks"]:
            task["eval_size"] = eval_n
    return load_config(path, data=data)


def summarise(state: dict, tolerance: float) -> dict:
    """Final minus best per domain (points), the final and best-stage means, and the cost."""
    from polyrl import best_per_task

    rows, tasks = state["rows"], state["tasks"]
    best = best_per_task(rows)
    gaps = {t: round((rows[-1]["eval"][t] - best[t]["accuracy"]) * 100, 1) for t in tasks}
    means = {r["label"]: 100 * sum(r["eval"][t] for t in tasks) / len(tasks) for r in rows}
    best_stage = max(list(means)[:-1], key=lambda k: means[k])  # every column before the final one
    return {
        "final_minus_best_points": gaps,
        "every_domain_within_tolerance": all(g >= -tolerance for g in gaps.values()),
        "final_mean": round(means[rows[-1]["label"]], 2),
        "best_stage_mean": round(means[best_stage], 2),
        "best_stage": best_stage,
        "final_mean_at_least_best_stage": means[rows[-1]["label"]] + 1e-9 >= means[best_stage],  # float sums
        "samples": sum(r.get("samples") or 0 for r in rows[1:]),
        "samples_per_stage": {r["label"]: r.get("samples") for r in rows[1:]},
        "stage_wall_s": {r["label"]: round(r.get("wall_s") or 0.0, 1) for r in rows[1:]},
        "train_time_s": {r["label"]: r.get("train_time_s") for r in rows[1:]},
    }


def seed_table(result: dict) -> str:
    """One run's domain x stage table (held-out accuracy, %)."""
    labels = list(result["accuracy"])
    lines = ["| task | " + " | ".join(labels) + " | best | final - best |", "|" + " --- |" * (len(labels) + 3)]
    for task, reg in result["registry"].items():
        cells = [f"{result['accuracy'][k][task] * 100:.0f}" for k in labels]
        lines.append(f"| {task} | " + " | ".join(cells) + f" | {reg['accuracy'] * 100:.0f} ({reg['stage']}) | "
                     f"{result['final_minus_best_points'][task]:+.0f} |")
    mean = " | ".join(f"{100 * sum(v.values()) / len(v):.1f}" for v in result["accuracy"].values())
    lines.append(f"| mean | {mean} | | |")
    return "\n".join(lines)


def gains(result: dict) -> dict[str, float]:
    """Each domain's final accuracy minus its base model's, in points."""
    columns = list(result["accuracy"].values())
    return {t: round((columns[-1][t] - columns[0][t]) * 100, 1) for t in columns[0]}


def block(results: list[dict]) -> str:
    """The doc block: a summary row per run, then each run's table."""
    results = sorted(results, key=lambda r: (r["config"], r["variant"] != "retention", r["seed"]))
    plain = {(r["config"], r["seed"]): r for r in results if r["variant"] == "plain"}
    lines = [
        "| config | variant | seed | worst final - best | within 2 | least gain over base | final mean | "
        "best stage mean | samples | wall min | samples vs plain |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        base = plain.get((r["config"], r["seed"]))
        extra = ""
        if base is not None and r["variant"] != "plain":
            # samples only: runs' wall times are comparable only when measured under the same load
            extra = f"{r['samples'] / base['samples'] - 1:+.0%} samples"
        lines.append(
            f"| {r['config']} | {r['variant']} | {r['seed']} | {min(r['final_minus_best_points'].values()):+.0f} | "
            f"{'yes' if r['every_domain_within_tolerance'] else '**no**'} | {min(gains(r).values()):+.0f} | "
            f"{r['final_mean']:.1f} | "
            f"{r['best_stage_mean']:.1f} ({r['best_stage']}) | {r['samples']} | {r['wall_minutes']:.1f} | {extra} |")
    for r in results:
        precision = r.get("precision", {}).get("training", "bf16")  # runs before the field were all bf16
        lines += ["", f"`{r['config']}`, {r['variant']}, seed {r['seed']} ({r['eval_size']} held-out items per "
                      f"task, {r['machine']}, {precision}):", "", seed_table(r)]
    return "\n".join(lines)


def write_doc(doc: Path, out: Path) -> None:
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    replace_block(doc, START, END, block(results), "Cascade RL and distillation")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "cascade.yaml")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plain", action="store_true", help="Without replay, retention KL and early stopping.")
    ap.add_argument("--scale", type=float, default=1.0, help="Multiply every stage's steps.")
    ap.add_argument("--eval", type=int, default=None, help="Held-out items per task (default: the config's).")
    ap.add_argument("--tolerance", type=float, default=2.0, help="Points a domain may end below its best.")
    ap.add_argument("--run-dir", type=Path, default=None,
                    help="Keep the run here (default: a temp dir, removed at the end).")
    ap.add_argument("--resume", action="store_true", help="Finish (or only summarise) the run in --run-dir.")
    ap.add_argument("--out", type=Path, default=OUT, help="Folder of the JSON results.")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "results" / "cascade.md")
    ap.add_argument("--table-only", action="store_true", help="Only rewrite the doc block from --out.")
    args = ap.parse_args()
    if args.table_only:
        write_doc(args.doc, args.out)
        return

    from polyrl import best_per_task, engine_bf16, model_bf16, run_pipeline, table_markdown

    config = load(args.config, args.seed, args.scale, args.eval, args.plain)
    with tempfile.TemporaryDirectory(prefix="cascade-") as tmp:  # a run's checkpoints: about 10 GB
        run_dir = args.run_dir or Path(tmp)
        state = run_pipeline(config, run_dir, resume=args.resume, log=lambda m: print(m, flush=True))
    wall_s = sum(r.get("wall_s") or 0.0 for r in state["rows"][1:])  # the stages; the base eval is common
    variant = "plain" if args.plain else "retention"
    name = args.config.stem
    result = {
        "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
        "variant": variant, "seed": args.seed, "scale": args.scale,
        "model": config.model.name,
        "machine": label(machine()),
        # what model.bf16 / engine.bf16_weights (auto) resolved to here: runs in another precision differ
        "precision": {"training": "bf16" if model_bf16(config) else "float32",
                      "sampling": "bf16" if engine_bf16(config) else "float32"},
        "wall_minutes": wall_s / 60,  # stages only, shared CPU
        "eval_size": config.tasks[0].eval_size,
        "stages": [s.model_dump(mode="json", exclude_defaults=True) for s in config.stages],
        "accuracy": {r["label"]: r["eval"] for r in state["rows"]},
        "regressions": {r["label"]: r.get("regressions", {}) for r in state["rows"][1:]},
        "early_stop": {r["label"]: r["early_stop"] for r in state["rows"] if "early_stop" in r},
        "kept_best": {r["label"]: r["kept_best"] for r in state["rows"] if "kept_best" in r},
        "registry": {t: {"stage": v["stage"], "accuracy": v["accuracy"]}
                     for t, v in best_per_task(state["rows"]).items()},
        "tolerance_points": args.tolerance,
        "table": table_markdown(state, config.pipeline.regression_threshold),
        **summarise(state, args.tolerance),
    }
    result["final_minus_base_points"] = gains(result)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.scale == 1 else f"-x{args.scale:g}"
    (args.out / f"{name}-{variant}-s{args.seed}{suffix}.json").write_text(json.dumps(result, indent=2))
    if args.scale == 1 and args.eval is None and args.out.resolve() == OUT:  # the doc shows the shipped folder only
        write_doc(args.doc, args.out)
    print(result["table"])
    print(json.dumps({k: result[k] for k in ("final_minus_best_points", "final_minus_base_points",
                                             "every_domain_within_tolerance",
                                             "final_mean", "best_stage_mean", "samples", "wall_minutes")}))


if __name__ == "__main__":
    main()
