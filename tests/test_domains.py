"""Domains as envs: math checked by math-verify, HumanEval in the sandbox, rule-checked instruction following,
and LLM-as-judge rewards mixed with rule rewards by weight."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from polyrl.config import ConfigError, RewardComponentConfig, TaskConfig, component_names
from polyrl.config_check import load_config
from polyrl.envs.base import make_task
from polyrl.envs.humaneval import HumanEvalParams, problem_source
from polyrl.envs.instruct import CONSTRAINTS, InstructParams, check_reply, make_item
from polyrl.envs.reward_mix import weighted_reward
from polyrl.rewards.math import math_verify_score

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"


@pytest.mark.parametrize("gold, reply, expected", [
    ("0.5", r"So the answer is $\boxed{\frac{1}{2}}$.", 1.0),
    ("3/4", "It comes to 0.75", 1.0),
    ("42", "First 40, then 2 more: 42.", 1.0),
    (42, "41", 0.0),
    ("x + 1", r"\boxed{1 + x}", 1.0),
    ("7", "I do not know", 0.0),
])
def test_math_verify_score(gold, reply, expected):
    assert math_verify_score(gold, reply) == expected


def test_reasoning_gym_task_with_math_verify_answers():
    cfg = TaskConfig(name="chain_sum", answer="math_verify", params={"min_terms": 2, "max_terms": 2})
    task = make_task(cfg, seed=0)
    item = task.train_item(0)
    env = task.make_env()
    env.reset(item)
    assert env.step(rf"The total is $\boxed{{{item['answer']}}}$").reward == 1.0
    env.reset(item)
    assert env.step(f"The total is {int(item['answer']) + 1}").reward == 0.0


def test_humaneval_split_is_deterministic_and_disjoint():
    def split(split_seed: int, seed: int = 0) -> tuple[set[str], list[str]]:
        source = problem_source(HumanEvalParams(held_out_fraction=0.25, split_seed=split_seed), seed)
        train = {source.train_item(i)["task_id"] for i in range(len(source))}
        return train, [p["task_id"] for p in source.eval_items(1000)]

    train, held = split(0)
    assert train.isdisjoint(held) and len(train) + len(held) == 164
    assert 25 <= len(held) <= 60  # about a quarter
    assert split(0) == (train, held) and split(0, seed=5) == (train, held)  # the run seed does not move it
    assert split(1)[1] != held


def test_humaneval_env_rewards_passing_code_only():
    task = make_task(TaskConfig(name="he", env="humaneval", params={"timeout_s": 20}), seed=3)
    held_ids = {p["task_id"] for p in task.eval_items()}
    item = task.train_item(0)
    assert item["task_id"] not in held_ids
    env = task.make_env()
    prompt = env.reset(item)[-1]["content"]
    assert item["prompt"] in prompt
    good = "```python\n" + item["prompt"] + item["canonical_solution"] + "```"
    assert env.step(good).reward == 1.0
    env.reset(item)
    assert env.step("```python\ndef nothing():\n    pass\n```").reward == 0.0


def test_instruct_items_are_deterministic_and_checkable():
    params = InstructParams(min_constraints=1, max_constraints=3)
    assert make_item(5, params) == make_item(5, params)
    assert make_item(5, params) != make_item(6, params)
    for seed in range(50):  # conflicting pairs are never drawn together
        ids = {c["id"] for c in make_item(seed, params)["constraints"]}
        assert not ({"json", "bullets"} <= ids or {"max_words", "min_words"} <= ids)


@pytest.mark.parametrize("family, good, bad", [
    ("lowercase", "all quiet here", "All quiet here"),
    ("no_commas", "one two three", "one, two"),
    ("json", '{"answer": 1, "text": "x", "title": "t"}', "answer: 1"),
])
def test_instruct_rules(family, good, bad):
    item = {"constraints": [{"id": family, "seed": 0}]}
    assert check_reply(item, good) == [True]
    assert check_reply(item, bad) == [False]


def test_instruct_parametrised_rules_follow_their_drawn_values():
    for family, make_good in (
        ("max_words", lambda d: " ".join(["w"] * d["max_words"])),
        ("min_words", lambda d: " ".join(["w"] * d["min_words"])),
        ("keyword", lambda d: f"A {d['keyword']} thing."),
        ("bullets", lambda d: "\n".join(f"- point {i}" for i in range(d["bullets"]))),
        ("closing", lambda d: f"Some text. {d['end']}"),
    ):
        seed = 11
        details = CONSTRAINTS[family](random.Random(seed))[2]
        item = {"constraints": [{"id": family, "seed": seed}]}
        assert check_reply(item, make_good(details)) == [True], family
        assert check_reply(item, "") == [False], family


def test_instruct_env_gives_partial_reward_and_all_or_nothing_score():
    task = make_task(TaskConfig(name="ifeval", env="instruct", params={"min_constraints": 2, "max_constraints": 2,
                                                                       "constraints": ["lowercase", "no_commas"]}),
                     seed=0)
    env = task.make_env()
    env.reset(task.train_item(0))
    result = env.step("hello, world")  # lowercase holds, a comma breaks the other
    assert result.reward == 0.5 and result.info["score"] == 0.0
    env.reset(task.train_item(0))
    assert env.step("hello world").info["score"] == 1.0


def test_instruct_config_errors_name_the_key():
    data = yaml.safe_load(SMOKE.read_text())
    data["tasks"] = [{"name": "ifeval", "env": "instruct", "params": {"constraints": ["haiku"]}}]
    with pytest.raises(ConfigError, match=r"tasks.0.params.constraints: unknown \['haiku'\]"):
        load_config(None, data=data)


def test_weighted_reward_and_names():
    comps = [RewardComponentConfig(kind="env", weight=0.7), RewardComponentConfig(kind="judge", weight=0.3)]
    assert component_names(comps) == ["env", "judge"]
    assert component_names(comps + [RewardComponentConfig(kind="judge")]) == ["env", "judge_1", "judge_2"]
    assert weighted_reward({"env": 1.0, "judge": 0.5}, {"env": 0.7, "judge": 0.3}) == pytest.approx(0.85)
    with pytest.raises(ValueError, match="no value"):
        weighted_reward({"env": 1.0}, {"env": 0.7, "judge": 0.3})


@pytest.mark.slow
def test_judge_scores_by_yes_probability():
    from polyrl.rewards.judge import Judge

    judge = Judge("tiny-random")
    pairs = [("What is 2+2?", "4"), ("What is 2+2?", "a long and unrelated reply about boats")]
    scores = judge.score(pairs, "Is the response correct?")
    assert all(0.0 < s < 1.0 for s in scores)
    assert scores[0] != scores[1]  # the verdict depends on the response
    assert judge.score(pairs[:1], "Is the response correct?") == pytest.approx(scores[:1], abs=1e-5)


@pytest.mark.slow
def test_judge_component_mixes_into_the_training_reward(tmp_path):
    from polyrl.train.step import build_run, rl_step

    data = yaml.safe_load(SMOKE.read_text())
    data["tasks"][0]["reward_components"] = [{"kind": "env", "weight": 0.5},
                                             {"kind": "judge", "weight": 2.0, "model": "tiny-random"}]
    run = build_run(load_config(None, data=data), tmp_path)
    _, kept = rl_step(run, 1)
    for t in kept:
        assert set(t.rewards) == {"env", "judge"} and 0.0 < t.rewards["judge"] < 1.0
        assert t.reward == pytest.approx(0.5 * t.rewards["env"] + 2.0 * t.rewards["judge"])
    json.dumps([t.rewards for t in kept])  # components stay JSON-serialisable for trajectories.jsonl


def test_reward_component_kind_is_checked():
    data = yaml.safe_load(SMOKE.read_text())
    data["tasks"][0]["reward_components"] = [{"kind": "vibes"}]
    with pytest.raises(ConfigError, match="tasks.0.reward_components.0.kind"):
        load_config(None, data=data)



def test_multitask_example_config_builds_every_domain():
    from polyrl.envs.curriculum import Curriculum

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "multitask.yaml",
                      ["model.name=tiny-random", "tasks.2.reward_components.1.model=tiny-random"])
    tasks = {t.name: make_task(t, cfg.train.seed) for t in cfg.tasks}
    assert [tasks[n].config.env for n in tasks] == [None, "humaneval", "instruct"]
    cur = Curriculum(cfg.curriculum, cfg.tasks, lambda c: make_task(c, cfg.train.seed))
    harder = cur.level_tasks["chain_sum"][1].train_item(0)["metadata"]
    assert harder["num_terms"] == 3  # level 2's params reach the dataset
