"""Does this CPU compute bfloat16 natively? Matmul GFLOP/s in float32 and bfloat16 at a decode step's shape and
at a training micro-batch's, and what ``model.bf16: auto`` resolves to here.

On an x86 CPU without AVX512-BF16 or AMX (AVX2 only) torch emulates bf16 matmuls, many times slower than
float32; ``auto`` then runs the policy and the sampling engine in float32 (docs/performance.md, "CPUs without
native bf16"). Results: benchmarks/results/bf16_native-<cpu>.json.

    python benchmarks/bf16_native.py          # about 30 s
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from cascade import machine

from polyrl import native_bf16

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M's widest projection (hidden 576 -> gate and up, 2 x 1536) at 16 decode rows and at 1024
# training positions.
SHAPES = {"decode, 16 rows": (16, 576, 3072), "training, 1024 positions": (1024, 576, 3072)}


def gflops(rows: int, inner: int, cols: int, dtype: torch.dtype, seconds: float = 2.0) -> float:
    a, b = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, cols, dtype=dtype)
    a @ b  # warm-up: the first call picks and caches the kernel
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return 2 * rows * inner * cols * n / (time.perf_counter() - start) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = {
        "cpu": machine(), "machine": platform.machine(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16("cpu"), "shapes": {},
    }
    for name, shape in SHAPES.items():
        f32, bf16 = gflops(*shape, torch.float32), gflops(*shape, torch.bfloat16)
        result["shapes"][name] = {"float32_gflops": round(f32, 1), "bfloat16_gflops": round(bf16, 2),
                                  "bf16_over_float32": round(bf16 / f32, 3)}
        print(f"{name}: float32 {f32:.1f} GFLOP/s, bf16 {bf16:.2f} GFLOP/s ({bf16 / f32:.2f}x)", flush=True)
    precision = "bf16" if result["native_bf16"] else "float32"
    print(f"native bf16: {result['native_bf16']} (model.bf16: auto runs {precision})")
    tag = result["cpu_capability"].lower()
    out = args.out or ROOT / "benchmarks" / "results" / f"bf16_native-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
