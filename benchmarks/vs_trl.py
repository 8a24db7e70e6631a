"""TRL's GRPOTrainer and polyrl side by side on reasoning-gym chain_sum with SmolLM2-135M-Instruct.

Both train the same model on the same prompt stream (question + " Answer with just the number."), 2 prompts x 8
samples per step, at most 64 new tokens, temperature 1, the same reward (reasoning-gym's scorer on the last number
of the reply), the same LoRA setting, each in its own process for the same training-time budget. Snapshots are
saved at fixed training-time points (saving is not counted) and all are evaluated afterwards by one evaluator:
greedy, 200 held-out items, accuracy = fraction fully correct.

    pip install -e ".[bench]"
    python benchmarks/vs_trl.py --minutes 7.5            # ~25 min in all on a 2-core CPU
    python benchmarks/vs_trl.py --minutes 1 --eval-n 50  # a quick look

Writes benchmarks/results/vs_trl.json and docs/vs_trl.png and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
BAR = 0.745  # TRL's 15-minute result on this setup, the accuracy polyrl must reach in half the time


def _task(eval_n: int = 200):
    from polyrl import load_config, make_task

    cfg = load_config(QUICKSTART)
    task_cfg = cfg.tasks[0].model_copy(update={"eval_size": eval_n})
    return make_task(task_cfg, cfg.train.seed)  # the quickstart's reasoning_gym task


class Snapshots:
    """Training-time clock that excludes snapshot saving, and the list of saved snapshots."""

    def __init__(self, out: Path, minutes: float, points: int) -> None:
        self.out, self.budget = out, minutes * 60
        self.due = [self.budget * (i + 1) / points for i in range(points)]
        self.saved: list[dict] = []
        self.step_times: list[float] = []
        self.train_time = 0.0

    def after_step(self, seconds: float, save) -> bool:
        """Record one step; save a snapshot when one is due; True when the budget is spent."""
        self.step_times.append(seconds)
        self.train_time += seconds
        while self.due and self.train_time >= self.due[0] - 1e-9:
            self.due.pop(0)
            self._snapshot(save)
        return self.train_time >= self.budget

    def finish(self, save) -> None:
        """Training ended before the budget (its schedule ran out): snapshot the final weights now."""
        if self.due:
            self.due.clear()
            if not self.saved or self.saved[-1]["step"] != len(self.step_times):  # not saved at this step yet
                self._snapshot(save)

    def _snapshot(self, save) -> None:
        path = self.out / f"snapshot-{len(self.saved) + 1}"
        save(path)
        self.saved.append({"train_time_s": self.train_time, "step": len(self.step_times), "path": str(path)})

    def result(self) -> dict:
        return {"steps": len(self.step_times), "step_times": self.step_times, "snapshots": self.saved}


def worker_polyrl(args) -> dict:
    import torch

    from polyrl import build_run, load_config, rl_step

    torch.manual_seed(args.seed)
    overrides = ["eval.before=false", "eval.after=false", "logging.progress=false", f"train.seed={args.seed}"]
    if args.like_for_like:  # TRL GRPOConfig's algorithm: one sampling round, no guidance, clip 0.2 both ways, its Adam
        overrides += ["algorithm.sampling.dynamic=false", "guidance.reference=false", "algorithm.loss.clip_high=0.2",
                      "optim.betas=[0.9,0.999]",
                      "train.steps=90"]  # the schedule these arms were measured with (the recipe's is longer)
    if args.polyrl_lr is not None:
        overrides.append(f"optim.lr={args.polyrl_lr}")
    if args.polyrl_fp32:
        overrides += ["model.bf16=false", "engine.bf16_weights=false"]
    if args.lora:
        overrides += ["model.lora={r: 16, alpha: 32}"]
    if args.no_dynamic_sampling:
        overrides += ["algorithm.sampling.dynamic=false"]
    cfg = load_config(QUICKSTART, overrides)
    out = Path(args.out) / "polyrl"
    run = build_run(cfg, out)
    clock = Snapshots(out, args.minutes, args.points)

    def save(path: Path) -> None:
        run.model.save_pretrained(path)
        run.tokenizer.save_pretrained(path)

    # The config's schedule ends at train.steps (the lr reaches 0 there), as `polyrl train` does.
    for step in range(1, cfg.train.steps + 1):
        metrics, _ = rl_step(run, step)
        if clock.after_step(metrics["step_time_s"], save):
            break
    clock.finish(save)
    return clock.result()


def worker_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from polyrl import smollm2_dir

    torch.manual_seed(args.seed)
    task = _task()
    rows = []
    for i in range(4000):  # the same item stream polyrl reads (its training items 0, 1, 2, ...)
        item = task.train_item(i)
        rows.append({"prompt": task.messages(item), "index": i})
    dataset = Dataset.from_list(rows)

    def reward(completions, index, **_):
        return [
            task.score(task.train_item(i), c[0]["content"]) for c, i in zip(completions, index, strict=True)
        ]

    out = Path(args.out) / "trl"
    clock = Snapshots(out, args.minutes, args.points)
    model_dir = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, _args, _state, control, model=None, **__):
            def save(path: Path) -> None:
                model.save_pretrained(path)
                tokenizer.save_pretrained(path)

            if clock.after_step(time.perf_counter() - self.t0, save):
                control.should_training_stop = True

    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        learning_rate=args.trl_lr,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=64,
        temperature=1.0,
        # Without --trl-decay-steps TRL's linear schedule spans 100,000 steps: in effect a constant rate.
        max_steps=args.trl_decay_steps or 100_000,
        bf16=not args.trl_fp32,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[Clock()],
    )
    trainer.train()

    def save_final(path: Path) -> None:
        trainer.model.save_pretrained(path)
        tokenizer.save_pretrained(path)

    clock.finish(save_final)  # the schedule (--trl-decay-steps) ended before the budget: the final weights count
    return clock.result()


def evaluate_dir(path: str | None, eval_n: int) -> float:
    from polyrl import SMOLLM2_ALIAS, HFEngine, evaluate, load_model, load_tokenizer

    name = path or SMOLLM2_ALIAS
    engine = HFEngine(load_model(name), load_tokenizer(SMOLLM2_ALIAS), bf16=False)
    return evaluate(engine, _task(eval_n), eval_n, max_new_tokens=64)["accuracy"]


def _spawn(kind: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, *sys.argv[1:]]
    subprocess.run(cmd, check=True)
    return json.loads((Path(args.out) / kind / "result.json").read_text())


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for kind, res in results["frameworks"].items():
        xs = [0.0] + [s["train_time_s"] / 60 for s in res["snapshots"]]
        ys = [results["accuracy_before"]] + [s["accuracy"] for s in res["snapshots"]]
        ax.plot(xs, [100 * y for y in ys], marker="o", label=kind)
    ax.axhline(100 * BAR, color="grey", linestyle=":", label=f"bar {100 * BAR:.1f}%")
    ax.set_xlabel("training time (min, evaluation excluded)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title("GRPO on chain_sum, SmolLM2-135M, 2-core CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=7.5, help="training-time budget per framework")
    p.add_argument("--points", type=int, default=5, help="snapshots per run, evenly spaced in training time")
    p.add_argument("--eval-n", type=int, default=200)
    p.add_argument("--polyrl-lr", type=float, default=None, help="default: the quickstart's (and its schedule)")
    p.add_argument("--trl-lr", type=float, default=5e-6, help="the learning rate of TRL's measured bar")
    p.add_argument("--lora", action="store_true", help="LoRA r=16 on all linear layers for both")
    p.add_argument("--only", choices=["both", "polyrl", "trl"], default="both")
    p.add_argument("--no-dynamic-sampling", action="store_true",
                   help="polyrl without DAPO's extra sampling rounds: the same work per step as TRL's")
    p.add_argument("--seed", type=int, default=0, help="both sides' seed (polyrl's train.seed, TRL's seed)")
    p.add_argument("--trl-decay-steps", type=int, default=None,
                   help="TRL's linear schedule reaches 0 at this step (as polyrl's does at train.steps); set it to "
                        "the steps TRL takes in --minutes")
    p.add_argument("--trl-fp32", action="store_true", help="TRL in float32 (its default is bf16 autocast)")
    p.add_argument("--polyrl-fp32", action="store_true", help="polyrl in float32 (model.bf16 and "
                   "engine.bf16_weights false), as on a CPU without native bf16")
    p.add_argument("--like-for-like", action="store_true",
                   help="polyrl with TRL's algorithm: no dynamic sampling or guidance, clip 0.2, Adam betas "
                        "(0.9, 0.999); give both the same learning rate")
    p.add_argument("--tag", default="", help="write vs_trl_TAG.json and no plot (side runs beside the main one)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vs_trl_runs"))
    p.add_argument("--worker", choices=["polyrl", "trl"], help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        res = worker_polyrl(args) if args.worker == "polyrl" else worker_trl(args)
        (Path(args.out) / args.worker).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / args.worker / "result.json").write_text(json.dumps(res))
        return

    kinds = ["polyrl", "trl"] if args.only == "both" else [args.only]
    runs = {kind: _spawn(kind, args) for kind in kinds}
    out = ROOT / "benchmarks" / "results"
    result_file = out / (f"vs_trl_{args.tag}.json" if args.tag else "vs_trl.json")
    previous = json.loads(result_file.read_text()) if result_file.exists() else {}
    results = {
        "settings": {k: v for k, v in vars(args).items() if k != "worker"},
        "accuracy_before": evaluate_dir(None, args.eval_n),
        "frameworks": {},
    }
    for kind, res in runs.items():
        for snap in res["snapshots"]:
            snap["accuracy"] = evaluate_dir(snap["path"], args.eval_n)
        reach = next((s["train_time_s"] for s in res["snapshots"] if s["accuracy"] >= BAR), None)
        results["frameworks"][kind] = {
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "steps": res["steps"],
            "median_step_s": statistics.median(res["step_times"]),
            "final_accuracy": res["snapshots"][-1]["accuracy"] if res["snapshots"] else None,
            "minutes_to_bar": None if reach is None else reach / 60,
            "snapshots": [{k: s[k] for k in ("train_time_s", "step", "accuracy")} for s in res["snapshots"]],
        }
    if args.only != "both":  # one framework re-run: keep the other's last measurement beside it
        for kind, res in previous.get("frameworks", {}).items():
            results["frameworks"].setdefault(kind, res)
    out.mkdir(parents=True, exist_ok=True)
    result_file.write_text(json.dumps(results, indent=2))
    if not args.tag:
        _plot(results, ROOT / "docs" / "vs_trl.png")

    print(f"held-out accuracy before training: {100 * results['accuracy_before']:.1f}%")
    print(f"{'framework':<10}{'steps':>7}{'s/step':>9}{'final acc':>11}{'min to 74.5%':>14}")
    for kind, r in results["frameworks"].items():
        reach = "-" if r["minutes_to_bar"] is None else f"{r['minutes_to_bar']:.2f}"
        print(
            f"{kind:<10}{r['steps']:>7}{r['median_step_s']:>9.2f}{100 * r['final_accuracy']:>10.1f}%{reach:>14}"
        )
    fw = results["frameworks"]
    if "trl" in fw and "polyrl" in fw:
        print(
            f"step-time ratio TRL / polyrl: {fw['trl']['median_step_s'] / fw['polyrl']['median_step_s']:.2f}x"
        )
    for kind, r in fw.items():
        curve = ", ".join(
            f"{s['train_time_s'] / 60:.1f}min {100 * s['accuracy']:.1f}%" for s in r["snapshots"]
        )
        print(f"{kind} accuracy vs training time: {curve}")


if __name__ == "__main__":
    main()
