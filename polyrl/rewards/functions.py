"""Rewards by name: ``reward: module:attr`` names a plain function of the user's, or a built-in checker
(``polyrl.rewards.checks``) by its name.

A user's function may take any of these forms, told apart by its parameter names:

- ``score(completion, item) -> float | dict`` (sync or async), one reply at a time;
- ``score(completions, items) -> list`` (sync or async), a batch at once;
- TRL's ``reward(prompts, completions, **columns) -> list[float]``, the row's other fields as column lists;
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict``;
- OpenRLHF's ``reward_func(queries, prompts, labels) -> list | tensor`` (a query is prompt + completion).

A dict return is a set of named terms, each logged; the reward is its ``score`` (verl) or ``reward`` entry if
it has one, else the sum of the terms. User functions run in a child process of their own, so one that runs
past ``timeout_s`` is killed and its replies score 0, as do replies whose call raised: the error's first line
is kept with the sample and counted in the metrics, and training goes on (``polyrl.rewards.worker``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from polyrl.loader import is_reference, load_object
from polyrl.rewards.checks import CHECKS

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0
"""Seconds a reward's process may take to import the function (heavy imports count here, not per call)."""

CONVENTIONS = {
    "single": "(completion, item)",
    "batched": "(completions, items)",
    "trl": "TRL's (prompts, completions, **kwargs)",
    "verl": "verl's (data_source, solution_str, ground_truth, extra_info)",
    "openrlhf": "OpenRLHF's (queries, prompts, labels)",
}


@dataclass
class Scored:
    """One reply's reward: the total, its named terms, and the error that zeroed it (if any)."""

    reward: float
    terms: dict[str, float]
    error: str | None = None


@dataclass
class Sample:
    """What a reward sees of one reply."""

    completion: str
    item: dict[str, Any]
    answer: Any
    prompt: Any
    """The row's prompt as given (a string or chat messages), for TRL-style functions."""
    conversational: bool = False


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def convention_of(fn: Callable[..., Any], reference: str, key: str) -> str:
    """Which of the forms ``fn`` takes, from its parameter names; a one-line error otherwise."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise ValueError(f"{key}: '{reference}' is not a function") from None
    names = list(params)
    if "solution_str" in names:
        return "verl"
    if "queries" in names:
        return "openrlhf"
    if "prompts" in names or ("completions" in names and any(p.kind is p.VAR_KEYWORD for p in params.values())
                              and "items" not in names):
        return "trl"
    if "completions" in names and "items" in names:
        return "batched"
    try:
        inspect.signature(fn).bind("", {})
        return "single"
    except TypeError:
        pass
    raise ValueError(f"{key}: '{reference}' takes ({', '.join(names)}); a reward takes "
                     + ", ".join(CONVENTIONS.values()))


def is_async_function(fn: Any) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__dict__.get("__call__"))


def to_scored(value: Any) -> Scored:
    """A function's return value as a reward; anything but a finite number (or a dict of them) is an error."""
    if value is None:  # TRL: this reward does not apply to the sample
        return Scored(0.0, {})
    if isinstance(value, dict):
        terms = {str(k): _number(v, f"'{k}'") for k, v in value.items() if not isinstance(v, str)}
        total = terms.get("score", terms.get("reward", sum(terms.values())))
        return Scored(total, terms)
    return Scored(_number(value, "the reward"), {})


def _number(value: Any, what: str) -> float:
    if isinstance(value, str | bytes) or not hasattr(value, "__float__"):  # numpy and torch scalars pass
        raise TypeError(f"{what} is a {type(value).__name__}, not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{what} is {number}")
    return number


def _trl_columns(samples: list[Sample]) -> dict[str, list[Any]]:
    fields = {k for s in samples for k in s.item if k not in ("prompt", "completion", "completions", "prompts")}
    return {k: [s.item.get(k) for s in samples] for k in sorted(fields)}


def _run_coroutines(coros: list[Any], timeout_s: float) -> list[Any]:
    """Await each with its own timeout in a fresh loop; a failure is returned in its place."""
    async def one(c: Any) -> Any:
        return await asyncio.wait_for(c, timeout_s)

    async def every() -> list[Any]:
        return await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)

    return asyncio.run(every())


def call(fn: Callable[..., Any], convention: str, samples: list[Sample], timeout_s: float) -> list[Any]:
    """Call ``fn`` on the samples in its own form; each entry is its return value or the exception it raised
    (a batched call that raises gives every sample that exception)."""
    is_async = is_async_function(fn)
    if convention in ("single", "verl"):
        def one(s: Sample) -> Any:
            if convention == "verl":
                return fn(data_source=s.item.get("data_source"), solution_str=s.completion, ground_truth=s.answer,
                          extra_info=s.item.get("extra_info"))
            return fn(s.completion, s.item)
        if is_async:
            return _run_coroutines([one(s) for s in samples], timeout_s)
        out: list[Any] = []
        for s in samples:
            try:
                out.append(one(s))
            except Exception as exc:  # noqa: BLE001 - the user's reward may raise anything on a reply
                out.append(exc)
        return out
    try:
        if convention == "batched":
            result = fn([s.completion for s in samples], [s.item for s in samples])
        elif convention == "openrlhf":
            prompts = [s.prompt if isinstance(s.prompt, str) else json.dumps(s.prompt) for s in samples]
            result = fn(queries=[p + s.completion for p, s in zip(prompts, samples, strict=True)], prompts=prompts,
                        labels=[s.answer for s in samples])
        else:
            completions = [[{"role": "assistant", "content": s.completion}] if s.conversational else s.completion
                           for s in samples]
            result = fn(prompts=[s.prompt for s in samples], completions=completions, **_trl_columns(samples))
        if is_async:
            result = _run_coroutines([result], timeout_s)[0]
            if isinstance(result, BaseException):
                raise result
        if convention == "openrlhf" and isinstance(result, dict):  # {"rewards": ..., "scores": ..., "extra_logs": ...}
            result = result["rewards"]
        result = result.tolist() if hasattr(result, "tolist") else list(result)  # OpenRLHF returns a tensor
        if len(result) != len(samples):
            raise ValueError(f"returned {len(result)} rewards for {len(samples)} completions")
        return result
    except Exception as exc:  # noqa: BLE001
        return [exc] * len(samples)


def _scored(value: Any) -> Scored:
    """A returned value, or an ``("__error__", line)`` a call left in its place, as a Scored."""
    if isinstance(value, tuple) and value[:1] == ("__error__",):
        return Scored(0.0, {}, value[1])
    try:
        return to_scored(value)
    except Exception as exc:  # noqa: BLE001 - a bad return value is the sample's error, not a crash
        return Scored(0.0, {}, first_line(exc))


_reported: set[str] = set()


def reward_error_metrics(trajectories: list[Any]) -> dict[str, float]:
    """``reward/errors``: replies whose reward raised or timed out (scored 0); each new error's first line is
    logged once."""
    errors = [t.info["reward_error"] for t in trajectories if "reward_error" in t.info]
    for message in sorted(set(errors) - _reported):
        _reported.add(message)
        logger.warning("a reward call failed (its replies score 0): %s", message)
    return {"reward/errors": float(len(errors))} if errors else {}


class RewardFn:
    """A reward named in the config, ready to score batches of replies."""

    def __init__(self, reference: str, params: dict[str, Any] | None = None, timeout_s: float = 30.0,
                 key: str = "reward", params_key: str | None = None) -> None:
        """``key`` names the config key of ``reference`` in errors, ``params_key`` that of ``params``."""
        self.reference, self.params, self.timeout_s, self.key = reference, dict(params or {}), timeout_s, key
        self.name = reference.rpartition(":")[2].rpartition(".")[2] if is_reference(reference) else reference
        self.builtin = CHECKS.get(reference)
        self._proc: Any = None
        self.is_async = False
        if self.builtin is not None:
            self.convention = "builtin"
            self.builtin.check_params(self.params, params_key or f"{key}.params")
            return
        if not is_reference(reference):
            raise ValueError(f"{key}: unknown reward '{reference}'; built-in: {', '.join(sorted(CHECKS))}, "
                             "or a function of yours as module:attr")
        fn = load_object(reference, key)
        if not callable(fn):
            raise ValueError(f"{key}: '{reference}' is not callable")
        if self.params:
            raise ValueError(f"{params_key or key + '.params'}: settings are for built-in rewards; '{reference}' "
                             "reads what it needs from the row")
        self.convention = convention_of(fn, reference, key)
        self.is_async = is_async_function(fn)

    @property
    def batched(self) -> bool:
        return self.convention in ("batched", "trl", "openrlhf")

    def score(self, samples: list[Sample]) -> list[Scored]:
        """Every sample's reward; a call that raised or timed out scores its samples 0 with the error."""
        if not samples:
            return []
        if self.builtin is not None:
            raw: list[Any] = []
            for s in samples:
                try:
                    raw.append(self.builtin.score(s.completion, s.answer, s.item, self.params))
                except Exception as exc:  # noqa: BLE001 - a checker choking on a row is the sample's error
                    raw.append(("__error__", first_line(exc)))
        elif self.batched or self.is_async:
            raw = self._remote(samples)
        else:  # one call per reply, so a reply that hangs costs only its own score
            raw = [r for s in samples for r in self._remote([s])]
        return [_scored(r) for r in raw]

    def _remote(self, samples: list[Sample]) -> list[Any]:
        try:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            self._requests.send(samples)
            # An async single-reply function times each reply in the child; the margin covers the batch.
            limit = self.timeout_s + (5.0 if len(samples) > 1 and not self.batched else 0.0)
            if self._replies.poll(limit):
                return self._replies.recv()
            why = f"TimeoutError: ran past reward_timeout_s ({self.timeout_s:g} s)"
        except (EOFError, OSError) as exc:
            why = f"the reward's process ended ({first_line(exc)})"
        except RuntimeError as exc:
            why = str(exc)
        self.close()
        return [("__error__", why)] * len(samples)

    def _start(self) -> None:
        """A fresh worker process with the function loaded; RuntimeError when it cannot load it."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen([sys.executable, "-u", "-m", "polyrl.rewards.worker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env)
        self._requests = Connection(os.dup(self._proc.stdin.fileno()), readable=False)
        self._replies = Connection(os.dup(self._proc.stdout.fileno()), writable=False)
        self._proc.stdin.close()
        self._proc.stdout.close()
        self._requests.send((self.reference, [os.getcwd(), *sys.path], self.convention, self.timeout_s))
        if not self._replies.poll(LOAD_TIMEOUT_S):
            raise RuntimeError(f"the reward's process did not load '{self.reference}' in {LOAD_TIMEOUT_S:g} s")
        kind, message = self._replies.recv()
        if kind != "ready":
            raise RuntimeError(f"the reward's process could not load '{self.reference}': {message}")

    def close(self) -> None:
        if self._proc is not None:
            for conn in (self._requests, self._replies):
                with contextlib.suppress(OSError):
                    conn.close()
            self._proc.kill()
            self._proc.wait(5)
            self._proc = None

    def __getstate__(self) -> dict[str, Any]:  # the child process stays with its owner
        return {**self.__dict__, "_proc": None, "_requests": None, "_replies": None}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()
