"""A short GRPO run on a TextArena game (env: textarena) with SmolLM2-135M-Instruct: the learning curve
(training reward per step) and greedy held-out score before and after; writes benchmarks/results/adapters.json.

    python benchmarks/adapters.py --steps 6 --eval 20
    python benchmarks/adapters.py --set model.name=tiny-random --steps 1 --eval 2 --out /tmp/a.json

The game is GuessTheNumber-v0 (1-20, the game's hints 'higher' / 'lower' after each guess; reward 1 for the
number, else the game's own closeness score); the policy has 4 guesses.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from polyrl import load_config, run_training

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {
    "name": "adapters-textarena",
    "model": {"name": "smollm2-135m-instruct", "bf16": True},
    "tasks": [{"name": "guess_the_number", "env": "textarena", "max_turns": 4,
               "params": {"game": "GuessTheNumber-v0"}}],
    "rollout": {"prompts_per_step": 2, "group_size": 8, "max_new_tokens": 32, "temperature": 1.0},
    "algorithm": {"advantage": "grpo", "loss": "ppo_clip", "regularisers": {"track_kl": False}},
    "optim": {"lr": 3.0e-5, "micro_batch_size": 16},
    "logging": {"progress": False, "tensorboard": False, "report": False},
}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--eval", type=int, default=20, help="held-out games, played greedily")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE config override (YAML value)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "adapters.json"))
    args = parser.parse_args()

    data: dict[str, Any] = json.loads(json.dumps(CONFIG))
    data["tasks"][0]["eval_size"] = args.eval
    data["train"] = {"steps": args.steps, "seed": 0}
    for override in args.set:
        key, value = override.split("=", 1)
        node = data
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    config = load_config(None, data=data)

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        summary = run_training(config, Path(tmp) / "run", log=print)
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    result = {
        "machine": _cpu(),
        "config": data,
        "wall_s": round(time.perf_counter() - start, 1),
        "eval_before": summary.get("eval_before"),
        "eval_after": summary.get("eval_after"),
        "curve": [{"step": r.get("step"), "reward_mean": r.get("reward/mean"), "loss": r.get("loss")}
                  for r in rows],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("eval_before", "eval_after", "curve", "wall_s")}))


if __name__ == "__main__":
    main()
