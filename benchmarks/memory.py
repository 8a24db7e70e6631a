"""Peak memory of a quickstart run (full fine-tuning or LoRA), and what holds it.

Part 1 runs ``polyrl train CONFIG`` (configs/quickstart.yaml, or configs/quickstart_lora.yaml) as a child
process, shortened to a few steps and one evaluation batch after training, and samples its resident set size
(RSS) every 0.1 s; the peak is also read from the kernel's own high-water mark (ru_maxrss). A whole run peaks
higher than a short one (longer replies later, a fuller heap): ``--steps 20`` comes closer, and ``--whole`` runs the
config as shipped (its evaluations, steps and time cap) and adds its held-out accuracy. Part 2 builds the same
run in this process, does one step and adds up the bytes of each tensor holder: policy weights, the engine's
bf16 sampling copy, gradients and optimizer states. Results: benchmarks/results/memory.json.

    python benchmarks/memory.py --config configs/quickstart_lora.yaml     # ~3 min on 2 idle cores
    python benchmarks/memory.py --steps 2 --no-breakdown --out /tmp/memory_full.json
    python benchmarks/memory.py --config configs/quickstart_lora.yaml --whole --out /tmp/lora_whole.json
    python benchmarks/memory.py --table benchmarks/results/memory_runs/lora_micro_batch16   # into the docs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from cascade import machine
from doc_block import replace_block

from polyrl import native_bf16

ROOT = Path(__file__).resolve().parents[1]
CONFIG = [ROOT / "configs" / "quickstart.yaml"]  # --config


EXTRA: list[str] = []  # --set: further overrides, e.g. a smaller optim.micro_batch_size


def overrides(steps: int, eval_size: int) -> list[str]:
    # Only the evaluation after training: it holds everything the one before does, plus the optimizer state.
    return [f"train.steps={steps}", f"tasks.0.eval_size={eval_size}", "eval.before=false",
            "logging.progress=false", "logging.report=false", "logging.tensorboard=false", *EXTRA]


def peak_rss_of_run(args: list[str]) -> dict:
    """Run ``polyrl train CONFIG *args`` as a child; its peak RSS, RSS timeline, step times and summary."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "polyrl", "train", str(CONFIG[0]), *args, "--output", out]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ps, samples = psutil.Process(proc.pid), []
        while True:
            # wait4 reports this child's own high-water mark; RUSAGE_CHILDREN would also count earlier children
            # of this process (and of a shell that exec'd it), so a second run in one shell read the first's peak.
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            with contextlib.suppress(psutil.NoSuchProcess):  # exited, not yet reaped
                samples.append((time.perf_counter() - start, ps.memory_info().rss))
            time.sleep(0.1)
        returncode = os.waitstatus_to_exitcode(status)
        proc.returncode = returncode  # reaped here, so Popen must not wait for it again
        err = proc.stderr.read()
        if returncode:
            raise SystemExit(f"quickstart run failed ({returncode}): {err[-2000:]}")
        steps = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((Path(out) / "summary.json").read_text())
    kernel_peak = usage.ru_maxrss * 1024  # KiB on Linux
    return {
        "command": " ".join(cmd[1:]), "seconds": time.perf_counter() - start,
        "peak_rss_gb": kernel_peak / 1e9, "peak_rss_sampled_gb": max(r for _, r in samples) / 1e9,
        "rss_timeline_gb": [(round(t, 1), round(r / 1e9, 3)) for t, r in samples[:: max(1, len(samples) // 200)]],
        "median_step_s": statistics.median(m["step_time_s"] for m in steps if "step_time_s" in m),
        "median_update_s": statistics.median(m["update_time_s"] for m in steps if "update_time_s" in m),
        "steps": summary["steps"], "training_min": round(summary["train_time_s"] / 60, 2),
        "eval_before": summary.get("eval_before"), "eval_after": summary.get("eval_after"),
    }


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def breakdown(steps: int, eval_size: int) -> dict:
    """Bytes held by each part of the run after one step, and the RSS around it."""
    import torch

    from polyrl import build_run, load_config, rl_step

    config = load_config(CONFIG[0], overrides(steps, eval_size))
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    with tempfile.TemporaryDirectory() as out:
        run = build_run(config, Path(out))
        rss_built = proc.memory_info().rss
        rl_step(run, 1)
    rss_step = proc.memory_info().rss
    engine, learner = run.engine, run.learner
    opt_states = [v for s in learner.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    held = {
        "policy_weights": tensor_bytes(run.model.parameters()),
        "trainable_weights": tensor_bytes(learner.params),
        "gradients": tensor_bytes(p.grad for p in learner.params),
        "optimizer_states": tensor_bytes(opt_states),
        "engine_bf16_copy": engine.fast.nbytes() if engine.fast is not None else (
            tensor_bytes(engine.model.parameters()) if engine.model is not run.model else 0),
        "engine_float32_head": tensor_bytes([engine.head_weight]),
    }
    return {
        "held_gb": {k: v / 1e9 for k, v in held.items()},
        "rss_python_and_libraries_gb": rss0 / 1e9,
        "rss_after_build_gb": rss_built / 1e9,
        "rss_after_one_step_gb": rss_step / 1e9,
    }


def whole_runs_table(folder: Path) -> str:
    """A markdown table of the whole runs (``--whole``) whose results lie in ``folder``, by config and seed."""
    rows = []
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        run = result["run"]
        if run["eval_before"] is None:  # a shortened run: no accuracy to set beside the others
            continue
        seed = next((int(a.split("=", 1)[1]) for a in run["command"].split() if a.startswith("train.seed=")), 0)
        task = next(iter(run["eval_after"]))
        rows.append((result["config"], seed, run["steps"], run["training_min"], 100 * run["eval_before"][task],
                     100 * run["eval_after"][task], run["median_step_s"], run["peak_rss_gb"]))
    lines = ["| config | seed | steps | training | held-out before → after | median step | peak RSS |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| `{c}` | {seed} | {n} | {m:.1f} min | {b:.1f} → {a:.1f} % | {t:.2f} s | {gb:.2f} GB |"
              for c, seed, n, m, b, a, t, gb in sorted(rows)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=CONFIG[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--eval-size", type=int, default=64, help="one evaluation batch (eval.batch_size is 64)")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--whole", action="store_true", help="the config's whole run, as shipped (implies --no-breakdown)")
    ap.add_argument("--set", nargs="*", default=[], help="extra dotted overrides of the quickstart config")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "memory.json")
    ap.add_argument("--table", type=Path, help="write the whole runs in this folder into docs/performance.md, run none")
    args = ap.parse_args()
    if args.table:
        name = args.table.resolve().name
        table = whole_runs_table(args.table)
        replace_block(ROOT / "docs" / "performance.md", f"<!-- memory-runs:{name}:start -->",
                      f"<!-- memory-runs:{name}:end -->", table, f"Whole quickstart runs: {name}")
        print(table)
        return
    EXTRA.extend(args.set)
    CONFIG[0] = args.config.resolve()
    quiet = ["logging.progress=false", "logging.report=false", "logging.tensorboard=false", *EXTRA]
    run_args = quiet if args.whole else overrides(args.steps, args.eval_size)
    result = {"config": str(CONFIG[0].relative_to(ROOT)), "cpu": machine(), "native_bf16": native_bf16("cpu"),
              "run": peak_rss_of_run(run_args)}
    run = result["run"]
    print(f"peak RSS {run['peak_rss_gb']:.2f} GB ({run['seconds']:.0f} s), median step {run['median_step_s']:.2f} s, "
          f"update {run['median_update_s']:.2f} s", flush=True)
    if not (args.no_breakdown or args.whole):
        result["breakdown"] = breakdown(args.steps, args.eval_size)
        print(json.dumps(result["breakdown"], indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
