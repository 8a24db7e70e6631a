"""The GPU check: one short script to run when a GPU machine is at hand, to see the GPU paths work and measure them.

It runs these parts, each in a process of its own under its own timeout (a part that fails or times out records
its one-line error and the next part runs), inside a total budget of about 7.5 minutes:

    quickstart_hf     configs/quickstart.yaml on train.device=cuda with the hf engine, 20 steps, 100 held-out items
    quickstart_vllm   the same with engine.kind=vllm (colocated, in the training process, sleeping through
                      each update); skipped without vllm
    model_1b          `polyrl make-model llama3 DIR --size 1b`, then 4 RL steps of that ~1.2B model (build_run and
                      rl_step: no evaluation, no checkpoint); an entropy bonus makes every update run although a
                      random model earns no reward
    world_size_2      the quickstart, 10 steps, with learner.world_size=2 (FSDP2 over NCCL); skipped below 2 GPUs

For each part it records the median step time (step_time_s in metrics.jsonl), rollout tokens/s
(rollout/tokens_per_s), weight-sync time (sync/time_s), held-out accuracy before and after, the peak GPU memory
torch allocated in the part's process (torch.cuda.max_memory_allocated) and the peak memory in use on the GPUs
(nvidia-smi, sampled every half second; it covers the ranks of world_size_2 and vLLM's own reservations).
Results: benchmarks/results/gpu_check.json (date, GPU, torch and CUDA versions), printed as a table too.

    python benchmarks/gpu_check.py                          # on a GPU machine, under 8 minutes
    python benchmarks/gpu_check.py --parts quickstart_hf    # some parts only
    python benchmarks/gpu_check.py --cpu-smoke              # the plumbing on a CPU: tiny-random, 2 steps a part

``--cpu-smoke`` runs every part on the CPU with the tiny random model (model_1b with ``--size tiny``, world_size_2
on two gloo ranks) and writes its JSON under the work directory, not over the GPU result; tests/test_gpu_check.py
runs it. polyrl's dependencies must be importable; polyrl itself is imported from this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.json"
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
PARTS = ("quickstart_hf", "quickstart_vllm", "model_1b", "world_size_2")
TOTAL_BUDGET_S = 450.0
"""The whole check stays under 8 minutes: a part's timeout is cut to what is left of this."""
TIMEOUTS_S = {"quickstart_hf": 150.0, "quickstart_vllm": 180.0, "model_1b": 170.0, "world_size_2": 150.0}
SMOKE_TIMEOUT_S = 180.0
GIB = 2**30


@dataclass
class Part:
    """One part of the check: the config a worker process runs, or why it is skipped."""

    name: str
    config: dict[str, Any] | None = None
    mode: str = "train"
    """train: ``polyrl.train.loop.train`` (evaluations, checkpoint, metrics.jsonl); steps: ``build_run`` and
    ``rl_step`` only (the 1B part: no evaluation, no 14 GB checkpoint)."""
    make_model: dict[str, str] | None = None
    """``write_random_model`` arguments (arch, size, path) run in the worker first."""
    timeout_s: float = 150.0
    skip: str | None = None
    notes: list[str] = field(default_factory=list)


# --- the parts' configs ------------------------------------------------------------------------------------------

def _quiet_logging(data: dict) -> None:
    data.setdefault("logging", {}).update(progress=False, report=False, tensorboard=False)


def quickstart_config(*, smoke: bool, steps: int, eval_size: int) -> dict:
    """configs/quickstart.yaml on the check's device with fewer steps and held-out items; ``smoke``: on the CPU
    with the tiny random model, 2 steps, short answers."""
    import yaml

    data = yaml.safe_load(QUICKSTART.read_text())
    data["name"] = "gpu-check"
    train = data.setdefault("train", {})
    train.update(device="cpu" if smoke else "cuda", steps=2 if smoke else steps, checkpoint_every=0)
    # Training time, so a slow part still ends with its evaluation inside its timeout (loading and evaluating
    # come on top).
    train["max_minutes"] = 0.5 if smoke else 1.5
    for task in data["tasks"]:
        task["eval_size"] = 8 if smoke else eval_size
    if smoke:
        data["model"] = {"name": "tiny-random", "bf16": False}
        data["engine"] = {"bf16_weights": True}  # the GPU's path: a sampling copy that every sync refreshes
        data["rollout"].update(group_size=4, max_new_tokens=8)
        data["algorithm"].update(dynamic_sampling=False, entropy_coef=1e-3)  # updates run on zero rewards
        data["optim"]["micro_batch_size"] = 8
    _quiet_logging(data)
    return data


def plan(smoke: bool, gpus: int, vllm: bool, workdir: Path) -> list[Part]:
    """The four parts for a machine with ``gpus`` GPUs (``smoke``: the CPU) and vllm importable or not."""
    def timeout(name: str) -> float:
        return SMOKE_TIMEOUT_S if smoke else TIMEOUTS_S[name]

    parts = [Part("quickstart_hf", quickstart_config(smoke=smoke, steps=20, eval_size=100),
                  timeout_s=timeout("quickstart_hf"))]

    data = quickstart_config(smoke=smoke, steps=20, eval_size=100)
    # Colocated: vLLM shares the GPU with the learner and sleeps through each update (CUDA only).
    data["engine"] = {"kind": "vllm", "vllm": {"max_model_len": 1024, "sleep_mode": not smoke}}
    parts.append(Part("quickstart_vllm", data, timeout_s=timeout("quickstart_vllm"),
                      skip=None if vllm else "vllm: not installed, skipped"))

    model_dir = workdir / "models" / ("llama3-tiny" if smoke else "llama3-1b")
    data = quickstart_config(smoke=smoke, steps=4, eval_size=1)
    data["model"] = {"name": str(model_dir)}  # bf16 where the device computes it (model.bf16: auto)
    # A random model earns no reward: without another loss term every update would be skipped as gradient-free.
    data["algorithm"].update(dynamic_sampling=False, entropy_coef=1e-3)
    data["eval"] = {"before": False, "after": False}
    parts.append(Part("model_1b", data, mode="steps", timeout_s=timeout("model_1b"),
                      make_model={"arch": "llama3", "size": "tiny" if smoke else "1b", "path": str(model_dir)},
                      notes=["llama3 --size tiny (cpu smoke)"] if smoke else []))

    data = quickstart_config(smoke=smoke, steps=10, eval_size=100)
    data["learner"] = {"world_size": 2}
    skip = None if smoke or gpus >= 2 else f"learner.world_size=2: needs 2+ GPUs, this machine has {gpus}"
    parts.append(Part("world_size_2", data, timeout_s=timeout("world_size_2"), skip=skip,
                      notes=["two gloo ranks on the CPU (cpu smoke)"] if smoke else []))
    return parts


# --- reading a part's results ------------------------------------------------------------------------------------

def _round(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return _round(statistics.median(values)) if values else None


def summarize(run_dir: Path) -> dict[str, Any]:
    """What a part measured, from its run directory: medians over metrics.jsonl's steps (and the first step's
    time and sync apart: they include the warm-up), held-out accuracy from summary.json."""
    out: dict[str, Any] = {}
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    if rows:
        out.update(
            steps=len(rows),
            step_time_s=_median(rows, "step_time_s"),
            first_step_time_s=_round(rows[0].get("step_time_s")),
            rollout_tokens_per_s=_median(rows, "rollout/tokens_per_s"),
            sync_time_s=_median(rows, "sync/time_s"),
            first_sync_time_s=_round(rows[0].get("sync/time_s")),
            update_time_s=_median(rows, "update_time_s"),
            rollout_time_s=_median(rows, "rollout_time_s"),
            # Steps whose forward and backward passes ran (not skipped as gradient-free or for NaN/inf).
            updates_run=sum(1 for r in rows if not r.get("zero_gradient") and not r.get("skipped_updates")),
        )
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        out["accuracy_before"] = summary.get("eval_before")
        out["accuracy_after"] = summary.get("eval_after")
        out["train_time_s"] = _round(summary.get("train_time_s"))
    return out


def one_line_error(log: str, returncode: int | None) -> str:
    """The line of a failed part's output that says why: the last exception line, else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.startswith("error") or (head.endswith(("Error", "Exception", "Interrupt")) and " " not in head):
            return line[:300]
    tail = lines[-1][:300] if lines else "no output"
    return f"exit code {returncode}: {tail}"


# --- running a part ----------------------------------------------------------------------------------------------

class GpuMemoryPoller:
    """Peak memory in use over all GPUs, read from nvidia-smi every ``interval_s`` while a part runs."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                text = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=5,
                ).stdout
                used = sum(float(v) for v in text.split())
                self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self) -> GpuMemoryPoller:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(timeout=10)


def run_part(part: Part, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``part`` in a worker process (a process group of its own, killed whole on timeout); its results."""
    if part.skip:
        return {"status": "skipped", "reason": part.skip, "notes": part.notes}
    part_dir = workdir / part.name
    shutil.rmtree(part_dir, ignore_errors=True)
    part_dir.mkdir(parents=True)
    spec = {"name": part.name, "config": part.config, "mode": part.mode, "make_model": part.make_model,
            "run_dir": str(part_dir / "run"), "result": str(part_dir / "worker.json")}
    (part_dir / "spec.json").write_text(json.dumps(spec, indent=2))
    log_path = part_dir / "log.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    returncode: int | None = None
    with GpuMemoryPoller() as poller, log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", str(part_dir / "spec.json")], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker and whatever it started (ranks, vLLM)
            proc.wait()
    worker_path = Path(spec["result"])
    result = json.loads(worker_path.read_text()) if worker_path.exists() else {}
    error = result.pop("error", None)
    if error is None and returncode is None and not worker_path.exists():
        error = f"timed out after {timeout_s:.0f} s"
    elif error is None and returncode not in (0, None):
        error = one_line_error(log_path.read_text(), returncode)
    record: dict[str, Any] = {"status": "failed" if error else "ok"}
    if error:
        record["error"] = error
    record.update(wall_s=round(time.perf_counter() - t0, 1), notes=list(part.notes), log=str(log_path))
    if returncode is None and worker_path.exists():  # finished its work, then hung on the way out
        record["notes"].append(f"killed after {timeout_s:.0f} s, after writing its results")
    record.update(summarize(Path(spec["run_dir"])))
    record.update(result)
    if poller.peak_mib is not None:
        record["peak_gpu_used_gib_nvidia_smi"] = round(poller.peak_mib / 1024, 2)
    return record


def worker(spec_path: Path) -> int:
    """One part, in this process: make the model if asked, run the config, write what only this process knows
    (peak GPU and host memory) beside the run directory."""
    import resource

    spec = json.loads(spec_path.read_text())
    result: dict[str, Any] = {}
    try:
        import torch

        from polyrl.config_check import load_config

        if spec["make_model"]:
            from polyrl.models.synthetic import write_random_model

            t0 = time.perf_counter()
            mm = spec["make_model"]
            if not (Path(mm["path"]) / "config.json").exists():
                write_random_model(mm["arch"], mm["path"], mm["size"])
            result["make_model_s"] = round(time.perf_counter() - t0, 1)
        cfg = load_config(None, data=spec["config"])
        run_dir = Path(spec["run_dir"])
        if spec["mode"] == "steps":
            _run_steps(cfg, run_dir)
        else:
            from polyrl.train.loop import train

            train(cfg, run_dir, log=lambda m: print(m, file=sys.stderr, flush=True))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            result["peak_gpu_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
            result["peak_gpu_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
    except BaseException as exc:  # noqa: BLE001 - any failure is the part's one-line result
        import traceback

        traceback.print_exc()
        message = " ".join(str(exc).split())
        result["error"] = f"{type(exc).__name__}: {message}"[:300]
    result["peak_host_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2)
    Path(spec["result"]).write_text(json.dumps(result, indent=2))
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's shutdown: what vLLM or CUDA left behind can hang it, and all is written.
    os._exit(1 if "error" in result else 0)


def _run_steps(cfg, run_dir: Path) -> None:
    """``train.steps`` RL steps without evaluation or checkpoint; metrics.jsonl as the loop writes it."""
    from polyrl.train.step import build_run, rl_step

    run_dir.mkdir(parents=True, exist_ok=True)
    run = build_run(cfg, run_dir)
    with (run_dir / "metrics.jsonl").open("w") as out:
        for step in range(1, cfg.train.steps + 1):
            metrics, _ = rl_step(run, step)
            out.write(json.dumps({"step": step, **metrics}) + "\n")
            out.flush()


# --- the machine ---------------------------------------------------------------------------------------------------

def environment(smoke: bool) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "mode": "cpu-smoke" if smoke else "gpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpus": os.cpu_count(),
        "vllm": None,
    }
    if find_spec("vllm") is not None:
        try:
            from importlib.metadata import version

            env["vllm"] = version("vllm")
        except Exception:  # noqa: BLE001 - a vllm without metadata (a source checkout) is still importable
            env["vllm"] = "installed"
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _accuracy(record: dict) -> str:
    before, after = record.get("accuracy_before"), record.get("accuracy_after")
    if not before and not after:
        return "-"
    task = next(iter(after or before))
    pct = lambda d: f"{d[task] * 100:.1f}%" if d and task in d else "-"  # noqa: E731
    return f"{pct(before)} -> {pct(after)}"


def print_table(results: dict) -> None:
    env = results["environment"]
    print(f"\n{env['date']}  {env['gpu_name'] or 'no GPU'}  torch {env['torch']}  cuda {env['cuda']}  "
          f"vllm {env['vllm'] or 'not installed'}  ({env['mode']})")
    head = f"{'part':<16}{'status':<8}{'step s':>8}{'tok/s':>9}{'sync s':>8}{'held-out':>18}{'GPU GiB':>9}{'wall s':>8}"
    print(head)
    for name, r in results["parts"].items():
        print(f"{name:<16}{r['status']:<8}{_fmt(r.get('step_time_s')):>8}"
              f"{_fmt(r.get('rollout_tokens_per_s'), '.0f'):>9}{_fmt(r.get('sync_time_s'), '.3f'):>8}{_accuracy(r):>18}"
              f"{_fmt(r.get('peak_gpu_allocated_gib') or r.get('peak_gpu_used_gib_nvidia_smi')):>9}"
              f"{_fmt(r.get('wall_s'), '.0f'):>8}")
        if r.get("error") or r.get("reason"):
            print(f"    {r.get('error') or r.get('reason')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="every part on the CPU, tiny-random, 2 steps")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--workdir", type=Path, default=None, help="run directories and the made model")
    ap.add_argument("--out", type=Path, default=None, help=f"results JSON (default {RESULTS.relative_to(ROOT)}; "
                    "with --cpu-smoke, WORKDIR/gpu_check.json)")
    ap.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="total time for all parts")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)

    import torch

    smoke = args.cpu_smoke
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not smoke and gpus == 0:
        print("error: torch sees no GPU; run with --cpu-smoke to check the plumbing on a CPU", file=sys.stderr)
        return 2
    workdir = args.workdir or Path("/tmp") / ("polyrl-gpu-check-smoke" if smoke else "polyrl-gpu-check")
    out = args.out or (workdir / "gpu_check.json" if smoke else RESULTS)
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"environment": environment(smoke), "budget_s": args.budget_s, "parts": {}}
    t_start = time.perf_counter()
    for part in plan(smoke, gpus, find_spec("vllm") is not None, workdir):
        if part.name not in args.parts:
            continue
        left = args.budget_s - (time.perf_counter() - t_start)
        if part.skip is None and left < 20:
            part.skip = f"not run: the check's {args.budget_s:.0f} s budget was spent"
        print(f"[gpu_check] {part.name}: " + (part.skip or f"running (timeout {min(part.timeout_s, left):.0f} s)"),
              flush=True)
        record = run_part(part, workdir, min(part.timeout_s, left))
        results["parts"][part.name] = record
        if record["status"] != "skipped":
            print(f"[gpu_check] {part.name}: {record['status']} in {record['wall_s']:.0f} s"
                  + (f": {record['error']}" if record.get("error") else ""), flush=True)
        results["total_s"] = round(time.perf_counter() - t_start, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")  # after every part: a cut-short check keeps its parts
    print_table(results)
    print(f"\nresults: {out}")
    return 0 if all(r["status"] != "failed" for r in results["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
