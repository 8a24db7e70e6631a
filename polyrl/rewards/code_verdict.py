"""A code verdict that only a real pass earns.

The naive harness runs ``prompt + completion + test + check(entry_point)`` in one interpreter and trusts its
exit status; the solution shares that interpreter with the test, so it can end it with status 0 (``os._exit``,
``sys.exit`` from a hook, ``exec`` of another program), return objects whose ``__eq__`` lies, patch what the
test relies on (``abs``, ``math``, the test's helpers, ``int``'s comparison slot through ctypes), or read
the expected values out of the test's frame. Here the solution never shares a process with the test, and
nothing it does inside its process can decide the verdict:

1. **Plan** (trusted code, sandboxed, cached per problem): the problem's own ``check`` runs against the
   canonical solution through a stand-in that records every call: the arguments (plain data) and the
   reference's return value. Unseeded ``random`` inputs are pinned by a fixed seed.
2. **Solve** (untrusted, sandboxed): a harness loads the solution and calls its entry point on each
   recorded argument list, in order, sending back each return value as plain data (``code_harness``: exact
   types, so no subclass or custom object crosses). It is given arguments only, never an expected value.
3. **Judge** (outside the untrusted process). The answers are decoded by this process's own codec into
   fresh plain values; there must be exactly one per recorded call, and each must have the reference's
   type (type-strict: ``1``, ``1.0`` and ``True`` are different answers). Then, when every assertion of
   the test is ``candidate(...) == expected`` (155 of the 164 problems), each answer must equal the
   reference's exactly, compared here. Otherwise (tolerances such as ``abs(candidate(x) - y) < 1e-6``,
   properties such as ``poly(xs, find_zero(xs)) ~ 0``, truth tests, calls inside expressions) the
   problem's own ``check`` is **replayed** in a separate sandbox holding only trusted code: the stand-in
   checks each call's arguments against the plan and returns the solution's decoded value; the test must
   run to its end with every recorded call made.

The solution's exit status is required (0) but never sufficient; what it prints is ignored. The channel its
answers travel on is not secret and need not be: anything the solution can write there is just a choice of
return values, which it had anyway, and the values are judged here. What it would need to forge a pass, the
expected values, never enter its process.

What the replay guarantees: the verdict is the problem's own test, run to its end on the solution's answers
as genuine plain values, in a process the solution's code never entered, so it can neither patch the test
nor end it early. A test that calls the entry point by name (HumanEval/33 compares with ``sort_third``)
reaches the canonical solution there, as a reference. Not mirrored: changes a solution makes to its
arguments in place (each call gets fresh copies, recorded before the reference ran), and inputs a test draws
from unseeded ``random`` are the same on every run (seed 0).
"""

from __future__ import annotations

import ast
import hashlib
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl.rewards import code_harness as plain
from polyrl.rewards.sandbox import Verdict, isolation_level, run_python

_HARNESS = Path(plain.__file__).read_text()
_SEED = 0
_plans: dict[str, Plan] = {}
_plans_lock = threading.Lock()


@dataclass(frozen=True)
class Limits:
    timeout_s: float
    memory_mb: int
    max_processes: int
    max_file_mb: int
    max_output_bytes: int


@dataclass(frozen=True)
class Plan:
    """What the problem's test does to a candidate, recorded against the canonical solution."""

    calls: tuple[str, ...]
    """Each call's (args, kwargs), encoded, in the order the test makes them."""
    expected: tuple[Any, ...]
    """The canonical solution's return value for each call, decoded."""
    exact: bool
    """Every assertion is ``candidate(...) == value``: answers are compared here, no replay needed."""
    size: int
    """Bytes of the encoded reference answers: sizes the answer channel."""


class PlanError(Exception):
    """The problem itself cannot be planned (its canonical solution fails its own test, ...)."""


def problem_source(problem: dict[str, Any]) -> str:
    return f"{problem['prompt']}{problem['canonical_solution']}\n\n{problem['test']}\n"


def record_plan(problem: dict[str, Any], limits: Limits) -> Plan:
    """The recorded plan of a problem, computed once per process (keyed by the problem's text)."""
    if not problem.get("canonical_solution"):
        raise PlanError("the problem has no canonical solution to record the test against")
    key = hashlib.sha256(json.dumps([problem_source(problem), problem["entry_point"]]).encode()).hexdigest()
    with _plans_lock:
        if key in _plans:
            return _plans[key]
    job = {"mode": "record", "src": problem_source(problem), "file": "problem.py",
           "entry": problem["entry_point"], "seed": _SEED}
    v = _run(job, limits, timeout_s=max(limits.timeout_s, 60.0), cap=16 << 20)
    last = _last_line(v.stdout)
    if not (last and last[0] == "plan" and v.status == "passed"):
        why = last[1] if last and last[0] in ("broken", "load") else v.reason
        raise PlanError(f"the canonical solution does not pass the problem's own test: {why}")
    calls = tuple(call for call, _ in last[1])
    if not calls:
        raise PlanError("the problem's test never calls the candidate")
    plan = Plan(calls, tuple(plain.decode(out) for _, out in last[1]),
                exact_only(problem["test"], problem["entry_point"]), sum(len(out) for _, out in last[1]))
    with _plans_lock:
        _plans[key] = plan
    return plan


def exact_only(test: str, entry: str) -> bool:
    """True when ``check``'s every use of the candidate is a direct operand of an asserted ``==`` (messages
    aside: they run only when the assertion has already failed), with no ``try`` or ``with`` that could
    swallow a failure and no other assertion. Then the test passes exactly when each answer equals the
    reference's, which is compared outside. Anything else is replayed, so a wrong False here only costs a
    sandbox run."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return False
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1 or not checks[0].args.args:
        return False
    check = checks[0]
    name = check.args.args[0].arg
    compared, skipped = set(), set()
    for node in ast.walk(check):
        if isinstance(node, ast.Try | ast.TryStar | ast.With):  # a failed assertion could be swallowed
            return False
        if not isinstance(node, ast.Assert) or isinstance(node.test, ast.Constant):
            continue
        test_expr = node.test
        if not (isinstance(test_expr, ast.Compare) and len(test_expr.ops) == 1
                and isinstance(test_expr.ops[0], ast.Eq)):
            return False
        sides = [s for s in (test_expr.left, test_expr.comparators[0]) if _calls(s, name)]
        if not sides:
            return False  # an assertion about something other than the candidate's answer
        compared.update(id(s.func) for s in sides)
        if node.msg is not None:
            skipped.update(id(n) for n in ast.walk(node.msg))
    return all(id(n) in compared or id(n) in skipped for n in ast.walk(check)
               if isinstance(n, ast.Name) and n.id in (name, entry))


def _calls(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def judge(problem: dict[str, Any], source: str, limits: Limits) -> Verdict:
    """Score ``source`` (the solution's whole module) against ``problem``; see the module docstring."""
    t0 = time.monotonic()
    entry = problem["entry_point"]
    try:
        plan = record_plan(problem, limits)
    except PlanError as exc:
        return Verdict("error", None, "", "", str(exc), time.monotonic() - t0, isolation_level())
    n = len(plan.calls)
    job = {"mode": "solve", "src": source, "file": "solution.py", "entry": entry,
           "calls": list(plan.calls), "seed": _SEED}
    u = _run(job, limits, cap=max(limits.max_output_bytes, 4 * plan.size + (64 << 10)))

    def verdict(status: str, reason: str) -> Verdict:
        cap = limits.max_output_bytes
        return Verdict(status, u.returncode, u.stdout[:cap], u.stderr[:cap], reason, time.monotonic() - t0,
                       u.isolation, u.truncated or len(u.stdout) > cap or len(u.stderr) > cap)

    answers, why = read_answers(u.stdout, plan.calls, entry)
    if u.status in ("timeout", "killed", "error"):
        return verdict(u.status, u.reason)
    if why is None and u.status != "passed":
        why = f"{u.reason} after returning all {n} answers"
    if why is not None:
        return verdict("failed", why)
    for i, (got, want) in enumerate(zip(answers, plan.expected, strict=True)):
        where = f"call {i + 1} of {n}, {_call_text(entry, plan.calls[i])}"
        if not plain.same_types(got, want):
            return verdict("failed", f"{where}: returned {_types(got)}, the reference returns {_types(want)}")
        if plan.exact and not plain.strict_equal(got, want):
            return verdict("failed", f"{where}: returned {_short(got)}, expected {_short(want)}")
    if plan.exact:
        return verdict("passed", f"all {n} answers equal the reference's, compared outside the sandbox")
    job = {"mode": "replay", "src": problem_source(problem), "file": "problem.py", "entry": entry,
           "calls": list(plan.calls), "outs": [plain.encode(a) for a in answers], "seed": _SEED}
    r = _run(job, limits, cap=max(limits.max_output_bytes, 64 << 10))
    last = _last_line(r.stdout)
    if r.status == "passed" and last == ["passed", n]:
        return verdict("passed", f"the problem's test, replayed apart from the solution, accepts all {n} answers")
    if r.status == "error":
        return verdict("error", f"replaying the test: {r.reason}")
    why = last[1] if last and last[0] == "failed" else r.reason
    return verdict("failed", f"the problem's test rejects the answers: {why}")


def read_answers(stdout: str, calls: tuple[str, ...], entry: str) -> tuple[list[Any], str | None]:
    """The solution's decoded answers, in order, and why they stop short of one per call (None if not).
    Every line is checked, since the solution can write to this channel too: it takes ``["ok", i, text]``
    for call i (then the harness's failure reports) and nothing else."""
    answers: list[Any] = []
    for line in stdout.splitlines():
        i = len(answers)
        try:
            item = json.loads(line)
        except ValueError:
            item = None
        if isinstance(item, list) and len(item) == 2 and item[0] == "load":
            return answers, f"the solution does not load: {item[1]}"[:300]
        if not (isinstance(item, list) and len(item) == 3 and type(item[1]) is int and item[1] == i
                and i < len(calls) and type(item[2]) is str):
            return answers, "the answer channel holds something other than answers"
        where = f"call {i + 1} of {len(calls)}, {_call_text(entry, calls[i])}"
        if item[0] == "raised":
            return answers, f"{where} raised {item[2]}"[:400]
        if item[0] == "notplain":
            return answers, f"{where}: the answer is not plain data ({item[2]})"[:400]
        try:
            if item[0] != "ok":
                raise plain.NotPlain(item[0])
            answers.append(plain.decode(item[2]))
        except plain.NotPlain:
            return answers, f"{where}: the answer is not an encoding of plain data"
    if len(answers) < len(calls):
        return answers, f"the program ended after {len(answers)} of {len(calls)} answers"
    return answers, None


def _run(job: dict[str, Any], limits: Limits, *, cap: int, timeout_s: float | None = None) -> Verdict:
    return run_python(_HARNESS, stdin=json.dumps(job), timeout_s=timeout_s or limits.timeout_s,
                      memory_mb=limits.memory_mb, max_processes=limits.max_processes,
                      max_file_mb=limits.max_file_mb, max_output_bytes=cap)


def _last_line(stdout: str) -> list | None:
    lines = stdout.splitlines()
    try:
        item = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return item if isinstance(item, list) and item else None


def _call_text(entry: str, call: str) -> str:
    args, kwargs = plain.decode(call)
    text = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
    return f"{entry}({text[:100]}{'...' if len(text) > 100 else ''})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


def _types(value: Any) -> str:
    return f"{type(value).__name__} {_short(value)}"
