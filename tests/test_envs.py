"""The env protocol and the built-in envs, played step by step without a model; config validation of tasks."""

import re
from collections import deque

import pytest
from conftest import ROOT

from polyrl.config import ConfigError, TaskConfig
from polyrl.config_check import load_config
from polyrl.envs import ENVS, SingleTurnEnv, Task, make_task
from polyrl.envs.base import env_name
from polyrl.envs.gym_text import frozen_lake_map
from polyrl.envs.reasoning_gym import ReasoningGymTask
from polyrl.envs.retrieval import answer_matches, build_corpus, make_question
from polyrl.envs.tool_parsers import SmolLM2Parser, ToolCall

CALL = SmolLM2Parser()


def call(name: str, **args) -> str:
    return CALL.format_calls([ToolCall(name, args)])


def config(**task) -> dict:
    return {"model": {"name": "tiny-random"}, "tasks": [task]}


def test_builtin_envs_are_registered():
    assert {"reasoning_gym", "tool_math", "retrieval_qa", "frozen_lake", "gym"} <= set(ENVS)


def test_env_defaults_to_the_task_name_else_reasoning_gym():
    assert env_name(TaskConfig(name="tool_math")) == "tool_math"
    assert env_name(TaskConfig(name="chain_sum")) == "reasoning_gym"
    assert env_name(TaskConfig(name="mine", env="retrieval_qa")) == "retrieval_qa"


@pytest.mark.parametrize(
    "task,message",
    [
        ({"name": "x", "env": "nope"}, "tasks.0.env: unknown env 'nope'; valid: dataset, frozen_lake, gym,"),
        ({"name": "chain_sums"}, "tasks.0.name: unknown task 'chain_sums'"),
        ({"name": "tool_math", "params": {"datset": "chain_sum"}}, "tasks.0.params.datset: unknown key"),
        ({"name": "tool_math", "params": {"dataset": "nope"}}, "tasks.0.params.dataset: unknown task 'nope'"),
        ({"name": "tool_math", "params": {"tool_error_penalty": -1}}, "tasks.0.params.tool_error_penalty:"),
        (
            {"name": "tool_math", "tool_parser": "mistral"},
            "tasks.0.tool_parser: unknown tool parser 'mistral'",
        ),
        ({"name": "tool_math", "max_turns": 0}, "tasks.0.max_turns:"),
        (
            {"name": "g", "env": "gym", "params": {"id": "NoSuchEnv-v9"}},
            "tasks.0.params.id: unknown Gymnasium env",
        ),
        ({"name": "g", "env": "gym"}, "tasks.0.params.id: Field required"),
        ({"name": "frozen_lake", "params": {"size": 1}}, "tasks.0.params.size:"),
    ],
)
def test_task_config_errors_name_the_key(task, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, data=config(**task))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_duplicate_task_names_are_refused():
    data = {"model": {"name": "tiny-random"}, "tasks": [{"name": "chain_sum"}, {"name": "chain_sum"}]}
    with pytest.raises(ConfigError, match="tasks.1.name: task 'chain_sum' is listed twice"):
        load_config(None, data=data)


def test_shipped_tool_math_config_validates():
    cfg = load_config(ROOT / "configs" / "tool_math.yaml")
    assert cfg.model.name == "smollm2-135m-instruct"
    assert env_name(cfg.tasks[0]) == "tool_math" and cfg.tasks[0].max_turns >= 2


def test_reasoning_gym_is_the_one_step_case_of_the_protocol():
    task = make_task(TaskConfig(name="chain_sum", prompt_suffix=" Just the number.", eval_size=3), seed=0)
    assert isinstance(task, ReasoningGymTask)
    item = task.train_item(0)
    env = task.make_env()
    assert isinstance(env, SingleTurnEnv) and env.tools == ()
    assert env.reset(item) == [{"role": "user", "content": item["question"] + " Just the number."}]
    obs, reward, done, info = env.step(f"It is {item['answer']}")
    assert (obs, reward, done, info) == ([], 1.0, True, {"score": 1.0})
    env.reset(item)
    assert env.step("no idea").reward == 0.0
    # train and held-out streams are deterministic and different
    assert task.train_item(5) == make_task(TaskConfig(name="chain_sum"), seed=0).train_item(5)
    assert [it["question"] for it in task.eval_items()] != [task.train_item(i)["question"] for i in range(3)]


def test_tool_math_solves_with_the_calculator():
    cfg = TaskConfig(name="tool_math", params={"dataset": "basic_arithmetic", "tool_error_penalty": 0.5})
    task = make_task(cfg, seed=0)
    for index in range(5):
        item = task.train_item(index)
        env = task.make_env()
        messages = env.reset(item)
        assert messages[0]["role"] == "system" and "calculate" in messages[0]["content"]
        expression = re.sub(r"^.*?:|=.*$", "", item["question"].replace("Calculate", ":")).strip().rstrip(".")
        obs, reward, done, info = env.step(call("calculate", expression=expression))
        assert not done and info["valid_tool_calls"] == 1, obs
        result = obs[0]["content"]
        assert float(result) == pytest.approx(float(item["answer"])), (item["question"], result)
        assert env.step(f"The answer is {result}").reward == 1.0
    env = task.make_env()
    env.reset(task.train_item(0))
    obs, reward, done, info = env.step(call("calculate", expression="1 / 0"))
    assert (reward, done) == (-0.5, False) and "division by zero" in info["tool_error"]


def test_retrieval_corpus_is_deterministic():
    a = build_corpus(seed=3, num_people=20, num_towns=6)
    build_corpus.cache_clear()
    b = build_corpus(seed=3, num_people=20, num_towns=6)
    assert a is not b and a.documents == b.documents and len(a.documents) == 26
    assert build_corpus(seed=4, num_people=20, num_towns=6).documents != a.documents
    assert make_question(a, 11) == make_question(b, 11)


def _search_agent(env, question: str) -> str:
    """Answers with the search tool only: look up the person, then (for two hops) their town."""
    name = re.search(r"\b[A-Z][a-z]+ [A-Z][a-z]+\b", question).group(0)
    obs = env.step(call("search", query=name)).observations[0]["content"]
    doc = next(line for line in obs.splitlines() if line.startswith(name))
    town = re.search(r"born in (\w+)", doc).group(1)
    if "province" in question or "river" in question:
        obs = env.step(call("search", query=town)).observations[0]["content"]
        doc = next(line for line in obs.splitlines() if line.startswith(town))
        return re.search(r"province of (\w+)" if "province" in question else r"river (\w+)", doc).group(1)
    if "town" in question:
        return town
    if "occupation" in question:
        return re.search(r"is an? (.+?) who", doc).group(1)
    return re.search(r"plays the (\w+)", doc).group(1)


def test_every_retrieval_question_is_answerable_through_search():
    task = make_task(TaskConfig(name="retrieval_qa"), seed=0)
    hops = set()
    for index in range(25):
        item = task.train_item(index)
        hops.add(item["hops"])
        env = task.make_env()
        env.reset(item)
        answer = _search_agent(env, item["question"])
        assert env.step(f"Answer: {answer}").reward == 1.0, (item, answer)
    assert hops == {1, 2}


def test_unknown_search_terms_find_nothing():
    corpus = build_corpus()
    assert corpus.search("zzzz qqqq") == "No documents found."


@pytest.mark.parametrize(
    "reply,ok",
    [
        ("Rewun", True),
        ("Answer: rewun.", True),
        ("It was Rewun.", True),
        ("Risthi", False),
        ("Rewun Risthi Githpan Kelmor Abba Dabba Foo Bar Baz", False),
    ],
)
def test_answer_matching(reply, ok):
    assert answer_matches(reply, "Rewun") is ok


MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}


def _plan(grid: list[str]) -> list[str]:
    """Shortest safe path from S to G on a FrozenLake map (breadth-first search)."""
    n = len(grid)
    queue, seen = deque([((0, 0), [])]), {(0, 0)}
    while queue:
        (r, c), path = queue.popleft()
        if grid[r][c] == "G":
            return path
        for move, (dr, dc) in MOVES.items():
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < n and grid[nr][nc] != "H" and (nr, nc) not in seen:
                seen.add((nr, nc))
                queue.append(((nr, nc), [*path, move]))
    raise AssertionError("generated maps always have a path")


def test_frozen_lake_played_as_text():
    task = make_task(
        TaskConfig(name="frozen_lake", max_turns=20, params={"invalid_action_penalty": 0.1}), seed=0
    )
    item = task.train_item(1)
    assert item["map"] == frozen_lake_map(1) and item == task.train_item(1)
    env = task.make_env()
    messages = env.reset(item)
    assert messages[1]["content"].splitlines()[0].startswith("P")
    obs, reward, done, info = env.step("hmm, let me think")
    assert (reward, done, info) == (-0.1, False, {"invalid_action": True}) and "Invalid action" in obs[0][
        "content"
    ]
    plan = _plan(item["map"])
    for i, move in enumerate(plan):
        obs, reward, done, info = env.step(f"I will go {move}.")
        assert done == (i == len(plan) - 1)
    assert reward == 1.0 and info["score"] == 1.0


def test_frozen_lake_hole_ends_the_episode_with_nothing():
    task = make_task(TaskConfig(name="frozen_lake"), seed=0)
    for seed in range(50):
        grid = frozen_lake_map(seed)
        first = next(
            (m for m, (dr, dc) in MOVES.items() if (dr, dc) in ((1, 0), (0, 1)) and grid[dr][dc] == "H"), None
        )
        if first:
            break
    env = task.make_env()
    env.reset({"seed": seed, "map": grid})
    obs, reward, done, info = env.step(first)
    assert done and reward == 0.0 and info["score"] == 0.0


def test_any_gymnasium_env_with_an_ansi_renderer():
    cfg = TaskConfig(
        name="cliff",
        env="gym",
        params={"id": "CliffWalking-v1", "action_names": ["up", "right", "down", "left"]},
    )
    task = make_task(cfg, seed=0)
    env = task.make_env()
    messages = env.reset(task.train_item(0))
    board = messages[1]["content"]
    assert "x" in board.splitlines()[3] and "\x1b" not in board and "up, right, down, left" in board
    obs, reward, done, _ = env.step("up")
    assert reward == -1.0 and not done and "x" in obs[0]["content"].splitlines()[2]
    numbered = make_task(TaskConfig(name="c", env="gym", params={"id": "CliffWalking-v1"}), seed=0).make_env()
    numbered.reset({"seed": 0})
    assert numbered.step("action 7").observations[0]["content"].startswith("Invalid action")
    assert numbered.step("0").reward == -1.0


def test_a_task_is_a_deterministic_item_stream():
    made = []
    task = Task(
        TaskConfig(name="t", eval_size=2),
        make_env=lambda: None,
        make_item=lambda s: made.append(s) or {"s": s},
        seed=10,
    )
    assert task.train_item(3) == {"s": 13}
    assert [it["s"] for it in task.eval_items()] == [10 + 7_919_000_003, 10 + 7_919_000_004]
