"""Agent tasks: the user's own openai-client agent named in the config, trained through the policy's endpoint;
the documented example; agents that misbehave; ``module:attr`` loading; ``polyrl serve``."""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys
import textwrap

import openai
import pytest
import torch
import yaml
from conftest import ROOT

from polyrl.config import ConfigError, TaskConfig
from polyrl.config_check import load_config
from polyrl.endpoint import rollout as agent_rollout
from polyrl.engines.hf import Completion
from polyrl.envs import make_task
from polyrl.envs.agent import AgentTask
from polyrl.envs.tool_parsers import SmolLM2Parser, ToolCall

TINY = {"model": {"name": "tiny-random", "bf16": False}, "optim": {"lr": 1e-3},
        "logging": {"progress": False, "tensorboard": False, "report": False}}


def _docs_example() -> tuple[str, dict]:
    text = (ROOT / "docs" / "agents.md").read_text()
    block = re.search(r"<!-- agent-example:start -->(.*?)<!-- agent-example:end -->", text, re.DOTALL).group(1)
    code = re.search(r"```python\n(.*?)```", block, re.DOTALL).group(1)
    config = yaml.safe_load(re.search(r"```yaml\n(.*?)```", block, re.DOTALL).group(1))
    assert len(code.splitlines()) <= 25
    return code, config


def _config(tmp_path, monkeypatch, module: str, code: str, tasks: list[dict], **sections):
    (tmp_path / f"{module}.py").write_text(code)
    monkeypatch.chdir(tmp_path)  # the agent is imported from the working directory
    sys.modules.pop(module, None)
    data = {**TINY, "tasks": tasks, "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 24},
            **sections}
    return load_config(None, data=data)


@pytest.mark.slow
def test_the_documented_example_trains_and_a_run_dir_is_served(tmp_path, monkeypatch):
    from polyrl.run.loop import train

    code, example = _docs_example()
    (task,) = example["tasks"]
    task["eval_items"] = task["items"]
    cfg = _config(tmp_path, monkeypatch, "my_agents", code, [task], train={"steps": 2})
    summary = train(cfg, tmp_path / "run", log=lambda m: None)
    assert set(summary["eval_before"]) == {"add"} and set(summary["eval_after"]) == {"add"}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["agent/episodes"] for r in rows] == [4.0, 4.0] and all(math.isfinite(r["loss"]) for r in rows)
    assert all(r["agent/dropped"] == 0 for r in rows)

    # polyrl serve RUN_DIR: the run's newest checkpoint on the same endpoint
    proc = subprocess.Popen([sys.executable, "-m", "polyrl", "serve", str(tmp_path / "run"), "--port", "0",
                             "--fp32"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        url = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line).group(1)
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4)
            assert reply.usage.completion_tokens <= 4
            assert {m.id for m in client.models.list()} == {"policy", str(tmp_path / "run")}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class FirstTurnCalls:
    """The run's engine, except that a prompt without a tool result is answered with an add call, scored with
    the policy's own log-probs, so a random model's episodes go through two calls."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.stop_ids = engine, engine.tokenizer, engine.stop_ids
        call = SmolLM2Parser().format_calls([ToolCall("add", {"a": 2, "b": 3})])
        self.call = self.tokenizer(call, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]

    def generate(self, prompts, n=1, max_new_tokens=64, temperature=1.0, top_p=1.0, seed=0, **kw):
        out = self.engine.generate(prompts, n, max_new_tokens, temperature, top_p, seed, **kw)
        for p, group in zip(prompts, out, strict=True):
            if "<|im_start|>tool" not in self.tokenizer.decode(p):
                with torch.no_grad():
                    logits = self.engine.policy(torch.tensor([p + self.call])).logits[0, len(p) - 1 : -1].float()
                lp = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(self.call)[:, None])
                group[:] = [Completion(self.call, lp.squeeze(-1).tolist(), True) for _ in group]
        return out

    def sync(self):
        self.engine.sync()

    def release_memory(self, until_used=False):
        self.engine.release_memory(until_used)


@pytest.mark.slow
def test_a_multi_turn_agent_trains_on_merged_trajectories(tmp_path, monkeypatch):
    from polyrl.train.step import build_run, rl_step

    code, example = _docs_example()
    cfg = _config(tmp_path, monkeypatch, "my_agents", code, example["tasks"])
    run = build_run(cfg, tmp_path / "run")
    run.engine = FirstTurnCalls(run.engine)
    for step in (1, 2):
        metrics, trajectories = rl_step(run, step)
        assert metrics["agent/merged_calls"] == 4 and metrics["agent/split_calls"] == 0
        assert len(trajectories) == 4 and math.isfinite(metrics["loss"])
        for t in trajectories:
            (a, b), (c, d) = t.turn_spans
            assert t.info["capture"] == "merged" and t.input_ids[a:b] == run.engine.call
            assert set(t.loss_mask[b:c]) == {0} and "<|im_start|>tool\n5<|im_end|>" in run.tokenizer.decode(
                t.input_ids[b:c])
            assert set(t.loss_mask[c:d]) == {1} and t.versions[a] == step - 1
        assert {t.group_id for t in trajectories} == {0, 1}


BAD_AGENTS = '''
import asyncio
import time


async def run(client, item):
    kind = item["kind"]
    msgs = [{"role": "user", "content": "hi"}]
    if kind == "raise":
        raise RuntimeError("agent bug")
    if kind == "silent":
        return 1.0
    if kind == "hang":
        await asyncio.sleep(60)
    if kind == "block":
        time.sleep(6)  # blocks its event loop: only its thread can be abandoned
    model = "gpt-4o" if kind == "bad_model" else "policy"
    tools = [{"type": "function", "function": {"name": "bad name"}}] if kind == "bad_tool" else None
    await client.chat.completions.create(model=model, messages=msgs, tools=tools, max_tokens=4)
    return "yes" if kind == "text" else 1.0
'''
KINDS = ["good", "raise", "silent", "hang", "block", "bad_model", "bad_tool", "text"]


@pytest.mark.slow
def test_misbehaving_agents_are_dropped_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    from polyrl.train.step import build_run, rl_step

    monkeypatch.setattr(agent_rollout, "GRACE_S", 0.5)
    task = {"name": "bad", "agent": "bad_agents:run", "items": [{"kind": k} for k in KINDS], "timeout_s": 2,
            "held_out_fraction": 0}  # every kind trains
    cfg = _config(tmp_path, monkeypatch, "bad_agents", BAD_AGENTS, [task])
    cfg.rollout.prompts_per_step = len(KINDS)  # one pass over the items: each kind once, in a group of 2
    run = build_run(cfg, tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="polyrl.endpoint"):
        metrics, trajectories = rl_step(run, 1)
    expect = {"raised": 2, "timeout": 4, "no_calls": 2, "bad_request": 4, "bad_reward": 2}
    assert {k: metrics[f"agent/dropped/{k}"] for k in expect} == expect and metrics["agent/dropped"] == 14
    assert len(trajectories) == 2 and {t.reward for t in trajectories} == {1.0} and math.isfinite(metrics["loss"])
    kinds = {run.tasks["bad"].train_item(t.item_id)["kind"] for t in trajectories}
    assert kinds == {"good"}
    reasons = "\n".join(r.getMessage() for r in caplog.records)
    for text in ("raised RuntimeError: agent bug", "ran past its timeout of 2 s", "never called the model",
                 "unknown model 'gpt-4o'", "tools[0].function.name", "returned str, not a number"):
        assert text in reasons
    metrics, _ = rl_step(run, 2)  # the run goes on
    assert metrics["agent/episodes"] == 16


def test_agent_task_config_errors_are_one_line_and_name_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sync_agent.py").write_text("def run(client, item):\n    return 1.0\n")
    (tmp_path / "items.jsonl").write_text('{"q": 1}\n{"q": \n')
    (tmp_path / "ok_agent.py").write_text("async def run(client, item):\n    return 1.0\n")
    cases = [
        ({"agent": "no_such_module:run", "items": [{}]}, "tasks.0.agent: no module named 'no_such_module'"),
        ({"agent": "ok_agent:missing", "items": [{}]}, "tasks.0.agent: 'ok_agent' has no attribute 'missing'"),
        ({"agent": "sync_agent:run", "items": [{}]}, "tasks.0.agent: 'sync_agent:run' must be an async function"),
        ({"agent": "ok_agent", "items": [{}]}, "is not a module:attr reference"),
        ({"agent": "ok_agent:run"}, "tasks.0.items: an agent task needs items"),
        ({"agent": "ok_agent:run", "items": "missing.jsonl"}, "tasks.0.items: no such file 'missing.jsonl'"),
        ({"agent": "ok_agent:run", "items": [{}], "env": "tool_math"}, "give items or an env"),
        ({"env": "ok_agent:nothing"}, "tasks.0.env: 'ok_agent' has no attribute 'nothing'"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)) as err:
            load_config(None, data={**TINY, "tasks": [{"name": "t", **extra}]})
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="runtime.kind: local"):
        load_config(None, data={**TINY, "tasks": [{"name": "t", "agent": "ok_agent:run", "items": [{}]}],
                                "runtime": {"kind": "async"}})
    # Rows are read when the task is built, before training: a bad one is one line naming the file and line.
    for items, message in (("items.jsonl", "items.jsonl: line 2: not valid JSON"),
                           ([1], "task.items: row 0: the row is a int, not an object")):
        with pytest.raises(ValueError, match=re.escape(message)) as err:
            make_task(TaskConfig(name="t", agent="ok_agent:run", items=items), 0)
        assert "\n" not in str(err.value)


def test_items_from_an_env_and_an_env_factory_by_module_attr(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok_agent.py").write_text("async def run(client, item):\n    return 1.0\n")
    (tmp_path / "my_envs.py").write_text(textwrap.dedent('''
        from polyrl.envs import SingleTurnEnv, Task

        def make_task(config, ctx):
            """Echo the number."""
            env = lambda: SingleTurnEnv(lambda item: [{"role": "user", "content": str(item["n"])}],
                                        lambda item, reply: float(reply.strip() == str(item["n"])))
            return Task(config, env, lambda seed: {"n": seed % 10, "answer": str(seed % 10)}, seed=ctx.seed)
    '''))
    params = {"dataset": "chain_sum", "dataset_params": {"min_terms": 2, "max_terms": 2}}
    agent = make_task(TaskConfig(name="tm", agent="ok_agent:run", env="tool_math", params=params, eval_size=3), 0)
    assert isinstance(agent, AgentTask) and len(agent.eval_items()) == 3
    assert {"question", "answer"} <= set(agent.train_item(0))
    own = make_task(TaskConfig(name="echo", env="my_envs:make_task"), seed=4)
    env = own.make_env()
    assert env.reset(own.train_item(1)) == [{"role": "user", "content": "5"}] and env.step("5").reward == 1.0
    listed = make_task(TaskConfig(name="l", agent="ok_agent:run", items=[{"i": i} for i in range(5)]), 0)
    first_pass = sorted(listed.train_item(i)["i"] for i in range(5))
    assert first_pass == [0, 1, 2, 3, 4] and listed.train_item(0) == listed.train_item(0)


def test_a_step_whose_episodes_all_drop_leaves_the_policy_as_it_was(tmp_path, monkeypatch):
    from polyrl.observe.progress import TrainProgress
    from polyrl.train.step import build_run, rl_step

    code = "async def run(client, item):\n    raise RuntimeError('always')\n"
    cfg = _config(tmp_path, monkeypatch, "raiser", code, [{"name": "r", "agent": "raiser:run", "items": [{}]}])
    run = build_run(cfg, tmp_path / "run")
    before = [p.detach().clone() for p in run.model.parameters()]
    for step in (1, 2):
        metrics, trajectories = rl_step(run, step)
        assert trajectories == [] and metrics["empty_batch"] == 1.0 and metrics["agent/dropped/raised"] == 4
        assert metrics["reward/mean"] is None and metrics["skipped_updates"] == 0.0
        with TrainProgress(2, True, step - 1) as progress:
            progress.update(step, metrics)
    assert all(torch.equal(a, b) for a, b in zip(before, run.model.parameters(), strict=True))


def test_advantage_estimators_and_losses_load_by_module_attr(tmp_path, monkeypatch):
    from polyrl.learner.advantage_stage import assign_advantages
    from polyrl.types import Trajectory

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_algos.py").write_text(textwrap.dedent('''
        def centered(rewards, group_ids, scale=1.0):
            """Rewards minus the batch mean, times scale."""
            return (rewards - rewards.mean()) * scale
    '''))
    algo = {"advantage": {"estimator": "my_algos:centered", "kwargs": {"scale": 2.0}}}
    cfg = load_config(None, data={**TINY, "tasks": [{"name": "chain_sum"}], "algorithm": algo})
    trajectories = [Trajectory("t", 0, 0, [1, 2], [0, 1], [0.0, -1.0], [-1, 0], reward=r) for r in (1.0, 0.0, 0.0)]
    assign_advantages(trajectories, cfg.algorithm, cfg.agents)
    assert [t.advantage for t in trajectories] == pytest.approx([4 / 3, -2 / 3, -2 / 3])  # 2 * (r - 1/3)
    for bad, message in (({"advantage": "my_algos:nope"}, "algorithm.advantage: 'my_algos' has no attribute 'nope'"),
                         ({"loss": "no_module:fn"}, "algorithm.loss: no module named 'no_module'"),
                         ({"advantage": {"kwargs": {"bogus": 1}, "estimator": "my_algos:centered"}}, "bogus")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, data={**TINY, "tasks": [{"name": "chain_sum"}], "algorithm": bad})
