"""runtime/allocator.py: with glibc's thresholds raised, a large block freed and allocated again is reused
instead of being mapped afresh and page-faulted in (what made each update re-fault its logits buffers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import resource, sys
import torch
from polyrl.runtime.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
def faults_of_fill():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(64 * 2**20 // 4)  # 64 MB: above glibc's default mmap threshold
    x.fill_(1.0)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del x
    return after - before
faults_of_fill()
print(applied, faults_of_fill())
"""


def refaults(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_block_is_reused_without_page_faults():
    applied, kept = refaults("keep")
    assert applied
    _, default = refaults("default")
    pages = 64 * 2**20 // 4096
    assert default > pages // 2  # glibc's default: the second 64 MB block is mapped and faulted in again
    assert kept < pages // 20  # raised thresholds: the freed block is reused, already resident
