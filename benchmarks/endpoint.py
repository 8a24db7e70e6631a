"""The endpoint path against the native env path on tool_math (configs/tool_math.yaml, SmolLM2-135M-Instruct):
the built-in task written as a plain openai-client agent (``solve`` below), trained through the policy's
endpoint, against the tool_math env, at equal samples; writes benchmarks/results/endpoint.json.

    python benchmarks/endpoint.py                      # both parts
    python benchmarks/endpoint.py overhead --rounds 4  # rollout throughput at the same weights, arms alternating
    python benchmarks/endpoint.py train --steps 20     # GRPO, held-out accuracy before/after, per arm
    python benchmarks/endpoint.py --set model.name=tiny-random --steps 1 --eval 4 --rounds 1 --out /tmp/e.json

Both arms play the same items (the agent task takes them from the tool_math env), see the same prompt tokens
(same system text, the same calculate schema rendered by the same template) and are scored the same way (the
last number of the final reply against the answer). The episode token budget (tasks[].max_tokens) is off in
both, as an agent has none; the tool-error penalty is off in both, as the agent sees a malformed call as text.
Run from the repository root: the agent is ``benchmarks.endpoint:solve``.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from statistics import mean, median
from typing import Any

import openai

from polyrl.envs.reasoning_gym import last_number
from polyrl.envs.tool_math import INSTRUCTIONS, calculate
from polyrl.envs.tools import Tool

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [Tool.from_function(calculate).schema]


async def solve(client: openai.AsyncOpenAI, item: dict) -> float:
    """tool_math as an agent: ask, run the calculate calls, score the final reply's last number."""
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": item["question"]}]
    for _ in range(3):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        reply = response.choices[0].message
        if not reply.tool_calls:
            return float(last_number(reply.content or "") == item["answer"])
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            try:
                result = calculate(**json.loads(call.function.arguments))
            except Exception as exc:  # noqa: BLE001 - a bad call is answered, as the env does
                result = f"Error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


def _config(agent: bool, args: argparse.Namespace, steps: int):
    from polyrl.config_check import load_config

    overrides = [
        f"train.steps={steps}", "train.max_minutes=null", f"tasks.0.eval_size={args.eval}", "tasks.0.max_tokens=null",
        "tasks.0.params.tool_error_penalty=0.0", "logging.progress=false", "logging.tensorboard=false",
        "logging.report=false", *args.set,
    ]
    if agent:
        overrides.append("tasks.0.agent=benchmarks.endpoint:solve")
    return load_config(ROOT / "configs" / "tool_math.yaml", overrides)


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Rollouts of the same groups at the same (initial) weights through each path, alternating round by round
    after one untimed warm-up round each: generated tokens per second of rollout wall time."""
    from polyrl.train.step import build_run

    runs = {arm: build_run(_config(arm == "endpoint", args, 1), Path(tempfile.mkdtemp())) for arm in
            ("native", "endpoint")}
    for run in runs.values():  # warm-up, untimed: kernel builds, the endpoint's start, first allocations
        task = next(iter(run.tasks.values()))
        run.group_rollout.roll_out(run.engine, [(task, 10**6, task.train_item(10**6))], seed=-1, version=0,
                                   first_id=0)
    tokens = {arm: 0 for arm in runs}
    seconds = {arm: 0.0 for arm in runs}
    episodes = {arm: 0 for arm in runs}
    round_ratios = []
    for r in range(args.rounds):
        rate_now = {}
        for arm in (("native", "endpoint") if r % 2 == 0 else ("endpoint", "native")):
            run = runs[arm]
            task = next(iter(run.tasks.values()))
            requests = [(task, 1000 * r + i, task.train_item(1000 * r + i))
                        for i in range(run.config.rollout.prompts_per_step)]
            t0 = time.perf_counter()
            out = run.group_rollout.roll_out(run.engine, requests, seed=r, version=0, first_id=0)
            took, made = time.perf_counter() - t0, sum(t.num_model_tokens for t in out)
            seconds[arm] += took
            tokens[arm] += made
            episodes[arm] += len(requests) * run.config.rollout.group_size
            rate_now[arm] = made / took
        round_ratios.append(rate_now["endpoint"] / rate_now["native"])
    rate = {arm: tokens[arm] / seconds[arm] for arm in runs}
    return {
        "rounds": args.rounds, "episodes": episodes, "generated_tokens": tokens, "rollout_s": seconds,
        "tokens_per_s": rate, "episodes_per_s": {arm: episodes[arm] / seconds[arm] for arm in runs},
        "throughput_ratio_endpoint_over_native": rate["endpoint"] / rate["native"],
        "round_ratios": round_ratios, "median_round_ratio": median(round_ratios),
    }


def train_arm(agent: bool, args: argparse.Namespace) -> dict[str, Any]:
    from polyrl.run.loop import train

    cfg = _config(agent, args, args.steps)
    with tempfile.TemporaryDirectory(prefix="polyrl-endpoint-") as tmp:  # checkpoints: GBs, not kept
        summary = train(cfg, Path(tmp), log=lambda m: None)
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    out = {
        "steps": summary["steps"], "samples": sum(cfg.rollout.prompts_per_step * cfg.rollout.group_size for _ in rows),
        "eval_before": summary["eval_before"]["tool_math"], "eval_after": summary["eval_after"]["tool_math"],
        "reward_curve": [r["reward/mean"] for r in rows],
        "rollout_tokens_per_s": mean(r["rollout/tokens_per_s"] for r in rows),
        "rollout_time_s": sum(r["rollout_time_s"] for r in rows), "train_time_s": summary["train_time_s"],
        "response_length": mean(r["response_length/mean"] for r in rows),
    }
    if agent:
        out["merged_calls"] = sum(r["agent/merged_calls"] for r in rows)
        out["split_calls"] = sum(r["agent/split_calls"] for r in rows)
        out["dropped"] = sum(r["agent/dropped"] for r in rows)
    else:
        out["tool_calls_mean"] = mean(r.get("tool_calls/mean") or 0.0 for r in rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", nargs="?", choices=["overhead", "train", "all"], default="all")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval", type=int, default=100, help="held-out items")
    parser.add_argument("--rounds", type=int, default=4, help="overhead: rollout rounds per arm")
    parser.add_argument("--set", action="append", default=[], help="config override for both arms")
    parser.add_argument("--arms", default="native,endpoint", help="train: which arms, in order")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "endpoint.json")
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    result: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    result.update(machine=cpu, config="configs/tool_math.yaml")
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(part: str, value: dict[str, Any]) -> None:
        """Merge into the file as it is now, after each part: a stopped run keeps what it measured, and arms
        run by separate processes (``--arms``) land in one file."""
        now = json.loads(args.out.read_text()) if args.out.exists() else result
        now[part] = {**now.get(part, {}), **value}
        args.out.write_text(json.dumps(now, indent=2) + "\n")
        print(json.dumps({part: value}, indent=1), flush=True)

    if args.part in ("overhead", "all"):
        save("overhead", {"overrides": args.set, **overhead(args)})
    if args.part in ("train", "all"):
        for arm in args.arms.split(","):
            save("train", {"overrides": args.set, "eval_items": args.eval, arm: train_arm(arm == "endpoint", args)})
    print(args.out)


if __name__ == "__main__":
    main()
