"""The "Your data" example on the bundled model: examples/your_data run exactly as docs/your-data.md shows it
(``python make_data.py``, then ``polyrl train config.yaml``), held-out accuracy before and after.

Each seed runs in a fresh copy of the example folder; the results go to benchmarks/results/your_data.json and a
table into docs/your-data.md.

    python benchmarks/your_data.py                 # seed 0, ~9 min on 2 cores
    python benchmarks/your_data.py --seeds 0 1 2
    python benchmarks/your_data.py --table-only    # the docs' table again, from the results file
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_block import replace_block  # noqa: E402
from large_data import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "your_data"
RESULTS = ROOT / "benchmarks" / "results" / "your_data.json"
DOC = ROOT / "docs" / "your-data.md"
START, END = "<!-- your-data:start -->", "<!-- your-data:end -->"


def run_seed(seed: int, workdir: Path) -> dict:
    folder = workdir / f"seed{seed}"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("qa.jsonl", "runs"))
    subprocess.run([sys.executable, "make_data.py"], cwd=folder, check=True, capture_output=True)
    t0 = time.perf_counter()
    proc = subprocess.run(["polyrl", "train", "config.yaml", f"train.seed={seed}", "-o", "run"], cwd=folder,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: polyrl train failed:\n{proc.stderr[-2000:]}")
    summary = json.loads((folder / "run" / "summary.json").read_text())
    return {
        "seed": seed, "before": summary["eval_before"]["qa"], "after": summary["eval_after"]["qa"],
        "steps": summary["steps"], "train_time_s": summary["train_time_s"], "wall_s": wall,
        "log_tail": proc.stderr.strip().splitlines()[-12:],
    }


def table(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"`python benchmarks/your_data.py` ({m['date']}; {m['cpu_model']}, {m['cores']} cores, "
        f"{', '.join(m['cpu_flags'])}; load average {m['load_average_at_start'][0]:.1f} at the start). "
        "examples/your_data as shipped: 2,000 rows of its own making, 200 held out and evaluated greedily, "
        "the five-line reward in reward.py, the quickstart's recipe.",
        "",
        "| seed | held-out before | after | gain | steps | training | wall (incl. both evaluations) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["runs"]:
        lines.append(f"| {r['seed']} | {100 * r['before']:.1f} % | {100 * r['after']:.1f} % | "
                     f"{100 * (r['after'] - r['before']):+.1f} pts | {r['steps']} | {r['train_time_s'] / 60:.1f} min | "
                     f"{r['wall_s'] / 60:.1f} min |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    if not args.table_only:
        info = machine()
        with tempfile.TemporaryDirectory(prefix="polyrl-your-data-") as tmp:
            runs = [run_seed(seed, Path(tmp)) for seed in args.seeds]
        info["load_average_at_end"] = os.getloadavg()
        RESULTS.write_text(json.dumps({"machine": info, "runs": runs}, indent=2) + "\n")
    results = json.loads(RESULTS.read_text())
    replace_block(DOC, START, END, table(results), "Your data")
    print(table(results))


if __name__ == "__main__":
    main()
