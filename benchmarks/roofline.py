"""This machine's roofline and polyrl's rollout and training throughput on SmolLM2-135M as a fraction of it.

The roofline is measured in the same process right before each throughput measurement (matmul GFLOP/s in
float32 and bfloat16, memory read bandwidth), so the fraction stays meaningful on a machine whose speed
varies, e.g. one shared with other jobs. Every figure is the median of ``--repeats`` runs.

    python benchmarks/roofline.py                              # SmolLM2-135M, ~3 min; writes the JSON below
    python benchmarks/roofline.py --model tiny-random --repeats 1 --out /tmp/r.json   # a check of the script

Bounds, per token of SmolLM2 (N = 134.5M parameters with the tied head counted once):
  rollout: 2N FLOPs per generated token (compute bound) and, per decode step, the bytes of the sampling copy
    (bf16 weights, head included) read once for the whole batch (memory bound); the attainable rate is the
    lower. Measured for the engine's fused decode path (the default) and for the transformers model it replaces,
    at the quickstart's 2 x 8 rows and at each ``--wide-prompts`` x 8 rows (64 and 256 by default).
  training: 6N FLOPs per token (forward + backward) at the bf16 matmul rate, applied two ways. Per trajectory
    token (prompt + response of every sample; the rate the loop logs as train/tokens_per_s): more than the
    hardware does, since the learner runs a group's shared prompt once. Per position the learner computes
    (each group's prompt once, each response), with the output head counted only on response positions, where
    it runs: the hardware utilisation. Also measured with prompt sharing off (every position computed).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "What is 3 + 4? Answer with just the number."


def median_time(fn: Callable[[], object], repeats: int, min_s: float = 0.0, warmup: bool = True,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of one call of ``fn`` over ``repeats`` timings (each loops until ``min_s`` has passed).
    ``clock``: wall time, or ``time.process_time`` (the CPU time of a one-thread process: what the call cost
    while it ran, not counting the time other processes held its core)."""
    if warmup:
        fn()  # allocator, oneDNN kernel selection
    times = []
    for _ in range(repeats):
        calls, start = 0, clock()
        while True:
            fn()
            calls += 1
            if clock() - start >= min_s:
                break
        times.append((clock() - start) / calls)
    return statistics.median(times)


def measure_roofline(repeats: int = 5, dtypes: tuple[str, ...] = ("fp32", "bf16"),
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Peak-ish matmul GFLOP/s (of ``dtypes``: fp32, bf16) and memory read bandwidth (GB/s) of this machine, now."""
    out = {}
    m = k = n = 1024
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if name not in dtypes:
            continue
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        seconds = median_time(lambda a=a, b=b: a @ b, repeats, 0.2, clock=clock)
        out[f"matmul_gflops_{name}"] = 2 * m * k * n / seconds / 1e9
    x = torch.ones(128 * 2**20 // 4)  # 128 MiB: far larger than the caches, like a decode step's weights
    out["mem_read_gbs"] = x.numel() * 4 / median_time(x.sum, repeats, 0.2, clock=clock) / 1e9
    return out


def model_numbers(model) -> dict[str, float]:
    """Parameter count (tied head once) and the bytes one decode step reads from the engine's sampling copy."""
    params = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings().weight.numel()
    # The fused path reads bf16 weights, head included (embedding lookups and the float32 rescoring of the
    # top-32 logits per row are negligible); the transformers path reads the head in float32.
    return {"params": params, "decode_step_bytes": 2 * params, "decode_step_bytes_transformers": 2 * (params + head)}


def prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def measure_rollout(engine, prompt: list[int], prompts: int, group: int, new_tokens: int, repeats: int) -> float:
    """Generated tokens per second for ``prompts`` x ``group`` samples of exactly ``new_tokens`` tokens each."""
    stop_ids, engine.stop_ids = engine.stop_ids, set()  # fixed length: every row decodes every step
    try:
        seconds = median_time(
            lambda: engine.generate([prompt] * prompts, n=group, max_new_tokens=new_tokens, seed=0), repeats,
            warmup=False,  # rollout_trajectories ran the same generation just before
        )
    finally:
        engine.stop_ids = stop_ids
    return prompts * group * new_tokens / seconds


def matmul_ceiling(engine, rows: int, repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Tokens/s of a decode step's matmuls alone at ``rows`` rows (every layer's fused weights and the head,
    bf16 or float32, as the fused path runs them, on random inputs): the rate the decode path would reach if
    nothing but its matmuls took time."""
    dec = engine.fast
    x_h = torch.randn(rows, dec.final_norm.numel(), dtype=dec.dtype)
    # Packed weights do not keep the [out, in] shape: the MLP's inner width is read off a product.
    x_i = torch.randn(rows, dec.linear(x_h, dec.layers[0].gate_up).shape[-1] // 2, dtype=dec.dtype)
    x_a = torch.randn(rows, dec.heads * dec.head_dim, dtype=dec.dtype)

    def step():
        for layer in dec.layers:
            dec.linear(x_h, layer.qkv, layer.qkv_bias)
            dec.linear(x_a, layer.o)
            dec.linear(x_h, layer.gate_up)
            dec.linear(x_i, layer.down)
        dec.linear(x_h, dec.head_low if dec.head_low is not None else dec.head_weight)

    return rows / median_time(step, repeats, 0.5, clock=clock)


def rollout_trajectories(engine, prompt: list[int], prompts: int, group: int, new_tokens: int) -> list:
    """Scored-looking trajectories from real samples, with random advantages so every token has a gradient."""
    from polyrl import Trajectory

    stop_ids, engine.stop_ids = engine.stop_ids, set()
    try:
        groups = engine.generate([prompt] * prompts, n=group, max_new_tokens=new_tokens, seed=0)
    finally:
        engine.stop_ids = stop_ids
    gen = torch.Generator().manual_seed(0)
    out = []
    for g, comps in enumerate(groups):
        for c in comps:
            ids = prompt + c.token_ids
            out.append(Trajectory(
                task="bench", item_id=g, group_id=g, input_ids=ids,
                loss_mask=[0] * len(prompt) + [1] * len(c.token_ids),
                logprobs=[0.0] * len(prompt) + c.logprobs, versions=[0] * len(ids),
                advantage=float(torch.randn((), generator=gen)),
            ))
    return out


def measure_training(learner, trajectories: list, repeats: int) -> float:
    """Seconds of one ``Learner.update`` over ``trajectories`` (median)."""
    return median_time(lambda: learner.update(trajectories), repeats, warmup=False)


def training_flops(model, trajectories: list, share_prefix: bool = True) -> dict[str, float]:
    """Positions and FLOPs one update computes: the decoder body (6 x its parameters) at every position it
    runs, the output head (6 x vocab x hidden) at response positions only. With ``share_prefix`` each distinct
    prompt runs once (``learner.response_hidden``)."""
    head = model.get_output_embeddings().weight.numel()
    body = sum(p.numel() for p in model.parameters()) - head  # tied: the embedding table is the head
    prompts = {tuple(t.input_ids[: t.prompt_len]) for t in trajectories} if share_prefix else None
    prompt_positions = (sum(map(len, prompts)) if share_prefix
                        else sum(t.prompt_len for t in trajectories))
    response_positions = sum(len(t.input_ids) - t.prompt_len for t in trajectories)
    positions = prompt_positions + response_positions
    return {"positions": positions, "flops": 6 * body * positions + 6 * head * response_positions}


def build(model_name: str, micro_batch: int, total_steps: int = 1000, checkpointing: bool = False):
    """SmolLM2's model, tokenizer, engine and learner as the quickstart sets them up; ``checkpointing``: layers
    recomputed in the backward pass (the quickstart's ``learner.activation_checkpointing``)."""
    from polyrl import (
        AlgorithmConfig,
        HFEngine,
        Learner,
        LearnerConfig,
        OptimConfig,
        keep_freed_memory,
        load_model,
        load_tokenizer,
    )

    keep_freed_memory()  # as every training run does (runtime.keep_freed_memory)
    tokenizer = load_tokenizer(model_name)
    model = load_model(model_name, None, seed=0)
    engine = HFEngine(model, tokenizer, bf16=True, bf16_weights=True)  # fused decode path on Llama-family models
    # The quickstart's objective; a tiny learning rate keeps the weights (and so the samples) nearly fixed.
    learner = Learner(
        model, AlgorithmConfig(regularisers={"track_kl": False}), OptimConfig(lr=1e-9, micro_batch_size=micro_batch),
        temperature=1.0, bf16=True, pad_id=engine.pad_id, total_steps=total_steps,
        sharding=LearnerConfig(activation_checkpointing=checkpointing),
    )
    return model, tokenizer, engine, learner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=16, help="the quickstart's: the whole 2 x 8 batch")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--wide-prompts", type=int, nargs="+", default=[8, 32],
                    help="prompts of each wider rollout (x --group rows)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "roofline.json")
    ap.add_argument("--skip-unshared", action="store_true", help="skip the training run with prompt sharing off")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer, engine, learner = build(args.model, args.micro_batch)
    sizes = model_numbers(model)
    prompt = prompt_ids(tokenizer)
    batch = args.prompts * args.group

    trajectories = rollout_trajectories(engine, prompt, args.prompts, args.group, args.new_tokens)
    roof_r = measure_roofline()
    rollout = measure_rollout(engine, prompt, args.prompts, args.group, args.new_tokens, args.repeats)
    compute_bound = roof_r["matmul_gflops_bf16"] * 1e9 / (2 * sizes["params"])
    memory_bound = batch * roof_r["mem_read_gbs"] * 1e9 / sizes["decode_step_bytes"]
    print(f"roofline {roof_r}; rollout {rollout:.1f} tok/s, bounds: compute {compute_bound:.0f}, "
          f"memory {memory_bound:.0f}", flush=True)  # shown early: the training half takes longer
    wide = {}  # rows -> tokens/s
    for prompts in args.wide_prompts:
        engine.generate([prompt] * prompts, n=args.group, max_new_tokens=8)  # warm-up at this width
        wide[prompts * args.group] = measure_rollout(engine, prompt, prompts, args.group, args.new_tokens, args.repeats)
    from polyrl import HFEngine

    ceilings = {rows: matmul_ceiling(engine, rows, args.repeats) for rows in [batch, *wide]}
    torch_ops = HFEngine(model, tokenizer, bf16=True, bf16_weights=True, native_kernels=False)
    torch_ops.generate([prompt] * args.prompts, n=args.group, max_new_tokens=8)
    rollout_torch_ops = measure_rollout(torch_ops, prompt, args.prompts, args.group, args.new_tokens, args.repeats)
    del torch_ops
    reference = HFEngine(model, tokenizer, bf16=True, bf16_weights=True, fast_decode=False)
    reference.generate([prompt] * args.prompts, n=args.group, max_new_tokens=8)
    rollout_ref = measure_rollout(reference, prompt, args.prompts, args.group, args.new_tokens, args.repeats)
    del reference
    widths = ", ".join(f"{rows} rows: {v:.1f}" for rows, v in wide.items())
    print(f"rollout {widths} tok/s; transformers path at {batch} rows: {rollout_ref:.1f} tok/s", flush=True)

    for _ in range(2):  # warm-up: optimizer states; the allocator's reuse pool fills over the first two updates
        learner.update(trajectories)
    roof_t = measure_roofline()
    peak = roof_t["matmul_gflops_bf16"] * 1e9
    train_s = measure_training(learner, trajectories, args.repeats)
    tokens = sum(len(t.input_ids) for t in trajectories)
    training, train_bound = tokens / train_s, peak / (6 * sizes["params"])
    shared = training_flops(model, trajectories)
    unshared_result = None
    if not args.skip_unshared:
        learner.share_prefix = False
        for _ in range(2):
            learner.update(trajectories)
        unshared_s = measure_training(learner, trajectories, args.repeats)
        learner.share_prefix = True
        unshared = training_flops(model, trajectories, share_prefix=False)
        unshared_result = {"seconds_per_update": unshared_s, "tokens_per_s": tokens / unshared_s,
                           "positions": unshared["positions"],
                           "utilisation": unshared["flops"] / unshared_s / peak}

    result = {
        "model": args.model, **sizes, "threads": torch.get_num_threads(), "machine": platform.processor()
        or platform.machine(), "setup": {k: v for k, v in vars(args).items() if k != "out"},
        "roofline_before_rollout": roof_r, "roofline_before_training": roof_t,
        "rollout": {
            "tokens_per_s": rollout, "compute_bound_tokens_per_s": compute_bound,
            "memory_bound_tokens_per_s": memory_bound,
            "fraction_of_compute_bound": rollout / compute_bound,
            "fraction_of_attainable": rollout / min(compute_bound, memory_bound),
            "rows": batch,
            "transformers_path_tokens_per_s": rollout_ref,
            "native_kernels": bool(engine.fast is not None and engine.fast.native),
            "torch_operations_tokens_per_s": rollout_torch_ops,
            "matmuls_alone_tokens_per_s": ceilings[batch],
            "matmuls_alone_fraction_of_compute_bound": ceilings[batch] / compute_bound,
            "wide": [
                {"rows": rows, "tokens_per_s": v, "fraction_of_compute_bound": v / compute_bound,
                 "matmuls_alone_tokens_per_s": ceilings[rows],
                 "matmuls_alone_fraction_of_compute_bound": ceilings[rows] / compute_bound}
                for rows, v in wide.items()
            ],
        },
        "training": {
            "tokens_per_s": training, "bound_tokens_per_s": train_bound, "fraction_of_bound": training / train_bound,
            "tokens_per_update": tokens, "seconds_per_update": train_s,
            "positions_computed": shared["positions"], "positions_per_s": shared["positions"] / train_s,
            "utilisation": shared["flops"] / train_s / peak,
            "prompt_sharing_off": unshared_result,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    r, t = result["rollout"], result["training"]
    print(f"roofline: {roof_r['matmul_gflops_fp32']:.0f} GFLOP/s fp32, {roof_r['matmul_gflops_bf16']:.0f} bf16, "
          f"{roof_r['mem_read_gbs']:.1f} GB/s")
    print(f"rollout: {rollout:.1f} tok/s = {r['fraction_of_compute_bound']:.0%} of the bf16 compute bound "
          f"({compute_bound:.0f}), {r['fraction_of_attainable']:.0%} of the attainable "
          f"{min(compute_bound, memory_bound):.0f}")
    print(f"  its matmuls alone: {r['matmuls_alone_tokens_per_s']:.0f} tok/s = "
          f"{r['matmuls_alone_fraction_of_compute_bound']:.0%} of the bound")
    for w in r["wide"]:
        print(f"rollout at {w['rows']} rows: {w['tokens_per_s']:.1f} tok/s = {w['fraction_of_compute_bound']:.0%}; "
              f"its matmuls alone {w['matmuls_alone_fraction_of_compute_bound']:.0%}")
    print(f"the fused path with torch operations (engine.native_kernels off) at {batch} rows: "
          f"{rollout_torch_ops:.1f} tok/s; the transformers path: {rollout_ref:.1f} tok/s")
    print(f"training: {training:.1f} trajectory tok/s = {t['fraction_of_bound']:.0%} of the bf16 bound "
          f"({train_bound:.0f}); {t['positions_per_s']:.1f} computed positions/s, utilisation {t['utilisation']:.0%}")
    if unshared_result:
        print(f"training, prompt sharing off: {unshared_result['tokens_per_s']:.1f} tok/s, "
              f"utilisation {unshared_result['utilisation']:.0%}")


if __name__ == "__main__":
    main()
