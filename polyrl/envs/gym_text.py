"""Gymnasium environments played as chat: the state is rendered as text, the model's reply is parsed into an
action. ``frozen_lake`` is FrozenLake on a map generated per item; ``gym`` adapts any Gymnasium env whose
``ansi`` renderer returns text.

A reply with no readable action is answered with an error message (and an optional penalty) and the game
state does not change.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from polyrl.config import TaskConfig
from polyrl.envs.base import Env, Message, StepResult, Task, TaskContext, register_env

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_INT = re.compile(r"-?\d+")


def _gym() -> Any:
    try:
        import gymnasium
    except ImportError:
        raise ValueError("gymnasium is not installed; pip install gymnasium") from None
    return gymnasium


def ansi_text(env: Any) -> str:
    """The env's ``ansi`` rendering with colour codes removed."""
    out = env.render()
    if not isinstance(out, str):
        name = env.spec.id if env.spec else env
        raise ValueError(f"{name}: render() did not return text; use render_mode='ansi'")
    return _ANSI.sub("", out).rstrip()


def action_parser(names: list[str] | None, n: int) -> Callable[[str], int | None]:
    """Read an action from a reply: the last action name in it (when names are given), else the last integer
    in ``[0, n)``."""
    if names:
        pattern = re.compile(r"\b(" + "|".join(re.escape(x) for x in names) + r")\b", re.IGNORECASE)
        lower = [x.lower() for x in names]

        def by_name(text: str) -> int | None:
            found = pattern.findall(text)
            return lower.index(found[-1].lower()) if found else None

        return by_name

    def by_number(text: str) -> int | None:
        found = [int(x) for x in _INT.findall(text)]
        return found[-1] if found and 0 <= found[-1] < n else None

    return by_number


class GymTextEnv(Env):
    """Any Gymnasium env with a text rendering, one action per model turn; the reward is the env's."""

    max_turns = 8

    def __init__(
        self,
        make: Callable[[dict[str, Any]], Any],
        instructions: str,
        parse_action: Callable[[str], Any | None],
        action_help: str,
        render: Callable[[Any], str] = ansi_text,
        invalid_action_penalty: float = 0.0,
        system_prompt: str | None = None,
    ) -> None:
        self.make, self.instructions, self.parse_action = make, instructions, parse_action
        self.action_help, self.render = action_help, render
        self.invalid_action_penalty = invalid_action_penalty
        self.system_prompt = system_prompt
        self.env: Any = None
        self.total = 0.0

    def _state(self) -> str:
        return f"{self.render(self.env)}\n\n{self.action_help}"

    def reset(self, item: dict[str, Any]) -> list[Message]:
        self.env = self.make(item)
        self.env.reset(seed=item["seed"])
        self.total = 0.0
        system = f"{self.system_prompt}\n\n{self.instructions}" if self.system_prompt else self.instructions
        return [{"role": "system", "content": system}, {"role": "user", "content": self._state()}]

    def step(self, assistant_message: str) -> StepResult:
        action = self.parse_action(assistant_message)
        if action is None:
            text = f"Invalid action. {self.action_help}"
            return StepResult([{"role": "user", "content": text}], -self.invalid_action_penalty, False,
                              {"invalid_action": True})
        _, reward, terminated, truncated, _ = self.env.step(action)
        self.total += float(reward)
        done = bool(terminated or truncated)
        info: dict[str, Any] = {"action": int(action) if isinstance(action, int) else action}
        if done:
            info["score"] = self.total
            self.env.close()
        return StepResult([{"role": "user", "content": self._state()}], float(reward), done, info)


# ---- FrozenLake ------------------------------------------------------------------------------------------

FROZEN_LAKE_ACTIONS = ["left", "down", "right", "up"]
FROZEN_LAKE_INSTRUCTIONS = (
    "You are on a frozen lake drawn as a grid: S is the start, F is frozen ice, H is a hole, G is the goal "
    "and P is where you stand. Reach G without stepping into a hole. Each turn, reply with one move: "
    "left, down, right or up."
)


def frozen_lake_text(env: Any) -> str:
    """The grid with the player as P (gymnasium's own ansi output marks it with colour codes only)."""
    lake = env.unwrapped
    row, col = divmod(int(lake.s), lake.ncol)
    lines = []
    for r, line in enumerate(lake.desc.tolist()):
        cells = [c.decode() for c in line]
        if r == row:
            cells[col] = "P"
        lines.append(" ".join(cells))
    return "\n".join(lines)


class FrozenLakeParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    size: int = Field(4, ge=2, le=12)
    frozen_prob: float = Field(0.8, gt=0, le=1)
    """Probability that a generated cell is ice rather than a hole."""
    slippery: bool = False
    invalid_action_penalty: float = Field(0.0, ge=0)


def frozen_lake_map(seed: int, size: int = 4, frozen_prob: float = 0.8) -> list[str]:
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    return generate_random_map(size=size, p=frozen_prob, seed=seed)


@register_env("frozen_lake", params=FrozenLakeParams)
def frozen_lake_task(config: TaskConfig, ctx: TaskContext) -> Task:
    """FrozenLake on a map generated per item, rendered as a text grid; moves are words."""
    gym, p = _gym(), ctx.params

    def make(item: dict[str, Any]) -> Any:
        return gym.make("FrozenLake-v1", desc=item["map"], is_slippery=p.slippery)

    def env() -> Env:
        return GymTextEnv(
            make, FROZEN_LAKE_INSTRUCTIONS, action_parser(FROZEN_LAKE_ACTIONS, 4),
            "Your move (left, down, right or up)?", frozen_lake_text, p.invalid_action_penalty,
            ctx.system_prompt,
        )

    return Task(config, env, lambda seed: {"seed": seed, "map": frozen_lake_map(seed, p.size, p.frozen_prob)},
                ctx.seed)


# ---- any Gymnasium env with an ansi renderer --------------------------------------------------------------


class GymParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    """A registered Gymnasium id, e.g. CliffWalking-v1; it must support render_mode='ansi'."""
    kwargs: dict[str, Any] = {}
    """Passed to gymnasium.make."""
    action_names: list[str] | None = None
    """Words for the discrete actions in order; unset means the model replies with the action's number."""
    instructions: str = "You are playing a game shown as text. Each turn, reply with one action."
    invalid_action_penalty: float = Field(0.0, ge=0)


def _check_gym(config: TaskConfig, key: str) -> None:
    gym, p = _gym(), GymParams.model_validate(config.params)
    try:
        gym.spec(p.id)
    except Exception:  # noqa: BLE001 - gymnasium raises several not-found types
        raise ValueError(f"{key}.params.id: unknown Gymnasium env '{p.id}'") from None


@register_env("gym", params=GymParams, check=_check_gym)
def gym_task(config: TaskConfig, ctx: TaskContext) -> Task:
    """Any Gymnasium env with a discrete action space and an ansi (text) renderer."""
    gym, p = _gym(), ctx.params
    probe = gym.make(p.id, render_mode="ansi", **p.kwargs)
    n = int(probe.action_space.n) if hasattr(probe.action_space, "n") else 0
    probe.close()
    if n == 0:
        raise ValueError(f"task '{config.name}': {p.id} has no discrete action space")
    if p.action_names is not None and len(p.action_names) != n:
        raise ValueError(f"task '{config.name}': params.action_names has {len(p.action_names)} names, {p.id} "
                         f"has {n} actions")
    help_text = ("Reply with one action: " + ", ".join(p.action_names) if p.action_names
                 else f"Reply with one action number from 0 to {n - 1}.")

    def env() -> Env:
        return GymTextEnv(
            lambda item: gym.make(p.id, render_mode="ansi", **p.kwargs), p.instructions,
            action_parser(p.action_names, n), help_text, ansi_text, p.invalid_action_penalty,
            ctx.system_prompt,
        )

    return Task(config, env, lambda seed: {"seed": seed}, ctx.seed)
