"""Fused C++ kernels for the fused decode path, compiled on first use and cached.

``available()`` builds the ``*.cpp`` files beside this module, as one translation unit (``kernels.cpp``), with
torch's extension builder (a C++ compiler and ninja are needed; ninja is a dependency) into the polyrl cache,
keyed by the sources and where they lie, the torch version, this CPU's instruction sets and the
instruction-set cap, and loads them as ``torch.ops.polyrl_native``.

The build targets the CPU it runs on (``-march=native``) unless ``ATEN_CPU_CAPABILITY``, torch's own cap on
the instruction sets its kernels use, says otherwise: ``avx2`` builds for AVX2 and FMA (how an AVX-512 machine
shows the speed of a CPU without it), ``default`` builds the portable C++ loops alone (what a CPU without AVX2,
e.g. an Arm one, runs, with whatever vectors the compiler finds).

Without a compiler, or with ``POLYRL_NATIVE=0`` in the environment, ``available()`` returns False, with a
warning in the first case, and the decode path keeps its torch operations: the kernels are an acceleration,
never a requirement.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

from polyrl.models.loading import cache_dir

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp")) + sorted(HERE.glob("*.h"))
"""Everything a build reads: the cache key hashes all of it."""
BUILD_UNIT = HERE / "kernels.cpp"
"""The one file compiled: it includes the kernel files, so torch's headers are parsed once a build."""
STALE_LOCK_S = 600.0
"""A build lock older than this was left by a process that died while building (a build takes under a minute).
torch's builder waits on its lock file for ever, so every later run would hang at its first decode."""
_state: dict[str, bool] = {}


def _cpu_flags() -> bytes:
    """This CPU's feature flags: a binary built with -march=native must not be reused on another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()


ISA_FLAGS = {"avx2": ["-mavx2", "-mfma", "-mf16c"], "default": []}
"""Compiler flags per ``ATEN_CPU_CAPABILITY`` value; any other value (or none) builds for this CPU."""


def isa_cap() -> str:
    """The instruction-set cap the kernels are built for: ``avx2``, ``default`` or ``native``."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "")  # spelt as torch reads it: lower case
    return cap if cap in ISA_FLAGS else "native"


def _arch_flags() -> list[str]:
    cap = isa_cap()
    return ["-march=native"] if cap == "native" else ISA_FLAGS[cap]


def _build_dir() -> Path:
    # The sources' directory too: torch's builder writes their paths into the build, and rebuilds whenever
    # another copy of the tree (same sources, other paths) used the entry last.
    digest = hashlib.sha256(torch.__version__.encode() + _cpu_flags() + isa_cap().encode() + str(HERE).encode())
    for source in SOURCES:
        digest.update(source.name.encode() + source.read_bytes())
    key = digest.hexdigest()[:16]
    path = cache_dir() / "native" / key
    path.mkdir(parents=True, exist_ok=True)
    return path


def wait_for_build_lock(build_dir: Path, stale_s: float = STALE_LOCK_S) -> None:
    """Wait while another process builds into ``build_dir``; a lock older than ``stale_s`` (its builder was
    killed mid-build) is removed instead, so that this process builds."""
    lock = build_dir / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_s:
            log.warning("removing %s, a native-kernel build lock left %.0f s ago by a process that did not "
                        "finish its build", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(1.0)


def _load() -> bool:
    if os.environ.get("POLYRL_NATIVE", "1") == "0":
        return False
    from torch.utils import cpp_extension

    build_dir = _build_dir()
    wait_for_build_lock(build_dir)
    try:
        cpp_extension.load(
            name="polyrl_native",
            sources=[str(BUILD_UNIT)],
            extra_cflags=["-O3", *_arch_flags(), "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except Exception as err:  # no compiler, no ninja, a build error: keep the torch path
        log.warning("polyrl native decode kernels unavailable (%s); using torch operations", str(err)[:200])
        return False
    return hasattr(torch.ops.polyrl_native, "attention")


def available() -> bool:
    """True once the kernels are built and loaded (the build runs once per process, then hits the cache)."""
    if "ok" not in _state:
        _state["ok"] = _load()
    return _state["ok"]


def ops():
    """The kernels' namespace, ``torch.ops.polyrl_native`` (call ``available()`` first)."""
    return torch.ops.polyrl_native
