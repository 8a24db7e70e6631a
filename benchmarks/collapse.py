"""What made GSPO and CISPO collapse in benchmarks/algorithms.py: an ablation on the quickstart task.

benchmarks/algorithms.py runs gspo and cispo with two epochs per batch (so their ratios differ from 1) and
``train.steps=1000000``, which turns the quickstart's linear learning-rate decay into a constant rate. Each
variant here changes one of those settings and trains for the same number of steps from the same weights;
held-out accuracy (greedy) at the start, half-way and the end, and each step's update metrics, go to
benchmarks/results/collapse.json.

    python benchmarks/collapse.py --steps 10 --seeds 0 1
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BENCH = ["train.steps=1000000"]  # the benchmark's setting: the linear schedule never decays
GSPO = ["algorithm.loss=gspo", "algorithm.loss.agg=seq-mean-token-mean", "algorithm.loss.clip_low=3e-4",
        "algorithm.loss.clip_high=4e-4"]
CISPO = ["algorithm.loss=cispo", "algorithm.loss.clip_high=0.28"]
VARIANTS: dict[str, list[str]] = {
    "grpo, 1 epoch (as benchmarked)": [*BENCH],
    "grpo, 2 epochs": [*BENCH, "algorithm.loss.epochs=2"],
    "gspo, 2 epochs (as benchmarked)": [*BENCH, *GSPO, "algorithm.loss.epochs=2"],
    "gspo, 1 epoch": [*BENCH, *GSPO],
    "gspo, 2 epochs, half lr": [*BENCH, *GSPO, "algorithm.loss.epochs=2", "optim.lr=1.5e-5"],
    "cispo, 2 epochs (as benchmarked)": [*BENCH, *CISPO, "algorithm.loss.epochs=2"],
    "cispo, 1 epoch": [*BENCH, *CISPO],
}
PER_STEP = ("reward/mean", "clip_frac", "grad_norm", "entropy", "ratio/max", "loss/pg", "lr")


def run_variant(config: Path, overrides: list[str], steps: int, seed: int, eval_n: int,
                start: float | None = None) -> dict:
    """Train one variant for ``steps``; ``start``: the accuracy of the starting weights when already known
    (every variant starts from the same ones)."""
    from polyrl import build_run, evaluate_all, load_config, rl_step

    base = load_config(config)
    extra = ["eval.before=false", "eval.after=false", "logging.progress=false", f"train.seed={seed}"]
    extra += [f"tasks.{i}.eval_size={eval_n}" for i in range(len(base.tasks))]
    cfg = load_config(config, [*overrides, *extra])
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(cfg, Path(tmp))

        def accuracy(run) -> float:
            scores = evaluate_all(run)
            return sum(scores.values()) / len(scores)

        curve = [{"step": 0, "accuracy": accuracy(run) if start is None else start}]
        history = []
        for step in range(1, steps + 1):
            metrics, _ = rl_step(run, step)
            history.append({k: metrics.get(k) for k in PER_STEP})
            if step in (steps // 2, steps):
                curve.append({"step": step, "accuracy": accuracy(run)})
        del run
    gc.collect()
    return {"overrides": overrides, "curve": curve, "steps": history}


def _algo(base: dict, overrides: list[str]) -> dict:
    """``base`` (a dumped ``algorithm``) with the ``algorithm.*`` settings among ``overrides`` applied."""
    from polyrl import apply_override

    data = {"algorithm": copy.deepcopy(base)}
    for o in overrides:
        if o.startswith("algorithm."):
            apply_override(data, o)
    return data["algorithm"]


def probe(config: Path, seed: int, batches: int, on_result: Callable[[dict], None] | None = None) -> dict:
    """How far one update moves the policy, per variant, on the same sampled batches from the same weights:
    the mean over the batch's tokens of r - 1 - log r with r = pi_before(y_t) / pi_after(y_t) (a k3-form
    divergence, 0 when nothing moved; stored as ``kl_before_after``), the update's clip fraction and
    gradient norm. No held-out evaluation: one update each, from a fresh optimizer."""
    import torch

    from polyrl import (
        AlgorithmConfig,
        Learner,
        build_run,
        collate,
        kl_estimate,
        load_config,
        model_bf16,
        produce_batch,
        token_logprobs,
    )

    cfg = load_config(config, [*BENCH, "eval.before=false", "eval.after=false", "logging.progress=false",
                               f"train.seed={seed}"])
    out: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(cfg, Path(tmp))
        start = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
        for b in range(1, batches + 1):
            trajs = produce_batch(run, b).groups.kept
            batch = collate(sorted(trajs, key=lambda t: t.prompt_len), run.learner.pad_id)
            with torch.no_grad():
                before, _ = token_logprobs(run.model, batch, cfg.rollout.temperature, model_bf16(cfg))
            for name, overrides in VARIANTS.items():
                run.model.load_state_dict(start)
                algo = AlgorithmConfig(**_algo(cfg.algorithm.model_dump(), overrides))
                learner = Learner(run.model, algo, cfg.optim, cfg.rollout.temperature, model_bf16(cfg),
                                  run.learner.pad_id, total_steps=1_000_000)
                m = learner.update(trajs)
                with torch.no_grad():
                    after, _ = token_logprobs(run.model, batch, cfg.rollout.temperature, model_bf16(cfg))
                mask = batch.loss_mask > 0
                kl = float(kl_estimate(after, before, "k3")[mask].mean())  # log r = before - after
                out.setdefault(name, []).append({"kl_before_after": kl, "clip_frac": m.get("clip_frac"),
                                                 "grad_norm": m.get("grad_norm")})
                print(f"batch {b} {name}: KL {kl:.5f} clip_frac {m.get('clip_frac'):.3f}", flush=True)
                if on_result is not None:
                    on_result(out)
            run.model.load_state_dict(start)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--eval-n", type=int, default=100)
    p.add_argument("--only", nargs="*", choices=list(VARIANTS))
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "collapse.json")
    p.add_argument("--probe", type=int, default=0, metavar="BATCHES",
                   help="instead of training: one update per variant on each of BATCHES sampled batches")
    args = p.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    results = {"config": str(args.config.relative_to(ROOT)), "steps": args.steps, "eval_n": args.eval_n,
               "machine": cpu, "date": time.strftime("%Y-%m-%d"), "variants": {}}
    starts: dict[int, float] = {}
    if args.probe:
        path = args.json.with_name(args.json.stem + "_probe.json")

        def save(rows: dict) -> None:  # after every variant: a partial probe survives
            path.write_text(json.dumps({**results, "probe": rows}, indent=2))

        probe(args.config, args.seeds[0], args.probe, save)
        return
    for name in args.only or list(VARIANTS):
        for seed in args.seeds:
            t0 = time.perf_counter()
            res = run_variant(args.config, VARIANTS[name], args.steps, seed, args.eval_n, starts.get(seed))
            starts[seed] = res["curve"][0]["accuracy"]
            results["variants"].setdefault(name, {})[str(seed)] = res
            accs = " -> ".join(f"{100 * c['accuracy']:.0f}%" for c in res["curve"])
            print(f"{name}, seed {seed}: {accs} ({time.perf_counter() - t0:.0f}s)", flush=True)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2))  # after every run: a partial result survives


if __name__ == "__main__":
    main()
