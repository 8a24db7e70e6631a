"""Adapter for Prime Intellect ``verifiers`` environments (classic API, verifiers 0.3.x), offline.

A verifiers environment is an installed Python package whose module exposes ``load_environment(**args)``;
it returns an ``Environment`` holding a dataset (rows with ``prompt``/``question``, ``answer``, ``info``) and
a ``Rubric`` of reward functions. polyrl generates the reply itself, so this module only takes the rows and
the prompt messages from the env and runs its rubric on one reply, as verifiers' own rollout would score it.
A config names one as ``env: "verifiers:<name>"`` with ``params`` as ``load_environment``'s arguments; its rows
become a dataset like any other (``polyrl.data.items``): the env's eval_dataset is the held-out set, or
``held_out_fraction`` of its rows when it has none.

verifiers 0.4 dropped the classic API (only ``verifiers.v1``) and needs ``openai<3``, so it does not install
beside polyrl's pins; 0.3.1 does. Load environments from the main thread: verifiers installs signal handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import sys
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from polyrl.config import TaskConfig
from polyrl.data.files import ListRows
from polyrl.data.items import DatasetSource
from polyrl.envs.base import Env, Message, StepResult, Task, TaskContext, register_env
from polyrl.rewards.functions import first_line

INSTALL_HINT = "pip install 'verifiers==0.3.*' (0.3.1 installs beside polyrl; 0.4 has no classic API)"


def _verifiers() -> Any:
    """The ``verifiers`` module with its classic API, or a one-line ValueError saying what to install."""
    try:
        import verifiers as vf
    except ImportError:
        raise ValueError(f"verifiers is not installed: {INSTALL_HINT}") from None
    if getattr(vf, "load_environment", None) is None:
        version = getattr(vf, "__version__", "?")
        raise ValueError(f"verifiers {version} has no classic API (load_environment): {INSTALL_HINT}")
    return vf


def load_verifiers_env(name: str, args: dict[str, Any]) -> Any:
    """The installed environment ``name`` (package ``my-env`` / module ``my_env``) built with ``args``.

    A missing verifiers, a missing environment package and a failing ``load_environment`` are one-line
    ValueErrors, like polyrl's other config errors."""
    vf = _verifiers()
    if os.getcwd() not in sys.path:  # an environment module beside the config, as for module:attr references
        sys.path.insert(0, os.getcwd())
    module = name.replace("-", "_").split("/")[-1]
    if not module.isidentifier() or importlib.util.find_spec(module) is None:
        raise ValueError(f"verifiers environment '{name}' is not installed (no Python module '{module}')")
    if not isinstance(args, dict):
        raise ValueError(f"verifiers environment '{name}': params must be a mapping, got {type(args).__name__}")
    try:
        return vf.load_environment(name, **args)
    except Exception as exc:  # noqa: BLE001 - any failure of the env's own loader is a config error here
        cause = exc.__cause__ or exc  # verifiers wraps the loader's error in a RuntimeError
        raise ValueError(f"verifiers environment '{name}' failed to load with {args}: {first_line(cause)}") from exc


def _plain_row(row: dict[str, Any]) -> dict[str, Any]:
    """A dataset row as a plain dict; ``info`` stored as JSON text (verifiers allows it) is decoded."""
    row = dict(row)
    if isinstance(row.get("info"), str):
        with contextlib.suppress(json.JSONDecodeError):
            row["info"] = json.loads(row["info"])
    return row


def _rows(dataset: Any) -> list[dict[str, Any]]:
    return [_plain_row(row) for row in dataset]


def verifiers_rows(env: Any, split: str = "train") -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(rows to train on, held-out rows or None). ``split: train`` trains on the env's dataset and holds out its
    eval_dataset; ``split: eval`` trains on the eval_dataset (for eval-only envs) and holds out nothing.

    Rows are the env's formatted rows: ``prompt`` (chat messages, system prompt included), ``answer``,
    ``example_id`` and whatever else the env put there (``question``, ``info``, ``task``)."""
    train = env.build_dataset() if hasattr(env, "build_dataset") else getattr(env, "dataset", None)
    held_out = env.build_eval_dataset() if hasattr(env, "build_eval_dataset") else getattr(env, "eval_dataset", None)
    if split == "train":
        if train is None:
            raise ValueError("verifiers environment has no training dataset, only an eval one: set split: eval")
        return _rows(train), (_rows(held_out) if held_out is not None else None)
    if split == "eval":
        if held_out is None:
            raise ValueError("verifiers environment has no eval_dataset: set split: train")
        return _rows(held_out), None
    raise ValueError(f"verifiers split must be 'train' or 'eval', got '{split}'")


def _message_dict(message: Any) -> dict[str, Any]:
    """A message as a plain dict without null fields (Arrow gives every message every key of its column)."""
    if hasattr(message, "model_dump"):
        message = message.model_dump()
    return {key: value for key, value in dict(message).items() if value is not None}


def verifiers_messages(env: Any, row: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages verifiers would prompt with: the row's ``prompt`` (already formatted by the env), else
    system prompt + few-shot + the ``question`` as the user turn; a text prompt is one user message."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if prompt:
        return [_message_dict(message) for message in prompt]
    messages: list[dict[str, Any]] = []
    if getattr(env, "system_prompt", None):
        messages.append({"role": "system", "content": env.system_prompt})
    messages.extend(_message_dict(message) for message in getattr(env, "few_shot", None) or [])
    messages.append({"role": "user", "content": str(row.get("question", ""))})
    return messages


def _run(make: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a coroutine to the end from sync code: in a fresh loop, or in a worker thread if this one has a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(make())
        return
    with ThreadPoolExecutor(1, thread_name_prefix="verifiers-score") as pool:
        pool.submit(lambda: asyncio.run(make())).result()


def _state(env: Any, row: dict[str, Any], prompt_messages: list[dict[str, Any]], reply: str) -> Any:
    """A finished single-turn rollout state, shaped like ``Environment.init_state`` + one model turn."""
    import verifiers.types as vf_types

    try:
        from verifiers.utils.message_utils import normalize_messages
    except ImportError:  # older verifiers: messages are plain dicts, completion-format text is a string
        normalize_messages = None

    data = _plain_row(row)
    flatten = getattr(vf_types, "flatten_task_input", None)
    try:
        task = flatten(data) if flatten else data
    except (TypeError, ValueError):  # a plain-text ``task`` column is a label here, not a task payload
        task = data
    state = getattr(vf_types, "State", dict)(input=task)
    state["task"] = task
    raw_prompt = row.get("prompt")
    if normalize_messages is not None:  # 0.2+: the rubric sees message lists; a text prompt is one "text" message
        prompt: Any = normalize_messages(raw_prompt if isinstance(raw_prompt, str) else prompt_messages)
        completion: Any = normalize_messages([{"role": "assistant", "content": reply}])
    elif getattr(env, "message_type", "chat") == "completion":  # older completion format: plain text
        prompt = raw_prompt if isinstance(raw_prompt, str) else "\n\n".join(str(m["content"]) for m in prompt_messages)
        completion = reply
    else:
        prompt, completion = prompt_messages, [{"role": "assistant", "content": reply}]
    state["prompt"] = prompt
    state["completion"] = completion
    ids = {"trajectory_id": uuid.uuid4().hex, "is_truncated": False}
    step = {"prompt": prompt, "completion": completion, "response": None, "tokens": None, "extras": {}}
    state["trajectory"] = [{**step, **ids, "reward": None, "advantage": None}]
    state.update(ids, model="", sampling_args=None, tool_defs=[], is_completed=True, final_env_response=None)
    state.update(reward=None, metrics=None, error=None)
    if hasattr(vf_types, "RolloutTiming"):
        state["timing"] = vf_types.RolloutTiming()
    return state


def verifiers_score(
    env: Any, row: dict[str, Any], prompt_messages: list[dict[str, Any]], reply: str, timeout_s: float | None = None
) -> dict[str, float]:
    """{"reward": the rubric's weighted total, <reward function name>: its value} for one single-turn reply.

    Scored as verifiers scores a finished rollout (``score_rollout``; ``score_group`` over this one rollout
    when the rubric has group-level functions), then the rubric's cleanup. verifiers scores a reward function
    that raises as 0; anything else the rubric raises propagates. Safe to call from a thread with no loop.
    A rubric may wait on another process (a judge model behind an API): past ``timeout_s`` it is cancelled and
    TimeoutError raised."""
    state = _state(env, row, prompt_messages, reply)
    rubric = env.rubric

    async def score() -> None:
        if getattr(rubric, "has_group_rewards", False):
            await rubric.score_group([state])
        else:
            await rubric.score_rollout(state)
        if hasattr(rubric, "cleanup"):
            await rubric.cleanup(state)

    async def bounded() -> None:
        try:
            await asyncio.wait_for(score(), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the rubric ran past reward_timeout_s ({timeout_s:g} s)") from None

    _run(bounded)
    scores = {str(key): float(value) for key, value in (state.get("metrics") or {}).items()}
    scores["reward"] = float(state.get("reward") or 0.0)
    return scores


class VerifiersEnv(Env):
    """One row of a verifiers environment: its prompt, then its rubric on the reply."""

    def __init__(self, vf_env: Any, timeout_s: float | None = None) -> None:
        """``timeout_s``: how long the rubric may score one reply (the task's ``reward_timeout_s``)."""
        self.vf_env, self.timeout_s = vf_env, timeout_s
        self.item: dict[str, Any] = {}
        self.messages: list[Message] = []

    def reset(self, item: dict[str, Any]) -> list[Message]:
        self.item, self.messages = item, verifiers_messages(self.vf_env, item)
        return self.messages

    def step(self, assistant_message: str) -> StepResult:
        try:
            scores = verifiers_score(self.vf_env, self.item, self.messages, assistant_message, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a rubric that chokes on a reply (or hangs) scores it 0
            return StepResult([], 0.0, True, {"score": 0.0, "reward_error": first_line(exc)})
        total = scores.pop("reward")
        return StepResult([], total, True, {"score": total, "reward_terms": scores})


def _check(config: TaskConfig, key: str) -> None:
    if config.items is not None or config.eval_items is not None:
        raise ValueError(f"{key}.items: a verifiers environment brings its own rows; leave items unset")
    _verifiers()


@register_env("verifiers", check=_check, takes_name=True)
def verifiers_task(config: TaskConfig, ctx: TaskContext) -> Task:
    """An installed verifiers environment (env: "verifiers:<name>", params: its load_environment arguments)."""
    name = (config.env or "").partition(":")[2]
    if not name:
        raise ValueError("task.env: name the verifiers environment: env: \"verifiers:<name>\"")
    vf_env = load_verifiers_env(name, dict(config.params))
    try:
        train, held_out = verifiers_rows(vf_env, "train")
    except ValueError:  # an eval-only environment: its rows are split like any dataset's
        train, held_out = verifiers_rows(vf_env, "eval")

    def key(row: dict[str, Any]) -> bytes:
        return json.dumps(verifiers_messages(vf_env, row), sort_keys=True, default=str).encode()

    source = DatasetSource(ListRows(train, f"verifiers:{name}"),
                           ListRows(held_out, f"verifiers:{name} eval") if held_out else None,
                           held_out_fraction=config.held_out_fraction, split_seed=config.split_seed, seed=ctx.seed,
                           key=key, name=f"task '{config.name}'")
    return Task(config, lambda: VerifiersEnv(vf_env, config.reward_timeout_s), seed=ctx.seed, source=source)
