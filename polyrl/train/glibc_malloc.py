"""Keep freed memory in the process instead of handing it back to the OS (glibc on Linux).

An RL step allocates and frees the same large tensors again and again: the output head's float32 logits of a
chunk of positions (16 rows x 16 positions x 49k vocabulary = 50 MB), its bf16 softmax, the bf16 copy of the
head's weights, the gradient of that copy. glibc serves every block above its mmap threshold (at most 32 MB by
default) with a fresh mapping and unmaps it on free, so each of those tensors page-faults its whole size in on
first touch, every step. Raising the mmap and trim thresholds lets such blocks come from the heap and be reused:
measured on SmolLM2-135M, a 16-row update (64-token responses) went from 5.2-7.7 s to 3.8-4.2 s, for a few
hundred MB more peak memory (docs/performance.md, "Memory allocator"). What is kept is bounded by a budget:
past it, ``trim_above`` hands the heap's free pages back before the next update (``runtime.memory_budget_gb``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import sys
from pathlib import Path

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 2**31 - 1  # the largest int mallopt takes: every block comes from the heap
TRIM_THRESHOLD = 2**30
"""Free memory at the heap's top beyond this goes back to the OS. 256 MB still left ~150k page faults per
16-row update, 1 GB almost none (2 GB: none, but the quickstart's peak grew by 0.8 GB)."""
BUDGET_SHARE = 0.8
"""Unless ``runtime.memory_budget_gb`` says otherwise, a run may keep freed memory while it stays under this
share of the memory available when it starts."""
_applied = False


def _libc() -> ctypes.CDLL | None:
    """The C library on Linux (None elsewhere, or when it cannot be loaded)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process, once; True when they are in effect.

    Does nothing (False) off Linux, on another C library, or when the environment already sets
    ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` (the user's choice wins)."""
    global _applied
    if _applied:
        return True
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)  # musl and others have no mallopt
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied


def available_bytes() -> int | None:
    """The memory this process is given: the kernel's MemAvailable, capped by its cgroup's limit (a container);
    None where /proc/meminfo is not there."""
    try:
        found = re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    except OSError:
        return None
    if found is None:
        return None
    available = int(found.group(1)) * 1024
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            available = min(available, int(text))
    return available


def memory_budget(configured_gb: float | None) -> int | None:
    """Bytes of resident memory above which freed memory goes back to the OS: ``configured_gb``, else
    ``BUDGET_SHARE`` of ``available_bytes()`` now; None when neither is known."""
    if configured_gb is not None:
        return int(configured_gb * 1e9)
    available = available_bytes()
    return None if available is None else int(available * BUDGET_SHARE)


def resident_bytes() -> int | None:
    """This process's resident set size, from /proc/self/statm (None where that is not there)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def trim_above(budget: int | None) -> bool:
    """Hand every free page of the heap back to the OS (glibc's ``malloc_trim``) when resident memory is above
    ``budget``: freed memory is kept for speed while it fits and given back when it does not. True when it
    trimmed."""
    rss = resident_bytes()
    if budget is None or rss is None or rss <= budget:
        return False
    return give_back_freed_memory()


def give_back_freed_memory() -> bool:
    """Hand every free page of the heap back to the OS now (glibc's ``malloc_trim``); False where there is no
    glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True
