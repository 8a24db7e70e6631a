"""One RL step, in two halves that every runtime composes: ``produce_batch`` (sample tasks -> roll out ->
score -> advantages) and ``learn_batch`` (loss -> update -> sync weights), plus ``build_run``, which builds what
a run holds, and ``rl_step``, the synchronous step of the diagram in docs/ARCHITECTURE.md. The local loop
(``run/loop.py``) and the async and Ray runtimes (``polyrl/runtime/``) all call these."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from statistics import mean
from typing import Any

import torch

from polyrl.algorithms.reward_shaping import shape_rewards
from polyrl.checkpoint import faults
from polyrl.config import Config
from polyrl.data.dynamic_sampling import Sampled, dynamic_sample
from polyrl.data.sampler import TaskSampler
from polyrl.data.selection import PromptSelector, item_key
from polyrl.engines import make_engine
from polyrl.engines.hf import HFEngine
from polyrl.engines.protocol import Engine
from polyrl.envs.agent import AgentTask
from polyrl.envs.base import Task, env_name, make_task
from polyrl.envs.curriculum import Curriculum
from polyrl.envs.reward_mix import RewardMixer
from polyrl.learner.advantage_stage import assign_advantages
from polyrl.learner.learner import Learner
from polyrl.models.device import model_bf16, resolve_device
from polyrl.models.loading import holds_bf16_weights, load_model, load_tokenizer
from polyrl.parallel.fsdp import gather_into
from polyrl.parallel.group import SHARD_SEED_STRIDE, all_gather_objects, contiguous_shards
from polyrl.plan import RunPlan, resolve_plan
from polyrl.rewards.functions import reward_error_metrics
from polyrl.rewards.monitors import RewardMonitor, monitor_kind, monitor_metrics
from polyrl.rollout.multi_turn import evaluate, rollout_metrics
from polyrl.rollout.policy_chat import EnginePolicy
from polyrl.train.agents import GroupRollout, Replay, Requests, add_metrics, episode_metrics
from polyrl.train.glibc_malloc import give_back_freed_memory, keep_freed_memory, memory_budget, trim_above
from polyrl.train.guidance import Guidance
from polyrl.train.hints import add_hints
from polyrl.train.multitask import CrossPolicy, build_curriculum, level_task, observe_curriculum, set_mixture
from polyrl.train.teachers import load_teachers
from polyrl.types import Trajectory


class NonFiniteError(RuntimeError):
    """Training produced NaN/inf too many times in a row."""


@dataclass
class Run:
    """Everything one training run holds; built once by ``build_run``. The producing half's features are one
    object each, off as None (or as a no-op) by default."""

    config: Config
    plan: RunPlan  # the run's shape, resolved once (polyrl/plan.py): this process's rank, runtime, engines
    run_dir: Path
    model: Any
    """The policy the learner trains (sharded over the ranks under ``learner.world_size`` > 1)."""
    engine_model: Any
    """The whole policy the engine samples from and evaluation reads: ``model`` itself in one process, an
    unsharded copy refreshed after each update under a sharded learner."""
    tokenizer: Any
    tasks: dict[str, Task]
    engine: Engine
    learner: Learner
    sampler: TaskSampler
    group_rollout: GroupRollout
    """How a group is played: env tasks (ARPO trees, early stop), agent tasks through the endpoint."""
    replay: Replay
    """Success and prompt replay (``agents.replay``); checkpointed."""
    reward_mixer: RewardMixer
    """Weighted reward components (``tasks[].reward_components``)."""
    curriculum: Curriculum | None = None
    """Task phases, difficulty levels, adaptive mixture (``curriculum``); checkpointed."""
    cross_policy: CrossPolicy | None = None
    """Another policy's engine for a share of the groups (``rollout.cross_policy``)."""
    monitor: RewardMonitor | None = None
    """Reward-hacking monitors (``monitors``), when on and some task has checks."""
    guidance: Guidance | None = None
    """Hints and reference replies for all-fail groups (``guidance``), when either is on."""
    selection: PromptSelector | None = None
    """Prompt selection by predicted pass rate (``rollout.prompt_selection``); checkpointed."""
    memory_budget: int | None = None
    """Bytes of resident memory above which freed memory is given back after an update (``runtime``)."""


def load_policy(config: Config, device: torch.device | None = None) -> tuple[Any, Any]:
    """The tokenizer and the policy model of ``config`` (LoRA, bf16 storage and attention as configured),
    seeded, with the allocator set up first; RL (``build_run``) and SFT runs start here."""
    if config.runtime.keep_freed_memory:  # before the model's weights: every process of a run builds one here
        keep_freed_memory()
    torch.manual_seed(config.train.seed)
    tokenizer = load_tokenizer(config.model.name)
    model = load_model(
        config.model.name, config.model.lora, seed=config.train.seed, bf16=model_bf16(config),
        float32_attention=config.model.float32_attention, device=device or resolve_device(config.train.device),
    )
    return tokenizer, model


def build_run(config: Config, run_dir: Path, plan: RunPlan | None = None) -> Run:
    """Build what a run of ``config`` holds (model, tokenizer, tasks, engine, learner, sampler, features) in the
    shape ``plan`` gives (default: one process, in no learners' group)."""
    plan = plan or resolve_plan(config)
    tokenizer, model = load_policy(config, plan.torch_device)
    # Each rank samples its share of a step's groups with the whole weights (copied before sharding).
    engine_model = copy.deepcopy(model) if plan.sharded else model
    engine = make_engine(config, engine_model, tokenizer)  # engine.kind: hf, or vllm (optional extra)
    r = config.rollout  # self-play envs (textarena opponent: self) sample the other seat from the engine too
    policy = EnginePolicy(engine, r.max_new_tokens, r.temperature, r.top_p)
    tasks = {
        t.name: make_task(t, config.train.seed, config.model.system_prompt, tokenizer, policy) for t in config.tasks
    }
    cross = config.rollout.cross_policy
    learner = Learner(
        model, config.algorithm, config.optim, config.rollout.temperature, model_bf16(config), engine.pad_id,
        total_steps=config.train.steps, teachers=load_teachers(config, engine_model), sharding=config.learner,
        replay_is_cap=config.agents.replay.is_cap, shaping_gamma=config.guidance.shaping_gamma, ranks=plan.ranks,
        **({"is_cap": cross.is_cap} if cross is not None else {}),
    )
    sampler = TaskSampler({t.name: t.weight for t in config.tasks}, seed=config.train.seed)
    monitor = RewardMonitor({t.name: monitor_kind(env_name(t), t.answer) for t in config.tasks}, tokenizer.decode,
                            config.monitors.zero_flagged, config.monitors.many_numbers)
    return Run(
        config, plan, run_dir, model, engine_model, tokenizer, tasks, engine, learner, sampler,
        group_rollout=GroupRollout(config),
        replay=Replay(config.agents.replay, config.train.seed),
        curriculum=build_curriculum(config, tokenizer),
        reward_mixer=RewardMixer(tasks, tokenizer, config.model.name, config.train.seed, device=config.train.device),
        cross_policy=CrossPolicy(config, tokenizer) if cross is not None and cross.share > 0 else None,
        monitor=monitor if config.monitors.enabled and monitor.active else None,
        guidance=Guidance(config.guidance, tokenizer, config.rollout.max_new_tokens, config.train.seed)
        if config.guidance.reference or config.guidance.hint_fraction > 0 else None,
        selection=PromptSelector(select.candidates, select.target, select.decay, config.train.seed)
        if (select := config.rollout.prompt_selection) is not None else None,
        memory_budget=memory_budget(config.runtime.memory_budget_gb),
    )


RolloutFn = Callable[[Requests, int, int, int], list[Trajectory]]
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
    """Roll out on this process's engine; under several learner ranks each rolls out a contiguous share of the
    groups (shard k from seed + k * stride, as Ray workers do) and all go on with all of them, the same batch."""
    ranks = run.plan.ranks

    def rollout_fn(requests: Requests, seed: int, version: int, first_id: int) -> list[Trajectory]:
        if not ranks.distributed:
            return run.group_rollout.roll_out(run.engine, requests, seed, version, first_id)
        lo, hi = contiguous_shards(len(requests), ranks.world_size)[ranks.rank]
        mine = run.group_rollout.roll_out(run.engine, requests[lo:hi], seed + ranks.rank * SHARD_SEED_STRIDE,
                                          version, first_id + lo) if hi > lo else []
        return [t for part in all_gather_objects(ranks, mine) for t in part]

    return rollout_fn


def produce_batch(run: Run, step: int, version: int | None = None, rollout_fn: RolloutFn | None = None) -> ScoredBatch:
    """Steps 1-4: sample tasks, roll out, score, advantages. ``version`` is the sampling policy's (default
    step - 1, the synchronous case); ``rollout_fn`` says where rollouts run (default: ``run.engine``)."""
    cfg, algo, t0 = run.config, run.config.algorithm, time.perf_counter()
    version = step - 1 if version is None else version
    rollout_fn = rollout_fn or local_rollout(run)
    round_metrics: dict[str, float] = {}  # agent-episode and replay counts, summed over the sampling rounds
    sample_round = partial(sample_and_score, run, step, version, rollout_fn, round_metrics)
    # DAPO dynamic sampling: more rounds replace zero-variance groups (one round when off)
    sampling = algo.sampling
    groups = dynamic_sample(sample_round, cfg.rollout.prompts_per_step, sampling.dynamic, sampling.max_extra_rounds)
    t_rollout = time.perf_counter() - t0
    metrics = shape_rewards(groups.sampled, algo, cfg.rollout.max_new_tokens)
    sampled = policy_samples(groups.sampled)
    metrics.update(observe_curriculum(run.curriculum, step, sampled))  # levels, pass rates, mixture
    if run.cross_policy is not None:
        metrics.update(run.cross_policy.metrics(sampled))
    if run.monitor is not None:
        metrics.update(monitor_metrics(sampled))
    metrics.update(assign_advantages(groups.kept, algo, cfg.agents))  # estimator, task norm, step credit, ARPO
    metrics.update(episode_metrics(groups.sampled, cfg.agents))
    metrics.update(reward_error_metrics(groups.sampled))
    metrics.update(round_metrics)
    return ScoredBatch(step, groups, metrics, t_rollout)


def policy_samples(trajectories: list[Trajectory]) -> list[Trajectory]:
    """What a policy sampled from its prompts: guidance's reference replies and hinted samples left out of
    rewards and pass rates."""
    return [t for t in trajectories if not t.guided and not t.hinted]


def sample_and_score(run: Run, step: int, version: int, rollout_fn: RolloutFn, round_metrics: dict[str, float],
                     round_index: int, n_prompts: int, first_id: int) -> list[Trajectory]:
    """One sampling round of a step: ``n_prompts`` groups drawn, rolled out and scored, numbered from
    ``first_id``; the round's counts are added to ``round_metrics``."""
    requests = draw_requests(run, step, n_prompts, round_index, round_metrics)
    # Round 0 keeps the step's seed; extra dynamic-sampling rounds need fresh samples, so fresh seeds.
    seed = run.config.train.seed * 1_000_003 + step + round_index * 1_000_000_007
    own, other = run.cross_policy.split(requests) if run.cross_policy is not None else (requests, [])
    trajectories = rollout_fn(own, seed, version, first_id) if own else []
    if other:  # rollout.cross_policy: the round's last groups sampled by another policy
        trajectories += run.cross_policy.roll_out(run.group_rollout, other, seed, version, first_id + len(own))
    add_metrics(round_metrics, run.group_rollout.take_metrics())  # agent episodes: drops, merged calls
    score_groups(run, trajectories, requests, first_id)
    if run.selection is not None:  # pass-rate estimates, from the policy's own samples (before any mixing in)
        observe_selection(run, requests, trajectories, first_id)
    add_metrics(round_metrics, run.replay.mix_in(trajectories, step))  # successes into all-fail groups
    if run.guidance is not None:  # hinted re-samples of the groups still all-fail, then reference replies
        by_group = {first_id + g: request for g, request in enumerate(requests)}

        def roll(hinted: Requests, hint_seed: int, first: int) -> list[Trajectory]:  # scored as the round is
            return score_groups(run, rollout_fn(hinted, hint_seed, version, first), hinted, first)

        add_metrics(round_metrics, add_hints(run.guidance, trajectories, by_group, step, seed, roll))
        guided, counts = run.guidance.mix_in(trajectories, by_group, step)
        run.reward_mixer.apply(guided, {gid: item for gid, (_, _, item) in by_group.items()})
        add_metrics(round_metrics, counts)
    return trajectories


def score_groups(run: Run, trajectories: list[Trajectory], requests: Requests, first_id: int) -> list[Trajectory]:
    """Weighted reward components (env, judge, rules) of groups numbered from ``first_id``, then the
    reward-hacking flags (which zero flagged rewards if asked, before replay sees them); in place."""
    run.reward_mixer.apply(trajectories, {first_id + g: item for g, (_, _, item) in enumerate(requests)})
    if run.monitor is not None:
        run.monitor.flag(trajectories)
    return trajectories


def draw_requests(run: Run, step: int, n: int, round_index: int, round_metrics: dict[str, float]) -> Requests:
    """A round's ``n`` (task, item index, item) requests: drawn from the curriculum's mixture (or the
    configured one), prompt replay's share among items already seen, each task at its curriculum level; with
    prompt selection, ``candidates`` times as many drawn and those predicted to give mixed groups kept."""
    set_mixture(run.curriculum, run.sampler, step)
    pool = n if run.selection is None else n * run.selection.candidates
    draws = run.replay.draw(run.sampler, step, pool, round_index)
    tasks = [level_task(run.curriculum, d.task, run.tasks[d.task]) for d in draws]
    requests = [(task, d.index, task.train_item(d.index)) for task, d in zip(tasks, draws, strict=True)]
    if run.selection is None:
        return requests
    chosen, counts = run.selection.select(requests, n, step, round_index, run.config.rollout.group_size)
    add_metrics(round_metrics, counts)
    return chosen


def observe_selection(run: Run, requests: Requests, trajectories: list[Trajectory], first_id: int) -> None:
    """Each group's successes and samples into its item's pass-rate estimate."""
    score = run.config.rollout.prompt_selection.success_score
    for g, (task, _, item) in enumerate(requests):
        group = [t for t in trajectories if t.group_id == first_id + g]
        wins = sum(float(t.info.get("score", t.reward)) >= score for t in group)
        run.selection.observe(item_key(task.name, item), wins, len(group))


def learn_batch(run: Run, batch: ScoredBatch) -> tuple[dict[str, float], float]:
    """Steps 5-7: loss and update, then sync the engine's weights; returns the update's metrics and its time."""
    t1 = time.perf_counter()
    faults.point("update", batch.step)
    if not batch.kept:  # every episode of the step was dropped (agent tasks): nothing to learn, weights unchanged
        return {"skipped_updates": 0.0, "empty_batch": 1.0}, time.perf_counter() - t1
    run.engine.release_memory()  # e.g. a colocated vLLM with sleep_mode frees the GPU for the update until the sync
    # The update is the step's highest memory: past the budget, it starts with the freed memory given back.
    # (Not logged: metrics.jsonl holds what a seed determines, and resident memory is the machine's.)
    trim_above(run.memory_budget)
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
    sampled = policy_samples(batch.sampled)
    generated = sum(t.num_model_tokens for t in sampled)
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
    if run.config.eval.bf16:
        return _evaluate_tasks(run, run.engine)
    # Weights stored in bf16 (LoRA's frozen base) need autocast; the rest of the policy is still evaluated as is.
    engine = HFEngine(run.engine_model, run.tokenizer, bf16=holds_bf16_weights(run.engine_model))
    # The sampling engine's weight copy idles meanwhile: it goes for the evaluation, whose caches would come on top
    # of it, and its sync (or a self-play opponent's first sample meanwhile) rebuilds it from the policy.
    releases = isinstance(run.engine, HFEngine)
    if releases:
        run.engine.release_memory(until_used=True)
    try:
        return _evaluate_tasks(run, engine)
    finally:
        if releases:
            run.engine.sync()


def _evaluate_tasks(run: Run, engine: Engine) -> dict[str, float]:
    cfg, ranks = run.config, run.plan.ranks
    # Evaluation's caches come on top of everything training holds, and it runs seldom: it always starts with the
    # freed memory given back, for a few page faults per evaluation.
    give_back_freed_memory()
    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    accuracy = {}
    for name, task in run.tasks.items():
        if not task.has_eval_items:  # a dataset with nothing held out (held_out_fraction: 0, no eval_items)
            continue
        if isinstance(task, AgentTask):  # the agent's own episodes, on the endpoint (one learner rank)
            from polyrl.endpoint.rollout import evaluate_agent  # loaded only for agent tasks (train/agents.py)

            accuracy[name] = evaluate_agent(engine, cfg.model.name, task, task.config.eval_size, max_new,
                                            cfg.eval.batch_size)["accuracy"]
            continue
        result = evaluate(engine, task, task.config.eval_size, max_new, cfg.eval.batch_size,
                          part=(ranks.rank, ranks.world_size))
        counts = all_gather_objects(ranks, (result["solved"], result["n"]))
        accuracy[name] = sum(s for s, _ in counts) / max(sum(n for _, n in counts), 1)
    return accuracy
