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
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, *faults[10:])
"""
BLOCK_PAGES = 50 * 2**20 // 4096  # the smallest large temporary of a step, in pages


def steady_faults(mode: str) -> tuple[bool, list[int]]:
    """(thresholds applied, page faults of each of steps 11-20)."""
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    applied, *faults = out.stdout.split()
    return applied == "True", [int(f) for f in faults]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_an_updates_temporaries_stop_page_faulting():
    applied, kept = steady_faults("keep")
    assert applied
    _, default = steady_faults("default")
    assert min(default) > BLOCK_PAGES  # glibc's default: every step maps and faults its blocks in again
    # Raised thresholds: the heap holds the blocks for reuse. A block now and then lands in a fresh place (other
    # threads' small allocations move the layout) and faults in once; most steps fault nothing of that size.
    assert sum(f > BLOCK_PAGES // 10 for f in kept) <= 2, kept


TRIM_PROBE = """
import sys
import torch
from polyrl.train.glibc_malloc import keep_freed_memory, resident_bytes, trim_above
keep_freed_memory()
held = [torch.ones(64 * 2**20 // 4) for _ in range(8)]  # 512 MB from the heap (the thresholds are raised)
del held  # freed, but kept by the process for reuse
kept = resident_bytes()
budget = int(float(sys.argv[1]) * 1e9)
trimmed = trim_above(budget)
print(trimmed, kept, resident_bytes())
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
@pytest.mark.parametrize("budget_gb, gives_back", [(0.3, True), (50.0, False)])
def test_freed_memory_goes_back_only_above_the_budget(budget_gb, gives_back):
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE, str(budget_gb)], capture_output=True, text=True,
                         check=True)
    trimmed, kept, after = out.stdout.split()
    assert (trimmed == "True") is gives_back
    if gives_back:  # the 512 MB kept in the heap went back to the OS
        assert int(kept) - int(after) > 400 * 2**20
    else:
        assert abs(int(kept) - int(after)) < 50 * 2**20


def test_the_budget_is_the_configured_one_or_a_share_of_what_is_available(monkeypatch):
    from polyrl.train import glibc_malloc

    assert glibc_malloc.memory_budget(4.0) == 4_000_000_000
    monkeypatch.setattr(glibc_malloc, "available_bytes", lambda: 10_000_000_000)
    assert glibc_malloc.memory_budget(None) == int(10_000_000_000 * glibc_malloc.BUDGET_SHARE)
    monkeypatch.setattr(glibc_malloc, "available_bytes", lambda: None)
    assert glibc_malloc.memory_budget(None) is None and not glibc_malloc.trim_above(None)
