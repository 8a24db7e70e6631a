"""Built-in checkers, named like a user's reward (``reward: math_verify``) and mixed like one
(``reward_components: [{reward: numeric, params: {tolerance: 0.01}}]``). Each compares a reply with the
row's reference answer (``tasks[].answer_field``) and returns 1.0 or 0.0; none raises on a model's output.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from polyrl.rewards.code import score_humaneval
from polyrl.rewards.math import math_verify_score

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number in a reply (the answer convention of the quickstart); commas inside it are dropped."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def _as_float(text: Any) -> float | None:
    try:
        return float(str(text).replace(",", "").strip())
    except ValueError:
        return None


def _last_number(reply: str, answer: Any, item: dict[str, Any], params: dict[str, Any]) -> float:
    got, want = _as_float(last_number(reply)), _as_float(answer)
    return 1.0 if got is not None and want is not None and got == want else 0.0


def _numeric(reply: str, answer: Any, item: dict[str, Any], params: dict[str, Any]) -> float:
    got, want = _as_float(last_number(reply)), _as_float(answer)
    if got is None or want is None:
        return 0.0
    tol = max(float(params.get("tolerance", 1e-6)), float(params.get("relative", 0.0)) * abs(want))
    return 1.0 if abs(got - want) <= tol else 0.0


def _exact(reply: str, answer: Any, item: dict[str, Any], params: dict[str, Any]) -> float:
    got, want = reply.strip(), str(answer).strip()
    if params.get("ignore_case", False):
        got, want = got.lower(), want.lower()
    return 1.0 if got == want and want else 0.0


def _math_verify(reply: str, answer: Any, item: dict[str, Any], params: dict[str, Any]) -> float:
    return math_verify_score(answer, reply)


def _regex(reply: str, answer: Any, item: dict[str, Any], params: dict[str, Any]) -> float:
    """``pattern`` searched for in the reply; ``{answer}`` in it stands for the escaped reference answer."""
    pattern = str(params["pattern"]).replace("{answer}", re.escape(str(answer)))
    return 1.0 if re.search(pattern, reply) else 0.0


def _code_tests(reply: str, answer: Any, item: dict[str, Any], params: dict[str, Any]) -> float:
    """The reply's code run in the sandbox against the row's HumanEval-style tests: ``test`` (a
    ``check(candidate)`` function), ``entry_point``, ``canonical_solution`` and ``prompt`` fields."""
    problem = {"prompt": item.get("prompt", ""), "test": item[params.get("tests_field", "test")],
               "entry_point": item["entry_point"], "canonical_solution": item["canonical_solution"]}
    return score_humaneval(problem, reply, timeout_s=float(params.get("timeout_s", 10.0))).reward


@dataclass(frozen=True)
class Check:
    fn: Callable[[str, Any, dict[str, Any], dict[str, Any]], float]
    params: dict[str, type] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    needs_answer: bool = True
    doc: str = ""

    def score(self, reply: str, answer: Any, item: dict[str, Any], params: dict[str, Any]) -> float:
        return self.fn(reply, answer, item, params)

    def check_params(self, params: dict[str, Any], key: str) -> None:
        """``key`` is the config key holding ``params`` (``tasks.0.reward_params``)."""
        for name, value in params.items():
            if name not in self.params:
                raise ValueError(f"{key}.{name}: unknown; valid: {', '.join(self.params) or 'none'}")
            want = (int, float) if self.params[name] is float else self.params[name]
            if not isinstance(value, want) or isinstance(value, bool) and self.params[name] is not bool:
                raise ValueError(f"{key}.{name}: expected {self.params[name].__name__}, got {value!r}")
        for name in self.required:
            if name not in params:
                raise ValueError(f"{key}.{name}: required")
        if "pattern" in params:
            try:
                re.compile(str(params["pattern"]).replace("{answer}", "x"))
            except re.error as exc:
                raise ValueError(f"{key}.pattern: not a regular expression ({exc})") from None


CHECKS: dict[str, Check] = {
    "last_number": Check(_last_number, doc="the reply's last number equals the answer"),
    "numeric": Check(_numeric, {"tolerance": float, "relative": float},
                     doc="the reply's last number within tolerance (absolute) or relative x |answer|"),
    "exact": Check(_exact, {"ignore_case": bool}, doc="the stripped reply equals the answer"),
    "math_verify": Check(_math_verify, doc="mathematically equal to the answer (math-verify: LaTeX, boxed)"),
    "regex": Check(_regex, {"pattern": str}, ("pattern",), needs_answer=False,
                   doc="the pattern is found in the reply ({answer} stands for the answer)"),
    "code_tests": Check(_code_tests, {"tests_field": str, "timeout_s": float}, needs_answer=False,
                        doc="the reply's code passes the row's tests in the sandbox"),
}
"""The built-in checkers by name. ``judge`` is a reward component of its own kind (``kind: judge``)."""
