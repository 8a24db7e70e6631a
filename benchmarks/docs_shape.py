"""How much of each docs page reports measurements: line counts and the share of results lines.

A page should say what a feature does and how to use it; measurements belong in one table of current results
at most, and their history in CHANGELOG.md. This script counts, for every page under docs/ (and README.md and
CHANGELOG.md), its lines and how many of them are results lines:

- every line of a **results table**: a Markdown table whose header names a measurement (accuracy, held-out,
  seconds, s/step, tok/s, samples/s, GFLOP/s, GB, MB, peak RSS, median, wall), whose rows state a measured
  quantity, or whose body cells are at least a third numbers;
- every line of a **paragraph or list item** (with its continuation lines) that states a measured quantity: a
  number with a unit of time, memory, throughput, percent or points, a ratio such as ``1.45x``, or a date
  (``2026-12-05``).

Headings, blank lines and code blocks (commands, configs, program output) are never results lines. The rule is
mechanical, so a how-to paragraph that gives a timeout in seconds counts too; it is the same rule for every
page and every revision, which is what the before/after comparison needs.

    python benchmarks/docs_shape.py --label after                       # the working tree
    python benchmarks/docs_shape.py --label before --rev 336792c        # the pages as a commit holds them

Each call merges its label into benchmarks/results/docs_shape.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "docs_shape.json"

NUMBER = r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?"
UNIT = (r"(?:%|pts\b|points\b|percentage points\b|ms\b|µs\b|s\b|sec\b|seconds?\b|min\b|minutes?\b|h\b|hours?\b"
        r"|[GMKkT]i?B(?:/s)?\b|tok/s\b|tokens/s\b|[GT]FLOP/s\b|samples/s\b|positions/s\b|s/step\b)")
RANGE = rf"{NUMBER}(?:\s*(?:-|–|to|/)\s*{NUMBER})*"
MEASURED = re.compile(rf"{RANGE}\s?{UNIT}|{NUMBER}[x×](?![\w])|\b20\d\d-\d\d-\d\d\b")
MEASURE_HEADER = re.compile(r"accuracy|held-out|\bseconds\b|s/step|tok(?:ens)?/s|samples/s|GFLOP/s|\bGB\b|\bMB\b"
                            r"|peak RSS|\bmedian\b|\bwall\b", re.I)


NUMERIC_CELL = re.compile(r"^[~<>≥≤±+\-–]?\s*\d")


def results_table(rows: list[str]) -> bool:
    """A table reports measurements when its header names one, a row states a measured quantity, or at least a
    third of its body cells are numbers (a table of accuracies per task and stage has no units)."""
    header, body = rows[0], rows[2:]
    if MEASURE_HEADER.search(header) or any(MEASURED.search(row) for row in body):
        return True
    cells = [c.replace("**", "").strip() for row in body for c in row.strip().strip("|").split("|")]
    return bool(cells) and sum(bool(NUMERIC_CELL.match(c)) for c in cells) >= len(cells) / 3


def blocks(lines: list[str]) -> list[tuple[str, int, int]]:
    """The page cut into (kind, first line, end) blocks: code, table, heading, blank, item (a list item with its
    continuation lines) and paragraph."""
    out, i = [], 0
    while i < len(lines):
        line = lines[i].strip()
        j = i + 1
        if line.startswith("```"):
            while j < len(lines) and not lines[j].strip().startswith("```"):
                j += 1
            out.append(("code", i, min(j + 1, len(lines))))
            i = j + 1
            continue
        if line.startswith("|"):
            while j < len(lines) and lines[j].strip().startswith("|"):
                j += 1
            kind = "table"
        elif line.startswith("#"):
            kind = "heading"
        elif not line:
            kind = "blank"
        else:
            kind = "item" if re.match(r"^(?:[-*]|\d+\.)\s", line) else "paragraph"
            indent = len(lines[i]) - len(lines[i].lstrip())
            while j < len(lines):
                nxt = lines[j]
                if not nxt.strip() or nxt.strip().startswith(("```", "|", "#")):
                    break
                if kind == "item" and len(nxt) - len(nxt.lstrip()) <= indent:
                    break  # the next item of the list (or text after it)
                j += 1
        out.append((kind, i, j))
        i = j
    return out


def classify(text: str) -> list[bool]:
    """One flag per line of a Markdown page: True for a results line (see the module docstring)."""
    lines = text.splitlines()
    flags = [False] * len(lines)
    for kind, i, j in blocks(lines):
        if kind == "table":
            is_results = results_table(lines[i:j])
        elif kind in ("paragraph", "item"):
            is_results = any(MEASURED.search(line) for line in lines[i:j])
        else:
            is_results = False
        flags[i:j] = [is_results] * (j - i)
    return flags


def count_tables(text: str) -> tuple[int, int]:
    """(tables, results tables) of a page."""
    lines = text.splitlines()
    tables = [lines[i:j] for kind, i, j in blocks(lines) if kind == "table"]
    return len(tables), sum(results_table(t) for t in tables)


def pages(rev: str | None) -> dict[str, str]:
    """Every docs page, README.md and CHANGELOG.md, from the working tree or from a git revision."""
    if rev is None:
        paths = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))
        paths += [p for p in ("README.md", "CHANGELOG.md") if (ROOT / p).exists()]
        return {p: (ROOT / p).read_text() for p in paths}
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "docs", "README.md", "CHANGELOG.md"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return {p: subprocess.run(["git", "show", f"{rev}:{p}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout for p in listed if p.endswith(".md")}


def shape(text: str) -> dict[str, float | int]:
    flags = classify(text)
    tables, results_tables = count_tables(text)
    return {"lines": len(flags), "results_lines": sum(flags), "share": round(sum(flags) / max(len(flags), 1), 3),
            "tables": tables, "results_tables": results_tables}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True, help="the key this measurement is stored under (before, after, ...)")
    ap.add_argument("--rev", help="a git revision to read the pages from (default: the working tree)")
    ap.add_argument("--json", type=Path, default=RESULTS)
    args = ap.parse_args()
    rev = None if args.rev is None else subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=ROOT,
                                                       capture_output=True, text=True, check=True).stdout.strip()
    measured = {path: shape(text) for path, text in pages(rev).items()}
    docs = [m for p, m in measured.items() if p.startswith("docs/")]
    total = {"lines": sum(m["lines"] for m in docs), "results_lines": sum(m["results_lines"] for m in docs)}
    total["share"] = round(total["results_lines"] / max(total["lines"], 1), 3)
    entry = {"rev": rev or "working tree", "date": time.strftime("%Y-%m-%d"), "docs_total": total, "pages": measured}
    data = json.loads(args.json.read_text()) if args.json.exists() else {}
    data[args.label] = entry
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")

    print(f"{args.label} ({entry['rev']}): page | lines | results lines | share | tables (of them results)")
    for path, m in measured.items():
        print(f"{path} | {m['lines']} | {m['results_lines']} | {m['share']:.0%} | {m['tables']} "
              f"({m['results_tables']})")
    print(f"docs/ in all | {total['lines']} | {total['results_lines']} | {total['share']:.0%}")


if __name__ == "__main__":
    main()
