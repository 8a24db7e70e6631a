"""One RL step, in two halves that every runtime composes: ``produce_batch`` (sample tasks -> roll out ->
score -> advantages) and ``learn_batch`` (loss -> update -> sync weights), plus ``build_run``, which builds what
a run holds, and ``rl_step``, the synchronous step of the diagram in docs/ARCHITECTURE.md. The local loop
(``train/loop.py``) and the async and Ray runtimes (``polyrl/runtime/``) all call these."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

import torch

from polyrl.algorithms.reward_shaping import shape_rewards
from polyrl.config import Config
from polyrl.data.dynamic_sampling import Sampled, dynamic_sample
from polyrl.data.sampler import TaskSampler
from polyrl.endpoint.rollout import evaluate_agent
from polyrl.engines import make_engine
from polyrl.engines.hf import HFEngine
from polyrl.envs.agent import AgentTask
from polyrl.envs.base import Task, env_name, make_task
from polyrl.models.device import resolve_device
from polyrl.models.loading import holds_bf16_weights, load_model, load_tokenizer
from polyrl.parallel.fsdp import gather_into
from polyrl.parallel.group import SHARD_SEED_STRIDE, all_gather_objects, contiguous_shards, current
from polyrl.rewards.monitors import RewardMonitor, monitor_kind, monitor_metrics
from polyrl.rollout.multi_turn import evaluate, rollout_metrics
from polyrl.rollout.policy_chat import EnginePolicy
from polyrl.train import faults
from polyrl.train.advantage_stage import assign_advantages
from polyrl.train.agents import AgentFeatures
from polyrl.train.glibc_malloc import keep_freed_memory
from polyrl.train.learner import Learner
from polyrl.train.multitask import MultiTask
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
    """The policy the learner trains (sharded over the ranks under ``learner.world_size`` > 1)."""
    engine_model: Any
    """The whole policy the engine samples from and evaluation reads: ``model`` itself in one process, an
    unsharded copy refreshed after each update under a sharded learner."""
    tokenizer: Any
    tasks: dict[str, Task]
    engine: HFEngine
    learner: Learner
    sampler: TaskSampler
    agents: AgentFeatures
    multitask: MultiTask | None = None
    monitor: RewardMonitor | None = None
    """Reward-hacking monitors (``monitors``), when on and some task has checks."""


def load_policy(config: Config) -> tuple[Any, Any]:
    """The tokenizer and the policy model of ``config`` (LoRA, bf16 storage and attention as configured),
    seeded, with the allocator set up first; RL (``build_run``) and SFT runs start here."""
    if config.runtime.keep_freed_memory:  # before the model's weights: every process of a run builds one here
        keep_freed_memory()
    torch.manual_seed(config.train.seed)
    tokenizer = load_tokenizer(config.model.name)
    model = load_model(
        config.model.name, config.model.lora, seed=config.train.seed, bf16=config.model.bf16,
        float32_attention=config.model.float32_attention, device=resolve_device(config.train.device),
    )
    return tokenizer, model


def build_run(config: Config, run_dir: Path) -> Run:
    """Load the model and tokenizer, build the tasks, the engine, the learner and the sampler of ``config``."""
    tokenizer, model = load_policy(config)
    # Each rank samples its share of a step's groups with the whole weights (copied before sharding).
    engine_model = copy.deepcopy(model) if current().distributed else model
    engine = make_engine(config, engine_model, tokenizer)  # engine.kind: hf, or vllm (optional extra)
    r = config.rollout  # self-play envs (textarena opponent: self) sample the other seat from the engine too
    policy = EnginePolicy(engine, r.max_new_tokens, r.temperature, r.top_p)
    tasks = {
        t.name: make_task(t, config.train.seed, config.model.system_prompt, tokenizer, policy) for t in config.tasks
    }
    learner = Learner(
        model, config.algorithm, config.optim, config.rollout.temperature, config.model.bf16, engine.pad_id,
        total_steps=config.train.steps, teachers=load_teachers(config, engine_model), sharding=config.learner,
    )
    sampler = TaskSampler({t.name: t.weight for t in config.tasks}, seed=config.train.seed)
    learner.replay_is_cap = config.agents.replay.is_cap
    if config.rollout.cross_policy is not None:
        learner.is_cap = config.rollout.cross_policy.is_cap
    monitor = RewardMonitor({t.name: monitor_kind(env_name(t), t.answer) for t in config.tasks}, tokenizer.decode,
                            config.monitors.zero_flagged, config.monitors.many_numbers)
    return Run(config, run_dir, model, engine_model, tokenizer, tasks, engine, learner, sampler, AgentFeatures(config),
               MultiTask(config, tasks, tokenizer), monitor if config.monitors.enabled and monitor.active else None)


RolloutFn = Callable[[list[tuple[Task, int, dict[str, Any]]], int, int, int], list[Trajectory]]
"""``rollout_fn(requests, seed, version, first_group_id)`` rolls out and scores one group per request."""


@dataclass
class ScoredBatch:
    """The producing half's output: one step's scored trajectories, advantages assigned, ready to learn from."""

    step: int
    groups: Sampled
    shaping: dict[str, float]
    rollout_time_s: float

    @property
    def kept(self) -> list[Trajectory]:
        """The trajectories to train on."""
        return self.groups.kept

    @property
    def sampled(self) -> list[Trajectory]:
        """Everything rolled out for the step (reward and length metrics are over these)."""
        return self.groups.sampled


def local_rollout(run: Run) -> RolloutFn:
    """Roll out on this process's engine; under several learner ranks, each rank rolls out a contiguous share
    of the groups (shard k from seed + k * stride, as Ray workers do) and all ranks receive all of them, so
    every rank goes on with the same batch."""
    r, ranks = run.config.rollout, current()

    def rollout_fn(requests, seed: int, version: int, first_id: int) -> list[Trajectory]:
        if not ranks.distributed:
            return run.agents.rollout(run.engine, requests, r, seed, version, first_id)
        lo, hi = contiguous_shards(len(requests), ranks.world_size)[ranks.rank]
        mine = run.agents.rollout(run.engine, requests[lo:hi], r, seed + ranks.rank * SHARD_SEED_STRIDE, version,
                                  first_id + lo) if hi > lo else []
        return [t for part in all_gather_objects(mine) for t in part]

    return rollout_fn


def produce_batch(run: Run, step: int, version: int | None = None, rollout_fn: RolloutFn | None = None) -> ScoredBatch:
    """Steps 1-4: sample tasks, roll out, score, advantages. ``version`` is the sampling policy's (default
    step - 1, the synchronous case); ``rollout_fn`` says where rollouts run (default: ``run.engine``)."""
    cfg, algo, t0 = run.config, run.config.algorithm, time.perf_counter()
    version = step - 1 if version is None else version
    rollout_fn = rollout_fn or local_rollout(run)

    mt = run.multitask

    def sample_round(round_index: int, n_prompts: int, first_id: int) -> list[Trajectory]:
        mt.before_draw(run.sampler, step)  # curriculum: phase / adaptive mixture
        draws = run.agents.draw(run.sampler, step, n_prompts, round_index)
        tasks = [mt.task(d.task, run.tasks[d.task]) for d in draws]  # curriculum: difficulty level
        requests = [(task, d.index, task.train_item(d.index)) for task, d in zip(tasks, draws, strict=True)]
        # Round 0 keeps the step's seed; extra dynamic-sampling rounds need fresh samples, so fresh seeds.
        seed = cfg.train.seed * 1_000_003 + step + round_index * 1_000_000_007
        # rollout.cross_policy: a share of the groups sampled by another policy's engine
        trajectories = mt.rollout(rollout_fn, lambda eng, reqs, *a: run.agents.rollout(eng, reqs, cfg.rollout, *a),
                                  requests, seed, version, first_id)
        mt.after_rollout(trajectories, requests, first_id)  # weighted reward components (env, judge)
        if run.monitor is not None:  # reward-hacking flags; zeroes flagged rewards if asked, before replay sees them
            run.monitor.after_rollout(trajectories)
        run.agents.after_rollout(trajectories, step)  # success replay mixes into all-fail groups here
        return trajectories

    # DAPO dynamic sampling swaps zero-variance groups for new ones
    groups = dynamic_sample(sample_round, cfg.rollout.prompts_per_step, algo.dynamic_sampling, algo.max_extra_rounds)
    t_rollout = time.perf_counter() - t0
    shaping = shape_rewards(groups.sampled, algo, cfg.rollout.max_new_tokens)
    shaping.update(mt.observe(step, groups.sampled))  # curriculum levels, pass rates, mixture
    if run.monitor is not None:
        shaping.update(monitor_metrics(groups.sampled))
    shaping.update(assign_advantages(groups.kept, algo, cfg.agents))  # estimator, task norm, step credit, ARPO
    shaping.update(run.agents.after_advantages(groups.kept, groups.sampled))
    return ScoredBatch(step, groups, shaping, t_rollout)


def learn_batch(run: Run, batch: ScoredBatch) -> tuple[dict[str, float], float]:
    """Steps 5-7: loss and update, then sync the engine's weights; returns the update's metrics and its time."""
    t1 = time.perf_counter()
    faults.point("update", batch.step)
    if not batch.kept:  # every episode of the step was dropped (agent tasks): nothing to learn, weights unchanged
        return {"skipped_updates": 0.0, "empty_batch": 1.0}, time.perf_counter() - t1
    release = getattr(run.engine, "release_memory", None)  # engines without memory to give back may omit it
    if release is not None:
        release()  # a colocated vLLM with sleep_mode frees the GPU for the update until the sync
    update = run.learner.update(batch.kept)
    t_sync = time.perf_counter()
    if run.engine_model is not run.model:  # the sharded weights, gathered whole on every rank
        update["sync/bytes"] = float(gather_into(run.model, run.engine_model, trainable_only=run.learner.is_lora))
    run.engine.sync()
    update["sync/time_s"] = time.perf_counter() - t_sync
    return update, time.perf_counter() - t1


def step_metrics(batch: ScoredBatch, update: dict[str, float], update_time_s: float, step_time_s: float) -> dict:
    """Step 8's record. Reward and length are over everything sampled (the policy's performance, not the
    filtered batch)."""
    sampled, generated = batch.sampled, sum(t.num_model_tokens for t in batch.sampled)
    if not sampled:
        return {"reward/mean": None, **batch.shaping, **update, "tokens_per_s": 0.0,
                "rollout_time_s": batch.rollout_time_s, "update_time_s": update_time_s, "step_time_s": step_time_s}
    return {
        "reward/mean": mean(t.reward for t in sampled),
        **{f"reward/{name}": mean(t.reward for t in sampled if t.task == name)
           for name in sorted({t.task for t in sampled})},
        **batch.shaping,
        "response_length/mean": generated / len(sampled),
        "truncated_frac": mean(float(t.truncated) for t in sampled),
        **rollout_metrics(sampled),
        "zero_variance_groups": batch.groups.zero_variance_groups,
        **batch.groups.metrics(),
        **update,
        "tokens_per_s": generated / step_time_s,
        "rollout/tokens_per_s": generated / batch.rollout_time_s,
        "train/tokens_per_s": sum(len(t.input_ids) for t in batch.kept) / update_time_s,
        "rollout_time_s": batch.rollout_time_s,
        "update_time_s": update_time_s,
        "step_time_s": step_time_s,
    }


def rl_step(run: Run, step: int) -> tuple[dict[str, float], list[Trajectory]]:
    """One synchronous RL step; returns the step's metrics and the scored trajectories it trained on.
    The async and Ray runtimes (polyrl/runtime/) call the same two halves, in other places."""
    t0 = time.perf_counter()
    faults.point("rollout", step)
    batch = produce_batch(run, step)  # 1. sample tasks, 2. roll out, 3. score, 4. advantages
    update, t_update = learn_batch(run, batch)  # 5. loss, 6. update, 7. sync weights into the engine
    return step_metrics(batch, update, t_update, time.perf_counter() - t0), batch.kept  # 8. log


def evaluate_all(run: Run) -> dict[str, float]:
    """Greedy held-out accuracy per task, on the policy's own weights (no bf16 copy unless eval.bf16); under
    several learner ranks each evaluates its share of the items."""
    cfg, ranks = run.config, current()
    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    policy = run.engine_model
    # Weights stored in bf16 (LoRA's frozen base) need autocast; the rest of the policy is still evaluated as is.
    engine = run.engine if cfg.eval.bf16 else HFEngine(policy, run.tokenizer, bf16=holds_bf16_weights(policy))
    accuracy = {}
    for name, task in run.tasks.items():
        if isinstance(task, AgentTask):  # the agent's own episodes, on the endpoint (one learner rank)
            if task.has_eval_items:
                accuracy[name] = evaluate_agent(engine, cfg.model.name, task, task.config.eval_size, max_new,
                                                cfg.eval.batch_size)["accuracy"]
            continue
        result = evaluate(engine, task, task.config.eval_size, max_new, cfg.eval.batch_size,
                          part=(ranks.rank, ranks.world_size))
        counts = all_gather_objects((result["solved"], result["n"]))
        accuracy[name] = sum(s for s, _ in counts) / max(sum(n for _, n in counts), 1)
    return accuracy
