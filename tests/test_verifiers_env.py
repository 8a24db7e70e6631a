"""env: "verifiers:<name>" loads an installed verifiers environment (0.3.x, the classic API) offline: its rows
become a dataset like any other, its rubric scores the replies, and it trains."""

from __future__ import annotations

import json
import textwrap

import pytest

from polyrl.config import ConfigError, TaskConfig
from polyrl.config_check import load_config
from polyrl.envs.base import make_task
from polyrl.run.loop import train

TINY = {"model": {"name": "tiny-random", "bf16": False}, "optim": {"lr": 1e-3},
        "logging": {"progress": False, "tensorboard": False, "report": False}}

ENV_MODULE = '''
import verifiers as vf
from datasets import Dataset


def load_environment(n=12, n_eval=3, system_prompt="Answer with the number only."):
    def rows(start, count):
        return Dataset.from_list([{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1),
                                   "info": {"i": i}, "task": "add"} for i in range(start, start + count)])

    parser = vf.Parser()

    def correct(completion, answer, **kwargs):
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    async def short(completion, **kwargs):
        return 1.0 if len(parser.parse_answer(completion) or "") <= 6 else 0.0

    rubric = vf.Rubric(funcs=[correct, short], weights=[1.0, 0.5], parser=parser)
    return vf.SingleTurnEnv(dataset=rows(0, n), eval_dataset=rows(1000, n_eval), system_prompt=system_prompt,
                            parser=parser, rubric=rubric)
'''


@pytest.fixture
def vf_env_module(tmp_path, monkeypatch):
    (tmp_path / "vf_add_env.py").write_text(textwrap.dedent(ENV_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.slow
def test_rows_prompt_and_rubric_come_from_the_environment(vf_env_module):
    task = make_task(TaskConfig(name="add", env="verifiers:vf_add_env", params={"n": 12, "n_eval": 3}), seed=0)
    assert len(task.source) == 12 and task.has_eval_items
    held = task.eval_items()
    assert [r["answer"] for r in held] == ["2001", "2003", "2005"]  # the environment's own eval_dataset
    train_answers = {task.train_item(i)["answer"] for i in range(12)}
    assert train_answers == {str(2 * i + 1) for i in range(12)}  # one epoch: every row once
    env = task.make_env()
    messages = env.reset(task.train_item(0))
    assert messages[0] == {"role": "system", "content": "Answer with the number only."}
    assert messages[-1]["role"] == "user" and messages[-1]["content"].startswith("What is")
    right = env.step(task.train_item(0)["answer"])
    assert right.reward == pytest.approx(1.5) and right.info["reward_terms"]["correct"] == 1.0  # 1.0 x 1 + 0.5 x 1
    env.reset(task.train_item(0))
    wrong = env.step("no idea, sorry")
    assert wrong.reward == 0.0 and wrong.info["reward_terms"]["short"] == 0.0


@pytest.mark.slow
def test_a_missing_environment_or_bad_arguments_are_one_line(vf_env_module):
    with pytest.raises(ValueError, match="verifiers environment 'no_such_env' is not installed") as err:
        make_task(TaskConfig(name="x", env="verifiers:no_such_env"), seed=0)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="failed to load with") as err:
        make_task(TaskConfig(name="x", env="verifiers:vf_add_env", params={"nope": 1}), seed=0)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="tasks.0.items: a verifiers environment brings its own rows"):
        load_config(None, data={**TINY, "tasks": [{"name": "x", "env": "verifiers:vf_add_env", "items": [{}]}]})


@pytest.mark.slow
def test_a_verifiers_environment_trains(vf_env_module):
    data = {**TINY, "tasks": [{"name": "add", "env": "verifiers:vf_add_env", "eval_size": 2}],
            "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
            "train": {"steps": 2, "seed": 0}}
    summary = train(load_config(None, data=data), vf_env_module / "run", log=lambda _: None)
    assert summary["steps"] == 2 and set(summary["eval_after"]) == {"add"}
    lines = (vf_env_module / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and "reward/criterion/correct" in json.loads(lines[-1])
