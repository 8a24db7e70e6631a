"""Single-turn rollouts and greedy evaluation: render the chat, sample, score, build Trajectories."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from polyrl.engines.hf import HFEngine
from polyrl.envs.reasoning_gym import ReasoningGymTask
from polyrl.types import Trajectory


def encode_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Render with the model's own chat template and tokenize without adding special tokens twice."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def rollout(
    engine: HFEngine,
    requests: list[tuple[ReasoningGymTask, int, dict[str, Any]]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    version: int,
    first_group_id: int = 0,
) -> list[Trajectory]:
    """Sample ``group_size`` completions per (task, item_id, item) request and score them."""
    tok = engine.tokenizer
    prompts = [encode_prompt(tok, task.messages(item)) for task, _, item in requests]
    groups = engine.generate(prompts, group_size, max_new_tokens, temperature, top_p, seed)
    out = []
    for g, ((task, item_id, item), prompt, completions) in enumerate(zip(requests, prompts, groups, strict=True)):
        for c in completions:
            text = tok.decode(c.token_ids, skip_special_tokens=True)
            reward = task.score(item, text)
            n = len(c.token_ids)
            out.append(
                Trajectory(
                    task=task.name,
                    item_id=item_id,
                    group_id=first_group_id + g,
                    input_ids=prompt + c.token_ids,
                    loss_mask=[0] * len(prompt) + [1] * n,
                    logprobs=[0.0] * len(prompt) + c.logprobs,
                    versions=[-1] * len(prompt) + [version] * n,
                    turn_spans=[(len(prompt), len(prompt) + n)],
                    text=text,
                    rewards={task.name: reward},
                    reward=reward,
                    truncated=not c.finished,
                    info={"answer": item.get("answer")},
                )
            )
    return out


def evaluate(
    engine: HFEngine, task: ReasoningGymTask, n: int | None, max_new_tokens: int, batch_size: int = 64
) -> dict[str, float]:
    """Greedy accuracy on the task's held-out items (the same items for every call with the same seed).

    ``accuracy`` counts fully correct replies (score 1); ``mean_score`` keeps the scorer's partial credit.
    """
    items = task.eval_items(n)
    scores, lengths = [], []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        prompts = [encode_prompt(engine.tokenizer, task.messages(it)) for it in chunk]
        for item, (c,) in zip(chunk, engine.generate(prompts, 1, max_new_tokens, temperature=0.0), strict=True):
            scores.append(task.score(item, engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)))
            lengths.append(len(c.token_ids))
    return {
        "accuracy": sum(s >= 1.0 for s in scores) / max(len(scores), 1),
        "mean_score": sum(scores) / max(len(scores), 1),
        "n": len(scores),
        "response_length": sum(lengths) / max(len(lengths), 1),
    }
