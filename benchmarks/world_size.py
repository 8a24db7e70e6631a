"""The quickstart at several learner world sizes on this machine: ``polyrl train configs/quickstart.yaml`` for a
fixed number of steps (the same samples per step at every world size) with one rank, with two ranks started
locally (FSDP2 over gloo) and with two ranks as Ray actors; held-out accuracy before and after, training time,
median step, update and weight-sync time, peak memory per process.

    python benchmarks/world_size.py --steps 90

Writes benchmarks/results/world_size.json. On a 2-core machine two ranks share the cores (one thread each), so
this shows that sharded runs learn like one process, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from doc_block import replace_block

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "world_size.json"
DOC = ROOT / "docs" / "scaling.md"
START, END = "<!-- world_size.py: start -->", "<!-- world_size.py: end -->"
SETUPS = {
    "1 rank": [],
    "2 ranks, local": ["learner.world_size=2"],
    "2 ranks, ray": ["learner.world_size=2", "runtime.kind=ray"],
}


WRAPPER = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[1:]).returncode\n"
    "print(f'maxrss_kb={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def cpu_model() -> str:
    """The CPU's name with its family and model numbers (they tell AMD's Zen generations apart)."""
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor()
    return f"{name} (CPU family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"


def run(name: str, extra: list[str], steps: int, out: Path) -> dict:
    args = [f"train.steps={steps}", "train.max_minutes=null", "logging.progress=false", "logging.report=false",
            *extra]
    t0 = time.perf_counter()
    command = [sys.executable, "-m", "polyrl", "train", str(ROOT / "configs" / "quickstart.yaml"), "-o", str(out),
               *args]
    # Run under a small wrapper that reports the peak resident memory of its largest descendant (a rank started
    # locally is one; Ray's actors belong to Ray's processes and are not counted).
    done = subprocess.run([sys.executable, "-c", WRAPPER, *command], capture_output=True, text=True,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    wall = time.perf_counter() - t0
    peak_kb = int(done.stderr.strip().splitlines()[-1].removeprefix("maxrss_kb="))
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return {"setup": name, "error": lines[-2] if len(lines) > 1 else "failed"}
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "setup": name,
        "overrides": args,
        "accuracy_before": summary["eval_before"]["chain_sum"],
        "accuracy_after": summary["eval_after"]["chain_sum"],
        "steps": summary["steps"],
        "train_time_min": round(summary["train_time_s"] / 60, 2),
        "wall_time_min": round(wall / 60, 2),
        "median_step_s": round(statistics.median(r["step_time_s"] for r in rows), 3),
        "median_update_s": round(statistics.median(r["update_time_s"] for r in rows), 3),
        "median_sync_s": round(statistics.median(r.get("sync/time_s", 0.0) for r in rows), 3),
        "sampling_rounds": sum(r.get("sampling/rounds", 1) for r in rows),
        "peak_rss_gb_largest_process": round(peak_kb / 1e6, 2) if "ray" not in name else None,
    }


def table(result: dict) -> str:
    """The doc's table of ``result`` (world_size.json)."""
    lines = [
        f"`python benchmarks/world_size.py --steps {result['steps']}` on {result['machine']}, {result['date']}:",
        "",
        "| setup | held-out before | after | training | median step | median update | median sync | peak RSS, "
        "largest process |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r['setup']} | failed: {r['error']} | | | | | | |")
            continue
        peak = f"{r['peak_rss_gb_largest_process']} GB" if r.get("peak_rss_gb_largest_process") else "not measured"
        lines.append(
            f"| {r['setup']} | {100 * r['accuracy_before']:.1f} % | **{100 * r['accuracy_after']:.1f} %** | "
            f"{r['train_time_min']} min | {r['median_step_s']} s | {r['median_update_s']} s | "
            f"{r['median_sync_s']} s | {peak} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--setups", nargs="*", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--table-only", action="store_true", help="rewrite the doc's table from the results; run nothing")
    args = p.parse_args()
    if args.table_only:
        replace_block(DOC, START, END, table(json.loads(RESULTS.read_text())), "The quickstart at two ranks")
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.setups):
            result = run(name, SETUPS[name], args.steps, Path(tmp) / f"run{i}")
            print(json.dumps(result), flush=True)
            results.append(result)
    RESULTS.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "python": platform.python_version(), "steps": args.steps, "runs": results,
    }, indent=2) + "\n")
    replace_block(DOC, START, END, table(json.loads(RESULTS.read_text())), "The quickstart at two ranks")
    print(f"wrote {RESULTS} and its table in {DOC}")


if __name__ == "__main__":
    main()
