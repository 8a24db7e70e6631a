"""Fail fast, as a user sees it: each case is ``polyrl train configs/smoke.yaml ...`` with something missing or
a process that hangs (``POLYRL_TEST_HANG_AT``, checkpoint/faults.py), and the seconds from the command's start until
its one ``error:`` line, with waits bounded by ``learner.timeout_s=5``.

    python benchmarks/fail_fast.py

Writes benchmarks/results/fail_fast.json and the table in docs/systems.md ("When something is missing or
hangs"). Needs ray installed (the Ray cases) and vllm and wandb not installed (their cases).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from doc_block import replace_block

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "fail_fast.json"
DOC = ROOT / "docs" / "systems.md"
START, END = "<!-- fail_fast.py: start -->", "<!-- fail_fast.py: end -->"
QUICK = ["eval.before=false", "eval.after=false", "logging.report=false", "logging.tensorboard=false"]
WAIT = ["learner.timeout_s=5"]


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CASES: list[tuple[str, list[str], dict[str, str]]] = [
    ("an extra missing (wandb)", ["logging.wandb=true"], {}),
    ("an extra missing (vllm)", ["engine.kind=vllm"], {}),
    ("Ray actors the machine cannot hold",
     ["runtime.kind=ray", "runtime.engines=disaggregated", "runtime.num_workers=1", "learner.world_size=2"], {}),
    ("a Ray cluster that does not answer", ["runtime.kind=ray", f"runtime.ray_address=127.0.0.1:{_closed_port()}"],
     {}),
    ("a learner rank that never joins", ["learner.world_size=2", *WAIT], {"POLYRL_TEST_HANG_AT": "join:0"}),
    ("a learner rank that hangs in a collective", ["learner.world_size=2", *WAIT],
     {"POLYRL_TEST_HANG_AT": "update:1"}),
    ("the async rollout process hangs", ["runtime.kind=async", *WAIT], {"POLYRL_TEST_HANG_AT": "rollout:1"}),
    ("a Ray rollout worker hangs", ["runtime.kind=ray", *WAIT], {"POLYRL_TEST_HANG_AT": "worker0.0:1"}),
]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or "unknown"


def run_case(overrides: list[str], env: dict[str, str], workdir: Path, limit_s: float = 300.0) -> tuple[str, float]:
    """The first ``error:`` line of the command and the seconds from its start until that line."""
    cmd = [sys.executable, "-m", "polyrl", "train", "configs/smoke.yaml", "-o", str(workdir / "run"), *QUICK,
           *overrides]
    full_env = {**os.environ, "RAY_AUTH_MODE": "disabled", "POLYRL_TEST_KILL_ONCE": str(workdir / "hang-once"),
                **env}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    found: list[tuple[str, float]] = []

    def read() -> None:
        for line in proc.stderr:
            if line.startswith("error:") and not found:
                found.append((line.strip(), time.perf_counter() - t0))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
    reader.join(10)
    return found[0] if found else (f"no error line within {limit_s:.0f} s", time.perf_counter() - t0)


def table(rows: list[dict]) -> str:
    out = ["| case | overrides (after `polyrl train configs/smoke.yaml`) | the line | seconds |",
           "| --- | --- | --- | ---: |"]
    for r in rows:
        env = " ".join(f"{k}={v}" for k, v in r["env"].items())
        line = r["line"].replace("|", "\\|")
        out.append(f"| {r['case']} | `{' '.join(r['overrides'])}`{f' ({env})' if env else ''} | {line} | "
                   f"{r['seconds']:.1f} |")
    return "\n".join(out)


def main() -> None:
    rows = []
    for case, overrides, env in CASES:
        with tempfile.TemporaryDirectory(prefix="ff-") as tmp:
            line, seconds = run_case(overrides, env, Path(tmp))
        print(f"{case}: {seconds:.1f} s: {line}", flush=True)
        rows.append({"case": case, "command": "polyrl train configs/smoke.yaml " + " ".join([*QUICK, *overrides]),
                     "overrides": overrides, "env": env, "line": line, "seconds": round(seconds, 1)})
    result = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count()}, "cases": rows}
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    replace_block(DOC, START, END, table(rows), "When something is missing or hangs")
    print(f"wrote {RESULTS} and the table in {DOC}")


if __name__ == "__main__":
    main()
