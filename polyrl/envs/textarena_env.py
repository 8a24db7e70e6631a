"""TextArena games as multi-turn envs: ``env: textarena`` with ``params.game`` naming any offline TextArena game
(``GuessTheNumber-v0``, ``TicTacToe-v0``, ``Nim-v0``, ...).

The policy plays one seat; in a two-player game the other seat is played by ``opponent``: ``random`` picks
uniformly among the ``[move]`` options the game lists in the opponent's newest observation, a ``module:attr``
callable ``(observation: str) -> str`` is a fixed policy of the user's own, and ``self`` is the policy being
trained (self-play, ``policy_opponent``): only the trained seat's turns are the trajectory. Each model turn is one
game action; the game's own rules judge it, so a malformed or illegal move is what TextArena makes of it (a
warning and a retry, then a lost game), never an error. The reward is the game's outcome for the policy's seat,
given on the turn the game ends.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from polyrl.config import TaskConfig
from polyrl.envs.base import Env, Message, PolicyChat, StepResult, Task, TaskContext, register_env
from polyrl.loader import is_reference, load_object

logger = logging.getLogger(__name__)
_BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")
Opponent = Callable[[str], str]


def _textarena() -> Any:
    try:
        import textarena
    except ImportError:
        raise ValueError("textarena is not installed; pip install 'polyrl[textarena]'") from None
    return textarena


class TextArenaParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    game: str
    """A TextArena env id, e.g. GuessTheNumber-v0 or TicTacToe-v0 (its unwrapped ``-raw`` version is played)."""
    kwargs: dict[str, Any] = {}
    """Override the game's registered constructor arguments (e.g. ``max_number`` for GuessTheNumber)."""
    num_players: int = Field(1, ge=1, le=2)
    opponent: str | None = None
    """For two players: ``random``; ``self``, the policy being trained (self-play: its moves sampled by the run's
    engine, only the trained seat's turns trained on); or ``module:attr``, a callable from the opponent's
    observation to its move."""
    seat: int | None = Field(None, ge=0, le=1)
    """The policy's player id; unset alternates with the item (seed % num_players)."""
    max_turns: int = Field(20, ge=1)
    """Policy turns before the episode is cut (reward 0); ``tasks[].max_turns`` overrides it."""


def format_observation(observation: list[tuple[int, str, Any]], seat: int | None) -> str:
    """TextArena's raw observation (sender, text, kind) as one message; the echo of ``seat``'s own action is
    left out (for the policy it is already in the conversation as the assistant's turn)."""
    lines = []
    for sender, text, _ in observation:
        if sender == seat:
            continue
        lines.append(text.strip() if sender < 0 else f"[Player {sender}] {text.strip()}")
    return "\n\n".join(line for line in lines if line)


def random_opponent(rng: random.Random) -> Opponent:
    """Uniform over the bracketed moves in the newest part of the observation that lists any; an empty reply
    (an invalid move, judged by the game) when there are none."""

    def move(observation: str) -> str:
        for part in reversed(observation.split("\n\n")):
            options = _BRACKETED.findall(part)
            if options:
                return rng.choice(options)
        return ""

    return move


def policy_opponent(policy: PolicyChat, system_prompt: str | None, seed: int) -> Opponent:
    """The policy being trained in the other seat (``opponent: self``). It keeps its own conversation, the one
    the policy would have in that seat: the system prompt, the game's observations to that seat (its own moves
    left out, as they are for the policy) and its replies. Each reply is sampled with a seed drawn from ``seed``
    and that conversation, so one position gets one reply whatever order the episodes run in: a group's
    episodes share the opponent's opening moves (and so their prompt), and a rerun at the same seed replays."""
    messages: list[Message] = [{"role": "system", "content": system_prompt}] if system_prompt else []

    def move(observation: str) -> str:
        messages.append({"role": "user", "content": observation})
        key = json.dumps([seed, messages]).encode()
        reply = policy(list(messages), int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "big"))
        messages.append({"role": "assistant", "content": reply})
        return reply

    return move


class TextArenaEnv(Env):
    """One TextArena game per episode, the policy in seat ``seat``; other seats are played by ``opponent``."""

    def __init__(self, params: TextArenaParams, opponent: Callable[[random.Random], Opponent] | None,
                 system_prompt: str | None = None) -> None:
        self.params, self.make_opponent, self.system_prompt = params, opponent, system_prompt
        self.max_turns = params.max_turns
        self.game: Any = None
        self.seat = 0
        self.ended_early = False
        self.opponent: Opponent | None = None
        self.invalid_moves = 0
        self.rng_state: Any = None

    @contextmanager
    def _game_rng(self) -> Iterator[None]:
        """TextArena games seed and draw from the global ``random``; give them their own stream, so that a game
        stays a function of its seed and the rest of the process keeps its own."""
        outside = random.getstate()
        if self.rng_state is not None:
            random.setstate(self.rng_state)
        try:
            yield
        finally:
            self.rng_state = random.getstate()
            random.setstate(outside)

    def reset(self, item: dict[str, Any]) -> list[Message]:
        ta, p = _textarena(), self.params
        self.game = ta.make(f"{p.game}-raw", **p.kwargs)
        self.rng_state = None
        with self._game_rng():
            self.game.reset(num_players=p.num_players, seed=item["seed"])
        self.seat = p.seat if p.seat is not None else item["seed"] % p.num_players
        if self.make_opponent is not None:
            self.opponent = self.make_opponent(random.Random(item["seed"]))
        self.invalid_moves = 0
        # An opponent that loses before the policy moves (invalid moves of its own) leaves a finished game:
        # the policy's first step then ends it with reward 0, whatever it replies.
        self.ended_early, _ = self._opponents_move()
        messages: list[Message] = [{"role": "user", "content": self._observe()}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def _observe(self) -> str:
        _, observation = self.game.get_observation()
        return format_observation(observation, self.seat)

    def _opponents_move(self) -> tuple[bool, dict]:
        done, info = False, {}
        while not done and self.game.state.current_player_id != self.seat:
            player, observation = self.game.get_observation()
            # The policy in the other seat sees that seat's view, as the trained seat sees its own.
            move = self.opponent(format_observation(observation, player if self.params.opponent == "self" else None))
            with self._game_rng():
                done, info = self.game.step(move)
        return done, info

    def step(self, assistant_message: str) -> StepResult:
        if self.ended_early:
            return StepResult([], 0.0, True, {"score": 0.0, "invalid_moves": 0, "outcome": "opponent forfeited"})
        try:
            with self._game_rng():
                done, _ = self.game.step(assistant_message)
        except Exception as exc:  # noqa: BLE001 - a game whose parser breaks on a reply: the reply loses
            logger.warning("textarena %s: the game raised %s on a reply; scored as a loss", self.params.game,
                           type(exc).__name__)
            reward = -1.0 if self.params.num_players > 1 else 0.0
            return StepResult([], reward, True, {"score": reward, "invalid_moves": self.invalid_moves + 1,
                                                 "outcome": f"game error: {type(exc).__name__}"})
        if not done:
            done, _ = self._opponents_move()
        if not done:
            state = self.game.state
            if getattr(state, "error_count", 0) and state.current_player_id == self.seat:
                self.invalid_moves += 1
            return StepResult([{"role": "user", "content": self._observe()}], 0.0, False,
                              {"invalid_moves": self.invalid_moves})
        rewards, game_info = self.game.close()
        reward = float((rewards or {}).get(self.seat, 0.0))
        seat_info = (game_info or {}).get(self.seat, {})
        info = {"score": reward, "invalid_moves": self.invalid_moves + int(bool(seat_info.get("invalid_move"))),
                "outcome": str(seat_info.get("reason", ""))}
        return StepResult([], reward, True, info)


def _check(config: TaskConfig, key: str) -> None:
    from textarena.envs.registration import ENV_REGISTRY

    p = TextArenaParams.model_validate(config.params)
    if f"{p.game}-raw" not in ENV_REGISTRY:
        raise ValueError(f"{key}.params.game: unknown TextArena game '{p.game}' (e.g. GuessTheNumber-v0, "
                         f"TicTacToe-v0)")
    if p.num_players > 1 and p.opponent is None:
        raise ValueError(f"{key}.params.opponent: a {p.num_players}-player game needs an opponent (random, self "
                         f"or module:attr)")
    if p.opponent == "self" and p.num_players < 2:
        raise ValueError(f"{key}.params.opponent: self plays the other seat of a 2-player game; set num_players: 2")
    if p.opponent is not None and p.opponent not in ("random", "self") and not is_reference(p.opponent):
        raise ValueError(f"{key}.params.opponent: '{p.opponent}' is none of random, self or module:attr")
    if p.seat is not None and p.seat >= p.num_players:
        raise ValueError(f"{key}.params.seat: {p.seat} is not a seat of a {p.num_players}-player game")


@register_env("textarena", params=TextArenaParams, check=lambda config, key: (_textarena(), _check(config, key)))
def textarena_task(config: TaskConfig, ctx: TaskContext) -> Task:
    """Any offline TextArena game (params.game), one or two players; the reward is the game's outcome."""
    p: TextArenaParams = ctx.params
    opponent: Callable[[random.Random], Opponent] | None = None
    if p.num_players > 1:
        if p.opponent == "random":
            opponent = random_opponent
        elif p.opponent == "self":
            policy = ctx.policy
            if policy is None:
                raise ValueError(f"task '{config.name}': params.opponent self is the policy being trained, which "
                                 f"only a training run provides here")
            opponent = lambda rng: policy_opponent(policy, ctx.system_prompt, rng.getrandbits(31))  # noqa: E731
        else:
            user_policy = load_object(p.opponent, f"task '{config.name}' params.opponent")
            if not callable(user_policy):
                raise ValueError(f"task '{config.name}': params.opponent '{p.opponent}' is not callable")
            opponent = lambda rng: user_policy  # noqa: E731 - a user's fixed policy keeps its own state
    return Task(config, lambda: TextArenaEnv(p, opponent, ctx.system_prompt), lambda seed: {"seed": seed},
                ctx.seed)
