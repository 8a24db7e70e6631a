"""The test suite's wall time: the whole suite (what CI runs) and the fast tier, as a user runs them.

    python benchmarks/suite_time.py                    # both tiers, one after the other
    python benchmarks/suite_time.py --tiers fast        # the fast tier only
    python benchmarks/suite_time.py --label before      # a label for the record (e.g. a commit)

Each tier is ``bash scripts/test.sh`` (``--fast``) on this checkout, timed from start to exit; its pytest summary
line (passed, skipped, failed) and the ten slowest tests are kept. Run it on an idle machine: the suite uses
both pytest-xdist workers. Results: benchmarks/results/suite_time.json (one record per run, appended), and
every record as the table in docs/testing.md ("Wall time").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.doc_block import replace_block  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "suite_time.json"
DOC = ROOT / "docs" / "testing.md"
START, END = "<!-- test-suite:start -->", "<!-- test-suite:end -->"
TIERS = {"full": [], "fast": ["--fast"]}


def cpu_model() -> str:
    """The CPU's name and its widest matrix instructions (what sets the tests' speed here)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor() or "unknown")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    isa = next((label for flag, label in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx2", "AVX2"))
                if flag in flags), "")
    return f"{name} ({isa})" if isa else name


def run_tier(tier: str) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", "scripts/test.sh", *TIERS[tier]], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    summary = next((line.strip("= ") for line in reversed(out.splitlines()) if re.search(r"\d+ passed", line)), "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|errors?)", summary)}
    slowest = re.findall(r"^(\d+\.\d+)s (?:call|setup|teardown)\s+(\S+)", out, re.M)[:10]
    return {"tier": tier, "wall_s": round(wall, 1), "exit_code": proc.returncode, **counts,
            "slowest": [{"test": name, "s": float(s)} for s, name in slowest]}


def table(records: list[dict]) -> str:
    rows = ["| date | label | machine | tier | wall | tests passed / skipped / failed |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in records:
        rows.append(f"| {r['date']} | {r['label']} | {r['machine']} | {r['tier']} | "
                    f"{int(r['wall_s'] // 60)} min {r['wall_s'] % 60:04.1f} s | "
                    f"{r.get('passed', 0)} / {r.get('skipped', 0)} / {r.get('failed', 0)} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiers", nargs="+", choices=list(TIERS), default=list(TIERS))
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    machine = f"{os.cpu_count()}-core {cpu_model()}"
    records = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    for tier in args.tiers:
        record = {"date": date.today().isoformat(), "label": args.label, "machine": machine, **run_tier(tier)}
        print(json.dumps({k: v for k, v in record.items() if k != "slowest"}), flush=True)
        records.append(record)
        RESULTS.write_text(json.dumps(records, indent=1) + "\n")
    replace_block(DOC, START, END, table(records), "Test suite")


if __name__ == "__main__":
    main()
