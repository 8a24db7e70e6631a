"""Tool latency (``tasks[].tool_latency_s``) and concurrent env steps within a turn."""

import json
import time

import pytest
from test_multi_turn import TOOL_MATH, ScriptedEngine, calculator_script

from polyrl.config import RolloutConfig, TaskConfig
from polyrl.config_check import load_config
from polyrl.envs import make_task
from polyrl.envs.tool_env import ToolEnv
from polyrl.envs.tool_parsers import ToolCall
from polyrl.envs.tools import ToolError
from polyrl.rollout import multi_turn
from polyrl.rollout.multi_turn import play, to_trajectory

CHAIN_SUM = TaskConfig(name="chain_sum", params={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})


def _latency(seconds: float) -> TaskConfig:
    return TOOL_MATH.model_copy(update={"tool_latency_s": seconds})


def test_config_default_off_and_validated():
    assert TaskConfig(name="x").tool_latency_s == 0.0
    with pytest.raises(ValueError, match="tool_latency_s"):
        load_config(None, [], data={"tasks": [{"name": "tool_math", "env": "tool_math", "tool_latency_s": -1}]})


def test_latency_needs_a_tool_env(tok):
    with pytest.raises(ValueError, match="tool_latency_s needs a tool env"):
        make_task(CHAIN_SUM.model_copy(update={"tool_latency_s": 0.1}), seed=0, tokenizer=tok)


def test_each_call_that_reaches_a_tool_waits(tok):
    env = make_task(_latency(0.2), seed=0, tokenizer=tok).make_env()
    assert isinstance(env, ToolEnv) and env.tool_latency_s == 0.2
    t0 = time.monotonic()
    assert env.call(ToolCall("calculate", {"expression": "2 + 3"})) == "5"
    assert time.monotonic() - t0 >= 0.2
    t0 = time.monotonic()
    with pytest.raises(ToolError):  # the tool rejects it, as slowly as a remote tool would
        env.call(ToolCall("calculate", {"expression": "import os"}))
    assert time.monotonic() - t0 >= 0.2
    t0 = time.monotonic()
    with pytest.raises(ToolError, match="unknown tool"):  # never reaches a tool: no wait
        env.call(ToolCall("search", {"query": "x"}))
    assert time.monotonic() - t0 < 0.2
    assert make_task(TOOL_MATH, seed=0, tokenizer=tok).make_env().tool_latency_s == 0.0


def _mixed_play(tok, latency: float, samples: int):
    tool_task = make_task(_latency(latency), seed=0, tokenizer=tok)
    single = make_task(CHAIN_SUM, seed=0, tokenizer=tok)
    engine = ScriptedEngine(tok, calculator_script(tool_task.make_env().tool_parser))
    requests = [(tool_task, 0, tool_task.train_item(0)), (single, 1, single.train_item(1)),
                (tool_task, 2, tool_task.train_item(2))]
    return play(engine, requests, RolloutConfig(group_size=samples, max_new_tokens=64), seed=0, version=7)


def test_concurrent_steps_give_the_sequential_trajectories(tok, monkeypatch):
    threaded = [json.loads(to_trajectory(e, tok).to_json()) for e in _mixed_play(tok, 0.01, 4)]
    monkeypatch.setattr(ToolEnv, "concurrent_steps", False)  # every step in the calling thread, in order
    sequential = [json.loads(to_trajectory(e, tok).to_json()) for e in _mixed_play(tok, 0.01, 4)]
    assert threaded == sequential
    # tool samples 1..3 of both tool groups called the calculator and were answered
    assert [t["info"].get("valid_tool_calls") for t in threaded] == [0, 1, 1, 1, None, None, None, None,
                                                                      0, 1, 1, 1]
    assert all(t["reward"] == 1.0 for t in threaded if t["info"].get("valid_tool_calls"))


@pytest.mark.slow
def test_a_turn_with_k_calls_waits_about_one_latency(tok, monkeypatch):
    latency, calls = 0.3, 8
    tool_task = make_task(_latency(latency), seed=0, tokenizer=tok)
    engine = ScriptedEngine(tok, calculator_script(tool_task.make_env().tool_parser))
    # Sample 0 answers at once, the other ``calls`` samples each call the calculator in the first turn.
    request = [(tool_task, 0, tool_task.train_item(0))]
    t0 = time.monotonic()
    episodes = play(engine, request, RolloutConfig(group_size=calls + 1, max_new_tokens=64), seed=0, version=7)
    elapsed = time.monotonic() - t0
    assert sum(e.valid_tool_calls for e in episodes) == calls
    assert latency <= elapsed < 4 * latency  # sequential would be calls x latency = 2.4 s
    monkeypatch.setattr(multi_turn, "MAX_ENV_THREADS", 2)  # the pool bounds how many wait at once
    t0 = time.monotonic()
    play(engine, request, RolloutConfig(group_size=calls + 1, max_new_tokens=64), seed=0, version=7)
    assert time.monotonic() - t0 >= calls / 2 * latency


class _SlowToolEnv(ToolEnv):
    """One tool that takes ``delay`` seconds; the final answer scores 1."""

    def __init__(self, delay: float) -> None:
        def lookup(key: str) -> str:
            """Look a key up.

            Args:
                key: what to look up.
            """
            time.sleep(delay)
            return f"value of {key}"

        super().__init__([lookup])

    def reset(self, item):
        return [{"role": "user", "content": "look it up"}]

    def score(self, answer: str) -> float:
        return 1.0


def test_a_tool_call_past_its_timeout_is_an_error_observation_and_the_episode_goes_on():
    env = _SlowToolEnv(delay=3.0)
    env.tool_timeout_s = 0.2
    t0 = time.monotonic()
    with pytest.raises(ToolError, match=r"tool 'lookup' ran past tasks\[\]\.tool_timeout_s \(0\.2 s\)"):
        env.call(ToolCall("lookup", {"key": "a"}))
    assert time.monotonic() - t0 < 1.0
    # through a whole turn: the error is the observation, and the episode is not over
    result = env.step(env.tool_parser.format_calls([ToolCall("lookup", {"key": "a"})]))
    assert not result.done and "ran past" in result.observations[0]["content"]
    quick = _SlowToolEnv(delay=0.0)
    assert quick.call(ToolCall("lookup", {"key": "b"})) == "value of b"  # a call in time answers as before


def test_tool_timeout_reaches_the_tool_env_from_the_task_config(tok):
    env = make_task(TOOL_MATH.model_copy(update={"tool_timeout_s": 2.5}), seed=0, tokenizer=tok).make_env()
    assert env.tool_timeout_s == 2.5
    assert make_task(TOOL_MATH, seed=0, tokenizer=tok).make_env().tool_timeout_s == 30.0
