"""How much of a run's resident memory between steps is freed memory the C library keeps.

Builds the quickstart run (or ``--config``) in this process and runs RL steps; after each it records the
resident set size (RSS) as the step left it, then after ``gc.collect()``, then after glibc's ``malloc_trim(0)``
hands every free page back to the OS. The last column is what the run holds alive; the gap to the first is
freed memory kept in the heap (``runtime.keep_freed_memory`` raises the thresholds that keep it). Linux/glibc
only. Writes ``--out`` (JSON rows: step, rss, rss after gc, rss after trim, step seconds, mean reply length).

    python benchmarks/heap_retention.py --steps 15 --out benchmarks/results/memory_runs/heap_retention.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import tempfile
from pathlib import Path

import psutil

from polyrl import build_run, load_config, rl_step

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    config = load_config(args.config, ["train.steps=20", "logging.progress=false", "logging.report=false",
                                       "logging.tensorboard=false"])
    libc = ctypes.CDLL("libc.so.6")
    proc = psutil.Process()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(config, Path(tmp))
        for step in range(1, args.steps + 1):
            metrics, _ = rl_step(run, step)
            as_left = proc.memory_info().rss
            gc.collect()
            after_gc = proc.memory_info().rss
            libc.malloc_trim(0)
            after_trim = proc.memory_info().rss
            rows.append((step, round(as_left / 1e9, 3), round(after_gc / 1e9, 3), round(after_trim / 1e9, 3),
                         round(metrics["step_time_s"], 2), metrics["response_length/mean"]))
            print(rows[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": str(args.config), "columns": [
        "step", "rss_gb", "rss_after_gc_gb", "rss_after_malloc_trim_gb", "step_s", "reply_tokens"], "rows": rows},
        indent=1) + "\n")


if __name__ == "__main__":
    main()
