"""The endpoint path against the native env path on tool_math (configs/tool_math.yaml, SmolLM2-135M-Instruct):
the built-in task written as a plain openai-client agent (``solve`` below; ``solve_streaming`` streams every turn,
``solve_required`` makes its first turn a tool call), trained through the policy's endpoint, against the
tool_math env, at equal samples; writes benchmarks/results/endpoint.json.

    python benchmarks/endpoint.py                      # both parts
    python benchmarks/endpoint.py overhead --rounds 4  # rollout throughput at the same weights, arms alternating
    python benchmarks/endpoint.py train --steps 20     # GRPO, held-out accuracy before/after, per arm
    python benchmarks/endpoint.py overhead --arms native,endpoint,endpoint-stream,endpoint-required
    python benchmarks/endpoint.py train --arms endpoint-stream,endpoint-required --steps 10
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
from collections.abc import Awaitable, Callable
from pathlib import Path
from statistics import mean, median
from typing import Any

import openai

from polyrl import TOOL_MATH_INSTRUCTIONS, Tool, calculate, last_number

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [Tool.from_function(calculate).schema]


Ask = Callable[[openai.AsyncOpenAI, list[dict], int], Awaitable[dict]]
"""One assistant turn: ``ask(client, messages, turn)`` returns the reply as a message dict."""


async def _ask(client: openai.AsyncOpenAI, messages: list[dict], turn: int) -> dict:
    response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    return response.choices[0].message.model_dump(exclude_none=True)


async def _ask_streamed(client: openai.AsyncOpenAI, messages: list[dict], turn: int) -> dict:
    """The turn streamed, its content and tool-call deltas put together as an agent framework does."""
    content, calls = "", {}
    stream = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True)
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"id": "", "type": "function",
                                                 "function": {"name": "", "arguments": ""}})
            slot["id"] += call.id or ""
            if call.function is not None:
                slot["function"]["name"] += call.function.name or ""
                slot["function"]["arguments"] += call.function.arguments or ""
    reply = {"role": "assistant", "content": content}
    return {**reply, "tool_calls": [calls[i] for i in sorted(calls)]} if calls else reply


async def _ask_required(client: openai.AsyncOpenAI, messages: list[dict], turn: int) -> dict:
    """The first turn must call the tool (``tool_choice: required``); later turns choose."""
    response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                    tool_choice="required" if turn == 0 else "auto")
    return response.choices[0].message.model_dump(exclude_none=True)


async def _solve(client: openai.AsyncOpenAI, item: dict, ask: Ask) -> float:
    """tool_math as an agent: ask, run the calculate calls, score the final reply's last number."""
    messages = [{"role": "system", "content": TOOL_MATH_INSTRUCTIONS}, {"role": "user", "content": item["question"]}]
    for turn in range(3):
        reply = await ask(client, messages, turn)
        if not reply.get("tool_calls"):
            return float(last_number(reply.get("content") or "") == item["answer"])
        messages.append(reply)
        for call in reply["tool_calls"]:
            try:
                result = calculate(**json.loads(call["function"]["arguments"]))
            except Exception as exc:  # noqa: BLE001 - a bad call is answered, as the env does
                result = f"Error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return 0.0


async def solve(client: openai.AsyncOpenAI, item: dict) -> float:
    return await _solve(client, item, _ask)


async def solve_streaming(client: openai.AsyncOpenAI, item: dict) -> float:
    """The same agent with every turn streamed (``stream: true``)."""
    return await _solve(client, item, _ask_streamed)


async def solve_required(client: openai.AsyncOpenAI, item: dict) -> float:
    """The same agent whose first turn must be a tool call (``tool_choice: required``)."""
    return await _solve(client, item, _ask_required)


AGENTS = {"native": None, "endpoint": "benchmarks.endpoint:solve",
          "endpoint-stream": "benchmarks.endpoint:solve_streaming",
          "endpoint-required": "benchmarks.endpoint:solve_required"}
"""Each arm's agent (tasks[].agent); native is the tool_math env itself."""


def _config(arm: str, args: argparse.Namespace, steps: int):
    from polyrl import load_config

    overrides = [
        f"train.steps={steps}", "train.max_minutes=null", f"tasks.0.eval_size={args.eval}", "tasks.0.max_tokens=null",
        "tasks.0.params.tool_error_penalty=0.0", "logging.progress=false", "logging.tensorboard=false",
        "logging.report=false", *args.set,
    ]
    if AGENTS[arm] is not None:
        overrides.append(f"tasks.0.agent={AGENTS[arm]}")
    return load_config(ROOT / "configs" / "tool_math.yaml", overrides)


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Rollouts of the same groups at the same (initial) weights through each path, alternating round by round
    after one untimed warm-up round each: generated tokens per second of rollout wall time."""
    from polyrl import build_run

    arms = args.arms.split(",")
    runs = {arm: build_run(_config(arm, args, 1), Path(tempfile.mkdtemp())) for arm in arms}
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
        for arm in (arms if r % 2 == 0 else arms[::-1]):
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
        round_ratios.append({arm: rate_now[arm] / rate_now["native"] for arm in arms if arm != "native"})
    rate = {arm: tokens[arm] / seconds[arm] for arm in runs}
    others = [arm for arm in arms if arm != "native"]
    return {
        "rounds": args.rounds, "episodes": episodes, "generated_tokens": tokens, "rollout_s": seconds,
        "tokens_per_s": rate, "episodes_per_s": {arm: episodes[arm] / seconds[arm] for arm in runs},
        "throughput_ratio_over_native": {arm: rate[arm] / rate["native"] for arm in others},
        "round_ratios": round_ratios,
        "median_round_ratio": {arm: median(r[arm] for r in round_ratios) for arm in others},
    }


def train_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    from polyrl import run_training

    cfg = _config(arm, args, args.steps)
    with tempfile.TemporaryDirectory(prefix="polyrl-endpoint-") as tmp:  # checkpoints: GBs, not kept
        summary = run_training(cfg, Path(tmp), log=lambda m: None)
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    out = {
        "steps": summary["steps"], "samples": sum(cfg.rollout.prompts_per_step * cfg.rollout.group_size for _ in rows),
        "eval_before": summary["eval_before"]["tool_math"], "eval_after": summary["eval_after"]["tool_math"],
        "reward_curve": [r["reward/mean"] for r in rows],
        "rollout_tokens_per_s": mean(r["rollout/tokens_per_s"] for r in rows),
        "rollout_time_s": sum(r["rollout_time_s"] for r in rows), "train_time_s": summary["train_time_s"],
        "response_length": mean(r["response_length/mean"] for r in rows),
    }
    if AGENTS[arm] is not None:
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
    parser.add_argument("--arms", default="native,endpoint",
                        help=f"which arms, in order (of {', '.join(AGENTS)}; overhead: native first)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "endpoint.json")
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    result: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    result.update(machine=cpu, config="configs/tool_math.yaml")
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(part: str, value: dict[str, Any], merge: bool) -> None:
        """Write into the file as it is now, after each part: a stopped run keeps what it measured, and training
        arms run by separate processes (``--arms``) merge into one entry."""
        now = json.loads(args.out.read_text()) if args.out.exists() else result
        now[part] = {**now.get(part, {}), **value} if merge else value
        args.out.write_text(json.dumps(now, indent=2) + "\n")
        print(json.dumps({part: value}, indent=1), flush=True)

    if args.part in ("overhead", "all"):
        save("overhead", {"overrides": args.set, "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          **overhead(args)}, merge=False)
    if args.part in ("train", "all"):
        for arm in args.arms.split(","):
            save("train", {"overrides": args.set, "eval_items": args.eval, arm: train_arm(arm, args)}, merge=True)
    print(args.out)


if __name__ == "__main__":
    main()
