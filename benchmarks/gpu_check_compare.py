"""The GPU check's parts that measure something beside polyrl (benchmarks/gpu_check.py runs them): TRL's
GRPOTrainer against polyrl on the same model and batch, and transformers' own generate with a static KV cache and
CUDA graphs against the HF engine's rollout. Helpers and the other parts: ``gpu_check_parts.py``."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch
from gpu_check_parts import (
    GIB,
    PAD,
    Setup,
    _r,
    build_model,
    from_completions,
    make_learner,
    random_prompts,
    timed,
    tokenizer,
    vocab_of,
)


def _peaks(device: torch.device, reset: bool) -> dict[str, float | None]:
    """The peak GPU memory torch allocated and reserved since the last reset, in GiB, under the keys the worker
    records a part's peaks by (empty on the CPU); ``reset`` starts a new measurement from here."""
    if device.type != "cuda":
        return {}
    peaks = {"peak_gpu_gib": _r(torch.cuda.max_memory_allocated(device) / GIB, 3),
             "peak_gpu_reserved_gib": _r(torch.cuda.max_memory_reserved(device) / GIB, 3)}
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peaks


def trl_ratio(setup: Setup, size: str, prompts: int, group_size: int, prompt_len: int, new_tokens: int,
              micro_batch: int, steps: int) -> dict[str, Any]:
    """TRL's GRPOTrainer and polyrl on the same random weights and the same batch: ``prompts`` x ``group_size``
    samples of at most ``new_tokens`` tokens a step from the same prompt texts, micro-batches of ``micro_batch``
    (TRL: gradient accumulation), bf16 autocast over float32 weights on the GPU, AdamW, no KL reference, rewards 0
    and 1 in turn. Gradient checkpointing is off on both sides (TRL turns it on by default); TRL generates with
    transformers' generate, as it does without vLLM. polyrl's step is rollout, update and sync. Each side's first
    step is warm-up; the ratio is TRL's median step time over polyrl's."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl import __version__ as trl_version

    device = setup.device
    tok = tokenizer()
    # Text prompts, as TRL takes them: random ids decoded; polyrl reads the same texts through the same tokenizer.
    texts = [tok.decode(ids) for ids in random_prompts(prompts * steps, prompt_len, len(tok), seed=0)]
    prompt_ids = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]

    polyrl_times = _polyrl_steps(setup, size, prompt_ids, prompts, group_size, new_tokens, micro_batch)
    gc.collect()  # polyrl's model and optimizer are gone before TRL builds its own
    # polyrl's peaks, then a new measurement for TRL's own. The part's peak is the larger: polyrl's are returned
    # under the worker's keys, and the worker keeps the larger of them and its own reading (TRL's).
    polyrl_peaks = _peaks(device, reset=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.times.append(time.perf_counter() - self.t0)

    def reward(completions: list, **_: Any) -> list[float]:
        return [float(i % 2) for i in range(len(completions))]

    rows = prompts * group_size
    config = GRPOConfig(
        output_dir=str(setup.workdir / "trl"), per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=rows // micro_batch, num_generations=group_size,
        max_completion_length=new_tokens, temperature=1.0, learning_rate=1e-6, beta=0.0, max_steps=steps,
        gradient_checkpointing=False, bf16=setup.bf16, use_cpu=device.type == "cpu", seed=0, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True,
    )
    clock = Clock()
    trainer = GRPOTrainer(model=build_model(size, device, float32_attention=False), reward_funcs=reward,
                          args=config, train_dataset=Dataset.from_list([{"prompt": t} for t in texts]),
                          processing_class=tok, callbacks=[clock])
    trainer.train()
    trl_peaks = _peaks(device, reset=False)
    polyrl_s = statistics.median(polyrl_times[1:] or polyrl_times)
    trl_s = statistics.median(clock.times[1:] or clock.times)
    ratio = trl_s / polyrl_s
    return {"trl": trl_version, "rows": rows, "new_tokens": new_tokens, "steps": steps,
            "polyrl_step_s": _r(polyrl_s), "trl_step_s": _r(trl_s), "trl_over_polyrl": _r(ratio, 3),
            "polyrl_peak_gpu_gib": polyrl_peaks.get("peak_gpu_gib"), "trl_peak_gpu_gib": trl_peaks.get("peak_gpu_gib"),
            **polyrl_peaks,
            "summary": f"TRL {trl_version} {trl_s:.2f} s a step, polyrl {polyrl_s:.2f} s ({rows} rows, "
                       f"{new_tokens} new): TRL takes {ratio:.2f}x polyrl's time"}


def _polyrl_steps(setup: Setup, size: str, prompt_ids: list[list[int]], prompts: int, group_size: int,
                  new_tokens: int, micro_batch: int) -> list[float]:
    """Seconds of each polyrl step (rollout, update, sync) over consecutive ``prompts`` of ``prompt_ids``."""
    from polyrl import HFEngine

    model = build_model(size, setup.device)
    engine = HFEngine(model, tokenizer(), bf16=setup.bf16, bf16_weights=True)
    learner = make_learner(model, setup.bf16, micro_batch, lr=1e-6)

    def step(k: int) -> None:
        rows = prompt_ids[k * prompts:(k + 1) * prompts]
        learner.update(from_completions(rows, engine.generate(rows, n=group_size, max_new_tokens=new_tokens,
                                                              seed=k)))
        engine.sync()

    return [timed(lambda k=k: step(k), setup.device)[1] for k in range(len(prompt_ids) // prompts)]


def rollout_compiled(setup: Setup, size: str, prompts: int, group_size: int, prompt_len: int, new_tokens: int,
                     repeats: int) -> dict[str, Any]:
    """transformers' generate on a bf16 copy of the same model and rows (fixed length), with a static KV cache,
    which on CUDA transformers compiles with torch.compile's reduce-overhead mode (CUDA graphs). Not polyrl's
    engine, which has neither: the reference that says whether they would pay there (compare rollout_sync's
    tokens/s). The first call, which compiles and captures, is timed apart. On the CPU the static cache runs
    eager."""
    cuda = setup.device.type == "cuda"
    model = build_model(size, setup.device, float32_attention=False).to(torch.bfloat16 if setup.bf16 else torch.float32)
    ids = torch.tensor(random_prompts(prompts, prompt_len, vocab_of(size), seed=0), device=setup.device)
    ids = ids.repeat_interleave(group_size, 0)

    def generate() -> Any:
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=PAD,
                              cache_implementation="static", disable_compile=not cuda)

    _, first_s = timed(generate, setup.device)
    seconds = statistics.median(timed(generate, setup.device)[1] for _ in range(repeats))
    tokens = ids.shape[0] * new_tokens
    # What generate did, not what it was asked: transformers keeps the compiled forward it built on the model
    # (a private attribute; where a version names it otherwise, "not confirmed" rather than a guess).
    compiled = True if hasattr(model, "_compiled_call") else (None if cuda else False)
    how = {True: "static cache, compiled (CUDA graphs)", None: "static cache, compilation not confirmed",
           False: "static cache, eager" + ("" if cuda else " (CUDA graphs need CUDA)")}[compiled]
    return {"rows": ids.shape[0], "new_tokens": new_tokens, "compiled": compiled, "first_call_s": _r(first_s),
            "rollout_s": _r(seconds), "rollout_tokens_per_s": _r(tokens / seconds),
            "summary": f"transformers generate, {how}: {tokens / seconds:,.0f} tok/s; first call {first_s:.0f} s"}
