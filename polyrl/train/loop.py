"""The RL loop. ``rl_step`` is one step of the diagram in docs/ARCHITECTURE.md:
sample tasks -> roll out -> score -> advantages -> loss -> update -> sync weights -> log."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

import torch

from polyrl.algorithms.shaping import assign_advantages, shape_rewards
from polyrl.config import Config, dump_config
from polyrl.data.dynamic_sampling import dynamic_sample
from polyrl.data.sampler import TaskSampler
from polyrl.engines.hf import HFEngine
from polyrl.envs.base import Task, make_task
from polyrl.models.loading import load_model, load_tokenizer
from polyrl.observe.metrics import TrajectoryWriter, open_metrics_logger
from polyrl.observe.progress import TrainProgress
from polyrl.observe.report import write_report_safely
from polyrl.rollout.multi_turn import evaluate, rollout, rollout_metrics
from polyrl.train import faults
from polyrl.train.checkpoint import latest_checkpoint, load_checkpoint, remove_partial_saves, save_checkpoint
from polyrl.train.learner import Learner
from polyrl.train.teachers import load_teachers
from polyrl.types import Trajectory


class NonFiniteError(RuntimeError):
    """Training produced NaN/inf too many times in a row."""


@dataclass
class Run:
    """Everything one training run holds; built once by ``build_run``."""

    config: Config
    run_dir: Path
    model: Any
    tokenizer: Any
    tasks: dict[str, Task]
    engine: HFEngine
    learner: Learner
    sampler: TaskSampler


def build_run(config: Config, run_dir: Path) -> Run:
    torch.manual_seed(config.train.seed)
    tokenizer = load_tokenizer(config.model.name)
    model = load_model(config.model.name, config.model.lora, seed=config.train.seed)
    tasks = {
        t.name: make_task(t, config.train.seed, config.model.system_prompt, tokenizer) for t in config.tasks
    }
    engine = HFEngine(model, tokenizer, bf16=config.model.bf16, bf16_weights=config.engine.bf16_weights)
    learner = Learner(
        model, config.algorithm, config.optim, config.rollout.temperature, config.model.bf16, engine.pad_id,
        total_steps=config.train.steps, teachers=load_teachers(config, model),
    )
    sampler = TaskSampler({t.name: t.weight for t in config.tasks}, seed=config.train.seed)
    return Run(config, run_dir, model, tokenizer, tasks, engine, learner, sampler)


def _sample_round(run: Run, step: int, round_index: int, n_prompts: int, first_id: int) -> list[Trajectory]:
    """Draw ``n_prompts`` tasks, roll out and score a group each (the sampling policy is version step - 1)."""
    cfg = run.config
    draws = run.sampler.draw(step, n_prompts, round_index)
    requests = [(run.tasks[d.task], d.index, run.tasks[d.task].train_item(d.index)) for d in draws]
    # Round 0 keeps the step's seed; extra dynamic-sampling rounds need fresh samples, so fresh seeds.
    seed = cfg.train.seed * 1_000_003 + step + round_index * 1_000_000_007
    return rollout(
        run.engine, requests, cfg.rollout.group_size, cfg.rollout.max_new_tokens, cfg.rollout.temperature,
        cfg.rollout.top_p, seed=seed, version=step - 1, first_group_id=first_id,
    )


def rl_step(run: Run, step: int) -> tuple[dict[str, float], list[Trajectory]]:
    """One synchronous RL step; returns the step's metrics and the scored trajectories it trained on."""
    cfg, algo, t0 = run.config, run.config.algorithm, time.perf_counter()
    faults.point("rollout", step)
    # 1. sample tasks, 2. roll out and 3. score; DAPO dynamic sampling swaps zero-variance groups for new ones
    batch = dynamic_sample(
        lambda k, n, first_id: _sample_round(run, step, k, n, first_id),
        cfg.rollout.prompts_per_step, algo.dynamic_sampling, algo.max_extra_rounds,
    )
    sampled, trajectories = batch.sampled, batch.kept
    t_rollout = time.perf_counter() - t0
    # 4. reward shaping and advantages
    shaping = shape_rewards(sampled, algo, cfg.rollout.max_new_tokens)
    assign_advantages(trajectories, algo)
    # 5. loss and 6. update
    t1 = time.perf_counter()
    faults.point("update", step)
    update = run.learner.update(trajectories)
    # 7. sync weights into the engine
    run.engine.sync()
    t_update = time.perf_counter() - t1
    # 8. log (reward and length over everything sampled: the policy's performance, not the filtered batch)
    step_time = time.perf_counter() - t0
    generated = sum(t.num_model_tokens for t in sampled)
    metrics: dict[str, Any] = {
        "reward/mean": mean(t.reward for t in sampled),
        **{f"reward/{name}": mean(t.reward for t in sampled if t.task == name)
           for name in sorted({t.task for t in sampled})},
        **shaping,
        "response_length/mean": generated / len(sampled),
        "truncated_frac": mean(float(t.truncated) for t in sampled),
        **rollout_metrics(sampled),
        "zero_variance_groups": batch.zero_variance_groups,
        **batch.metrics(),
        **update,
        "tokens_per_s": generated / step_time,
        "rollout/tokens_per_s": generated / t_rollout,
        "train/tokens_per_s": sum(len(t.input_ids) for t in trajectories) / t_update,
        "rollout_time_s": t_rollout,
        "update_time_s": t_update,
        "step_time_s": step_time,
    }
    return metrics, trajectories


def evaluate_all(run: Run) -> dict[str, float]:
    """Greedy held-out accuracy per task, on the policy's own weights (no bf16 copy unless eval.bf16)."""
    cfg = run.config
    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    engine = run.engine if cfg.eval.bf16 else HFEngine(run.model, run.tokenizer, bf16=False)
    return {
        name: evaluate(engine, task, task.config.eval_size, max_new, cfg.eval.batch_size)["accuracy"]
        for name, task in run.tasks.items()
    }


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def train(config: Config, run_dir: Path, resume: bool = False, log=print) -> dict[str, Any]:
    """Run (or resume) training into ``run_dir``; returns the summary written to summary.json."""
    wall0 = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    run = build_run(config, run_dir)
    summary_path = run_dir / "summary.json"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if resume and summary_path.exists() else {}

    start, train_time = 0, 0.0
    ckpt = latest_checkpoint(run_dir) if resume else None
    if resume:
        remove_partial_saves(run_dir)  # temp dirs of saves killed before their rename
    if resume and ckpt is None:
        log(f"{run_dir}: no usable checkpoint to resume from; starting from step 0")
    if ckpt is not None:
        optimizer_state, state = load_checkpoint(ckpt, run.model)
        run.engine.sync()
        run.learner.load_state_dict(optimizer_state)
        run.sampler.load_state_dict(state["sampler"])
        start, train_time = state["step"], state["train_time_s"]
        log(f"resumed from {ckpt} (step {start})")

    if config.eval.before and "eval_before" not in summary:
        summary["eval_before"] = evaluate_all(run)
        log(f"eval before: {json.dumps(summary['eval_before'])}")
        _write_json(summary_path, summary)

    def checkpoint(step: int) -> None:
        save_checkpoint(
            run_dir, step, run.model, run.tokenizer,
            run.learner.state_dict(),
            {"sampler": run.sampler.state_dict(), "train_time_s": train_time},
            keep=config.train.keep_checkpoints,
        )

    resume_step = start if ckpt is not None else None
    logger = open_metrics_logger(config, run_dir, resume_step)
    samples = TrajectoryWriter(run_dir, config.logging.trajectories_per_group, resume_step)
    step, skipped_in_row = start, 0
    budget_s = config.train.max_minutes * 60 if config.train.max_minutes else float("inf")
    try:
        with TrainProgress(config.train.steps, config.logging.progress, start) as progress:
            while step < config.train.steps and train_time < budget_s:
                step += 1
                metrics, trajectories = rl_step(run, step)
                train_time += metrics["step_time_s"]
                metrics["train_time_s"] = train_time
                metrics.update({f"task_ratio/{k}": v for k, v in run.sampler.realised_ratio().items()})
                logger.write(step, metrics)
                samples.write(step, trajectories)
                faults.point("logged", step)
                progress.update(step, metrics)
                skipped_in_row = skipped_in_row + 1 if metrics["skipped_updates"] else 0
                if skipped_in_row >= config.train.max_skipped_updates:
                    raise NonFiniteError(
                        f"{skipped_in_row} updates in a row had NaN/inf loss or gradients (step {step}); "
                        f"stopping. The last good checkpoint is in {run_dir / 'checkpoints'}"
                    )
                if config.train.checkpoint_every and step % config.train.checkpoint_every == 0:
                    checkpoint(step)
    finally:
        logger.close()
        samples.close()
    already_saved = config.train.checkpoint_every and step % config.train.checkpoint_every == 0 and step > start
    if (ckpt is None or step > start) and not already_saved:
        checkpoint(step)

    if config.eval.after:
        summary["eval_after"] = evaluate_all(run)
        log(f"eval after:  {json.dumps(summary['eval_after'])}")
    if "eval_before" in summary and "eval_after" in summary:
        summary["gain"] = {k: summary["eval_after"][k] - summary["eval_before"][k] for k in summary["eval_after"]}
    summary.update(
        steps=step, train_time_s=train_time, wall_time_s=summary.get("wall_time_s", 0.0) + time.perf_counter() - wall0
    )
    _write_json(summary_path, summary)
    if config.logging.report:
        write_report_safely(run_dir, log)
    return summary
