"""Supervised fine-tuning on gold answers, or on teachers' correct replies: the ``sft`` stage of a pipeline.

An env with a ``demonstration`` method (tool_math) is trained on its multi-turn demonstration instead, loss
on the assistant turns only (``polyrl.train.demonstrations``). Otherwise each item's prompt is rendered
exactly as a rollout renders it (the env's opening messages, the model's chat template, the generation
prompt); the gold answer follows as the assistant's turn, up to and including the model's stop token. The loss
is the mean negative log-likelihood of those assistant tokens only. When the tasks name teachers
(``tasks[].teacher``; a pipeline's ``stages[].sft_from: teacher``), each step's examples are instead the
teachers' correct replies to ``rollout.prompts_per_step`` drawn items (``polyrl.train.teacher_examples``).
Steps, checkpoints and resume work as in the RL loop (same checkpoint layout, same sampler), so a pipeline
treats both alike.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from polyrl.checkpoint import faults
from polyrl.checkpoint.store import checkpoint_to_resume, latest_checkpoint, load_checkpoint, save_checkpoint
from polyrl.config import Config, dump_config
from polyrl.data.sampler import TaskSampler
from polyrl.envs.base import Task, make_task
from polyrl.learner.batch import collate
from polyrl.learner.logprobs import token_logprobs
from polyrl.learner.optimizer import load_optimizer_state, make_optimizer, optimizer_state, schedule_step
from polyrl.models.device import model_bf16
from polyrl.observe.metrics import open_metrics_logger
from polyrl.rollout.render import ChatRenderer
from polyrl.train.demonstrations import demonstration_example
from polyrl.train.step import load_policy
from polyrl.train.teacher_examples import TeacherExamples
from polyrl.types import Trajectory


def sft_example(task: Task, index: int, item: dict[str, Any], tokenizer) -> Trajectory:
    """The item as a trajectory whose model tokens are the gold answer: loss_mask 1 on the assistant turn."""
    answer = item.get("answer")
    if answer is None:
        raise ValueError(f"task '{task.name}': item {index} has no gold 'answer', so an sft stage cannot use it")
    env = task.make_env()
    renderer = ChatRenderer(tokenizer, env.tools, env.tool_parser)
    messages = list(env.reset(item))
    prompt_text, prompt_ids = renderer.prompt(messages)
    full = renderer.text([*messages, {"role": "assistant", "content": str(answer)}], add_generation_prompt=False)
    if not full.startswith(prompt_text):
        raise ValueError(f"task '{task.name}': the chat template rewrites the prompt when a reply is added")
    # Tokenised apart from the prompt, as at rollout time; cut after the stop token (what the model emits).
    reply_ids = renderer.encode(full[len(prompt_text):])
    if tokenizer.eos_token_id in reply_ids:
        reply_ids = reply_ids[: reply_ids.index(tokenizer.eos_token_id) + 1]
    ids = prompt_ids + reply_ids
    return Trajectory(
        task=task.name, item_id=index, group_id=index, input_ids=ids,
        loss_mask=[0] * len(prompt_ids) + [1] * len(reply_ids), logprobs=[0.0] * len(ids),
        versions=[-1] * len(ids), turn_spans=[(len(prompt_ids), len(ids))], text=str(answer),
        rewards={}, reward=0.0,
    )


def training_example(task: Task, index: int, item: dict[str, Any], tokenizer) -> Trajectory:
    """The env's own multi-turn demonstration when it gives one (tool-call traces,
    ``polyrl.train.demonstrations``), else the gold answer as a single assistant turn."""
    return demonstration_example(task, index, item, tokenizer) or sft_example(task, index, item, tokenizer)


def sft_loss(model, batch, bf16: bool, num_tokens: float) -> torch.Tensor:
    """Summed negative log-likelihood of the masked (assistant) tokens over ``num_tokens``."""
    logp, _ = token_logprobs(model, batch, 1.0, bf16)
    return -(logp * batch.loss_mask).sum() / num_tokens


def train_sft(config: Config, run_dir: Path, resume: bool = False, log=print) -> dict[str, Any]:
    """``train.steps`` optimizer steps of ``rollout.prompts_per_step x rollout.group_size`` gold examples each
    (as many sequences as an RL step), or of the teachers' correct replies among as many samples; writes
    metrics.jsonl, checkpoints and summary.json like ``train``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    tokenizer, model = load_policy(config)
    device = next(model.parameters()).device
    seed, system_prompt = config.train.seed, config.model.system_prompt
    tasks = {t.name: make_task(t, seed, system_prompt, tokenizer) for t in config.tasks}
    sampler = TaskSampler({t.name: t.weight for t in config.tasks}, seed=seed)
    params = [p for p in model.parameters() if p.requires_grad]
    o = config.optim
    optimizer, scheduler = make_optimizer(params, o, config.train.steps)  # the RL learner's optimizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    teachers = TeacherExamples(config, tokenizer)  # empty unless the tasks name teachers

    start, train_time = 0, 0.0
    ckpt = checkpoint_to_resume(run_dir, log=log) if resume else None  # as the RL loop resumes
    if ckpt is not None:
        opt_state, state = load_checkpoint(ckpt, model)
        load_optimizer_state(optimizer, scheduler, opt_state)
        sampler.load_state_dict(state["sampler"])
        start, train_time = state["step"], state["train_time_s"]
        log(f"resumed from {ckpt} (step {start})")

    def checkpoint(step: int) -> None:
        save_checkpoint(
            run_dir, step, model, tokenizer, optimizer_state(optimizer, scheduler),
            {"sampler": sampler.state_dict(), "train_time_s": train_time}, keep=config.train.keep_checkpoints,
        )

    n = config.rollout.prompts_per_step * config.rollout.group_size
    logger = open_metrics_logger(config, run_dir, start if ckpt is not None else None)
    step, last_loss = start, float("nan")
    try:
        while step < config.train.last_step:
            step += 1
            t0 = time.perf_counter()
            faults.point("sft", step)
            if teachers:  # each drawn item: the teacher's correct replies among group_size samples
                draws = sampler.draw(step, config.rollout.prompts_per_step)
                requests = [(tasks[d.task], d.index, tasks[d.task].train_item(d.index)) for d in draws]
                examples, sampled = teachers.examples(requests, seed + step)
                extra = {"teacher/kept": len(examples), "teacher/sampled": sampled}
            else:
                draws = sampler.draw(step, n)
                examples = [training_example(tasks[d.task], d.index, tasks[d.task].train_item(d.index), tokenizer)
                            for d in draws]
                extra = {}
            model.train()
            optimizer.zero_grad(set_to_none=True)
            total, grad_norm, num_tokens = 0.0, 0.0, 0.0
            if examples:  # a step where no teacher reply was correct has nothing to learn from
                examples.sort(key=lambda t: len(t.input_ids) - t.prompt_len)
                batch = collate(examples, pad_id)
                num_tokens = float(batch.loss_mask.sum().clamp(min=1))
                for i in range(0, len(examples), o.micro_batch_size):
                    loss = sft_loss(model, batch.rows(slice(i, i + o.micro_batch_size)).to(device),
                                    model_bf16(config), num_tokens)
                    loss.backward()
                    total += float(loss.detach())
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, o.grad_clip))
            if examples and math.isfinite(grad_norm):  # a NaN/inf gradient must not reach the weights
                optimizer.step()
            schedule_step(scheduler)
            step_time = time.perf_counter() - t0
            train_time += step_time
            last_loss = total
            logger.write(step, {
                "loss": total, "loss/sft": total, "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0],
                "sft_tokens": num_tokens, "step_time_s": step_time, "train_time_s": train_time, **extra,
                **{f"task_ratio/{k}": v for k, v in sampler.realised_ratio().items()},
            })
            faults.point("logged", step)
            if config.train.checkpoint_every and step % config.train.checkpoint_every == 0:
                checkpoint(step)
    finally:
        logger.close()
    if latest_checkpoint(run_dir) is None or not (run_dir / "checkpoints" / f"step-{step}").is_dir():
        checkpoint(step)
    summary = {"kind": "sft", "steps": step, "train_time_s": train_time, "final_loss": last_loss}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
