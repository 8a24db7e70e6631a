"""The fused decode path's C++ kernels (polyrl/engines/native) against the torch operations they replace.

Part 1 times each kernel and its torch counterpart on SmolLM2-135M's shapes (9 query heads over 3 key/value
heads of 64, hidden 576, MLP 1536, vocabulary 49152) at 16, 64 and 256 rows, with 100 cached positions for
attention (the torch attention on one buffer per row; the kernel on a 52-position prompt shared by groups of 8
and 48 positions of each row's own). Part 2 samples SmolLM2 with the fused path twice, native kernels off and
on, alternating in one process, at each width (exactly 64 new tokens per row, the roofline's setup).

    python benchmarks/native_kernels.py        # ~2 min; writes benchmarks/results/native_kernels.json

With ``--dtype float32`` part 1 times the float32 kernels (the path of a CPU without native bf16; run it under
``ATEN_CPU_CAPABILITY=avx2`` to time the AVX2 build) against the same torch operations in float32, and the
native ``linear`` against ``F.linear`` on the output head's shape; rollouts of that path are in
benchmarks/avx2_path.py, so part 2 is skipped.

    ATEN_CPU_CAPABILITY=avx2 python benchmarks/native_kernels.py --dtype float32 \
        --out benchmarks/results/native_kernels_float32_avx2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

HEADS, KV_HEADS, D, HIDDEN, INNER, VOCAB = 9, 3, 64, 576, 1536, 49152


def best_of(fn, repeats: int = 5, calls: int = 20) -> float:
    """Median over ``repeats`` of the mean microseconds of ``calls`` calls."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def kernels(rows: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, dict[str, float]]:
    """Microseconds per call of each kernel and its torch counterpart, in ``dtype`` (bfloat16 or float32)."""
    from polyrl import (
        KVBuffers,
        PromptSharedKV,
        native_linear,
        native_ops,
        rescore_top,
        rms_norm,
        rotate_half,
        sample_tokens,
    )

    ops = native_ops()
    gen = torch.Generator().manual_seed(0)
    x, delta, w = (torch.randn(s, generator=gen).to(dtype) for s in ((rows, HIDDEN), (rows, HIDDEN), (HIDDEN,)))
    out = {}
    out["residual add + RMSNorm"] = {
        "torch_us": best_of(lambda: rms_norm(x + delta, w, 1e-5)),
        "native_us": best_of(lambda: ops.add_rms_norm(x.clone(), delta, w, 1e-5)),
    }
    qkv = torch.randn((rows, (HEADS + 2 * KV_HEADS) * D), generator=gen).to(dtype)
    cos, sin = (torch.randn((rows, 1, D), generator=gen).to(dtype) for _ in range(2))
    kv_torch = KVBuffers(1, rows, KV_HEADS, 99, D, dtype)  # float32 keys, as the torch path keeps them
    kv_torch.length = 99
    shared = PromptSharedKV(1, torch.ones((max(rows // 8, 1), 52), dtype=torch.long), KV_HEADS, D, dtype)
    shared.batch_repeat_interleave(rows // max(rows // 8, 1))
    shared.own.reserve(48)
    shared.own.length = 47

    def torch_rope_write():
        qk = qkv[:, : (HEADS + KV_HEADS) * D].view(rows, HEADS + KV_HEADS, D)
        qk = qk * cos + rotate_half(qk) * sin
        kv_torch.write(0, qk[:, HEADS:], qkv[:, (HEADS + KV_HEADS) * D :].view(rows, KV_HEADS, D))

    out["rotary + key/value write"] = {
        "torch_us": best_of(torch_rope_write),
        "native_us": best_of(lambda: ops.rope_write(qkv, cos, sin, shared.own.keys[0], shared.own.values[0], 47,
                                                    HEADS, KV_HEADS)),
    }
    mask = torch.ones((rows, 100), dtype=torch.long)
    bias = kv_torch.attention_bias(mask)
    q = qkv[:, : HEADS * D].reshape(rows, KV_HEADS, HEADS // KV_HEADS, D)
    out["attention, 100 positions"] = {
        "torch_us": best_of(lambda: kv_torch.attend(0, q, bias, D**-0.5)),
        "native_us": best_of(lambda: ops.attention(qkv, shared.prefix_keys[0], shared.prefix_values[0],
                                                   shared.prefix_bias, shared.row_prompt, shared.own.keys[0],
                                                   shared.own.values[0], None, 48, D**-0.5, HEADS, KV_HEADS)),
    }
    gate_up = torch.randn((rows, 2 * INNER), generator=gen).to(dtype)
    out["SiLU-and-multiply"] = {
        "torch_us": best_of(lambda: (lambda g, u: F.silu(g) * u)(*gate_up.chunk(2, dim=-1))),
        "native_us": best_of(lambda: ops.silu_mul(gate_up)),
    }
    head = torch.randn((VOCAB, HIDDEN), generator=gen) * 0.05
    hidden = torch.randn((rows, HIDDEN), generator=gen).to(dtype)
    if dtype == torch.float32:  # the whole head in float32: the native linear against F.linear
        out["output head matmul (576 -> 49152)"] = {
            "torch_us": best_of(lambda: F.linear(hidden, head), calls=5),
            "native_us": best_of(lambda: native_linear(hidden, head), calls=5),
        }
        logits = hidden @ head.T
    else:
        low = (hidden.float() @ head.T).to(dtype)

        def torch_rescore():
            return rescore_top(low, hidden, head, 32)

        out["rescored head (after its bf16 matmul)"] = {
            "torch_us": best_of(torch_rescore, calls=5),
            "native_us": best_of(lambda: ops.rescore_head(low, hidden, head, 32), calls=5),
        }
        logits = torch_rescore()
    out["sampling"] = {
        "torch_us": best_of(lambda: sample_tokens(logits, 1.0, 1.0, gen), calls=5),
        "native_us": best_of(lambda: sample_tokens(logits, 1.0, 1.0, gen, native_kernel=True), calls=5),
    }
    return out


def rollout(widths: list[int], repeats: int) -> dict[int, dict[str, float]]:
    from roofline import build, measure_rollout, prompt_ids

    _, tokenizer, engine, _ = build("smollm2-135m-instruct", 16)
    prompt = prompt_ids(tokenizer)
    result = {}
    for rows in widths:
        engine.generate([prompt] * (rows // 8), n=8, max_new_tokens=8)  # warm-up at this width
        runs: dict[str, list[float]] = {"torch": [], "native": []}
        for _ in range(repeats):
            for label, on in (("torch", False), ("native", True)):
                engine.fast.native = engine.native_sampling = on
                runs[label].append(measure_rollout(engine, prompt, rows // 8, 8, 64, 1))
        engine.fast.native = engine.native_sampling = True
        result[rows] = {f"{k}_tokens_per_s": statistics.median(v) for k, v in runs.items()}
        print(f"rollout at {rows} rows: torch operations {result[rows]['torch_tokens_per_s']:.0f} tok/s, "
              f"native kernels {result[rows]['native_tokens_per_s']:.0f}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--repeats", type=int, default=3, help="alternating rollout runs per width")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "native_kernels.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    from polyrl import keep_freed_memory, native_kernels_available, native_ops

    keep_freed_memory()  # as every run does (runtime.keep_freed_memory): no page faults on reused buffers
    if not native_kernels_available():
        raise SystemExit("the native kernels did not build on this machine (see the warning above)")
    per_kernel = {}
    for rows in args.rows:
        per_kernel[rows] = kernels(rows, dtype)
        for name, t in per_kernel[rows].items():
            print(f"{rows:>4} rows  {name:<40} torch {t['torch_us']:8.1f} us   native {t['native_us']:8.1f} us",
                  flush=True)
    result = {"threads": torch.get_num_threads(), "dtype": args.dtype, "isa": native_ops().isa(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "kernels_us": per_kernel,
              "rollout": rollout(args.rows, args.repeats) if dtype == torch.bfloat16 else None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
