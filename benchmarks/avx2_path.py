"""The float32 decode path on a CPU without native bf16 (AVX2), against the bf16 path, as fractions of the bound.

Reproduces an AVX2-only CPU on any x86 machine by forcing float32 and capping the instruction sets every
library uses: ``ATEN_CPU_CAPABILITY=avx2`` (torch's kernels, and polyrl's native kernels, which build for the
same cap), ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN) and ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's BLAS). Each path
runs in a process of its own, since the caps are read when the libraries load.

Part ``decode``: per path, the machine's bound measured in the same process (1024^3 matmul GFLOP/s in the
path's dtype, memory read GB/s), then rollout tokens/s of SmolLM2-135M at 16, 64 and 256 rows (exactly 64 new
tokens per row) for each engine, alternating, median of ``--repeats``; and each engine's decode-step matmuls
alone at each width. An engine's bound is the lower of compute (2N FLOPs per token at the matmul rate) and
memory (its weights read once per step for the whole batch: 4N bytes in float32, 2N in bf16); the roofline is
measured again after the rollouts and both are kept.
  - float32 (capped): ``before`` = the transformers model in float32 (``engine.fast_decode=false``, the
    engine as it ran before the fused float32 path); ``now`` = the fused decoder on the native float32 kernels
    and the policy's own weights; ``now_bf16_weights`` = ``engine.bf16_weights=true`` on this CPU without
    native bf16: the same kernels on a bf16 copy widened in registers.
  - bf16 (uncapped, the default on a CPU with native bf16): ``now`` only (this work did not change it).
With ``--threads 1`` every time is the process's CPU time: on a machine shared with other jobs, wall times of
two threads mostly measure how often a thread waits for the other one to be scheduled again.

Part ``precision``: in the capped process, each float32-learner engine's behaviour log-probs against the
learner's own (float32) on 4 chain_sum prompts x 8 samples: mean, 99th percentile and maximum |difference|
(what the mismatch metrics and the importance-sampling correction see).

Part ``quickstart``: ``polyrl train configs/quickstart.yaml model.bf16=false engine.bf16_weights=false`` with
the caps, ``--steps`` steps (no evaluation, no time cap), median step time; runs of the code before
(``--before-tree``: a checkout of the commit before, e.g. ``git archive``; else ``engine.fast_decode=false`` in
this tree), now, and now with ``engine.bf16_weights=true`` alternate; with ``--bf16`` also the default bf16
quickstart, uncapped, for the ratio to it.

Part ``capped``: the main job itself (``configs/quickstart.yaml``: its 7.5-minute cap, held-out evaluation
before and after) in float32 with the caps: the steps it reaches and its accuracy.

    python benchmarks/avx2_path.py --part decode                # ~15 min on 2 cores
    python benchmarks/avx2_path.py --part quickstart --before-tree /tmp/before   # ~30 min

The machine is named in the JSON (model, cores, flags that matter, load averages at the start and the end of
each measurement): on a shared machine the fractions move with the load, so the ratios measured in one run are
the figures to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from doc_block import replace_block  # noqa: E402
from machine_facts import machine  # noqa: E402

CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
PATHS = {"float32_avx2": CAPS, "bf16": {}}
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "avx2_path.json"


def load_now() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------------------------------------- decode part


def rollout_rate(engine, prompt: list[int], rows: int, clock) -> float:
    """Generated tokens per second (of ``clock``) for ``rows`` samples of exactly 64 tokens, 8 per prompt."""
    stop_ids, engine.stop_ids = engine.stop_ids, set()  # fixed length: every row decodes every step
    try:
        start = clock()
        engine.generate([prompt] * (rows // 8), n=8, max_new_tokens=64, seed=0)
        return rows * 64 / (clock() - start)
    finally:
        engine.stop_ids = stop_ids


def decode_worker(path: str, rows: list[int], repeats: int, threads: int | None) -> dict:
    """Runs inside the capped (or uncapped) process: the bound, then the engines' rollouts at each width,
    alternating. With one thread every time is the process's CPU time (robust to a shared machine)."""
    import torch
    from roofline import matmul_ceiling, measure_roofline, model_numbers, prompt_ids

    from polyrl import HFEngine, keep_freed_memory, load_model, load_tokenizer, native_kernels_available, native_ops

    if threads:
        torch.set_num_threads(threads)
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    keep_freed_memory()  # as every run does
    bf16 = path == "bf16"
    dtype = "bf16" if bf16 else "fp32"
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    model = load_model("smollm2-135m-instruct", None, seed=0)
    prompt = prompt_ids(tokenizer)
    params = model_numbers(model)["params"]
    # name -> (engine, bytes of weights one decode step reads)
    if bf16:
        engines = {"now": (HFEngine(model, tokenizer, bf16=True, bf16_weights=True), 2 * params)}
    else:
        engines = {
            "before": (HFEngine(model, tokenizer, bf16=False, bf16_weights=False, fast_decode=False), 4 * params),
            "now": (HFEngine(model, tokenizer, bf16=False, bf16_weights=False), 4 * params),
            # engine.bf16_weights=true where the CPU has no native bf16: the bf16 copy widened in registers
            "now_bf16_weights": (HFEngine(model, tokenizer, bf16=False, bf16_weights=True), 2 * params),
        }
    start = {"load": load_now(), **measure_roofline(dtypes=(dtype,), clock=clock)}
    rate = start[f"matmul_gflops_{dtype}"] * 1e9
    compute = rate / (2 * params)
    widths = []
    for n in rows:
        for engine, _ in engines.values():
            engine.generate([prompt] * (n // 8), n=8, max_new_tokens=8)  # warm-up at this width
        runs: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(repeats):
            for name, (engine, _) in engines.items():
                runs[name].append(rollout_rate(engine, prompt, n, clock))
        width: dict = {"rows": n, "compute_bound_tokens_per_s": compute}
        for name, (engine, step_bytes) in engines.items():
            tok = statistics.median(runs[name])
            memory = n * start["mem_read_gbs"] * 1e9 / step_bytes
            bound = min(compute, memory)
            ceiling = matmul_ceiling(engine, n, repeats, clock) if engine.fast is not None else None
            width[name] = {
                "tokens_per_s": tok, "runs": runs[name], "step_ms": 1e3 * n / tok,
                "memory_bound_tokens_per_s": memory, "bound": "compute" if compute <= memory else "memory",
                "fraction_of_bound": tok / bound, "matmuls_alone_tokens_per_s": ceiling,
                "matmuls_alone_fraction_of_bound": ceiling / bound if ceiling else None,
            }
            print(f"{path} {n:>3} rows {name:<17} {tok:7.1f} tok/s = {tok / bound:4.0%} of the {width[name]['bound']} "
                  f"bound {bound:.0f}; matmuls alone {ceiling or 0:.0f}", flush=True)
        if "before" in engines:
            width["speedup_now"] = width["now"]["tokens_per_s"] / width["before"]["tokens_per_s"]
            width["speedup_now_bf16_weights"] = width["now_bf16_weights"]["tokens_per_s"] / width["before"][
                "tokens_per_s"]
        width["load_after"] = load_now()
        widths.append(width)
    end = {"load": load_now(), **measure_roofline(dtypes=(dtype,), clock=clock)}
    now = engines["now"][0]
    return {
        "path": path, "caps": PATHS[path], "threads": torch.get_num_threads(),
        "clock": "process CPU time (one thread)" if clock is time.process_time else "wall",
        "native_isa": native_ops().isa() if native_kernels_available() else None,
        "engines": {name: {"fused": e.fast is not None, "native": bool(e.fast and e.fast.native),
                           "dtype": str(e.fast.dtype) if e.fast else None,
                           "weight_dtype": str(e.fast.weight_dtype) if e.fast else None,
                           "weights_shared_with_policy": bool(e.fast and e.fast.shares_weights),
                           "decode_step_bytes": b} for name, (e, b) in engines.items()},
        "native_kernels_now": bool(now.fast and now.fast.native), "params": params,
        "roofline_start": start, "roofline_end": end, "widths": widths,
    }


def run_decode(args) -> dict:
    out = {}
    for path in args.paths:
        env = {**os.environ, **PATHS[path]}
        cmd = [sys.executable, __file__, "--worker", path, "--rows", *map(str, args.rows),
               "--repeats", str(args.repeats), *(["--threads", str(args.threads)] if args.threads else [])]
        res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"{path} worker failed: {res.stderr[-3000:]}")
        print(res.stdout, end="", flush=True)
        out[path] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def decode_key(args) -> str:
    return f"decode_{args.threads}_threads" if args.threads else "decode"


# ------------------------------------------------------------------------------------------- precision part


def precision_worker() -> dict:
    """In the capped process: each float32-learner engine's behaviour log-probs against the learner's own
    (float32, no autocast: ``model.bf16=false``) on 4 chain_sum prompts x 8 samples of up to 48 tokens."""
    from decode_precision import logprob_gaps, sample_prompts

    from polyrl import HFEngine, load_model, load_tokenizer

    tok, model = load_tokenizer("smollm2-135m-instruct"), load_model("smollm2-135m-instruct", None, seed=0)
    prompts = sample_prompts(tok)
    engines = {
        "before (transformers model, float32)": HFEngine(model, tok, bf16=False, bf16_weights=False, fast_decode=False),
        "now (fused, float32 kernels, the policy's weights)": HFEngine(model, tok, bf16=False, bf16_weights=False),
        "now, engine.bf16_weights=true (bf16 copy widened)": HFEngine(model, tok, bf16=False, bf16_weights=True),
    }
    results = {}
    for label, engine in engines.items():
        r = results[label] = logprob_gaps(engine, model, prompts, bf16=False)
        print(f"{label:<52} tokens {r['tokens']:>4}  mean {r['mean']:.2e}  p99 {r['p99']:.2e}  "
              f"max {r['max']:.2e}", flush=True)
    return results


def run_precision() -> dict:
    res = subprocess.run([sys.executable, __file__, "--worker", "precision"], env={**os.environ, **CAPS}, cwd=ROOT,
                         capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"precision worker failed: {res.stderr[-3000:]}")
    print(res.stdout, end="", flush=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------ quickstart part


def quickstart_run(tree: Path, env: dict, overrides: list[str]) -> dict:
    """One ``polyrl train`` of the quickstart from ``tree``; its step times."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "polyrl", "train", "configs/quickstart.yaml", *overrides, "--output", out]
        load = load_now()
        start = time.perf_counter()
        res = subprocess.run(cmd, env={**env, "PYTHONPATH": str(tree)}, cwd=tree, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"quickstart run failed in {tree}: {res.stderr[-3000:]}")
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_time_s"] for r in rows if "step_time_s" in r]
    return {"median_step_s": statistics.median(steps), "step_times_s": steps,
            "median_rollout_s": statistics.median(r["rollout_time_s"] for r in rows if "rollout_time_s" in r),
            "median_update_s": statistics.median(r["update_time_s"] for r in rows if "update_time_s" in r),
            "rollout_tokens_per_s": statistics.median(r["rollout/tokens_per_s"] for r in rows
                                                      if "rollout/tokens_per_s" in r),
            "wall_s": time.perf_counter() - start, "load_start": load, "load_end": load_now()}


def run_quickstart(args) -> dict:
    # No time cap: on a shared machine the quickstart's 7.5 minutes may end a run before its steps.
    common = ["eval.before=false", "eval.after=false", f"train.steps={args.steps}", "train.max_minutes=600",
              "logging.progress=false", "logging.report=false", "logging.tensorboard=false"]
    float32 = ["model.bf16=false", "engine.bf16_weights=false"]
    capped = {**os.environ, **CAPS}
    if args.threads:
        capped["OMP_NUM_THREADS"] = str(args.threads)
    if args.before_tree:
        before = (Path(args.before_tree), capped, common + float32)
    else:
        before = (ROOT, capped, common + float32 + ["engine.fast_decode=false"])
    variants = {"float32_avx2_before": before, "float32_avx2_now": (ROOT, capped, common + float32),
                # engine.bf16_weights=true where the CPU has no native bf16: the engine's bf16 copy, widened
                "float32_avx2_bf16_weights_now": (ROOT, capped, common + ["model.bf16=false",
                                                                          "engine.bf16_weights=true"])}
    if args.bf16:
        variants["bf16_now"] = (ROOT, dict(os.environ), common)
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for i in range(args.quickstart_repeats):
        for name, (tree, env, overrides) in variants.items():
            runs[name].append(quickstart_run(tree, env, overrides))
            r = runs[name][-1]
            print(f"quickstart {name} run {i + 1}: median step {r['median_step_s']:.2f} s (rollout "
                  f"{r['median_rollout_s']:.2f} s, update {r['median_update_s']:.2f} s), load {r['load_start']}",
                  flush=True)
    summary = {name: statistics.median(r["median_step_s"] for r in rs) for name, rs in runs.items()}
    result = {"steps": args.steps, "threads": args.threads or "torch's default",
              "before": "tree " + str(args.before_tree) if args.before_tree else "engine.fast_decode=false",
              "runs": runs, "median_step_s": summary,
              "ratio_now_to_before": summary["float32_avx2_now"] / summary["float32_avx2_before"],
              "ratio_bf16_weights_now_to_before": summary["float32_avx2_bf16_weights_now"]
              / summary["float32_avx2_before"]}
    if args.bf16:
        result["ratio_float32_now_to_bf16"] = summary["float32_avx2_now"] / summary["bf16_now"]
    print(f"quickstart median step: {summary}; now / before {result['ratio_now_to_before']:.2f}", flush=True)
    return result


def run_capped_quickstart(args) -> dict:
    """The main job as a user without native bf16 gets it: ``polyrl train configs/quickstart.yaml`` in float32
    with the caps, its own 7.5-minute cap and held-out evaluation; steps reached and accuracy before/after."""
    capped = {**os.environ, **CAPS, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as out:
        load = load_now()
        cmd = [sys.executable, "-m", "polyrl", "train", "configs/quickstart.yaml", "model.bf16=false",
               "engine.bf16_weights=false", "logging.progress=false", "--output", out]
        res = subprocess.run(cmd, env=capped, cwd=ROOT, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"capped quickstart failed: {res.stderr[-3000:]}")
        summary = json.loads((Path(out) / "summary.json").read_text())
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_time_s"] for r in rows if "step_time_s" in r]
    result = {**summary, "median_step_s": statistics.median(steps), "load_start": load, "load_end": load_now()}
    print(f"capped quickstart: {summary['steps']} steps in {summary['train_time_s'] / 60:.1f} min, held-out "
          f"{summary['eval_before']} -> {summary['eval_after']}", flush=True)
    return result


DOC = ROOT / "docs" / "results" / "avx2-path.md"


def doc_markers(out: Path) -> tuple[str, str]:
    """The block of DOC a results file writes, named after it: ``avx2-path`` for ``avx2_path.json``,
    ``avx2-path-zen5`` for ``avx2_path_zen5.json`` (another kind of machine, kept beside it)."""
    name = out.stem.replace("_", "-")
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def tables(result: dict) -> str:
    """The results as markdown: decode against the bound per path and width, the quickstart's step times, the
    capped main job; each only where it was measured."""
    m = result["machine"]
    out = [f"Machine: {m['cpu']} (family {m['cpu_family']}), {m['cores']} cores, flags {', '.join(m['flags'])}."
           + (f" {result['notes']}." if "notes" in result else "")]
    for key in (k for k in result if k.startswith("decode")):
        rows = ["", f"Decode (`{key}`: rollout tokens/s of 64-token samples, and the share of the bound: the lower "
                    "of compute at the path's matmul rate and memory for one read of the weights per step)", "",
                "| path | rows | engine | tokens/s | bound | share of bound | matmuls alone |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for path, res in result[key].items():
            for width in res["widths"]:
                for name in ("before", "now", "now_bf16_weights"):
                    if name in width:
                        w = width[name]
                        alone = f"{w['matmuls_alone_fraction_of_bound']:.0%}" if w["matmuls_alone_fraction_of_bound"] \
                            else "-"
                        rows.append(f"| {path} | {width['rows']} | {name} | {w['tokens_per_s']:.0f} | {w['bound']} | "
                                    f"{w['fraction_of_bound']:.0%} | {alone} |")
        out += rows
    for key in (k for k in result if k.startswith("quickstart")):
        q = result[key]
        out += ["", f"Quickstart step (`{key}`: {q['steps']} steps, no evaluation, median of "
                    f"{len(next(iter(q['runs'].values())))} runs each; before = {q['before']})", "",
                "| variant | median step (s) | runs |", "| --- | --- | --- |"]
        for name, runs in q["runs"].items():
            each = ", ".join(f"{r['median_step_s']:.2f}" for r in runs)
            out.append(f"| {name} | {q['median_step_s'][name]:.2f} | {each} |")
    if "capped_quickstart" in result:
        c = result["capped_quickstart"]
        before, after = (next(iter(c[k].values())) for k in ("eval_before", "eval_after"))
        out += ["", f"The main job capped to AVX2 in float32: {c['steps']} steps in {c['train_time_s'] / 60:.1f} "
                    f"minutes of training (median step {c['median_step_s']:.2f} s), held-out {before:.1%} -> "
                    f"{after:.1%}."]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["decode", "precision", "quickstart", "capped", "all"], default="all")
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--repeats", type=int, default=3, help="alternating rollout runs per width")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quickstart-repeats", type=int, default=2)
    ap.add_argument("--before-tree", type=Path, default=None, help="a checkout of the code before, for the "
                    "quickstart's before runs")
    ap.add_argument("--bf16", action="store_true", help="also run the default bf16 quickstart (uncapped)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own); with 1, "
                    "decode times are the process's CPU time, robust to other jobs on the machine")
    ap.add_argument("--worker", choices=[*PATHS, "precision"], help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--table", action="store_true", help="only write docs/results/avx2-path.md from --out")
    args = ap.parse_args()
    if args.table:
        replace_block(DOC, *doc_markers(args.out), tables(json.loads(args.out.read_text())), "Results")
        return
    if args.worker:  # inside a capped process: one JSON line last
        out = precision_worker() if args.worker == "precision" else decode_worker(args.worker, args.rows,
                                                                                   args.repeats, args.threads)
        print(json.dumps(out))
        return
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    result["machine"] = machine()
    if args.part in ("decode", "all"):
        result[decode_key(args)] = {**result.get(decode_key(args), {}), **run_decode(args)}  # other paths kept
    if args.part in ("precision", "all"):
        result["precision_float32_avx2"] = run_precision()
    if args.part in ("quickstart", "all"):
        result[f"quickstart_{args.threads}_threads" if args.threads else "quickstart"] = run_quickstart(args)
    if args.part in ("capped", "all"):
        result["capped_quickstart"] = run_capped_quickstart(args)
    result["machine"]["load_average_end"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if doc_markers(args.out)[0] in DOC.read_text():  # a results file with a block of its own; a scratch one not
        replace_block(DOC, *doc_markers(args.out), tables(result), f"Results ({args.out.name})")


if __name__ == "__main__":
    main()
