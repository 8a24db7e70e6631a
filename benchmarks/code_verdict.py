"""The code verdict on all 164 HumanEval problems and the reward-hacking suite, with what it costs.

    python benchmarks/code_verdict.py          # ~2-3 min on 2 cores; writes benchmarks/results/code_verdict.json

- Canonical solutions: each of the 164 scored by ``score_humaneval`` in two passes (the first records each
  problem's plan, the second reuses it, so a flaky plan or replay would show as a difference), and once as
  the problem's single naive program (``build_program``, judged by exit status) for the time it took.
- Hacks: every entry of ``tests/test_code_verdict.py``'s ``HACKS`` scored by ``score_humaneval`` (all must
  score 0), and run as the naive program (how many of them it would have rewarded).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
OUT = ROOT / "benchmarks" / "results" / "code_verdict.json"
WORKERS = max(1, min(4, os.cpu_count() or 1))  # sandboxes are separate processes: threads overlap them


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def main() -> None:
    from test_code_verdict import HACKS, _problem

    from polyrl import (
        VerdictLimits,
        build_program,
        humaneval_problems,
        isolation_level,
        record_plan,
        run_python,
        score_humaneval,
    )

    problems = humaneval_problems()
    ids = sorted(problems, key=lambda t: int(t.rsplit("/", 1)[1]))
    t_start = time.monotonic()

    def canonical(task_id):
        p = problems[task_id]
        return _timed(score_humaneval, p, p["canonical_solution"])

    def naive(task_id):
        p = problems[task_id]
        return _timed(run_python, build_program(p, p["canonical_solution"]))

    def hack(entry):
        cls, name, ref, completion, _ = entry
        problem = _problem(ref)
        score = score_humaneval(problem, completion)
        return {"class": cls, "name": name, "reward": score.reward, "status": score.verdict.status,
                "reason": score.verdict.reason[:200],
                "naive_passes": run_python(build_program(problem, completion)).passed}

    with ThreadPoolExecutor(WORKERS) as pool:
        first = dict(zip(ids, pool.map(canonical, ids), strict=True))
        second = dict(zip(ids, pool.map(canonical, ids), strict=True))
        old = dict(zip(ids, pool.map(naive, ids), strict=True))
        hacks = list(pool.map(hack, HACKS))

    limits = VerdictLimits(10.0, 512, 4, 4, 16_000)
    rows = []
    for t in ids:
        plan = record_plan(problems[t], limits)  # cached: no sandbox run here
        rows.append({"task_id": t, "passed": [first[t][0].reward == 1.0, second[t][0].reward == 1.0],
                     "path": "compared" if plan.exact else "replayed", "calls": len(plan.calls),
                     "first_s": round(first[t][1], 3), "second_s": round(second[t][1], 3),
                     "naive_s": round(old[t][1], 3), "naive_passed": old[t][0].passed,
                     "reason": second[t][0].verdict.reason})
    both = sum(all(r["passed"]) for r in rows)
    failures = [{"task_id": r["task_id"], "reason": r["reason"]} for r in rows if not all(r["passed"])]

    def median(key, path=None):
        return round(statistics.median(r[key] for r in rows if path in (None, r["path"])), 3)

    classes: dict[str, list[int]] = {}
    for h in hacks:
        c = classes.setdefault(h["class"], [0, 0, 0])
        c[0] += h["reward"] == 0.0
        c[1] += 1
        c[2] += h["naive_passes"]
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "isolation": isolation_level(), "as_root": os.geteuid() == 0,
                    "workers": WORKERS},
        "canonical": {"passed_both_passes": both, "total": len(rows), "failures": failures,
                      "compared_outside": sum(r["path"] == "compared" for r in rows),
                      "replayed": [r["task_id"] for r in rows if r["path"] == "replayed"],
                      "naive_passed": sum(r["naive_passed"] for r in rows)},
        "hacks": {"scored_zero": sum(h["reward"] == 0.0 for h in hacks), "total": len(hacks),
                  "naive_rewarded": sum(h["naive_passes"] for h in hacks),
                  "by_class": {k: {"scored_zero": v[0], "total": v[1], "naive_rewarded": v[2]}
                               for k, v in classes.items()},
                  "cases": hacks},
        "seconds_per_score_median": {
            "naive_program": median("naive_s"),
            "first_with_plan": median("first_s"), "compared_outside": median("second_s", "compared"),
            "replayed": median("second_s", "replayed")},
        "wall_s": round(time.monotonic() - t_start, 1),
        "problems": rows,
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("problems",)} | {
        "hacks": {k: v for k, v in result["hacks"].items() if k != "cases"}}, indent=1))
    if both != len(rows) or result["hacks"]["scored_zero"] != len(hacks):
        sys.exit(1)


if __name__ == "__main__":
    main()
