"""TextArena self-play (``params.opponent: self``): the policy being trained plays the other seat from that seat's
own conversation; only the trained seat's turns are its trajectory; seeded replies replay at a fixed seed."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch
import yaml
from conftest import ROOT

pytest.importorskip("textarena")

from polyrl.config import ConfigError, RolloutConfig, TaskConfig  # noqa: E402
from polyrl.config_check import load_config  # noqa: E402
from polyrl.engines.hf import HFEngine  # noqa: E402
from polyrl.envs import make_task  # noqa: E402
from polyrl.models.loading import load_model  # noqa: E402
from polyrl.rollout.multi_turn import rollout  # noqa: E402
from polyrl.rollout.policy_chat import EnginePolicy  # noqa: E402

TINY = {"model": {"name": "tiny-random", "bf16": False}, "optim": {"lr": 1e-3},
        "logging": {"progress": False, "tensorboard": False, "report": False}}
TIC_TAC_TOE = {"game": "TicTacToe-v0", "num_players": 2, "opponent": "self"}
# Every reply is a legal move here (free talk, then a choice that defaults), so a random model's games run to the
# end: one round of one message and one decision, 2 turns per seat.
DILEMMA = {"game": "IteratedPrisonersDilemma-v0", "kwargs": {"num_rounds": 1, "communication_turns": 1},
           "num_players": 2, "opponent": "self"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_engine(tok):
    return HFEngine(load_model("tiny-random", seed=0), tok, bf16=False)


class FirstFreeCell:
    """A stand-in policy for the other seat: the first free cell of the newest board it was shown."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[dict], int]] = []

    def __call__(self, messages: list[dict], seed: int) -> str:
        self.calls.append(([dict(m) for m in messages], seed))
        return re.findall(r"\[\d\]", messages[-1]["content"].split("Available Moves:")[-1])[0]


class Recording:
    """An engine's ``generate``, recording each call's prompts and completions."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine, self.tokenizer, self.stop_ids = engine, engine.tokenizer, engine.stop_ids
        self.prompts: list[list[int]] = []
        self.completions: list[list[int]] = []

    def generate(self, prompts, n=1, *args, **kwargs):
        out = self.engine.generate(prompts, n, *args, **kwargs)
        self.prompts += prompts
        self.completions += [c.token_ids for group in out for c in group]
        return out


def _play_tic_tac_toe(index: int):
    """One game: the trained seat takes the first free cell too; returns the env, its opening, the replies'
    observations, the stand-in's record and the last step."""
    other = FirstFreeCell()
    task = make_task(TaskConfig(name="ttt", env="textarena", params=TIC_TAC_TOE), seed=0,
                     system_prompt="Play well.", policy=other)
    env = task.make_env()
    messages = env.reset(task.train_item(index))
    seen = [messages[-1]["content"]]
    while True:
        result = env.step(re.findall(r"\[\d\]", seen[-1].split("Available Moves:")[-1])[0])
        if result.done:
            return env, seen, other, result
        seen.append(result.observations[0]["content"])


@pytest.mark.parametrize("index", [0, 1])
def test_self_play_game_runs_to_the_end_with_both_seats_played_from_their_own_view(index):
    env, seen, other, result = _play_tic_tac_toe(index)
    seat, opponent = env.seat, 1 - env.seat
    assert seat == index % 2  # the seat alternates with the item
    # Both take the first free cell: X fills 0, 2, 4, 6 and wins on the diagonal 2-4-6 at the 7th move.
    assert result.reward == (1.0 if seat == 0 else -1.0) and result.info["invalid_moves"] == 0
    assert len(seen) + len(other.calls) == 7
    if seat == 1:
        assert "[Player 0] [0]" in seen[0]  # the other seat opened, in the trained seat's first observation
    conversation, _ = other.calls[-1]
    assert conversation[0] == {"role": "system", "content": "Play well."}
    turns = conversation[1:]
    assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2) + ["user"]
    assert f"You are Player {opponent}" in turns[0]["content"]
    observations = [m["content"] for m in turns if m["role"] == "user"]
    assert all(f"[Player {opponent}]" not in text for text in observations)  # its own moves are its replies
    assert any(f"[Player {seat}]" in text for text in observations)  # the trained seat's moves reach it
    replies = [m["content"] for m in turns if m["role"] == "assistant"]  # all but the last, asked for here
    expected = ["[1]", "[3]", "[5]"] if seat == 0 else ["[0]", "[2]", "[4]", "[6]"]
    assert len(other.calls) == len(expected) and replies == expected[:-1]
    # the seeds are a function of the item and the conversation: a replay asks with the same ones
    _, _, again, _ = _play_tic_tac_toe(index)
    assert [s for _, s in again.calls] == [s for _, s in other.calls]
    assert len({s for _, s in other.calls}) == len(other.calls)


def _self_play_rollout(engine: HFEngine, seed: int = 3):
    """Two items (one per seat), two samples each, of the dilemma with the tiny model in both seats."""
    trained, opponent = Recording(engine), Recording(engine)
    policy = EnginePolicy(opponent, max_new_tokens=6, temperature=1.0)
    task = make_task(TaskConfig(name="pd", env="textarena", params=DILEMMA), seed=0, policy=policy)
    requests = [(task, i, task.train_item(i)) for i in (0, 1)]
    trajectories = rollout(trained, requests, RolloutConfig(group_size=2, max_new_tokens=6, temperature=1.0, top_p=1.0),
                           seed=seed, version=7)
    return trajectories, trained, opponent


@pytest.mark.slow
def test_only_the_trained_seats_tokens_are_model_tokens(tiny_engine, tok):
    trajectories, trained, opponent = _self_play_rollout(tiny_engine)
    assert len(opponent.completions) == 2 * len(trajectories)  # every episode's other seat played all its turns
    for traj in trajectories:
        assert traj.info["env_done"] and traj.info["turns"] == 2
        model = [i for i, m in enumerate(traj.loss_mask) if m]
        assert model == [i for a, b in traj.turn_spans for i in range(a, b)]
        for a, b in traj.turn_spans:
            assert traj.input_ids[a:b] in trained.completions and traj.versions[a:b] == [7] * (b - a)
        text = tok.decode(traj.input_ids)
        seat = 1 if "You are Player 1" in text else 0
        assert f"[Player {1 - seat}]" in text  # the other seat's moves, as env tokens (in the prompt if it opened)
    seats = {1 if "You are Player 1" in tok.decode(t.input_ids) else 0 for t in trajectories}
    assert seats == {0, 1}
    # The other seat's prompts are its own conversation in the chat template: the game's opening to that seat.
    for prompt in opponent.prompts:
        text = tok.decode(prompt)
        assert text.count("<|im_start|>user") >= 1 and text.endswith("<|im_start|>assistant\n")
    assert any("You are Player 1" in tok.decode(p) for p in opponent.prompts)
    assert any("You are Player 0" in tok.decode(p) for p in opponent.prompts)


@pytest.mark.slow
def test_self_play_replays_at_a_fixed_seed_and_leaves_the_global_rngs_alone(tiny_engine):
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    first, _, first_opponent = _self_play_rollout(tiny_engine)
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state
    second, _, second_opponent = _self_play_rollout(tiny_engine)
    assert [t.input_ids for t in first] == [t.input_ids for t in second]
    assert [t.logprobs for t in first] == [t.logprobs for t in second]
    assert [t.reward for t in first] == [t.reward for t in second]
    assert first_opponent.completions == second_opponent.completions
    other, _, _ = _self_play_rollout(tiny_engine, seed=4)  # the rollout's seed still steers the trained seat
    assert [t.input_ids for t in other] != [t.input_ids for t in first]


@pytest.mark.parametrize(("params", "message"), [
    ({"game": "GuessTheNumber-v0", "opponent": "self"},
     "task.params.opponent: self plays the other seat of a 2-player game; set num_players: 2"),
    ({"game": "TicTacToe-v0", "num_players": 2, "opponent": "selfish"}, "none of random, self or module:attr"),
])
def test_bad_self_play_config_is_a_one_line_error(params, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        make_task(TaskConfig(name="game", env="textarena", params=params), seed=0, policy=FirstFreeCell())
    assert "\n" not in str(err.value)


def test_bad_self_play_config_file_names_the_key():
    data = {**TINY, "tasks": [{"name": "g", "env": "textarena", "params": {"game": "Nim-v0", "opponent": "self"}}]}
    with pytest.raises(ConfigError, match=r"tasks\.0\.params\.opponent: self plays the other seat"):
        load_config(None, data=data)


def test_self_play_without_a_policy_to_play_it_names_the_key():
    with pytest.raises(ValueError, match=r"params\.opponent self is the policy being trained"):
        make_task(TaskConfig(name="game", env="textarena", params=TIC_TAC_TOE), seed=0)


@pytest.mark.slow
def test_the_documented_self_play_config_trains_a_step(tmp_path, monkeypatch):
    """The run's own engine plays the other seat: build_run hands every task the policy."""
    from polyrl.run.loop import train

    moves = []
    real = EnginePolicy.__call__

    def counting(self, messages, seed):
        moves.append(seed)
        return real(self, messages, seed)

    monkeypatch.setattr(EnginePolicy, "__call__", counting)
    text = (ROOT / "docs" / "agents.md").read_text()
    block = re.search(r"<!-- textarena-self-play:start -->(.*?)<!-- textarena-self-play:end -->", text, re.DOTALL)
    tasks = yaml.safe_load(re.search(r"```yaml\n(.*?)```", block.group(1), re.DOTALL).group(1))["tasks"]
    for task in tasks:
        task["eval_size"] = 1
    cfg = load_config(None, data={**TINY, "tasks": tasks, "train": {"steps": 1}, "eval": {"before": False},
                                  "rollout": {"prompts_per_step": 1, "group_size": 2, "max_new_tokens": 4}})
    summary = train(cfg, tmp_path / "run", log=lambda m: None)
    assert set(summary["eval_after"]) == {"tictactoe_self"} and moves
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and math.isfinite(rows[0]["loss"]) and -1.0 <= rows[0]["reward/mean"] <= 1.0


@pytest.mark.slow
def test_a_pipelines_evaluation_plays_the_other_seat_with_the_model_evaluated(monkeypatch):
    from polyrl.run.pipeline import evaluate_domains

    engines = []
    real = EnginePolicy.__call__

    def recording(self, messages, seed):
        engines.append(self.engine)
        return real(self, messages, seed)

    monkeypatch.setattr(EnginePolicy, "__call__", recording)
    cfg = load_config(None, data={**TINY, "rollout": {"max_new_tokens": 4}, "tasks": [
        {"name": "ttt", "env": "textarena", "eval_size": 2, "params": TIC_TAC_TOE}]})
    result = evaluate_domains(cfg, "tiny-random")
    assert set(result) == {"ttt"} and 0.0 <= result["ttt"] <= 1.0
    assert engines and all(e.model is engines[0].model for e in engines)
