"""OpenAI Agents SDK agents through the policy's endpoint (polyrl/adapters/agents_sdk.py): a function tool
runs, model mistakes end the run and not the episode, and the documented example takes an RL step."""

from __future__ import annotations

import asyncio
import math
import re
import sys

import openai
import pytest
import yaml
from conftest import ROOT

pytest.importorskip("agents")

from agents import Agent, function_tool  # noqa: E402
from test_agent_tasks import FirstTurnCalls  # noqa: E402
from test_endpoint import ScriptedEngine, serve  # noqa: E402

from polyrl.adapters.agents_sdk import run_agent  # noqa: E402
from polyrl.config_check import load_config  # noqa: E402
from polyrl.envs.tool_parsers import SmolLM2Parser, ToolCall  # noqa: E402
from polyrl.models.loading import load_tokenizer  # noqa: E402

TINY = {"model": {"name": "tiny-random", "bf16": False}, "optim": {"lr": 1e-3},
        "logging": {"progress": False, "tensorboard": False, "report": False}}


@function_tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


CALCULATOR = Agent(name="calculator", instructions="Use the add tool.", tools=[add])


def _script(prompt: str) -> str:
    """A model that calls ``add`` (or a missing tool when asked to) and then states the tool's result."""
    if "<|im_start|>tool" in prompt:
        return "The sum is " + prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    name = "subtract" if "missing tool" in prompt else "add"
    return SmolLM2Parser().format_calls([ToolCall(name, {"a": 2, "b": 3})])


def _run(server, prompt: str, max_turns: int = 3):
    async def go():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client:
            return await run_agent(CALCULATOR, client, prompt, max_turns=max_turns, model="tiny")

    return asyncio.run(go())


@pytest.fixture(scope="module")
def scripted_server():
    engine = ScriptedEngine(load_tokenizer("tiny-random"), _script)
    server = serve(engine)
    yield server, engine
    server.stop()


@pytest.mark.slow
def test_a_function_tool_runs_through_the_endpoint(scripted_server):
    server, engine = scripted_server
    before = len(engine.calls)
    outcome = _run(server, "What is 2 + 3?")
    assert outcome.error is None and outcome.output == "The sum is 5.0"
    assert outcome.tool_calls() == ["add"] and len(engine.calls) - before == 2


def test_a_missing_tool_is_told_to_the_model_and_running_out_of_turns_is_an_outcome(scripted_server):
    server, _ = scripted_server
    outcome = _run(server, "Use the missing tool.")
    assert outcome.error is None and "not found" in outcome.output  # the error came back as the tool's result
    assert outcome.tool_calls() == ["subtract"]
    cut = _run(server, "What is 2 + 3?", max_turns=1)  # the tool call uses the only turn
    assert cut.output is None and cut.error == "max_turns" and cut.tool_calls() == []


def _docs_example() -> tuple[str, dict]:
    text = (ROOT / "docs" / "agents.md").read_text()
    block = re.search(r"<!-- agents-sdk-example:start -->(.*?)<!-- agents-sdk-example:end -->", text,
                      re.DOTALL).group(1)
    code = re.search(r"```python\n(.*?)```", block, re.DOTALL).group(1)
    return code, yaml.safe_load(re.search(r"```yaml\n(.*?)```", block, re.DOTALL).group(1))


@pytest.mark.slow
def test_the_documented_sdk_agent_takes_an_rl_step(tmp_path, monkeypatch):
    from polyrl.train.step import build_run, rl_step

    code, example = _docs_example()
    (tmp_path / "sdk_agents.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("sdk_agents", None)
    cfg = load_config(None, data={**TINY, "tasks": example["tasks"],
                                  "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 24}})
    run = build_run(cfg, tmp_path / "run")
    run.engine = FirstTurnCalls(run.engine)  # the first turn calls add(2, 3); the tiny model says the rest
    metrics, trajectories = rl_step(run, 1)
    assert metrics["agent/episodes"] == 4 and metrics["agent/dropped"] == 0 and math.isfinite(metrics["loss"])
    # the SDK sends the history back as the endpoint returned it: both calls merge into one trajectory
    assert metrics["agent/merged_calls"] == 4 and metrics["agent/split_calls"] == 0 and len(trajectories) == 4
    for t in trajectories:
        (a, b), (c, d) = t.turn_spans
        assert t.info["capture"] == "merged" and t.input_ids[a:b] == run.engine.call
        assert set(t.loss_mask[b:c]) == {0} and "<|im_start|>tool\n5.0<|im_end|>" in run.tokenizer.decode(
            t.input_ids[b:c])  # the SDK ran add(2, 3) and sent its result back
    assert all(t.reward in (0.0, 1.0) for t in trajectories)
