"""Agent features on SmolLM2-135M-Instruct with the calculate tool (configs/tool_math.yaml), three parts that
each run alone and merge their numbers into benchmarks/results/agents.json:

    python benchmarks/agents.py sft --config configs/tool_math_bootstrap.yaml --steps 6   # tool-call warm start
    python benchmarks/agents.py a --set model.name=/tmp/polyrl-agents-sft/checkpoints/step-6   # RL from it
    python benchmarks/agents.py a --minutes 8     # GRPO on tool_math: valid-tool-call rate, accuracy before/after
    python benchmarks/agents.py b --steps 8       # ARPO vs GRPO, same samples per step and same steps
    python benchmarks/agents.py c --steps 8       # success + prompt replay on vs off
    python benchmarks/agents.py b --set tasks.0.params.dataset_params.max_digits=1 ...   # any override, all arms
    python benchmarks/agents.py a --config configs/smoke.yaml --minutes 0.1 --eval 4 --out /tmp/agents.json

Training runs in this process (``build_run`` + ``rl_step``); evaluation is greedy on held-out items with the
float32 policy (``polyrl.evaluate``), so the valid-tool-call rate is measured too.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ARMS: dict[str, dict[str, list[str]]] = {
    "b": {
        "grpo": [],
        "arpo": ["agents.arpo.enabled=true", "agents.arpo.global_samples=4", "agents.arpo.branch_width=2",
                 "agents.arpo.entropy_threshold=0.0"],
    },
    "c": {
        "replay_off": [],
        "replay_on": ["agents.replay.success_buffer=4", "agents.replay.prompt_replay=0.5"],
    },
}


def _config(path: Path, overrides: list[str], eval_n: int, steps: int, minutes: float):
    from polyrl import load_config

    base = [
        "eval.before=false", "eval.after=false", "logging.progress=false", "logging.tensorboard=false",
        "logging.report=false", f"train.steps={steps}", f"train.max_minutes={minutes}",
    ]
    cfg = load_config(path, base)
    base += [f"tasks.{i}.eval_size={eval_n}" for i in range(len(cfg.tasks))]
    return load_config(path, base + overrides)


def _evaluate(run) -> dict[str, Any]:
    from polyrl import HFEngine, evaluate

    engine = HFEngine(run.model, run.tokenizer, bf16=False)
    cfg = run.config
    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    task = next(iter(run.tasks.values()))
    return evaluate(engine, task, task.config.eval_size, max_new, cfg.eval.batch_size)


def _train(path: Path, overrides: list[str], eval_n: int, steps: int, minutes: float, before: bool) -> dict:
    """Train one arm; returns eval before (optional) / after and per-step rollout statistics."""
    from polyrl import build_run, rl_step

    cfg = _config(path, overrides, eval_n, steps, minutes)
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(cfg, Path(tmp))
        out: dict[str, Any] = {"overrides": overrides}
        if before:
            out["before"] = _evaluate(run)
            print(f"  before: {json.dumps(out['before'])}", flush=True)
        t0, step, rows = time.perf_counter(), 0, []
        budget = minutes * 60
        while step < steps and time.perf_counter() - t0 < budget:
            step += 1
            metrics, trajectories = rl_step(run, step)
            rows.append(metrics)
            print(f"  step {step}: reward {metrics['reward/mean']:.3f} tools {metrics.get('tool_calls/mean')} "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
        out["train_time_s"] = time.perf_counter() - t0
        out["steps"] = step
        out["generated_tokens"] = sum(m["response_length/mean"] for m in rows) * cfg.rollout.group_size \
            * cfg.rollout.prompts_per_step
        for key in ("reward/mean", "tool_calls/mean", "valid_tool_call_rate", "replay/all_fail_groups",
                    "replay/replayed", "arpo/branch_leaves", "tool_calls/per_solved", "zero_variance_groups"):
            vals = [m[key] for m in rows if m.get(key) is not None]
            if vals:
                out[f"train/{key}"] = mean(vals) if key != "replay/replayed" else sum(vals)
        out["after"] = _evaluate(run)
        del run
    return out


def _sft(path: Path, overrides: list[str], eval_n: int, steps: int, ckpt_dir: Path) -> dict:
    """The tool-call warm start: ``steps`` SFT steps on the env's demonstrations into ``ckpt_dir``; eval after
    (the RL parts start from ``ckpt_dir/checkpoints/step-N`` with ``--set model.name=...``)."""
    from polyrl import build_run, latest_checkpoint, train_sft

    cfg = _config(path, overrides, eval_n, steps, 1e9)
    t0 = time.perf_counter()
    summary = train_sft(cfg, ckpt_dir)
    out: dict[str, Any] = {"overrides": overrides, "sft": summary, "wall_s": time.perf_counter() - t0}
    ckpt = latest_checkpoint(ckpt_dir)
    out["checkpoint"] = str(ckpt)
    after = _config(path, overrides + [f"model.name={ckpt}"], eval_n, steps, 1e9)
    with tempfile.TemporaryDirectory() as tmp:
        out["after"] = _evaluate(build_run(after, Path(tmp)))
    return out


def _save(path: Path, part: str, data: dict) -> None:
    results = json.loads(path.read_text()) if path.exists() else {}
    results[part] = {**data, "machine": platform.processor() or platform.machine(),
                     "date": time.strftime("%Y-%m-%d %H:%M")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["sft", "a", "b", "c"])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "tool_math.yaml")
    p.add_argument("--minutes", type=float, default=8.0, help="training-time cap per arm")
    p.add_argument("--steps", type=int, default=1_000_000, help="step count per arm (b, c: equal budgets)")
    p.add_argument("--eval", type=int, default=50, help="held-out items")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "agents.json")
    p.add_argument("--arms", nargs="*", default=[], help="b, c: run only these arms (grpo and replay_off are "
                   "the same run)")
    p.add_argument("--ckpt-dir", type=Path, default=Path(tempfile.gettempdir()) / "polyrl-agents-sft",
                   help="sft: where the warm-start checkpoint goes")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, every arm")
    args = p.parse_args()
    if args.part == "sft":
        print("sft: tool-call warm start", flush=True)
        result = _sft(args.config, args.set, args.eval, args.steps, args.ckpt_dir)
    elif args.part == "a":
        print("a: GRPO on tool_math", flush=True)
        result = _train(args.config, args.set, args.eval, args.steps, args.minutes, before=True)
    else:
        result = {}
        for name, overrides in ARMS[args.part].items():
            if args.arms and name not in args.arms:
                continue
            print(f"{args.part}: {name}", flush=True)
            result[name] = _train(args.config, args.set + overrides, args.eval, args.steps, args.minutes,
                                  before=False)
    _save(args.out, args.part, {"config": str(args.config.relative_to(ROOT) if args.config.is_absolute()
                                              else args.config), "args": vars(args) | {
        "config": str(args.config), "out": str(args.out), "ckpt_dir": str(args.ckpt_dir)}, "result": result})
    print(json.dumps(result, indent=2, default=str)[:3000])


if __name__ == "__main__":
    main()
