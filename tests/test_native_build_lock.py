"""The native kernels' build lock: a lock left by a killed build must not hang every later run."""

from __future__ import annotations

import os
import threading
import time

import pytest

from polyrl.engines.native import wait_for_build_lock


def test_a_stale_build_lock_is_removed(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    t0 = time.perf_counter()
    wait_for_build_lock(tmp_path, stale_s=600)
    assert not lock.exists() and time.perf_counter() - t0 < 1.0


@pytest.mark.slow
def test_a_live_build_lock_is_waited_for(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    builder = threading.Timer(1.5, lock.unlink)  # another process finishing its build
    builder.start()
    t0 = time.perf_counter()
    wait_for_build_lock(tmp_path, stale_s=600)
    builder.join()
    assert time.perf_counter() - t0 >= 1.4 and not lock.exists()


def test_no_lock_returns_at_once(tmp_path):
    t0 = time.perf_counter()
    wait_for_build_lock(tmp_path)
    assert time.perf_counter() - t0 < 0.1
