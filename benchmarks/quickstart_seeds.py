"""How the quickstart's choices were made: train the quickstart setup for a fixed number of steps (not a time
budget, so runs on a busy machine compare), with a training seed and config overrides, then score the final
policy in float32 on the seed-0 held-out items (the ones the quickstart reports) and break the errors down.

    python benchmarks/quickstart_seeds.py --name dapo-seed1 --steps 45 --seed 1 \
        algorithm.loss.clip_high=0.28 algorithm.sampling.dynamic=true algorithm.sampling.max_extra_rounds=2

Appends one record to benchmarks/results/quickstart_seeds.json. The breakdown shows what limits the score:
items whose answer is negative need a minus sign the base model almost never writes.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "quickstart_seeds.json"


def category(item: dict) -> str:
    op = "minus" if " - " in item["question"] else "plus"
    return f"{op}, {'negative' if int(item['answer']) < 0 else 'non-negative'} answer"


def heldout_breakdown(model, tokenizer, n: int = 200) -> dict:
    """Greedy float32 accuracy on the quickstart's seed-0 held-out items, overall and per category."""
    from polyrl import HFEngine, greedy, load_config, make_task, rollout_episodes

    cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    task = make_task(cfg.tasks[0], 0, cfg.model.system_prompt, tokenizer)
    engine = HFEngine(model, tokenizer, bf16=False)
    items = task.eval_items(n)
    trajectories = []
    for s in range(0, len(items), 64):
        chunk = [(task, s + i, item) for i, item in enumerate(items[s : s + 64])]
        trajectories += rollout_episodes(engine, chunk, greedy(cfg.rollout.max_new_tokens), seed=0, version=-1)
    right, total = Counter(), Counter()
    for item, t in zip(items, trajectories, strict=True):
        total[category(item)] += 1
        right[category(item)] += t.info["score"] >= 1.0
    return {
        "accuracy": sum(right.values()) / len(items),
        "by_category": {k: f"{right[k]}/{total[k]}" for k in sorted(total)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True)
    p.add_argument("--steps", type=int, default=45)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="dotted config overrides, as for polyrl train")
    args = p.parse_args()

    from polyrl import build_run, load_config, rl_step

    fixed = ["eval.before=false", "eval.after=false", "logging.progress=false", f"train.seed={args.seed}"]
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", fixed + args.overrides)
    out = Path("/tmp") / f"polyrl-quickstart-seeds-{args.name}"
    run = build_run(cfg, out)
    train_s, rewards, guided = 0.0, [], 0
    for step in range(1, args.steps + 1):
        metrics, _ = rl_step(run, step)
        train_s += metrics["step_time_s"]
        rewards.append(round(metrics["reward/mean"], 4))
        guided += int(metrics.get("guidance/guided", 0))
    t0 = time.perf_counter()
    record = {
        "name": args.name, "seed": args.seed, "steps": args.steps, "overrides": args.overrides,
        "train_time_s": round(train_s, 1), "train_reward": rewards, "guided_groups": guided,
        "heldout": heldout_breakdown(run.model, run.tokenizer), "eval_s": round(time.perf_counter() - t0, 1),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    runs = json.loads(RESULTS.read_text())["runs"] if RESULTS.exists() else []
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"runs": [*runs, record]}, indent=1))
    print(json.dumps(record["heldout"]))


if __name__ == "__main__":
    main()
