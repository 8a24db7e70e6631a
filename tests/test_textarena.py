"""TextArena games as multi-turn envs (``env: textarena``): a single-player puzzle, a two-player game against a
fixed opponent, malformed moves as a reward signal, config errors, and a short train run with a tiny model."""

from __future__ import annotations

import json
import math
import re
import sys

import pytest
import yaml
from conftest import ROOT

pytest.importorskip("textarena")

from polyrl.config import ConfigError, TaskConfig  # noqa: E402
from polyrl.config_check import load_config  # noqa: E402
from polyrl.envs import make_task  # noqa: E402
from polyrl.envs.textarena_env import format_observation, random_opponent  # noqa: E402

TINY = {"model": {"name": "tiny-random", "bf16": False}, "optim": {"lr": 1e-3},
        "logging": {"progress": False, "tensorboard": False, "report": False}}


def _task(**params):
    return make_task(TaskConfig(name="game", env="textarena", params=params), seed=0)


def test_guess_the_number_is_won_by_bisection_and_scored_by_the_game():
    task = _task(game="GuessTheNumber-v0")
    for index in range(3):
        env = task.make_env()
        (opening,) = env.reset(task.train_item(index))
        assert "Guess The Number" in opening["content"] and opening["role"] == "user"
        low, high, turns = 1, 20, 0
        while True:
            guess = (low + high) // 2
            result = env.step(f"I think it is [{guess}].")
            turns += 1
            if result.done:
                break
            assert result.reward == 0.0
            hint = result.observations[0]["content"]
            assert f"[{guess}]" not in hint  # the policy's own move is not echoed back to it
            if "higher" in hint:
                low = guess + 1
            else:
                assert "lower" in hint
                high = guess - 1
        assert result.reward == 1.0 and result.info["score"] == 1.0 and turns <= 5


def test_a_game_has_its_own_random_stream():
    """TextArena seeds the global ``random``: the env keeps that inside the game, and the game a function of its
    item whatever the process drew before."""
    import random

    task = _task(game="GuessTheNumber-v0")
    secrets = []
    for outside_seed in (1, 2):
        random.seed(outside_seed)
        expected = random.Random(outside_seed).random()
        env = task.make_env()
        env.reset(task.train_item(4))
        env.step("[1]")
        assert random.random() == expected
        secrets.append(env.game.state.game_state["game_number"])
    assert secrets[0] == secrets[1]


def test_malformed_moves_are_warned_then_lose_the_game_without_an_error():
    task = _task(game="GuessTheNumber-v0")
    env = task.make_env()
    env.reset(task.train_item(0))
    first = env.step("<|im_end|> \x00 no number here")
    assert not first.done and first.reward == 0.0 and first.info["invalid_moves"] == 1
    assert "invalid move" in first.observations[0]["content"]
    second = env.step("")
    assert second.done and second.reward == 0.0 and second.info["invalid_moves"] == 2
    assert "Invalid Move" in second.info["outcome"]


def test_a_reply_that_breaks_the_game_loses_it(caplog):
    task = _task(game="TicTacToe-v0", num_players=2, opponent="random", seat=0)
    env = task.make_env()
    env.reset(task.train_item(0))

    def broken(action):
        raise IndexError("the game's own parser failed")

    env.game.step = broken
    result = env.step("[[[")
    assert result.done and result.reward == -1.0 and result.info["outcome"] == "game error: IndexError"
    assert "the game raised IndexError" in caplog.text


def test_tic_tac_toe_against_the_random_opponent_from_either_seat():
    task = _task(game="TicTacToe-v0", num_players=2, opponent="random")
    outcomes, seats = [], set()
    for index in range(12):
        env = task.make_env()
        (opening,) = env.reset(task.train_item(index))
        seats.add(env.seat)
        assert f"You are Player {env.seat}" in opening["content"]
        if env.seat == 1:  # the opponent opened: its move is in the policy's first observation
            assert "[Player 0]" in opening["content"]
        text = opening["content"]
        while True:
            free = re.findall(r"\[\d\]", text.split("Available Moves:")[-1])
            result = env.step(free[0])  # the first free cell: always legal
            if result.done:
                break
            text = result.observations[0]["content"]
        assert result.info["invalid_moves"] == 0
        outcomes.append(result.reward)
    assert seats == {0, 1} and set(outcomes) <= {-1.0, 0.0, 1.0} and len(set(outcomes)) > 1


def test_random_opponent_picks_only_listed_moves():
    move = random_opponent(__import__("random").Random(0))
    text = "For example, '[4]' places a mark.\n\nAvailable Moves: '[0]', '[7]'"
    assert {move(text) for _ in range(30)} == {"[0]", "[7]"}
    assert move("no options") == ""
    assert format_observation([(-1, " Board ", None), (0, "[3]", None), (1, "[5]", None)], seat=0) == \
        "Board\n\n[Player 1] [5]"


def test_a_user_opponent_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_opponents.py").write_text(
        "import re\n\ndef first_free(observation: str) -> str:\n"
        "    return re.findall(r'\\[\\d\\]', observation.split('Available Moves:')[-1])[0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_opponents", None)
    task = _task(game="TicTacToe-v0", num_players=2, opponent="my_opponents:first_free", seat=1)
    env = task.make_env()
    (opening,) = env.reset(task.train_item(0))
    assert "Player 0 placed their symbol (O) in cell 0" in opening["content"]


@pytest.mark.parametrize(("params", "message"), [
    ({"game": "NoSuchGame-v0"}, "task.params.game: unknown TextArena game 'NoSuchGame-v0'"),
    ({"game": "TicTacToe-v0", "num_players": 2}, "task.params.opponent: a 2-player game needs an opponent"),
    ({"game": "TicTacToe-v0", "num_players": 2, "opponent": "best"}, "none of random, self or module:attr"),
    ({"game": "GuessTheNumber-v0", "seat": 1}, "task.params.seat: 1 is not a seat of a 1-player game"),
    ({"game": "GuessTheNumber-v0", "colour": "red"}, "task.params.colour: unknown key"),
])
def test_bad_params_are_one_line_errors(params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _task(**params)


def test_bad_game_in_a_config_file_names_the_key():
    data = {**TINY, "tasks": [{"name": "g", "env": "textarena", "params": {"game": "Chez-v0"}}]}
    with pytest.raises(ConfigError, match=r"tasks\.0\.params\.game: unknown TextArena game 'Chez-v0'"):
        load_config(None, data=data)


@pytest.mark.slow
def test_the_documented_config_trains_two_steps(tmp_path):
    from polyrl.run.loop import train

    text = (ROOT / "docs" / "agents.md").read_text()
    block = re.search(r"<!-- textarena-example:start -->(.*?)<!-- textarena-example:end -->", text, re.DOTALL)
    tasks = yaml.safe_load(re.search(r"```yaml\n(.*?)```", block.group(1), re.DOTALL).group(1))["tasks"]
    for task in tasks:
        task["eval_size"] = 2
    cfg = load_config(None, data={**TINY, "tasks": tasks, "train": {"steps": 2}, "eval": {"before": False},
                                  "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8}})
    summary = train(cfg, tmp_path / "run", log=lambda m: None)
    assert set(summary["eval_after"]) == {"guess", "tictactoe"} and "eval_before" not in summary
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    # a random model's replies are malformed moves: the games go on (or are lost), the run does not stop
    assert all(r["reward/mean"] is not None and -1.0 <= r["reward/mean"] <= 1.0 for r in rows)
