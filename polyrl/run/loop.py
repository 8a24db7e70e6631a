"""The training loop: build the run, resume from its checkpoint, evaluate, step through the chosen runtime
(``runtime.kind``: local ``rl_step``, async or Ray), log, checkpoint, evaluate again, write the summary."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from polyrl.checkpoint import faults
from polyrl.checkpoint.sharded import is_sharded, load_sharded, save_sharded
from polyrl.checkpoint.store import checkpoint_to_resume, load_checkpoint, save_checkpoint
from polyrl.config import Config, dump_config
from polyrl.data.items import DatasetSource
from polyrl.envs.reward_audit import audit_tasks
from polyrl.models.device import resolve_device
from polyrl.models.loading import TINY_ALIAS, load_tokenizer, resolve_model_path
from polyrl.observe.metrics import TrajectoryWriter, open_metrics_logger
from polyrl.observe.progress import TrainProgress
from polyrl.observe.report import write_report_safely
from polyrl.parallel.fsdp import gather_into
from polyrl.parallel.group import RankFailedError, all_reduce_max, join_group, leave_group
from polyrl.parallel.launch import launch_ranks
from polyrl.plan import Ranks, RunPlan, resolve_plan
from polyrl.runtime import make_stepper
from polyrl.runtime.ray_ranks import train_on_ray_ranks
from polyrl.runtime.stepper import load_producer_state
from polyrl.train.step import NonFiniteError, Run, build_run, evaluate_all


def _write_json(path: Path, data: dict, writer: bool = True) -> None:
    if not writer:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def train(config: Config, run_dir: Path, resume: bool = False, log=print,
          plan: RunPlan | None = None) -> dict[str, Any]:
    """Run (or resume) training into ``run_dir``; returns the summary written to summary.json. With
    ``learner.world_size`` > 1 this starts the ranks (or, started by torchrun, joins them); every rank runs
    this loop, rank 0 writes the run's files. The run's shape (``plan``, a launched rank's) is resolved here
    once and handed to everything that reads it."""
    if plan is None:
        world = config.learner.world_size
        if world > 1 and "RANK" not in os.environ:
            return _train_on_ranks(config, run_dir, resume)  # each rank resolves its plan once it has joined
        plan = resolve_plan(config, _join(config) if world > 1 else Ranks())  # world > 1: started by torchrun
    ranks = plan.ranks
    wall0 = time.perf_counter()
    if not ranks.is_main:
        log = _quiet
    run = build_run(config, run_dir, plan)
    for task in run.tasks.values():
        if isinstance(task.source, DatasetSource):
            log(task.source.describe())
    audit_tasks(run.tasks, log)  # a broken reward stops the run here, before anything is written
    run_dir.mkdir(parents=True, exist_ok=True)
    if ranks.is_main:
        (run_dir / "config.yaml").write_text(dump_config(config))
    summary_path = run_dir / "summary.json"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if resume and summary_path.exists() else {}

    start, train_time = 0, 0.0
    ckpt = checkpoint_to_resume(run_dir, ranks.is_main, log) if resume else None
    if ckpt is not None:
        state = _restore(run, ckpt)
        load_producer_state(run, state)
        start, train_time = state["step"], state["train_time_s"]
        log(f"resumed from {ckpt} (step {start})")

    if config.eval.before and "eval_before" not in summary:
        faults.point("eval_before", 0)
        summary["eval_before"] = evaluate_all(run)
        log(f"eval before: {json.dumps(summary['eval_before'])}")
        _write_json(summary_path, summary, ranks.is_main)

    def checkpoint(step: int) -> None:
        _save(run, step, {**stepper.producer_state(), "train_time_s": train_time})

    resume_step = start if ckpt is not None else None
    logger = open_metrics_logger(config, run_dir, resume_step) if ranks.is_main else _Discard()
    samples = TrajectoryWriter(run_dir, config.logging.trajectories_per_group if ranks.is_main else 0, resume_step)
    step, skipped_in_row = start, 0
    budget_s = config.train.max_minutes * 60 if config.train.max_minutes else float("inf")
    stepper = make_stepper(run, start)  # runtime.kind: local (rl_step), async or ray
    try:
        with TrainProgress(config.train.steps, config.logging.progress and ranks.is_main, start) as progress:
            while step < config.train.last_step and train_time < budget_s:
                step += 1
                metrics, trajectories = stepper.step(step)
                # The slowest rank's time, so every rank's time budget ends at the same step.
                metrics["step_time_s"] = all_reduce_max(ranks, metrics["step_time_s"])
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
        stepper.close()
        logger.close()
        samples.close()
    already_saved = config.train.checkpoint_every and step % config.train.checkpoint_every == 0 and step > start
    if (ckpt is None or step > start) and not already_saved:
        checkpoint(step)

    if config.eval.after:
        faults.point("eval_after", step)
        summary["eval_after"] = evaluate_all(run)
        log(f"eval after:  {json.dumps(summary['eval_after'])}")
    if "eval_before" in summary and "eval_after" in summary:
        summary["gain"] = {k: summary["eval_after"][k] - summary["eval_before"][k] for k in summary["eval_after"]}
    summary.update(
        steps=step, train_time_s=train_time, wall_time_s=summary.get("wall_time_s", 0.0) + time.perf_counter() - wall0
    )
    _write_json(summary_path, summary, ranks.is_main)
    if config.logging.report and ranks.is_main:
        faults.point("report", step)
        write_report_safely(run_dir, log)
    return summary


def _save(run: Run, step: int, state: dict[str, Any]) -> None:
    """Checkpoint ``step``: in one process an HF directory with the optimizer beside it; under several ranks
    every rank writes its shards (``checkpoint/sharded.py``), which resume at any world size."""
    keep = run.config.train.keep_checkpoints
    if not run.plan.ranks.distributed:
        save_checkpoint(run.run_dir, step, run.model, run.tokenizer, run.learner.state_dict(), state, keep=keep)
        return
    learner = run.learner
    extra = {"step": step, **state, "learner": {"scheduler": learner.scheduler.state_dict(), **learner.own_state()}}
    save_sharded(run.run_dir / "checkpoints" / f"step-{step}", learner.policy_pass, learner.optimizer, extra,
                 tokenizer=run.tokenizer, keep=keep)


def _restore(run: Run, ckpt: Path) -> dict[str, Any]:
    """Load ``ckpt`` (either kind) into the policy, learner and engine; returns the trainer state."""
    learner = run.learner
    if is_sharded(ckpt):
        state = load_sharded(ckpt, learner.policy_pass, learner.optimizer)
        learner.scheduler.load_state_dict(state["learner"]["scheduler"])
        learner.load_own_state(state["learner"])
        if run.engine_model is not run.model:
            gather_into(run.model, run.engine_model, trainable_only=learner.is_lora)
    elif run.plan.ranks.distributed:
        raise ValueError(f"{ckpt}: saved by one process; resume it with learner.world_size: 1")
    else:
        optimizer_state, state = load_checkpoint(ckpt, run.model)
        learner.load_state_dict(optimizer_state)
    run.engine.sync()
    return state


def _train_on_ranks(config: Config, run_dir: Path, resume: bool) -> dict[str, Any]:
    """Start ``learner.world_size`` ranks on this machine, each running ``train``; rank 0's summary."""
    load_tokenizer(config.model.name)  # the bundled model is converted once, before ranks race for it
    if config.model.name != TINY_ALIAS:
        resolve_model_path(config.model.name)
    if config.runtime.kind == "ray":
        train_on_ray_ranks(config, run_dir, _rank_train, resume)
    else:
        launch_ranks(config.learner.world_size, resolve_device(config.train.device), _rank_train, config, run_dir,
                     resume)
    return json.loads((run_dir / "summary.json").read_text())


def _rank_train(config: Config, run_dir: Path, resume: bool) -> None:
    ranks = _join(config)
    try:  # the plan after joining: on a GPU, the device is the joined rank's
        train(config, run_dir, resume, log=_to_stderr, plan=resolve_plan(config, ranks))
    finally:
        leave_group()


def _join(config: Config) -> Ranks:
    """Join the learners' group; this process's ranks, for its plan. The device is resolved here before the plan
    exists: its type picks the backend, and on a GPU joining selects the rank's own device."""
    faults.point("join", 0)  # fail-fast tests: a rank that hangs before it joins
    ranks = join_group(config.learner.backend, config.learner.timeout_s, resolve_device(config.train.device))
    if ranks.world_size != config.learner.world_size:
        raise RankFailedError(f"learner.world_size is {config.learner.world_size}, but the launcher started "
                              f"{ranks.world_size} ranks (WORLD_SIZE)")
    return ranks


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _quiet(message: str) -> None:
    """Ranks other than 0 keep quiet: rank 0 says everything once."""


class _Discard:
    """The metrics sink of ranks other than 0."""

    def write(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass
