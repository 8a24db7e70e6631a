"""The test suite's wall time: the whole suite (what CI runs) and the fast tier, as a user runs them.

    python benchmarks/suite_time.py                    # both tiers, one after the other
    python benchmarks/suite_time.py --tiers fast        # the fast tier only
    python benchmarks/suite_time.py --label before      # a label for the record (e.g. a commit)
    python benchmarks/suite_time.py --cold-cache        # an empty polyrl cache, as CI and a new machine have

Each tier is ``bash scripts/test.sh`` (``--fast``) on this checkout, timed from start to exit; its pytest summary
line (passed, skipped, failed), the CPU seconds of the processes it waited for (Ray's daemons are not among
them) and the ten slowest tests are kept. With ``--cold-cache`` the tier runs with an empty polyrl cache
(``POLYRL_CACHE``): the native kernels are compiled and the bundled model converted inside the suite, as in CI.
Run it on an idle machine: the suite uses both pytest-xdist workers. Results: benchmarks/results/suite_time.json
(one record per run, appended), and every record as the table in docs/testing.md ("Wall time"). A tier that
fails is not recorded: its output's tail is printed and the script exits non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.doc_block import replace_block  # noqa: E402
from benchmarks.machine_facts import label  # noqa: E402
from benchmarks.machine_facts import machine as cpu_facts  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "suite_time.json"
DOC = ROOT / "docs" / "testing.md"
START, END = "<!-- test-suite:start -->", "<!-- test-suite:end -->"
TIERS = {"full": [], "fast": ["--fast"]}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_tier(tier: str, cold_cache: bool) -> dict:
    env = dict(os.environ)
    cache_dir = tempfile.TemporaryDirectory(prefix="polyrl-cold-cache-") if cold_cache else contextlib.nullcontext()
    with cache_dir as cache:
        if cold_cache:
            env["POLYRL_CACHE"] = cache
        cpu0, t0 = children_cpu_s(), time.perf_counter()
        proc = subprocess.run(["bash", "scripts/test.sh", *TIERS[tier]], cwd=ROOT, capture_output=True, text=True,
                              env=env)
        wall, cpu = time.perf_counter() - t0, children_cpu_s() - cpu0
    out = proc.stdout + proc.stderr
    summary = next((line.strip("= ") for line in reversed(out.splitlines()) if re.search(r"\d+ passed", line)), "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|errors?)", summary)}
    slowest = re.findall(r"^(\d+\.\d+)s (?:call|setup|teardown)\s+(\S+)", out, re.M)[:10]
    return {"tier": tier, "cache": "cold" if cold_cache else "warm", "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1), "exit_code": proc.returncode, "tail": out[-3000:], **counts,
            "slowest": [{"test": name, "s": float(s)} for s, name in slowest]}


def table(records: list[dict]) -> str:
    rows = ["| date | label | machine | tier | polyrl cache | wall | CPU | tests passed / skipped / failed |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        cpu = f"{r['cpu_s']:.0f} s" if "cpu_s" in r else "-"  # not recorded before the column existed
        rows.append(f"| {r['date']} | {r['label']} | {r['machine']} | {r['tier']} | {r.get('cache', '-')} | "
                    f"{int(r['wall_s'] // 60)} min {r['wall_s'] % 60:04.1f} s | {cpu} | "
                    f"{r.get('passed', 0)} / {r.get('skipped', 0)} / {r.get('failed', 0)} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiers", nargs="+", choices=list(TIERS), default=list(TIERS))
    ap.add_argument("--label", default="")
    ap.add_argument("--cold-cache", action="store_true", help="run each tier with an empty polyrl cache")
    args = ap.parse_args()
    machine = label(cpu_facts())
    records = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    for tier in args.tiers:
        record = {"date": date.today().isoformat(), "label": args.label, "machine": machine,
                  **run_tier(tier, args.cold_cache)}
        tail = record.pop("tail")
        print(json.dumps({k: v for k, v in record.items() if k != "slowest"}), flush=True)
        if record["exit_code"] != 0:
            raise SystemExit(f"the {tier} tier failed (exit {record['exit_code']}), nothing recorded:\n{tail}")
        records.append(record)
        RESULTS.write_text(json.dumps(records, indent=1) + "\n")
    replace_block(DOC, START, END, table(records), "Test suite")


if __name__ == "__main__":
    main()
