"""The machine a benchmark ran on, as its results name it: the one place that reads /proc/cpuinfo for them."""

from __future__ import annotations

import os
import platform
from pathlib import Path

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
# AMD's CPU families by microarchitecture: the model name of a cloud VM often says only "AMD EPYC".
# Family 25 is Zen 3 or Zen 4; only Zen 4 has AVX-512.
AMD_FAMILIES = {"23": "Zen/Zen 2", "25": "Zen 3", "26": "Zen 5"}


def machine() -> dict:
    """The CPU, its family, its core count, the instruction sets that matter here, the load now."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((x.split(":", 1)[1].strip() for x in text.splitlines() if x.startswith("model name")),
                 platform.processor() or platform.machine())
    family = next((x.split(":", 1)[1].strip() for x in text.splitlines() if x.startswith("cpu family")), "?")
    words = set(text.split())
    return {"cpu": model, "cpu_family": family, "cores": os.cpu_count(),
            "flags": [f for f in FLAGS if f in words], "load_average": list(os.getloadavg())}


def label(m: dict) -> str:
    """One line for a table's caption: "2-core AMD EPYC (Zen 5), avx2, fma, avx512f, avx512_bf16"."""
    arch = AMD_FAMILIES.get(m["cpu_family"]) if "AMD" in m["cpu"] else None
    if arch == "Zen 3" and "avx512f" in m["flags"]:
        arch = "Zen 4"
    return (f"{m['cores']}-core {m['cpu']}" + (f" ({arch})" if arch else f" (family {m['cpu_family']})")
            + (f", {', '.join(m['flags'])}" if m["flags"] else ""))
