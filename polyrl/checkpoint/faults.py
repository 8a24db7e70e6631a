"""Fault injection for the kill-and-resume tests: named points in the loop where a run can be SIGKILLed.

``POLYRL_TEST_KILL_AT="phase:step"`` kills the process when it reaches ``point(phase, step)``;
``"phase:step#2"`` the second time it gets there (the final checkpoint can rewrite the last one);
``"phase:step+0.05"`` kills it 0.05 s later, from a timer thread, i.e. somewhere inside the work that follows
the point (generation after ``rollout``, the optimizer update after ``update``). ``POLYRL_TEST_FAULT_TRACE``
names a file that gets one ``phase:step`` line per point reached, so a test can tell where a kill landed.
``POLYRL_TEST_KILL_ONCE`` names a marker file: only the first process to create it is killed (the ranks of a
run restarted after the kill reach the same point again and must live).
``POLYRL_TEST_DISK_FULL_AT="phase:step"`` makes ``point`` raise ``OSError(ENOSPC)`` there instead, as a write
on a full disk would. ``POLYRL_TEST_HANG_AT="phase:step"`` makes the process hang there for good, as a stuck
process would (the fail-fast tests: whoever waits on it must give up with one line); ``POLYRL_TEST_KILL_ONCE``
applies to it too.
All unset (the normal case), ``point`` costs four environment lookups.

Points: ``join`` (step 0, a learner rank before it joins the process group), ``rollout`` (start of a step),
``update`` (before the optimizer update), ``logged`` (metrics and trajectories written), ``ckpt_weights`` /
``ckpt_files`` / ``ckpt_manifest`` / ``ckpt_renamed`` (inside ``save_checkpoint``: weights written to the temp
dir, every file written, manifest written, temp dir renamed into place), ``eval_before`` (step 0) and
``eval_after`` (the last step) at the start of an evaluation, ``report`` before the report is written.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

KILL_AT = "POLYRL_TEST_KILL_AT"
DISK_FULL_AT = "POLYRL_TEST_DISK_FULL_AT"
KILL_ONCE = "POLYRL_TEST_KILL_ONCE"
HANG_AT = "POLYRL_TEST_HANG_AT"
TRACE = "POLYRL_TEST_FAULT_TRACE"
_seen: dict[str, int] = {}


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def point(phase: str, step: int) -> None:
    """Mark that the run reached ``phase`` of ``step``; kill it here (or shortly after) if a test asked to."""
    trace = os.environ.get(TRACE)
    if trace:
        with open(trace, "a") as f:
            f.write(f"{phase}:{step}\n")
    if os.environ.get(DISK_FULL_AT) == f"{phase}:{step}":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if os.environ.get(HANG_AT) == f"{phase}:{step}" and _first_process():
        while True:
            time.sleep(3600)
    spec = os.environ.get(KILL_AT)
    if not spec:
        return
    target, _, delay = spec.partition("+")
    target, _, nth = target.partition("#")
    here = f"{phase}:{step}"
    if target != here:
        return
    _seen[here] = _seen.get(here, 0) + 1
    if _seen[here] != int(nth or 1) or not _first_process():
        return
    if delay:
        threading.Timer(float(delay), _kill).start()
    else:
        _kill()


def _first_process() -> bool:
    """False when ``POLYRL_TEST_KILL_ONCE`` names a marker another process has already created."""
    once = os.environ.get(KILL_ONCE)
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True
