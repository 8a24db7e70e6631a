"""Re-evaluate a cascade run's checkpoints on more held-out items than its table used, to size the noise.

The table of ``benchmarks/cascade.py`` scores every stage on 100 held-out items per task, and a task's "best"
is the largest of those noisy scores. This script scores given checkpoints on the first N items of the same
held-out generator (so the table's 100 items are among them) for the tasks named, and writes the accuracies
to ``--out``.

    python benchmarks/cascade_recheck.py --run-dir RUN --stages 1-rl-chain_sum 3-rl-syllogism --tasks chain_sum \
        --items 500 --out benchmarks/results/cascade/recheck-cascade-s0.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from polyrl import evaluate_domains, load_config

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "cascade.yaml")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--stages", nargs="+", required=True, help="stage labels, e.g. 1-rl-chain_sum")
    ap.add_argument("--tasks", nargs="+", default=None, help="default: every task of the config")
    ap.add_argument("--items", type=int, default=500)
    ap.add_argument("--seed", type=int, default=None, help="the run's seed (default: the config's)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    data = load_config(args.config).model_dump(mode="json")
    data.pop("stages", None)
    if args.seed is not None:
        data["train"]["seed"] = args.seed
    data["tasks"] = [t for t in data["tasks"] if args.tasks is None or t["name"] in args.tasks]
    for task in data["tasks"]:
        task["eval_size"] = args.items
    config = load_config("recheck", data=data)
    rows = json.loads((args.run_dir / "stages.json").read_text())["rows"]
    checkpoints = {r["label"]: r["checkpoint"] for r in rows}
    result = json.loads(args.out.read_text()) if args.out.exists() else {"items": args.items, "accuracy": {}}
    for label in args.stages:
        accuracy = evaluate_domains(config, checkpoints[label])
        result["accuracy"].setdefault(label, {}).update(accuracy)
        print(label, accuracy, flush=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
