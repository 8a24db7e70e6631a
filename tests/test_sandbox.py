"""Hostile programs against polyrl.rewards.sandbox: each is contained, every time, and this process lives.

Tests that need namespaces (no network, no host files, a kill(-1) that only reaches the sandbox) are skipped
where ``isolation_level()`` is ``rlimits``; docs/reliability.md says what that fallback does not cover.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from polyrl.rewards.code import build_program, get_problem, score_humaneval
from polyrl.rewards.sandbox import isolation_level, run_python

LEVEL = isolation_level()
needs_namespaces = pytest.mark.skipif(LEVEL != "namespaces", reason=f"no namespaces here (sandbox: {LEVEL})")
# Without namespaces, host files are hidden only by permissions from a uid of the program's own (as root).
needs_file_isolation = pytest.mark.skipif(LEVEL == "rlimits", reason="program would run as the caller's uid")
# Root ignores RLIMIT_NPROC: the process cap needs a dropped uid (or a caller that is not root).
needs_unprivileged = pytest.mark.skipif(
    LEVEL == "rlimits" and os.geteuid() == 0, reason="program would run as root (no process cap)"
)
# Processes that leave the session (setsid, double fork) are reached by the PID namespace, or by kill(-1) as
# the program's own uid; the plain fallback can only kill its process group.
needs_reaper = pytest.mark.skipif(LEVEL == "rlimits", reason="no PID namespace and no uid of its own")
REPEATS = 2  # "contained every time": each hostile program runs more than once


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _assert_no_leftovers(marker: str) -> None:
    deadline = time.monotonic() + 3.0  # the kernel tears a PID namespace down asynchronously
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == [], "sandboxed processes outlived the run"


# --- the program's own result -------------------------------------------------------------------------------

def test_correct_code_passes_and_wrong_code_fails():
    ok = run_python("assert sum(range(5)) == 10\nprint('fine')")
    assert ok.status == "passed" and ok.returncode == 0 and ok.stdout == "fine\n"
    bad = run_python("assert sum(range(5)) == 11, 'off by one'")
    assert bad.status == "failed" and bad.returncode == 1
    assert "AssertionError: off by one" in bad.stderr and "off by one" in bad.reason


def test_stdin_reaches_the_program():
    v = run_python("import sys\nprint(sys.stdin.read().upper())", stdin="hello")
    assert v.status == "passed" and v.stdout == "HELLO\n"


def test_isolated_interpreter_has_no_site_packages():
    # The trainer's packages (torch, polyrl, ...) are not importable by model-written code.
    v = run_python("import torch")
    assert v.status == "failed" and "ModuleNotFoundError" in v.stderr


HUMANEVAL_SAMPLE = ["HumanEval/0", "HumanEval/2", "HumanEval/32", "HumanEval/53", "HumanEval/163"]


@pytest.mark.parametrize("task_id", HUMANEVAL_SAMPLE)
def test_humaneval_canonical_solutions_pass(task_id):
    problem = get_problem(task_id)
    score = score_humaneval(problem, problem["canonical_solution"])
    assert score.reward == 1.0, score.verdict


def test_humaneval_wrong_and_fenced_completions():
    problem = get_problem("HumanEval/53")  # add(x, y)
    assert score_humaneval(problem, "    return x - y\n").reward == 0.0
    fenced = "Sure:\n```python\ndef add(x: int, y: int):\n    return x + y\n```\nDone."
    assert score_humaneval(problem, fenced).reward == 1.0
    assert build_program(problem, "    return x + y\n").endswith("check(add)\n")
    with pytest.raises(ValueError, match="unknown HumanEval problem 'HumanEval/999'"):
        get_problem("HumanEval/999")


# --- hostile programs -------------------------------------------------------------------------------------

@pytest.mark.slow
@needs_unprivileged
@pytest.mark.parametrize("attempt", range(REPEATS))
def test_fork_bomb_is_capped_and_cleaned_up(attempt):
    marker = f"polyrl-bomb-{uuid.uuid4().hex}"
    code = (
        "import os, sys\n"
        "n, told = 0, False\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        f"            os.execv(sys.executable, [sys.executable, '-c', 'while True: pass', '{marker}'])\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        if not told:\n"
        "            print(n, flush=True)\n"
        "            told = True\n"
    )
    v = run_python(code, timeout_s=2, max_processes=6)
    assert v.status == "timeout"
    assert v.stdout.strip() and int(v.stdout.split()[0]) <= 6  # fork failed once the process cap was reached
    _assert_no_leftovers(marker)
    assert os.getpid() > 0 and run_python("print(1)").passed  # we are alive and the sandbox still works


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(REPEATS))
def test_infinite_loop_times_out(attempt):
    v = run_python("while True:\n    pass", timeout_s=1)
    assert v.status == "timeout" and v.returncode is None and "1s" in v.reason
    assert v.wall_s < 3


@pytest.mark.parametrize("code", [
    "x = bytearray(4 << 30)",
    "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))",
])
def test_memory_hog_hits_the_limit(code):
    v = run_python(code, memory_mb=256, timeout_s=10)
    assert v.status == "failed" and "memory limit" in v.reason, v


def test_disk_filler_one_big_file():
    code = "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))"
    v = run_python(code, max_file_mb=4, timeout_s=10)
    # Python ignores SIGXFSZ, so the write fails with EFBIG instead of the process dying.
    assert v.status in ("killed", "failed") and ("File too large" in v.reason or "file size" in v.reason), v


@needs_namespaces
def test_disk_filler_many_files_runs_out_of_private_space():
    code = "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (3 << 20))\n    i += 1"
    v = run_python(code, max_file_mb=4, timeout_s=10)
    assert v.status == "failed" and "No space left on device" in v.reason


@needs_file_isolation
@pytest.mark.parametrize("attempt", range(REPEATS))
def test_caller_run_dir_is_neither_readable_nor_writable(tmp_path, attempt):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    secret = run_dir / "secret.txt"
    secret.write_text("TOPSECRET")
    code = f"""
import json, os
out = {{}}
try:
    out["read"] = open({str(secret)!r}).read()
except OSError as e:
    out["read"] = type(e).__name__
try:
    open({str(run_dir / "pwned")!r}, "w").write("x")
    out["write"] = "ok"
except OSError as e:
    out["write"] = type(e).__name__
try:
    out["list"] = os.listdir({str(run_dir)!r})
except OSError as e:
    out["list"] = type(e).__name__
print(json.dumps(out))
"""
    v = run_python(code)
    assert v.status == "passed", v
    out = json.loads(v.stdout)
    assert "TOPSECRET" not in v.stdout and out["read"] in ("FileNotFoundError", "PermissionError")
    assert out["write"] != "ok" and not (run_dir / "pwned").exists()
    assert out["list"] in ("FileNotFoundError", "PermissionError")


@needs_file_isolation
def test_home_and_system_files_are_out_of_reach():
    home = str(Path.home())
    passwd = Path("/etc/passwd")
    before = hashlib.sha256(passwd.read_bytes()).hexdigest()
    code = f"""
import json, os
out = {{}}
for name, fn in [
    ("home", lambda: os.listdir({home!r})),
    ("shadow", lambda: open("/etc/shadow").read()),
    ("passwd_write", lambda: open("/etc/passwd", "a").write("evil::0:0::/:/bin/sh\\n")),
    ("mkdir_root", lambda: os.mkdir("/evil")),
    ("usr_write", lambda: open("/usr/evil", "w")),
]:
    try:
        out[name] = ["ok", repr(fn())]
    except OSError as e:
        out[name] = [type(e).__name__]
print(json.dumps(out))
"""
    v = run_python(code)
    assert v.status == "passed", v
    out = json.loads(v.stdout)
    for name in ("shadow", "passwd_write", "mkdir_root", "usr_write"):
        assert out[name][0] != "ok", (name, out[name])
    # Home may show only the path down to the interpreter (e.g. ~/.pyenv); nothing else of it.
    if out["home"][0] == "ok":
        import sys

        prefix = Path(sys.base_prefix)
        allowed = {prefix.relative_to(home).parts[0]} if prefix.is_relative_to(home) else set()
        assert set(eval(out["home"][1])) <= allowed  # noqa: S307 - our own repr of a list of names
    assert hashlib.sha256(passwd.read_bytes()).hexdigest() == before
    assert not Path("/evil").exists() and not Path("/usr/evil").exists()


@pytest.mark.slow
@needs_namespaces
@pytest.mark.parametrize("attempt", range(REPEATS))
def test_no_connection_to_a_local_listener(attempt):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('blocked', e)\n"
        )
        v = run_python(code, timeout_s=5)
        assert v.status == "passed" and v.stdout.startswith("blocked"), v
        with pytest.raises(TimeoutError):
            listener.accept()


@needs_reaper
@pytest.mark.parametrize("attempt", range(REPEATS))
def test_spawned_and_detached_subprocesses_do_not_survive(attempt):
    marker = f"polyrl-spawn-{uuid.uuid4().hex}"
    code = f"""
import os, subprocess, sys
subprocess.Popen(["sh", "-c", "sleep 600; echo {marker}"], start_new_session=True)
if os.fork() == 0:  # a double-forked daemon
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", "{marker}"])
    os._exit(0)
print("spawned")
"""
    v = run_python(code, timeout_s=5)
    assert v.status == "passed" and v.stdout == "spawned\n", v
    assert v.wall_s < 4  # a leftover holding the output pipe does not stall the run
    _assert_no_leftovers(marker)


@needs_unprivileged
def test_no_subprocess_when_processes_are_capped_at_one():
    v = run_python("import subprocess\nsubprocess.run(['true'])", max_processes=1)
    assert v.status == "failed" and "Resource temporarily unavailable" in v.stderr


@pytest.mark.parametrize("attempt", range(REPEATS))
def test_signalling_the_parent_does_not_reach_the_caller(attempt):
    code = (
        "import os, signal\n"
        "for target in (os.getppid(), -os.getpgid(0)):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__)\n"
        "print('after')\n"
    )
    v = run_python(code, timeout_s=5)
    # Whatever the program manages to signal, it is inside the sandbox; we get a verdict, not a signal.
    assert v.status in ("passed", "failed", "killed", "error"), v
    assert os.getpid() > 0 and run_python("print(2)").stdout == "2\n"


@needs_namespaces
def test_kill_everything_reaches_only_the_sandbox():
    # kill(-1) signals every process the caller may signal; in the sandbox that is only its own.
    victim = subprocess.Popen(["sleep", "30"])
    try:
        code = (
            "import os\ntry:\n    os.kill(-1, 9)\nexcept OSError as e:\n    print(e.strerror)\nprint('alive')"
        )
        v = run_python(code, timeout_s=5)
        # Nothing else in its namespace is its to signal: "No such process", and it is still running.
        assert v.status == "passed" and v.stdout == "No such process\nalive\n", v
        assert victim.poll() is None  # a process of ours outside the sandbox was not touched
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_gigabytes_of_output_are_capped(stream):
    code = f"import sys\nblock = 'x' * 65536\nfor _ in range(1 << 15):\n    sys.{stream}.write(block)"  # 2GiB
    t0 = time.monotonic()
    v = run_python(code, timeout_s=20, max_output_bytes=100_000)
    assert v.status == "killed" and "output limit" in v.reason and v.truncated
    assert len(getattr(v, stream)) == 100_000
    assert time.monotonic() - t0 < 10  # stopped early, not after writing 2 GiB
