"""The environment protocol, the Task that feeds it items, and the registry that config names envs by.

An ``Env`` plays one episode: ``reset(item) -> messages``, then ``step(assistant_message) -> (observations,
reward, done, info)`` until ``done``. A single-turn task is the same protocol with one step
(``SingleTurnEnv``), so every task goes through one rollout code path. A ``Task`` is a named, deterministic
stream of items plus a factory for fresh envs (one per sampled trajectory, so envs may keep episode state).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError

from polyrl.config import TaskConfig
from polyrl.data.files import check_source
from polyrl.data.items import GeneratedSource, ItemSource, dataset_source
from polyrl.envs.tool_parsers import ToolParser, check_parser_name, get_parser
from polyrl.envs.tools import Tool
from polyrl.loader import is_reference, load_object
from polyrl.rewards.functions import RewardFn

Message = dict[str, Any]
"""A chat message: ``{"role": ..., "content": ...}`` (tool results may add ``name``)."""
PolicyChat = Callable[[list[Message], int], str]
"""The policy being trained as a chat function, ``(messages, seed) -> reply`` (``polyrl.rollout.policy_chat``)."""

# Held-out items use a seed far from the training seed so the two streams do not share generator states.
EVAL_SEED_OFFSET = 7_919_000_003


class StepResult(NamedTuple):
    observations: list[Message]
    """Messages appended to the conversation before the model's next turn (ignored once ``done``)."""
    reward: float
    done: bool
    info: dict[str, Any]
    """Free-form; ``score`` (the task's success measure, used by evaluation), ``tool_calls``,
    ``valid_tool_calls`` and ``tool_error`` are read by the rollout when present."""


class Env(ABC):
    """One episode at a time. Subclasses set ``tools`` (and get ``tool_parser``) when they offer tools."""

    tools: Sequence[Tool] = ()
    tool_parser: ToolParser | None = None
    tool_latency_s: float | None = None
    """Seconds each tool call takes at least (``tasks[].tool_latency_s``); None: the env makes no tool calls
    to delay (``ToolEnv`` sets 0.0 and honours it)."""
    tool_timeout_s: float | None = None
    """Seconds one tool call may run (``tasks[].tool_timeout_s``); ``ToolEnv`` honours it."""
    max_turns: int = 1
    """Default turn limit; ``tasks[].max_turns`` in the config overrides it."""
    batch_scorer: Any = None
    """An object with ``step_many(envs, replies) -> list[StepResult]`` shared by envs whose replies are best
    scored together (a batched reward): the rollout steps such envs of one turn in one call."""
    concurrent_steps: bool = False
    """True when ``step`` may wait on something outside the process (a tool, a service) and is safe to call
    from a worker thread: the rollout then steps such envs of one turn concurrently. Envs whose steps only
    compute stay in the calling thread (threads would not speed them up, and math-verify's timeout needs the
    main thread)."""

    @abstractmethod
    def reset(self, item: dict[str, Any]) -> list[Message]:
        """Start an episode on ``item``; return the opening messages. Must be deterministic in ``item``:
        all samples of a group share one prompt."""

    @abstractmethod
    def step(self, assistant_message: str) -> StepResult:
        """Take the model's reply: as generated, special tokens kept, the final stop token removed."""


class SingleTurnEnv(Env):
    """A question, an answer and a scorer: ``reset`` asks, the first ``step`` scores and ends."""

    def __init__(
        self,
        messages: Callable[[dict[str, Any]], list[Message]],
        score: Callable[[dict[str, Any], str], float],
    ) -> None:
        self._messages, self._score = messages, score
        self.item: dict[str, Any] = {}

    def reset(self, item: dict[str, Any]) -> list[Message]:
        self.item = item
        return self._messages(item)

    def step(self, assistant_message: str) -> StepResult:
        score = self._score(self.item, assistant_message)
        return StepResult([], score, True, {"score": score})


class TryAgainEnv(Env):
    """A single-turn task as a multi-turn episode: a wrong answer gets ``feedback`` and another attempt, up to
    ``attempts`` in all (``tasks[].attempts``). The episode ends at the first success (the env's ``score``
    reaching 1) or after the last attempt; its reward is that attempt's, times ``discount`` per earlier
    attempt, so a later success can be worth less. ``info["score"]`` stays the undiscounted success, so
    held-out accuracy with the wrapper is accuracy at k attempts; ``info["attempts"]`` is how many were used.
    """

    def __init__(self, inner: Env, attempts: int, feedback: str, discount: float = 1.0) -> None:
        if inner.max_turns != 1 or inner.tools:
            raise ValueError(f"tasks[].attempts: needs a single-turn env without tools, got {type(inner).__name__}")
        self.inner, self.max_turns, self.feedback, self.discount = inner, attempts, feedback, discount
        self.attempt = 0

    def reset(self, item: dict[str, Any]) -> list[Message]:
        self.attempt = 0
        return self.inner.reset(item)

    def step(self, assistant_message: str) -> StepResult:
        self.attempt += 1
        result = self.inner.step(assistant_message)
        score = float(result.info.get("score", result.reward))
        if score >= 1.0 or self.attempt >= self.max_turns:
            info = {**result.info, "score": score, "attempts": self.attempt}
            return StepResult([], result.reward * self.discount ** (self.attempt - 1), True, info)
        return StepResult([{"role": "user", "content": self.feedback}], 0.0, False, {"attempts": self.attempt})


class Task:
    """A named source of items and the env that plays them. Items come from one ``ItemSource``
    (``polyrl.data.items``): generated from integer seeds (``make_item``: the training stream is
    ``seed + index``, the held-out set ``seed + EVAL_SEED_OFFSET + i``) or a finite dataset split by hash."""

    def __init__(
        self,
        config: TaskConfig,
        make_env: Callable[[], Env],
        make_item: Callable[[int], dict[str, Any]] | None = None,
        seed: int = 0,
        source: ItemSource | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self._make_env = make_env
        self.seed = seed
        if source is None and make_item is not None:
            source = GeneratedSource(lambda i: make_item(seed + i), lambda i: make_item(seed + EVAL_SEED_OFFSET + i))
        self.source = source

    def make_env(self) -> Env:
        env = self._make_env()
        if self.config.tool_latency_s:
            if env.tool_latency_s is None:
                raise ValueError(f"task '{self.name}': tool_latency_s needs a tool env (a ToolEnv), got "
                                 f"{type(env).__name__}")
            env.tool_latency_s = self.config.tool_latency_s
        if env.tool_timeout_s is not None:
            env.tool_timeout_s = self.config.tool_timeout_s
        if self.config.attempts > 1:
            env = TryAgainEnv(env, self.config.attempts, self.config.attempt_feedback, self.config.attempt_discount)
        return env

    @property
    def has_eval_items(self) -> bool:
        return self.source is not None and self.source.has_eval

    def train_item(self, index: int) -> dict[str, Any]:
        if self.source is None:
            raise NotImplementedError(f"task '{self.name}' has no item source")
        return self.source.train_item(index)

    def reference_answer(self, item: dict[str, Any]) -> Any:
        """The item's reference answer (its ``answer``), None when it has none."""
        return item.get("answer")

    @property
    def reference_template(self) -> str:
        return self.config.reference or "{answer}"

    def reference_reply(self, item: dict[str, Any]) -> str | None:
        """The reply guidance plays for ``item`` (``tasks[].reference``, a template over the item's fields with
        ``{answer}`` its reference answer); None when the item has no answer or the template cannot be
        filled from it."""
        answer = self.reference_answer(item)
        if answer is None and self.config.reference is None:
            return None
        try:
            return self.reference_template.format_map({**item, "answer": answer})
        except (KeyError, IndexError, ValueError, AttributeError):
            return None

    def eval_items(self, n: int | None = None) -> list[dict[str, Any]]:
        if self.source is None:
            raise NotImplementedError(f"task '{self.name}' has no item source")
        if not self.source.has_eval:
            raise ValueError(f"task '{self.name}': no held-out items (give eval_items, or a held_out_fraction "
                             "above 0)")
        return self.source.eval_items(self.config.eval_size if n is None else n)


@dataclass
class TaskContext:
    """What a task factory gets besides its TaskConfig."""

    seed: int
    params: Any
    """``tasks[].params``, validated by the env's params model when it registered one (else the raw dict)."""
    tool_parser: ToolParser
    system_prompt: str | None = None
    policy: PolicyChat | None = None
    """The policy being trained, for envs where it also plays another part (self-play); set by training runs."""


TaskFactory = Callable[["TaskConfig", TaskContext], Task]


@dataclass
class EnvSpec:
    factory: TaskFactory
    params: type[BaseModel] | None = None
    check: Callable[[TaskConfig, str], None] | None = None
    """Extra config-time validation; raises ValueError naming ``key``."""
    doc: str = field(default="")
    takes_name: bool = False
    """Named as ``env: "<name>:<what>"`` (``verifiers:my-env``): the part after the colon is the factory's to read
    from ``config.env``."""


ENVS: dict[str, EnvSpec] = {}
"""The registered envs: the built-ins register when ``polyrl/envs/__init__.py`` imports their modules, which
any import of a ``polyrl.envs`` module runs first."""


def register_env(
    name: str,
    params: type[BaseModel] | None = None,
    check: Callable[[TaskConfig, str], None] | None = None,
    takes_name: bool = False,
) -> Callable[[TaskFactory], TaskFactory]:
    """Decorator: ``@register_env("my_env")`` on a ``(config, ctx) -> Task`` factory makes
    ``tasks: [{name: x, env: my_env}]`` valid."""

    def wrap(factory: TaskFactory) -> TaskFactory:
        if name in ENVS:
            raise ValueError(f"env '{name}' is already registered")
        ENVS[name] = EnvSpec(factory, params, check, (factory.__doc__ or "").strip().split("\n")[0], takes_name)
        return factory

    return wrap


def env_names() -> list[str]:
    """The envs a config can name (agent tasks and module:attr factories are named their own way)."""
    return sorted(n for n in ENVS if n != "agent")


def env_name(config: TaskConfig) -> str:
    """``agent`` for an agent task, else ``tasks[].env``, or ``dataset`` for a task with ``items``, or the env
    registered under the task's name, or reasoning-gym."""
    if config.agent is not None:
        return "agent"
    if config.env is not None:
        return config.env
    if config.items is not None:
        return "dataset"
    return config.name if config.name in ENVS else "reasoning_gym"


OWN_ROWS = ("dataset", "agent")
"""Envs that read ``items`` themselves; any other env given ``items`` plays those rows instead of its own."""


_REFERENCED: dict[str, EnvSpec] = {}
"""Task factories named by ``module:attr``, loaded once; kept apart from ENVS, the registered names that
``polyrl tasks`` lists."""


def env_spec(name: str, key: str) -> EnvSpec:
    """The registered env ``name``, or the task factory a ``module:attr`` reference names (loaded on first
    use)."""
    if name in ENVS:
        return ENVS[name]
    prefix = name.partition(":")[0]
    if prefix in ENVS and ENVS[prefix].takes_name:
        return ENVS[prefix]
    if not is_reference(name):
        raise ValueError(f"{key}: unknown env '{name}'; valid: {', '.join(env_names())}, or module:attr")
    if name not in _REFERENCED:
        factory = load_object(name, key)
        if not callable(factory):
            raise ValueError(f"{key}: '{name}' is not callable; it must be a task factory (config, ctx) -> Task")
        _REFERENCED[name] = EnvSpec(factory, doc=(getattr(factory, "__doc__", None) or "").strip().split("\n")[0])
    return _REFERENCED[name]


def task_params(spec: EnvSpec, config: TaskConfig, key: str) -> Any:
    if spec.params is None:
        return config.params
    try:
        return spec.params.model_validate(config.params)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
        raise ValueError(f"{key}.params{'.' + loc if loc else ''}: {msg}") from None


def check_task(config: TaskConfig, key: str = "task") -> None:
    """Config-time validation of one task entry; raises a one-line ValueError naming the key."""
    name = env_name(config)
    spec = env_spec(name, f"{key}.env")
    check_parser_name(config.tool_parser, key=f"{key}.tool_parser")
    task_params(spec, config, key)
    if config.reward is not None and name == "agent":
        raise ValueError(f"{key}.reward: an agent task's reward is what its agent returns; score there, or mix a "
                         f"named reward in with {key}.reward_components")
    for j, comp in enumerate(config.reward_components):
        if comp.kind == "reward":  # imported and checked now, not at the first scored step
            RewardFn(comp.reward, comp.params, config.reward_timeout_s, f"{key}.reward_components.{j}.reward",
                     f"{key}.reward_components.{j}.params")
    if name not in OWN_ROWS and not spec.takes_name:
        if config.reward is not None:
            raise ValueError(f"{key}.reward: the env '{name}' scores its own episodes; add your reward to them "
                             f"as a component ({key}.reward_components: [{{reward: {config.reward}}}])")
        if config.eval_items is not None and config.items is None:
            raise ValueError(f"{key}.eval_items: given without items; the env '{name}' makes its own held-out "
                             "items")
    if config.items is not None and not isinstance(config.items, list):
        check_source(config.items, f"{key}.items")
    if config.eval_items is not None and not isinstance(config.eval_items, list):
        check_source(config.eval_items, f"{key}.eval_items")
    if spec.check is not None:
        spec.check(config, key)


def make_task(config: TaskConfig, seed: int, system_prompt: str | None = None, tokenizer: Any = None,
              policy: PolicyChat | None = None) -> Task:
    """Build the task a config entry describes; ``tokenizer`` lets ``tool_parser: auto`` pick the format,
    ``policy`` is ``TaskContext.policy``."""
    check_task(config, key="task")
    spec = env_spec(env_name(config), "task.env")
    parser = get_parser(config.tool_parser, tokenizer)
    ctx = TaskContext(seed, task_params(spec, config, "task"), parser, system_prompt, policy)
    task = spec.factory(config, ctx)
    if config.items is not None and env_name(config) not in OWN_ROWS and not spec.takes_name:  # env plays your rows
        task.source = dataset_source(config, seed)
    if config.tool_latency_s:
        task.make_env()  # fail at start-up, not at the first rollout, when the env has no tools to delay
    return task
