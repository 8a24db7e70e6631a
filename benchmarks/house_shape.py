"""The shape of polyrl's source: package import cycles, files and lines per package, the longest functions.

    python benchmarks/house_shape.py --label now                    # this checkout
    python benchmarks/house_shape.py --root /path/to/polyrl --label 336792c   # another tree of the package
    python benchmarks/house_shape.py --label split --same-numerics RUN_A RUN_B  # and two runs' records compared

``--same-numerics`` compares two run directories of the same config and seed (one trained before a refactor,
one after): every metrics.jsonl field but times and speeds, every stored trajectory's tokens, log-probs and
reward, and the held-out results in summary.json; the record says which differ (none, for a refactor).

The import graph is the one tests/test_import_graph.py checks (every import statement, wherever it sits),
folded to packages: ``polyrl.train.step`` belongs to ``train``, a top-level module such as ``polyrl.cli`` is its
own package. Results: benchmarks/results/house_shape.json (one record per label, replaced on a rerun).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter
from datetime import date
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_import_graph import import_graph, package_graph  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "house_shape.json"


def package_of(path: Path, package_dir: Path) -> str:
    parts = path.relative_to(package_dir).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def longest_functions(package_dir: Path, count: int = 10) -> list[dict]:
    """The ``count`` longest function bodies (``def`` line to last line), nested functions counted on their own."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append({"function": f"{path.relative_to(package_dir.parent)}:{node.name}",
                              "lines": node.end_lineno - node.lineno + 1})
    return sorted(found, key=lambda f: -f["lines"])[:count]


def shape(package_dir: Path) -> dict:
    packages = package_graph(import_graph(package_dir))
    cycles = sorted(sorted(c) for c in nx.strongly_connected_components(packages) if len(c) > 1)
    files, lines = Counter(), Counter()
    for path in package_dir.rglob("*.py"):
        name = package_of(path, package_dir)
        files[name] += 1
        lines[name] += len(path.read_text().splitlines())
    return {
        "package_cycles": cycles,
        "packages": {name: {"files": files[name], "lines": lines[name]} for name in sorted(files)},
        "total_lines": sum(lines.values()),
        "longest_functions": longest_functions(package_dir),
    }


TIMING = ("_time_s", "time_s", "tokens_per_s")


def same_numerics(run_a: Path, run_b: Path) -> dict:
    """What differs between two runs of one config and seed, timings aside."""
    def rows(run: Path, name: str) -> list[dict]:
        return [json.loads(line) for line in (run / name).read_text().splitlines()]

    metrics_a, metrics_b = rows(run_a, "metrics.jsonl"), rows(run_b, "metrics.jsonl")
    differing = sorted({f"step {x.get('step')}: {k}" for x, y in zip(metrics_a, metrics_b, strict=False)
                        for k in set(x) | set(y) if not k.endswith(TIMING) and x.get(k) != y.get(k)})

    def samples(run: Path) -> list:
        return [(r["input_ids"], r["logprobs"], r.get("reward")) for r in rows(run, "trajectories.jsonl")]

    summary_a, summary_b = (json.loads((r / "summary.json").read_text()) for r in (run_a, run_b))
    evals = {k: (summary_a.get(k), summary_b.get(k)) for k in ("eval_before", "eval_after")}
    return {
        "runs": [str(run_a), str(run_b)], "steps": [len(metrics_a), len(metrics_b)],
        "metric_fields_compared": len({k for r in metrics_a for k in r if not k.endswith(TIMING)}),
        "differing_metrics": differing, "trajectories_identical": samples(run_a) == samples(run_b),
        "held_out": evals, "held_out_identical": all(a == b for a, b in evals.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT / "polyrl", help="the polyrl package directory")
    parser.add_argument("--label", required=True, help="what this tree is, e.g. a commit")
    parser.add_argument("--same-numerics", nargs=2, type=Path, metavar=("RUN_A", "RUN_B"),
                        help="two run directories of one config and seed, before and after a change")
    args = parser.parse_args()
    record = {"date": date.today().isoformat(), "label": args.label, **shape(args.root.resolve())}
    if args.same_numerics:
        record["same_numerics"] = same_numerics(*args.same_numerics)
        print("same numerics:", json.dumps(record["same_numerics"])[:400])
    records = [r for r in (json.loads(RESULTS.read_text()) if RESULTS.exists() else []) if r["label"] != args.label]
    RESULTS.write_text(json.dumps(records + [record], indent=1) + "\n")
    print(f"{args.label}: {len(record['package_cycles'])} package cycles, {record['total_lines']} lines")
    for cycle in record["package_cycles"]:
        print("  cycle:", " <-> ".join(cycle))
    for fn in record["longest_functions"]:
        print(f"  {fn['lines']:4d}  {fn['function']}")


if __name__ == "__main__":
    main()
