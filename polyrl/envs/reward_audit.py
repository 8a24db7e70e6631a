"""The reward audit: before step 1, a task's reward is tried on rows whose right answer is known.

On each of ``audit.rows`` training rows three replies are scored: the row's reference answer (through
``audit.reply``), an empty reply, and another row's answer. A sound reward gives the reference the top score
on every row and gives neither of the others that score. A reward that always returns 0, always returns 1, or
reads the wrong field fails, and the run stops with one line naming the rows and what scored what, before
training spends anything on it ("no learning, no error").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polyrl.envs.dataset import DatasetTask
from polyrl.rewards.functions import Scored

EPS = 1e-9


@dataclass
class AuditResult:
    task: str
    rows: int
    top: float
    problems: list[str] = field(default_factory=list)
    table: list[tuple[str, float, float, float | None]] = field(default_factory=list)
    """(where, reference score, empty score, other row's answer score) per row."""

    @property
    def passed(self) -> bool:
        return not self.problems

    def line(self) -> str:
        if self.passed:
            return (f"task '{self.task}': reward audit passed on {self.rows} rows (reference replies score "
                    f"{self.top:g}; empty replies and other rows' answers score less)")
        return (f"task '{self.task}': reward audit failed: {'; '.join(self.problems)}. Fix the reward or the "
                "task's answer_field / audit.reply, or set tasks[].audit: false for a reward without references")


def _rows(where: list[str], limit: int = 3) -> str:
    shown = ", ".join(where[:limit])
    return shown + (f" (+{len(where) - limit} more rows)" if len(where) > limit else "")


def reference_reply(task: DatasetTask, row: dict[str, Any]) -> str:
    answer = task.format.answer(row)
    try:
        return task.config.audit.reply.format_map({**row, "answer": answer})
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"task '{task.name}': audit.reply cannot be filled from a row ({type(exc).__name__}: "
                         f"{exc})") from None


def audit_task(task: DatasetTask) -> AuditResult:
    """Score reference, empty and other-answer replies on the first ``audit.rows`` training rows."""
    n = min(task.config.audit.rows, len(task.source))
    rows = [task.train_item(i) for i in range(n)]
    where = [task.source.train_where(i) for i in range(n)]
    refs = [reference_reply(task, row) for row in rows]
    answers = [str(task.format.answer(row)).strip() for row in rows]
    # Each row's "other" reply is the next row's reference whose answer differs (none if all answers agree).
    other: list[int | None] = []
    for i in range(n):
        j = next((j % n for j in range(i + 1, i + n) if answers[j % n] != answers[i]), None)
        other.append(j)
    first = task.reward.score([task.sample(rows[0], refs[0])])[0]
    if first.error is not None and first.error.startswith("TimeoutError"):  # not 3 x rows timeouts in a row
        result = AuditResult(task.name, n, 0.0)
        result.problems.append(f"the reward ran past its timeout on a reference reply ({where[0]}: {first.error})")
        return result
    samples = [task.sample(row, r) for row, r in zip(rows[1:], refs[1:], strict=True)]
    samples += [task.sample(row, "") for row in rows]
    samples += [task.sample(rows[i], refs[j]) for i, j in enumerate(other) if j is not None]
    scored = [first, *task.reward.score(samples)]
    ref, empty, rest = scored[:n], scored[n:2 * n], iter(scored[2 * n:])
    other_scores: list[Scored | None] = [next(rest) if j is not None else None for j in other]
    top = max(s.reward for s in ref)
    result = AuditResult(task.name, n, top)
    result.table = [(w, r.reward, e.reward, o.reward if o is not None else None)
                    for w, r, e, o in zip(where, ref, empty, other_scores, strict=True)]
    errors = [f"{w}: {s.error}" for w, s in zip(where, ref, strict=True) if s.error]
    if errors:
        result.problems.append(f"the reward raised on reference replies ({_rows(errors, 1)})")
    if top <= EPS and all(abs(e.reward) <= EPS for e in empty):
        result.problems.append(f"every reply scored 0, reference answers too (e.g. {where[0]}: reply "
                               f"{refs[0][:40]!r} scored {ref[0].reward:g})")
        return result
    low = [f"{w}: reply {r[:40]!r} scored {s.reward:g}" for w, r, s in zip(where, refs, ref, strict=True)
           if s.reward < top - EPS]
    if low:
        result.problems.append(f"reference answers scored below the top reward {top:g} on {len(low)} of {n} rows "
                               f"({_rows(low)})")
    high_empty = [f"{w}: {e.reward:g}" for w, e in zip(where, empty, strict=True) if e.reward >= top - EPS]
    if high_empty:
        result.problems.append(f"an empty reply scored the top reward {top:g} on {len(high_empty)} of {n} rows "
                               f"({_rows(high_empty)})")
    high_other = [f"{where[i]}: reply {refs[j][:40]!r} (answer of another row) scored {o.reward:g}"
                  for i, (j, o) in enumerate(zip(other, other_scores, strict=True))
                  if o is not None and j is not None and o.reward >= top - EPS]
    if high_other:
        result.problems.append(f"another row's answer scored the top reward {top:g} on {len(high_other)} of "
                               f"{sum(o is not None for o in other_scores)} rows ({_rows(high_other)})")
    return result


def audit_tasks(tasks: dict[str, Any], log: Any = print) -> list[AuditResult]:
    """Audit every dataset task whose audit is on; raise ValueError with the first failure's line."""
    results = []
    for task in tasks.values():
        if isinstance(task, DatasetTask) and task.config.audit.enabled:
            result = audit_task(task)
            results.append(result)
            if not result.passed:
                raise ValueError(result.line())
            log(result.line())
    return results
