"""GRPO in one file: the quickstart's training loop written out top to bottom.

Load the policy, sample a group of replies per prompt, score them, turn rewards into advantages, take the
clipped policy-gradient loss, update, copy the new weights into the sampler, and measure held-out accuracy
before and after. The parts are polyrl's own functions (the task and its scorer, the sampling engine, the GRPO
estimator, the PPO-clip loss as a pure function, greedy evaluation); only the loop is spelled out here.
`polyrl train configs/quickstart.yaml` runs the same recipe with what this file leaves out: DAPO's dynamic
sampling, guidance for all-fail groups, checkpoints, metrics, several runtimes.

    python examples/grpo_in_one_file.py                       # SmolLM2-135M-Instruct on chain_sum, 20 steps
    python examples/grpo_in_one_file.py --steps 90 --eval-n 200
    python examples/grpo_in_one_file.py --model tiny-random --steps 2 --eval-n 8   # seconds, learns nothing
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polyrl import (
    HFEngine,
    PolicyLossInputs,
    Task,
    evaluate,
    forward_logits,
    grpo_advantages,
    load_model,
    load_tokenizer,
    make_task,
    native_bf16,
    parse_config,
    ppo_clip_loss,
)

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GRPO on the quickstart task, written out in one file.")
    p.add_argument("--model", default="smollm2-135m-instruct", help="an alias (or tiny-random) or an HF directory")
    p.add_argument("--steps", type=int, default=20, help="training steps (the learning rate decays to 0 over them)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt: the group GRPO compares")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28, help="DAPO's clip-higher")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--eval-n", type=int, default=200, help="held-out items, evaluated greedily before and after")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


@dataclass
class Sample:
    group: int
    prompt: list[int]
    response: list[int]
    """The sampled token ids, the stop token included when the reply finished: the loss trains on it too."""
    logprobs: list[float]
    """The sampler's log-prob of each response token (what the learner's distribution should reproduce)."""
    reward: float


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The conversation rendered by the model's chat template, ready for the assistant's reply."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def sample_groups(engine: HFEngine, task: Task, items: list[dict], group: int, max_new_tokens: int,
                  seed: int) -> list[Sample]:
    """`group` replies per item at temperature 1, each scored by the task's own env."""
    prompts = [prompt_ids(engine.tokenizer, task.make_env().reset(item)) for item in items]
    # One prefill per prompt; its KV cache is shared by the group's samples.
    groups = engine.generate(prompts, n=group, max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    samples = []
    for g, (item, prompt, completions) in enumerate(zip(items, prompts, groups, strict=True)):
        for c in completions:
            env = task.make_env()
            env.reset(item)
            reply = c.token_ids[:-1] if c.finished else c.token_ids  # the env reads the reply without its stop token
            text = engine.tokenizer.decode(reply, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            samples.append(Sample(g, prompt, c.token_ids, c.logprobs, env.step(text).reward))
    return samples


def response_logprobs(policy: torch.nn.Module, samples: list[Sample], pad_id: int,
                      bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, R] of each sample's response tokens under `policy`, and the mask of real tokens.

    Rows are laid out as [left-padded prompt | right-padded response], so every response starts at column P.
    """
    width_p = max(len(s.prompt) for s in samples)
    width_r = max(len(s.response) for s in samples)
    ids = torch.full((len(samples), width_p + width_r), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, width_p - len(s.prompt) : width_p] = torch.tensor(s.prompt)
        ids[i, width_p : width_p + len(s.response)] = torch.tensor(s.response)
        mask[i, width_p - len(s.prompt) : width_p + len(s.response)] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # Position t predicts token t + 1: the logits from the prompt's last position to the response's last but one.
    # The decoder body runs under bf16 autocast where the CPU has it; the output head stays float32.
    logits, _ = forward_logits(policy, ids, mask, positions, keep=width_r + 1, bf16=bf16)
    logits = logits[:, :-1]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, width_p:].unsqueeze(-1)).squeeze(-1)
    return logp, mask[:, width_p:].float()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    # 1. The model, its tokenizer and the quickstart's task (reasoning-gym chain_sum, two one-digit terms).
    bf16 = native_bf16("cpu")  # bf16 where the CPU computes it natively, float32 where it would be emulated
    policy = load_model(args.model, seed=args.seed, bf16=bf16)
    tokenizer = load_tokenizer(args.model)
    task = make_task(parse_config(QUICKSTART).tasks[0], seed=args.seed)
    # The sampler keeps its own bf16 copy of the weights (half the bytes per decoded token); sync() refreshes it.
    engine = HFEngine(policy, tokenizer, bf16=bf16, bf16_weights=bf16)
    # Held-out accuracy is measured greedily on the policy's own float32 weights, as `polyrl train` does.
    eval_engine = HFEngine(policy, tokenizer, bf16=False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / max(args.steps, 1))

    before = evaluate(eval_engine, task, args.eval_n, args.max_new_tokens, batch_size=32)["accuracy"]
    print(f"held-out accuracy before training: {before:.1%} ({args.eval_n} items)")

    history = []
    t_train = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        # 2. Sample a group of replies for each of this step's prompts, and score them.
        items = [task.train_item((step - 1) * args.prompts + i) for i in range(args.prompts)]
        samples = sample_groups(engine, task, items, args.group, args.max_new_tokens, seed=args.seed * 100_003 + step)

        # 3. GRPO advantages: each reward against its own group's mean, divided by the group's spread.
        rewards = torch.tensor([s.reward for s in samples])
        advantages = grpo_advantages(rewards, torch.tensor([s.group for s in samples]))

        # 4. The loss. With one pass over the batch the policy that sampled is the one being updated, so the
        # old log-probs are the current ones, detached: every ratio is 1 and the clip only matters past epoch 1.
        policy.train()
        logp, mask = response_logprobs(policy, samples, engine.pad_id, bf16)
        inputs = PolicyLossInputs(logp, logp.detach(), advantages, mask, args.clip_low, args.clip_high, "token-mean")
        loss, loss_metrics = ppo_clip_loss(inputs)

        # 5. The update, then the new weights into the sampler.
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm=1.0)
        optimizer.step()
        schedule.step()
        engine.sync()

        record = {"step": step, "reward": rewards.mean().item(), "loss": loss.item(), "grad_norm": grad_norm.item(),
                  "clip_frac": loss_metrics["clip_frac"], "seconds": time.perf_counter() - t0}
        history.append(record)
        print(f"step {step:3d}  reward {record['reward']:.3f}  loss {record['loss']:+.4f}  "
              f"grad norm {record['grad_norm']:.3f}  {record['seconds']:.1f} s")
    train_s = time.perf_counter() - t_train

    # 6. Evaluate on the same held-out items.
    after = evaluate(eval_engine, task, args.eval_n, args.max_new_tokens, batch_size=32)["accuracy"]
    total_s = time.perf_counter() - t_start
    print(f"held-out accuracy: {before:.1%} -> {after:.1%} ({after - before:+.1%}) after {args.steps} steps; "
          f"training {train_s / 60:.1f} min, whole script {total_s / 60:.1f} min")
    return {"eval_before": before, "eval_after": after, "history": history, "train_s": train_s, "policy": policy}


if __name__ == "__main__":
    main()
