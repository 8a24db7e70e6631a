"""Training from a large dataset file: start-up time and memory of a 1,000,000-row JSONL and parquet file
beside 1,000-row files of the same formats.

Writes seeded rows like ``{"question": "What is 417 + 288?", "answer": "705", "id": 0}`` to JSONL and parquet
files (pyarrow's default row groups) of 1,000 and 1,000,000 rows, then, for each file:

* runs ``polyrl train CONFIG -o RUN_DIR`` as a child process with the tiny random model (2 steps, 2 prompts x 2
  samples, 8 new tokens, no evaluation) and measures the seconds from launch to the end of step 1 (when its
  line reaches RUN_DIR/metrics.jsonl), the seconds before step 1 began (that minus step 1's own
  ``step_time_s``), the total wall time, and the peak RSS: of the process tree sampled every 0.1 s, and the
  kernel's high-water mark of the training process itself;
* builds the task in a fresh Python process with ``make_task(TaskConfig(...), seed=0)`` (the one pass over the
  rows that checks them and splits off the held-out ones): its seconds and peak RSS growth (sampled every
  10 ms), the first training row's read, and a second build under tracemalloc (peak and retained bytes of
  Python allocations; Arrow's buffers are not among them, so parquet files add the peak of Arrow's pool);
* profiles one ``make_task`` of each 1,000,000-row file with cProfile (the ten functions with the most own time).

Each measurement is repeated (``--repeats``, the files taking turns) and reported as min and max; each large
file is compared with the 1,000-row file of its format, so that what both share (Python, torch, the model,
pyarrow's libraries for parquet) cancels out. Results: benchmarks/results/large_data.json, and a
table in docs/results/large-data.md.

    python benchmarks/large_data.py                       # ~5 min on 2 cores
    python benchmarks/large_data.py --rows 100000 --repeats 1 --no-doc --out /tmp/large_data.json
    python benchmarks/large_data.py --table-only          # the docs' table again, from the results file
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_block import replace_block

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "large_data.json"
START, END = "<!-- large-data:start -->", "<!-- large-data:end -->"
PROMPT = "{question} Answer with just the number."
MB = 1e6


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in cpuinfo.splitlines()) if v}
    flags = set(field.get("flags", "").split())
    return {
        "cpu_model": field.get("model name", platform.machine()), "cores": os.cpu_count(),
        "cpu_flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1), "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average_at_start": os.getloadavg(),
    }


def write_files(folder: Path, small: int, large: int, seed: int) -> dict[str, Path]:
    """The dataset files, JSONL and parquet; each small file holds the first ``small`` rows of the large one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    a, b = rng.integers(100, 1000, large).tolist(), rng.integers(100, 1000, large).tolist()
    questions = [f"What is {x} + {y}?" for x, y in zip(a, b, strict=True)]
    answers = [str(x + y) for x, y in zip(a, b, strict=True)]
    lines = [json.dumps({"question": q, "answer": s, "id": i}) + "\n"
             for i, (q, s) in enumerate(zip(questions, answers, strict=True))]
    paths = {"jsonl_small": folder / f"rows_{small}.jsonl", "jsonl_large": folder / f"rows_{large}.jsonl",
             "parquet_small": folder / f"rows_{small}.parquet", "parquet_large": folder / f"rows_{large}.parquet"}
    paths["jsonl_small"].write_text("".join(lines[:small]))
    paths["jsonl_large"].write_text("".join(lines))
    del lines
    table = pa.table({"question": questions, "answer": answers, "id": np.arange(large, dtype=np.int64)})
    pq.write_table(table.slice(0, small), paths["parquet_small"])
    pq.write_table(table, paths["parquet_large"])
    return paths


def config_yaml(items: Path) -> str:
    return "\n".join([
        "model: {name: tiny-random, bf16: false}",
        f"tasks: [{{name: qa, items: {json.dumps(str(items))}, prompt: {json.dumps(PROMPT)}, reward: last_number}}]",
        "train: {steps: 2}",
        "rollout: {prompts_per_step: 2, group_size: 2, max_new_tokens: 8}",
        "eval: {before: false, after: false}",
        "logging: {progress: false, report: false, tensorboard: false}",
        "",
    ])


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += p.memory_info().rss
    return total


def train_run(items: Path, work: Path) -> dict:
    """``polyrl train`` on ``items`` as a child: seconds to the end of step 1, total seconds, peak RSS."""
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        config, run_dir = Path(tmp) / "config.yaml", Path(tmp) / "run"
        config.write_text(config_yaml(items))
        metrics = run_dir / "metrics.jsonl"
        cmd = [sys.executable, "-m", "polyrl", "train", str(config), "-o", str(run_dir)]
        launched_epoch, start = time.time(), time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ps, peak_tree, step1_s = psutil.Process(proc.pid), 0, None
        while True:
            # wait4: this child's own high-water mark (RUSAGE_CHILDREN would fold in every earlier child).
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            with contextlib.suppress(psutil.NoSuchProcess):
                peak_tree = max(peak_tree, tree_rss(ps))
            if step1_s is None and metrics.exists():
                with contextlib.suppress(OSError):
                    lines = metrics.read_text().splitlines()
                    if lines and lines[0].endswith("}"):
                        # The file's mtime is when step 1's line was written, as long as step 2's is not there.
                        step1_s = (metrics.stat().st_mtime - launched_epoch if len(lines) == 1
                                   else time.perf_counter() - start)
            time.sleep(0.1)
        total_s = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here; Popen must not wait again
        err = proc.stderr.read()
        if proc.returncode:
            raise SystemExit(f"polyrl train failed ({proc.returncode}) on {items}: {err[-2000:]}")
        steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    step1 = steps[0]
    if step1_s is None:  # the run ended between two polls
        step1_s = total_s
    return {
        "to_step1_end_s": round(step1_s, 2), "step1_s": round(step1["step_time_s"], 2),
        "before_step1_s": round(step1_s - step1["step_time_s"], 2), "total_s": round(total_s, 2),
        "peak_rss_tree_mb": round(peak_tree / MB, 1), "peak_rss_trainer_mb": round(usage.ru_maxrss * 1024 / MB, 1),
    }


def task_config(items: Path):
    from polyrl import TaskConfig

    return TaskConfig(name="qa", items=str(items), prompt=PROMPT, reward="last_number")


def task_build_worker(items: Path) -> dict:
    """In this (fresh) process: ``make_task``'s seconds and memory, then the first training row's read."""
    from polyrl import make_task

    config = task_config(items)
    proc = psutil.Process()
    gc.collect()
    rss0 = proc.memory_info().rss
    peak, done = [rss0], threading.Event()

    def sample() -> None:  # the RSS every 10 ms while the task is built
        while not done.wait(0.01):
            peak[0] = max(peak[0], proc.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    task = make_task(config, seed=0)
    build_s = time.perf_counter() - t0
    done.set()
    sampler.join()
    rss_built = proc.memory_info().rss
    peak[0] = max(peak[0], rss_built)
    t0 = time.perf_counter()
    task.source.train_item(0)
    first_s = time.perf_counter() - t0
    rss_first = proc.memory_info().rss
    source = task.source
    rows = {"train": len(source.train_ids), "held_out": len(source.held_ids), "skipped": len(source.skipped)}
    del task, source
    gc.collect()
    tracemalloc.start()
    task = make_task(config, seed=0)
    traced_now, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del task  # held until the traced bytes were read: they are what the task keeps
    arrow = {}
    if "pyarrow" in sys.modules:  # Arrow's buffers live in its own memory pool, which tracemalloc does not see
        arrow = {"arrow_pool_peak_mb": round(sys.modules["pyarrow"].default_memory_pool().max_memory() / MB, 1)}
    return {
        "build_s": round(build_s, 2), "rss_before_mb": round(rss0 / MB, 1),
        "rss_growth_mb": round((rss_built - rss0) / MB, 1), "peak_rss_growth_mb": round((peak[0] - rss0) / MB, 1),
        "first_row_s": round(first_s, 3), "rss_growth_after_first_row_mb": round((rss_first - rss0) / MB, 1),
        "traced_peak_mb": round(traced_peak / MB, 1), "traced_retained_mb": round(traced_now / MB, 1),
        **arrow, "rows": rows,
    }


def profile_worker(items: Path, top: int = 10) -> dict:
    """cProfile of one ``make_task``: the ``top`` functions by own time."""
    from polyrl import make_task

    config = task_config(items)
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.runcall(make_task, config, seed=0)
    seconds = time.perf_counter() - t0
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    prefixes = sorted({str(ROOT) + "/", *(p + "/" for p in sys.path if p)}, key=len, reverse=True)

    def name(file: str, line: int, func: str) -> str:
        short = next((file[len(p):] for p in prefixes if file.startswith(p)), file)
        return f"{short}:{line}({func})" if line else func

    return {"seconds_under_profiler": round(seconds, 2), "top_by_tottime": [
        {"function": name(*key), "calls": nc, "tottime_s": round(tt, 3), "cumtime_s": round(ct, 3)}
        for key, (_, nc, tt, ct, _) in rows]}


def in_fresh_process(flag: str, items: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, flag, str(items)], capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{flag} {items} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def span(values: list[float]) -> dict:
    return {"min": min(values), "max": max(values)}


def summarise(runs: list[dict], builds: list[dict]) -> dict:
    return {
        "train": {k: span([r[k] for r in runs]) for k in runs[0]},
        "make_task": {k: span([b[k] for b in builds]) for k in builds[0] if k != "rows"},
    }


def fmt(s: dict, unit: str, digits: int = 1) -> str:
    lo, hi = f"{s['min']:.{digits}f}", f"{s['max']:.{digits}f}"
    return f"{lo} {unit}" if lo == hi else f"{lo}–{hi} {unit}"


def size(n: int) -> str:
    return f"{n / MB:.1f} MB" if n >= MB else f"{n / 1e3:.0f} kB"


def table(result: dict) -> str:
    m = result["machine"]
    flags = ", ".join(m["cpu_flags"]) or "none of avx2/avx512f/avx512_bf16/amx_bf16"
    load0 = ", ".join(f"{x:.2f}" for x in m["load_average_at_start"])
    load1 = ", ".join(f"{x:.2f}" for x in m["load_average_at_end"])
    lines = [
        f"{m['cpu_model']}, {m['cores']} cores ({flags}), {m['date']}; load averages (1, 5, 15 min) "
        f"{load0} at the start, {load1} at the end. `polyrl train` with the tiny random model, 2 steps of 2 prompts "
        f"x 2 samples, no evaluation; min–max of {result['repeats']} runs each. Peak RSS is the training process's "
        "high-water mark; `make_task` is the task's build alone, in a fresh process (RSS growth: its peak / what it "
        "keeps). Reproduce with `python benchmarks/large_data.py`.",
        "",
        "| file | size | launch → end of step 1 | before step 1 | whole run | peak RSS | `make_task` | "
        "its RSS growth | first row read |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for d in result["datasets"].values():
        t, b = d["summary"]["train"], d["summary"]["make_task"]
        lines.append(
            f"| {d['rows']:,}-row {d['format']} | {size(d['file_bytes'])} | {fmt(t['to_step1_end_s'], 's')} | "
            f"{fmt(t['before_step1_s'], 's')} | {fmt(t['total_s'], 's')} | "
            f"{fmt(t['peak_rss_trainer_mb'], 'MB', 0)} | {fmt(b['build_s'], 's', 2)} | "
            f"{fmt(b['peak_rss_growth_mb'], '', 0).strip()} / {fmt(b['rss_growth_mb'], 'MB', 0)} | "
            f"{fmt(b['first_row_s'], 's', 3)} |")
    lines.append("")
    for key, diff in result["added_over_small"].items():
        d, small = result["datasets"][key], result["datasets"][key.replace("_large", "_small")]
        step1, rss = diff["to_step1_end_s"], diff["peak_rss_trainer_mb"]
        lines.append(f"- {d['rows']:,}-row {d['format']} against the {small['rows']:,}-row {small['format']} (min "
                     f"against min, max against max): {step1['min']:+.1f} / {step1['max']:+.1f} s to the end of "
                     f"step 1, {rss['min']:+.0f} / {rss['max']:+.0f} MB peak RSS.")
        if d.get("row_groups"):
            groups = "one row group of" if d["row_groups"] == 1 else f"{d['row_groups']} row groups of up to"
            lines.append(f"  The file is {groups} {d['largest_row_group_rows']:,} rows (pyarrow's default); reading "
                         "a row decodes its whole group.")
    for key, prof in result.get("profiles", {}).items():
        d = result["datasets"][key]
        top = ", ".join(f"`{p['function']}` {p['tottime_s']:.1f} s" for p in prof["top_by_tottime"][:5])
        lines.append(f"- Where `make_task`'s time goes on the {d['rows']:,}-row {d['format']} (cProfile, own time; "
                     f"{prof['seconds_under_profiler']:.1f} s under the profiler): {top}.")
    return "\n".join(lines)


def added(large: dict, small: dict) -> dict:
    """What the large file adds over the small one, min against min and max against max."""
    out = {m: {e: round(large["train"][m][e] - small["train"][m][e], 2) for e in ("min", "max")}
           for m in ("to_step1_end_s", "before_step1_s", "total_s", "peak_rss_tree_mb", "peak_rss_trainer_mb")}
    for m in ("build_s", "peak_rss_growth_mb", "rss_growth_mb"):
        out[f"make_task_{m}"] = {e: round(large["make_task"][m][e] - small["make_task"][m][e], 2)
                                 for e in ("min", "max")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the large files")
    ap.add_argument("--small", type=int, default=1_000, help="rows of the baseline files")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, help="write the dataset files here and keep them (default: a temp folder)")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile of make_task")
    ap.add_argument("--no-doc", action="store_true", help="do not write the table into docs/results/large-data.md")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--table-only", action="store_true", help="rewrite the docs' table from --out; run nothing")
    ap.add_argument("--task-build", type=Path, help=argparse.SUPPRESS)  # worker: one make_task, JSON on stdout
    ap.add_argument("--profile", type=Path, help=argparse.SUPPRESS)  # worker: cProfile of one make_task
    args = ap.parse_args()
    if args.task_build:
        print(json.dumps(task_build_worker(args.task_build)))
        return
    if args.profile:
        print(json.dumps(profile_worker(args.profile)))
        return
    if args.table_only:
        result = json.loads(args.out.read_text())
        for key, d in result["datasets"].items():  # recomputed, so a change to what is compared needs no rerun
            if key.endswith("_large"):
                result["added_over_small"][key] = added(d["summary"],
                                                        result["datasets"][key.replace("_large", "_small")]["summary"])
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        replace_block(ROOT / "docs" / "results" / "large-data.md", START, END, table(result), "Large datasets")
        print(table(result))
        return

    result = {"machine": machine(), "repeats": args.repeats, "seed": args.seed}
    with contextlib.ExitStack() as stack:
        if args.dir:
            folder = args.dir.resolve()
            folder.mkdir(parents=True, exist_ok=True)
        else:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="polyrl-large-data-")))
        t0 = time.perf_counter()
        paths = write_files(folder, args.small, args.rows, args.seed)
        result["write_files_s"] = round(time.perf_counter() - t0, 1)
        print(f"wrote the files in {result['write_files_s']} s", flush=True)
        runs: dict[str, list] = {k: [] for k in paths}
        builds: dict[str, list] = {k: [] for k in paths}
        for rep in range(args.repeats):
            for key, path in paths.items():  # the files take turns, so a busy spell hits all of them
                runs[key].append(train_run(path, folder))
                builds[key].append(in_fresh_process("--task-build", path))
                print(f"[{rep + 1}/{args.repeats}] {path.name}: {json.dumps(runs[key][-1])} "
                      f"make_task {json.dumps(builds[key][-1])}", flush=True)
        if not args.no_profile:
            result["profiles"] = {k: in_fresh_process("--profile", p) for k, p in paths.items() if k.endswith("_large")}
        result["datasets"] = {
            key: {"file": path.name, "format": "parquet" if path.suffix == ".parquet" else "JSONL",
                  "rows": args.small if key.endswith("_small") else args.rows,
                  "file_bytes": path.stat().st_size, **_parquet_layout(path),
                  "summary": summarise(runs[key], builds[key]), "train_runs": runs[key], "make_task": builds[key]}
            for key, path in paths.items()}
    result["added_over_small"] = {  # each large file against the small file of its own format
        key: added(d["summary"], result["datasets"][key.replace("_large", "_small")]["summary"])
        for key, d in result["datasets"].items() if key.endswith("_large")}
    result["machine"]["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    block = table(result)
    if not args.no_doc:
        replace_block(ROOT / "docs" / "results" / "large-data.md", START, END, block, "Large datasets")
    print(block)


def _parquet_layout(path: Path) -> dict:
    if path.suffix != ".parquet":
        return {}
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    return {"row_groups": meta.num_row_groups, "largest_row_group_rows": max(
        meta.row_group(g).num_rows for g in range(meta.num_row_groups))}


if __name__ == "__main__":
    main()
