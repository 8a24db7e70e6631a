"""Start a run's learner ranks on this machine, torchrun-style: ``polyrl train cfg.yaml learner.world_size=2``
spawns the ranks itself (one process each, the launcher's environment set as torchrun sets it), every rank runs
the same training loop, and a rank that fails or dies ends them all with one line naming it."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from polyrl.parallel.group import RankFailedError, collective_timeout
from polyrl.waits import WaitTimeoutError


def free_port() -> int:
    """A free TCP port on the loopback interface for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_devices(world_size: int, device: torch.device) -> None:
    """One GPU per rank on a machine: more ranks than GPUs is a one-line error, not a hang."""
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise RankFailedError(
            f"learner.world_size: {world_size} ranks but this machine has {torch.cuda.device_count()} GPU(s); "
            "use at most one rank per GPU, or runtime.kind: ray to place ranks on several machines"
        )


_server_modules: set[str] = set()
"""The modules this process's fork server imported: the union of what ``fork_server`` was asked for."""


def fork_server(*modules: str) -> multiprocessing.context.BaseContext:
    """A multiprocessing context whose processes are forked from a server that imported ``modules`` (and with
    them torch, transformers and polyrl) once but has run nothing: as clean as a spawned interpreter (no torch
    thread pools or locks), without each process paying the imports. The server serves this process's later
    processes too; asked for a module it lacks while none of its children lives, it is replaced by one that
    imports that module as well. Its children hold the environment it started with, so pass ``dict(os.environ)``
    to the child and ``adopt_environ`` it there. Where there is no fork server (Windows): spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    # Children report their exit through the server: a running one is replaced only while no child lives.
    # Otherwise a child imports what the server lacks itself.
    running = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None) is not None
    if not set(modules) <= _server_modules and not (running and multiprocessing.active_children()):
        _server_modules.update(modules)
        multiprocessing.set_forkserver_preload(sorted(_server_modules))
        _restart_server_on_this_path()
    return mp.get_context("forkserver")


def _restart_server_on_this_path() -> None:
    """(Re)start the fork server with this process's ``sys.path`` as its PYTHONPATH. Python before 3.12.8 drops
    the path it hands the server (CPython gh-117378), which then silently skips a module found through a folder
    added at run time (a script's, pytest's) and leaves every child to import it afresh."""
    server = multiprocessing.forkserver._forkserver
    if hasattr(server, "_stop"):  # private, as stable as the module: without it the running server stays
        server._stop()
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(path or os.getcwd() for path in sys.path)
    try:
        server.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def adopt_environ(environ: dict[str, str]) -> None:
    """In a process from ``fork_server``: the starting process's environment, as a spawned process inherits it."""
    os.environ.clear()
    os.environ.update(environ)


def _rank_main(rank: int, world_size: int, port: int, device_type: str, environ: dict[str, str], fn: Callable,
               args: tuple) -> None:
    adopt_environ(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cpu":  # the machine's cores shared out, so ranks do not oversubscribe them
        torch.set_num_threads(max(1, usable_cpus() // world_size))
    try:
        fn(*args)
    except Exception as exc:
        # The parent shows this one line; the whole traceback goes to the rank's stderr first.
        traceback.print_exc()
        exc = collective_timeout(exc, rank) or exc  # gloo's own message names neither the wait nor the setting
        what = str(exc) if isinstance(exc, WaitTimeoutError) else f"{type(exc).__name__}: {exc}"
        raise RankFailedError(f"learner rank {rank}: {what}") from None


def launch_ranks(world_size: int, device: torch.device, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on ``world_size`` new processes of this machine, each a rank of one process group
    (``fn`` joins it with ``group.join_group``). Returns when all have finished; if one fails or is killed,
    the others are stopped and ``RankFailedError`` says which."""
    check_devices(world_size, device)
    # The ranks fork from it instead of each importing torch and polyrl afresh; it also imports the modules of
    # the functions passed on, which each rank would otherwise import to unpickle them.
    functions = [f for f in (fn, *args) if callable(f)]
    ctx = fork_server(*(m for m in (getattr(f, "__module__", None) for f in functions) if isinstance(m, str)))
    try:
        mp.start_processes(_rank_main, args=(world_size, free_port(), device.type, dict(os.environ), fn, args),
                           nprocs=world_size, start_method=ctx.get_start_method())
    except mp.ProcessRaisedException as exc:
        last = str(exc).strip().splitlines()[-1]
        raise RankFailedError(last.split("RankFailedError: ", 1)[-1]) from None
    except mp.ProcessExitedException as exc:
        raise RankFailedError(
            f"learner rank {exc.error_index} exited with code {exc.exit_code}"
            + (f" (signal {exc.signal_name})" if exc.signal_name else "") + "; the other ranks were stopped"
        ) from None
