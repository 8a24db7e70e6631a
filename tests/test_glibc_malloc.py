"""train/glibc_malloc.py: with glibc's thresholds raised, the large temporaries an update makes and frees every
step are reused from the heap instead of being mapped afresh and page-faulted in each time."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import resource, sys
import torch
from polyrl.train.glibc_malloc import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
def step():  # an update's pattern: temporaries of 50-113 MB (above glibc's 32 MB mmap cap), made and freed
    a = torch.ones(50 * 2**20 // 4)
    b = (a * 2).to(torch.bfloat16)
    c = torch.zeros(113 * 2**20 // 4)
    del a
    d = b.float() + 1
    return float(d[0] + c[0])
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sum(faults[5:]))
"""


def steady_faults(mode: str) -> tuple[bool, int]:
    """(thresholds applied, page faults of steps 6-10)."""
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_an_updates_temporaries_stop_page_faulting():
    applied, kept = steady_faults("keep")
    assert applied
    _, default = steady_faults("default")
    assert default > 5 * 50 * 2**20 // 4096  # glibc's default: every step maps and faults its blocks in again
    assert kept < default / 20  # raised thresholds: after a few steps the heap holds blocks to reuse
