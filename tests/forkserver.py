"""``polyrl`` command lines run in processes forked from a server that has imported polyrl (and torch) once.

Each run is still a process of its own (its own pid, files, signals: a SIGKILL kills it for real), started from
the same CLI entry point as ``python -m polyrl``, but it skips the seconds of imports a fresh interpreter pays.
Tests that start many runs (kill and resume chains, faults, determinism) use it; tests/test_kill_resume.py
checks that a forked chain ends bit-identical to a plain ``python -m polyrl`` run.

The server forks before torch has started any thread, so the children are as clean as a spawned process. Two
things are the server's, not the run's: the thread settings (``OMP_NUM_THREADS``, read when torch starts; start
a server per setting) and Python's hash seed (every child of one server iterates sets alike, so a determinism
check compares against a run in a fresh interpreter too).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVER = r"""
import json, os, sys, traceback
import polyrl.cli, polyrl.run.loop  # preloaded: forked children skip the imports
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests stay the server's
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        for key, value in req["env"].items():  # None: unset
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        os.chdir(req["cwd"])
        sys.argv = ["polyrl", *req["argv"]]
        code = 1
        try:
            polyrl.cli.main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class ForkServer:
    """Runs ``polyrl`` command lines one at a time; ``env`` is added to this process's environment for the
    server and every run (thread counts, for one); a value of None removes that variable."""

    def __init__(self, env: dict[str, str | None] | None = None) -> None:
        self.logs = Path(tempfile.mkdtemp(prefix="polyrl-fork-"))
        environ = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     bufsize=0, env=environ)
        self.runs = 0

    def _reply(self, timeout: float) -> dict:
        """The server's next line, read unbuffered (a buffered reader could hold the next reply where select
        cannot see it); TimeoutError past ``timeout`` seconds."""
        line, deadline, fd = b"", time.monotonic() + timeout, self.proc.stdout.fileno()
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
            byte = os.read(fd, 1)
            if not byte:
                raise RuntimeError(f"the fork server exited (code {self.proc.poll()})")
            line += byte
        return json.loads(line)

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 600.0,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        """``polyrl *argv`` with ``env`` added to the environment (None unsets a variable), in ``cwd`` (default:
        this process's); its exit code (negative: killed by that signal) and output, as ``subprocess.run(...,
        capture_output=True, text=True)`` gives them. A run past ``timeout`` seconds is killed and raises
        ``subprocess.TimeoutExpired``."""
        self.runs += 1
        out, err = self.logs / f"{self.runs}.out", self.logs / f"{self.runs}.err"
        request = {"argv": [str(a) for a in argv], "env": env or {}, "stdout": str(out), "stderr": str(err),
                   "cwd": str(cwd or os.getcwd())}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        pid = self._reply(30)["pid"]
        try:
            rc = self._reply(timeout)["rc"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._reply(30)
            raise subprocess.TimeoutExpired(["polyrl", *argv], timeout) from None
        return subprocess.CompletedProcess(["polyrl", *argv], rc, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.logs, ignore_errors=True)
