"""The GPU check's parts that run polyrl alone (benchmarks/gpu_check.py runs them in worker processes): the learner
on CUDA against the CPU, update throughput and MFU, the HF engine's rollout with a checked weight sync, and FSDP2
at world size 1 with a sharded checkpoint. Each part is a function of the device and its batch shape that returns
what it measured, with a one-line ``summary`` for the table; a check that does not hold raises ``CheckFailed``
with the numbers. ``gpu_check_compare.py`` holds the parts that run something else beside polyrl (TRL, and
transformers' compiled generate).

Models are Qwen3-shaped with random weights, built from their transformers config on the device
(``models/synthetic.py``: ``tiny``, ``0.6b``, ``1.7b``), given polyrl's float32 attention as ``load_model`` gives
every policy. The tokenizer is the one polyrl uses for its tiny random model (SmolLM2's, from polyrl's cache), needed
only for its special ids and, in the TRL part, for text.
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polyrl import AlgorithmConfig, OptimConfig, Trajectory

QWEN3_VOCAB = 151936
SMOLLM2_VOCAB = 49152
"""The tiny model's vocabulary: its tokenizer's, so that prompts made from text fit it."""
PAD = 2  # SmolLM2's pad and end-of-text id, which synthetic_model_config gives every synthetic model
PARITY_RTOL = 1e-4
"""The CUDA learner's entropy, gradient norm and gradients agree with the CPU's to this relative error (float32,
TF32 off): summation order differs, so bit-equality is not expected."""
GIB = 2**30

# Dense bf16 tensor-core peaks from NVIDIA's datasheets (the sparsity figures halved), by a part of the device name.
BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200 NVL", 835.5),
                    ("H200", 989.4), ("A100", 312.0))


class CheckFailed(AssertionError):
    """A part's check did not hold; ``result`` keeps what it measured."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class Setup:
    """Where a part runs: the device, and whether it is the CPU dry run."""

    device: torch.device
    smoke: bool
    workdir: Path

    @property
    def bf16(self) -> bool:
        """bf16 autocast and a bf16 sampling copy on the GPU; float32 in the CPU dry run, which checks plumbing."""
        return self.device.type == "cuda"

    @property
    def peak_tflops(self) -> float | None:
        if self.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.device)
        return next((peak for key, peak in BF16_PEAK_TFLOPS if key in name), None)


# --- models, batches, timing -------------------------------------------------------------------------------------

def vocab_of(size: str) -> int:
    return SMOLLM2_VOCAB if size == "tiny" else QWEN3_VOCAB


def build_model(size: str, device: torch.device | str, seed: int = 0, float32_attention: bool = True):
    """A Qwen3-shaped causal LM with random float32 weights, created on ``device``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from polyrl import synthetic_model_config, use_float32_attention

    hf_logging.set_verbosity_error()  # transformers' warnings and progress bars off, as load_model has them
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(synthetic_model_config("qwen3", size, vocab_size=vocab_of(size)),
                                                 dtype=torch.float32)
    model = model.to(device)
    model.config.use_cache = True
    if float32_attention:
        use_float32_attention(model)
    return model


def tokenizer():
    """SmolLM2's tokenizer, as polyrl's tiny random model uses it, from polyrl's cache (a GPU machine without
    the bundled model gets it from the bundle: scripts/gpu_bundle.sh)."""
    from polyrl import TINY_ALIAS, ModelNotFoundError, cache_dir, load_tokenizer

    try:
        return load_tokenizer(TINY_ALIAS)
    except ModelNotFoundError:
        raise ModelNotFoundError(f"SmolLM2's tokenizer is not in polyrl's cache {cache_dir()}: set POLYRL_CACHE to "
                                 "gpu-bundle/polyrl-cache (scripts/gpu_bundle.sh)") from None


def make_learner(model, bf16: bool, micro_batch: int, lr: float, **kwargs: Any):
    """The quickstart's objective (GRPO advantages, PPO clip, no KL reference) with AdamW at ``lr``."""
    from polyrl import Learner

    algo = AlgorithmConfig(regularisers={"track_kl": False})
    return Learner(model, algo, OptimConfig(lr=lr, micro_batch_size=micro_batch),
                   temperature=1.0, bf16=bf16, pad_id=PAD, total_steps=100, **kwargs)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def scored(trajectories: list[Trajectory]) -> list[Trajectory]:
    """Rewards 0 and 1 in turn within each group and GRPO's advantages from them, so every group has a gradient
    to follow (a random model earns nothing real)."""
    from polyrl import grpo_advantages

    rewards = torch.tensor([float(i % 2) for i in range(len(trajectories))])
    advantages = grpo_advantages(rewards, torch.tensor([t.group_id for t in trajectories]))
    for t, r, a in zip(trajectories, rewards.tolist(), advantages.tolist(), strict=True):
        t.reward, t.advantage = r, a
    return trajectories


def trajectory(group: int, prompt: list[int], response: list[int], logprobs: list[float]) -> Trajectory:
    ids = prompt + response
    return Trajectory(task="gpu-check", item_id=group, group_id=group, input_ids=ids,
                      loss_mask=[0] * len(prompt) + [1] * len(response), logprobs=[0.0] * len(prompt) + logprobs,
                      versions=[0] * len(ids))


def random_batch(groups: int, group_size: int, prompt_len: int, response_len: int, vocab: int,
                 seed: int = 0) -> list[Trajectory]:
    """Groups with random token ids and the behaviour log-prob of a near-uniform random model."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g, prompt in enumerate(random_prompts(groups, prompt_len, vocab, seed)):
        for _ in range(group_size):
            response = torch.randint(3, vocab, (response_len,), generator=gen).tolist()
            out.append(trajectory(g, prompt, response, [-math.log(vocab)] * response_len))
    return scored(out)


def from_completions(prompts: list[list[int]], groups: list) -> list[Trajectory]:
    """The engine's samples as trajectories, with their behaviour log-probs."""
    out = [trajectory(g, prompt, c.token_ids, c.logprobs)
           for g, (prompt, comps) in enumerate(zip(prompts, groups, strict=True)) for c in comps]
    return scored(out)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``fn()`` and its seconds, with the device's queued work finished on both sides of the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


# --- the parts ---------------------------------------------------------------------------------------------------

def parity(setup: Setup, groups: int, group_size: int, prompt_len: int, response_len: int) -> dict[str, Any]:
    """One float32 learner update of the tiny model on the GPU against the same update on the CPU (same weights,
    same batch). In the CPU dry run both run on the CPU: a check of determinism and of the plumbing."""
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    lr = 1e-3
    batch = random_batch(groups, group_size, prompt_len, response_len, SMOLLM2_VOCAB)
    cpu_model = build_model("tiny", "cpu")
    other = copy.deepcopy(cpu_model).to(setup.device)
    runs = []
    for model in (cpu_model, other):
        learner = make_learner(model, bf16=False, micro_batch=group_size, lr=lr)
        metrics = learner.update(copy.deepcopy(batch))
        # The learner leaves the clipped gradients of its last step in place.
        grads = torch.cat([p.grad.detach().flatten().cpu() for p in learner.params])
        weights = torch.cat([p.detach().flatten().cpu() for p in learner.params])
        runs.append((metrics, grads, weights))
    (m0, g0, w0), (m1, g1, w1) = runs

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(a), 1e-12)

    # The entropy for the forward pass (the loss itself is 0 at the first step: GRPO's advantages sum to 0 over
    # rows of one length), the gradient norm and the gradients for the backward pass.
    diffs = {"entropy": rel(m0["entropy"], m1["entropy"]), "grad_norm": rel(m0["grad_norm"], m1["grad_norm"]),
             "gradients": float((g1 - g0).norm() / g0.norm())}
    compared = f"{setup.device.type} vs cpu"
    result = {"compared": compared, "tolerance": PARITY_RTOL, "rows": len(batch), "entropy": _r(m0["entropy"], 6),
              **{f"{k}_rel_diff": _r(v, 3) for k, v in diffs.items()},
              "weights_max_diff_in_lr": _r(float((w1 - w0).abs().max()) / lr, 3),
              "summary": f"{compared}, float32: relative differences entropy {diffs['entropy']:.1e}, grad norm "
                         f"{diffs['grad_norm']:.1e}, gradients {diffs['gradients']:.1e} (tolerance {PARITY_RTOL:g})"}
    beyond = [k for k, v in diffs.items() if not v <= PARITY_RTOL]
    if beyond:
        raise CheckFailed(f"{compared}: {', '.join(beyond)} differ beyond {PARITY_RTOL:g}", result)
    return result


def update(setup: Setup, size: str, groups: int, group_size: int, prompt_len: int, response_len: int,
           micro_batch: int, repeats: int) -> dict[str, Any]:
    """Update throughput: ``Learner.update`` on one batch (bf16 autocast on the GPU), the first update apart as
    warm-up, then the median of ``repeats``. tokens/s counts every trajectory token (as train/tokens_per_s);
    the model FLOPs are 6 x parameters per position the learner computes (each group's prompt once, the output
    head on response positions only; ``roofline.training_flops``), attention's own products not counted."""
    from roofline import training_flops

    model = build_model(size, setup.device)
    learner = make_learner(model, setup.bf16, micro_batch, lr=1e-6)
    batch = random_batch(groups, group_size, prompt_len, response_len, vocab_of(size))
    _, first_s = timed(lambda: learner.update(batch), setup.device)
    seconds = statistics.median(timed(lambda: learner.update(batch), setup.device)[1] for _ in range(repeats))
    tokens = sum(len(t.input_ids) for t in batch)
    tflops = training_flops(model, batch)["flops"] / seconds / 1e12
    peak = setup.peak_tflops
    mfu = tflops / peak if peak else None
    params = sum(p.numel() for p in model.parameters())
    return {"params_b": _r(params / 1e9, 4), "bf16": setup.bf16, "rows": len(batch), "micro_batch": micro_batch,
            "tokens": tokens, "first_update_s": _r(first_s), "update_s": _r(seconds),
            "tokens_per_s": _r(tokens / seconds), "model_tflops_per_s": _r(tflops), "peak_bf16_tflops": peak,
            "mfu": _r(mfu, 3),
            "summary": (f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.1f}M")
                       + f" params, {len(batch)} rows x {prompt_len}+{response_len} tokens: "
                       f"{tokens / seconds:,.0f} tok/s, {tflops:.3g} TFLOP/s, MFU "
                       + (f"{mfu:.1%}" if mfu is not None else "- (no known peak)")}


def rollout_sync(setup: Setup, size: str, prompts: int, group_size: int, prompt_len: int, new_tokens: int,
                 micro_batch: int, repeats: int) -> dict[str, Any]:
    """The HF engine's rollout with its bf16 sampling copy (fixed length: no stop token ends a row), then one
    update on those samples and ``engine.sync()``, whose result is checked: every tensor of the engine's copy
    equals the learner's weight in bf16, the head's float32 copy equals the learner's, and the update changed
    the copy. The update's engine/learner mismatch (KL of the sampled tokens' log-probs) is recorded."""
    from polyrl import HFEngine

    model = build_model(size, setup.device)
    engine = HFEngine(model, tokenizer(), bf16=setup.bf16, bf16_weights=True)
    engine.stop_ids = set()  # every row decodes every step, so tokens/s is over a known amount of work
    prompt_ids = random_prompts(prompts, prompt_len, vocab_of(size), seed=0)
    engine.generate(prompt_ids, n=group_size, max_new_tokens=8)  # warm-up: kernels, allocator
    times = []
    for seed in range(repeats):
        groups, seconds = timed(lambda s=seed: engine.generate(prompt_ids, n=group_size, max_new_tokens=new_tokens,
                                                               seed=s), setup.device)
        times.append(seconds)
    rollout_s = statistics.median(times)
    generated = sum(len(c.token_ids) for g in groups for c in g)
    batch = from_completions(prompt_ids, groups)
    learner = make_learner(model, setup.bf16, micro_batch, lr=1e-4)  # big enough to move bf16 weights
    before = [p.detach().clone() for p in engine.model.parameters()]
    metrics, update_s = timed(lambda: learner.update(batch), setup.device)
    _, sync_s = timed(engine.sync, setup.device)
    pairs = list(zip(model.named_parameters(), engine.model.parameters(), strict=True))
    stale = [n for (n, p), q in pairs if not torch.equal(q, p.detach().to(q.dtype))]
    head_equal = torch.equal(engine.head_weight, model.get_output_embeddings().weight)
    changed = sum(not torch.equal(b, q) for b, (_, q) in zip(before, pairs, strict=True))
    sync = f"{len(pairs) - len(stale)}/{len(pairs)} tensors equal the learner's, {changed} changed by the update"
    result = {"rows": prompts * group_size, "new_tokens": new_tokens, "rollout_s": _r(rollout_s),
              "rollout_tokens_per_s": _r(generated / rollout_s), "update_s": _r(update_s), "sync_s": _r(sync_s),
              "step_s": _r(rollout_s + update_s + sync_s), "sync_check": sync, "head_copy_equal": head_equal,
              "mismatch_kl": _r(metrics.get("mismatch/kl"), 3),
              "summary": f"{generated / rollout_s:,.0f} tok/s ({prompts}x{group_size} rows, {new_tokens} new); "
                         f"sync {sync_s * 1e3:.0f} ms: {sync}" + ("" if head_equal else "; head copy differs")}
    if stale or not head_equal or not changed:
        raise CheckFailed(f"weight sync: {sync}" + ("" if head_equal else ", the head's copy differs"), result)
    return result


def fsdp_checkpoint(setup: Setup, size: str, groups: int, group_size: int, prompt_len: int, response_len: int,
                    micro_batch: int) -> dict[str, Any]:
    """FSDP2 at world size 1: the learner sharded under a process group of one rank (NCCL on the GPU), one
    update, the whole weights gathered into an engine copy (checked equal), a sharded checkpoint saved and loaded
    into a second learner built from other weights (weights, AdamW moments and trainer state checked equal),
    and the same next update on both (entropy and gradient norm compared)."""
    from torch.distributed.tensor import DTensor

    from polyrl import free_port, full_tensor, gather_into, join_group, leave_group, load_sharded, save_sharded

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    join_group("auto", 300.0, setup.device)
    try:
        batch = random_batch(groups, group_size, prompt_len, response_len, vocab_of(size))
        model = build_model(size, setup.device)
        engine_model = copy.deepcopy(model)  # as build_run copies it for the engine before sharding
        learner = make_learner(model, setup.bf16, micro_batch, lr=1e-4, fsdp=True)
        sharded = all(isinstance(p, DTensor) for p in learner.params)
        _, update_s = timed(lambda: learner.update(batch), setup.device)
        _, gather_s = timed(lambda: gather_into(model, engine_model), setup.device)
        full = {n: full_tensor(p) for n, p in model.named_parameters()}
        engine_params = dict(engine_model.named_parameters())
        gathered_ok = all(torch.equal(engine_params[n], t) for n, t in full.items())

        path = setup.workdir / "fsdp" / "checkpoints" / "step-1"
        extra = {"step": 1, "learner": {"scheduler": learner.scheduler.state_dict()}}
        _, save_s = timed(lambda: save_sharded(path, learner.policy_pass, learner.optimizer, extra), setup.device)
        nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        resumed = make_learner(build_model(size, setup.device, seed=1), setup.bf16, micro_batch, lr=1e-4, fsdp=True)
        state, load_s = timed(lambda: load_sharded(path, resumed.policy_pass, resumed.optimizer), setup.device)
        weights_ok = all(torch.equal(full_tensor(p), full[n]) for n, p in resumed.model.named_parameters())
        moments_ok = all(_moments_equal(learner.optimizer.state[a], resumed.optimizer.state[b], full_tensor)
                         for a, b in zip(learner.params, resumed.params, strict=True))
        resumed.scheduler.load_state_dict(state["learner"]["scheduler"])
        # The next update's entropy and gradient norm on both (its loss is 0: see parity).
        after = [each.update(batch) for each in (learner, resumed)]
        next_diff = max(abs(after[0][k] - after[1][k]) / max(abs(after[0][k]), 1e-12) for k in ("entropy", "grad_norm"))
    finally:
        leave_group()
    checks = {"parameters sharded (DTensors)": sharded, "gathered engine copy equal": gathered_ok,
              "loaded weights equal": weights_ok, "loaded AdamW moments equal": moments_ok,
              "trainer state equal": state == extra,
              f"next update's entropy and gradient norm within {PARITY_RTOL:g}": next_diff <= PARITY_RTOL}
    result = {"update_s": _r(update_s), "gather_s": _r(gather_s), "checkpoint_gib": _r(nbytes / GIB),
              "save_s": _r(save_s), "load_s": _r(load_s), "next_update_rel_diff": _r(next_diff, 3),
              "checks": checks,
              "summary": f"update {update_s:.2f} s; checkpoint {nbytes / GIB:.2f} GiB saved {save_s:.1f} s, loaded "
                         f"{load_s:.1f} s; {sum(checks.values())}/{len(checks)} checks hold"}
    failed = [k for k, ok in checks.items() if not ok]
    if failed:
        raise CheckFailed("fsdp: not " + "; not ".join(failed), result)
    return result


def _moments_equal(a: dict, b: dict, whole: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Two AdamW states of one parameter hold the same moments (``whole`` gathers a sharded one)."""
    return all(torch.equal(whole(a[key]), whole(b[key])) for key in ("exp_avg", "exp_avg_sq"))
