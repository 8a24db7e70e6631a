"""Run untrusted, model-written Python in a separate, resource-limited process.

Layers, strongest first (``isolation_level()`` says which one this machine gets):

- ``namespaces``: ``unshare`` (util-linux) puts the program in fresh network, mount, PID, IPC and UTS
  namespaces (plus a user namespace when not root). Inside, a launcher builds a new root on tmpfs holding only
  read-only binds of /usr, /lib*, /bin and the interpreter's prefix (its site-packages hidden), /dev/null and
  friends, and a size-limited tmpfs ``/sandbox`` as the only writable place; it pivots into it and detaches
  the host tree. No network (only a downed loopback), no host files, and when the launcher (PID 1) exits the
  kernel kills every process left in the namespace. As root the program also runs as a fresh unprivileged
  uid; otherwise a nested user namespace leaves it with no capabilities.
- ``rlimits``: where namespaces are unavailable (e.g. containers whose seccomp profile forbids ``unshare``):
  a private mode-700 temp directory, and as root a fresh unprivileged uid (so other users' mode-700 files are
  unreadable and every leftover process can be killed). The network stays reachable and, for a non-root
  caller, files readable by the caller stay readable. Documented in docs/reliability.md.

Every layer applies rlimits (CPU, address space, processes, file size, open files, no core files), runs
``python -I -S`` with a minimal environment in its own session, enforces a wall-clock timeout by killing
the whole process group, and caps captured output while reading it.

This file is also the launcher: ``python -I -S sandbox.py SPEC`` runs ``_launch`` with the stdlib only.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import platform
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)
Status = Literal["passed", "failed", "timeout", "killed", "error"]
Isolation = Literal["auto", "namespaces", "rlimits", "rlimits+uid"]

_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/sandbox", "TMPDIR": "/sandbox"}
_SETUP_FAILED = 125  # launcher exit code: the sandbox could not be built (not the program's fault)
_UNSHARE = ["--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
_cached_level: str | None = None


@dataclass(frozen=True)
class Verdict:
    status: Status
    returncode: int | None
    """The program's exit code, or minus the signal that ended it; None when it never ran or was timed out."""
    stdout: str
    stderr: str
    reason: str
    """One line: why the status is what it is."""
    wall_s: float
    isolation: str = "rlimits"
    truncated: bool = False

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def isolation_level() -> str:
    """What ``run_python`` gets here: ``namespaces``; ``rlimits+uid`` (fallback, as root, with a fresh uid);
    or ``rlimits`` (fallback, limits only). Probed once; ``POLYRL_SANDBOX=rlimits`` forces the fallback."""
    global _cached_level
    if _cached_level is None:
        _cached_level = "rlimits"
        forced = os.environ.get("POLYRL_SANDBOX") == "rlimits"
        if not forced and shutil.which("unshare") and sys.platform == "linux":
            probe = _run("print('ok')", "namespaces", 20.0, 256, 4, 1, 1024, None)
            if probe.passed and probe.stdout.strip() == "ok":
                _cached_level = "namespaces"
            else:
                log.warning("sandbox: namespaces unavailable (%s); falling back to rlimits", probe.reason)
        if _cached_level == "rlimits" and os.geteuid() == 0 and _world_readable(_python(), sys.base_prefix):
            _cached_level = "rlimits+uid"
    return _cached_level


def run_python(
    code: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    max_processes: int = 8,
    max_file_mb: int = 16,
    max_output_bytes: int = 64_000,
    stdin: str | bytes | None = None,
    isolation: Isolation = "auto",
) -> Verdict:
    """Run ``code`` as ``python -I -S main.py`` in the strongest sandbox available; never raises for
    anything the program does. ``stdout``/``stderr`` are each cut to ``max_output_bytes`` and the program is
    killed when it writes more."""
    level = (isolation_level() if isolation == "auto" else isolation).removesuffix("+uid")
    return _run(code, level, timeout_s, memory_mb, max_processes, max_file_mb, max_output_bytes, stdin)


def _run(code, level, timeout_s, memory_mb, max_processes, max_file_mb, max_output_bytes, stdin) -> Verdict:
    t0 = time.monotonic()
    as_root = os.geteuid() == 0
    # A fresh uid per run: its process count starts at zero (RLIMIT_NPROC is per user) and a final
    # kill(-1) as that uid reaches every process the program left behind.
    uid = 200_000 + secrets.randbelow(1_000_000) if as_root else None
    python = _python()
    with tempfile.TemporaryDirectory(prefix="polyrl-sandbox-") as tmp:
        work, root = Path(tmp, "work"), Path(tmp, "root")
        work.mkdir(mode=0o700)
        root.mkdir(mode=0o700)
        # Lone surrogates pass through as bytes; Python then rejects the file, which is the program's failure.
        (work / "main.py").write_bytes(code.encode("utf-8", "surrogatepass"))
        stdin_path = work / ".stdin"
        stdin_path.write_bytes(stdin.encode("utf-8", "surrogatepass") if isinstance(stdin, str) else (stdin or b""))
        if level == "rlimits" and uid is not None:
            if _world_readable(python, sys.base_prefix):
                os.chmod(tmp, 0o711)  # traversable, not listable: the uid reaches only its mode-700 work dir
                for p in (work, work / "main.py"):
                    os.chown(p, uid, uid)
            else:  # the interpreter lives in a private directory (e.g. /root/.pyenv): cannot drop the uid
                uid = None
        status_r, status_w = os.pipe()
        spec = {
            "level": level, "root": str(root), "work": str(work), "python": python, "uid": uid,
            "prefix": sys.base_prefix, "hide": _site_dirs(), "status_fd": status_w, "host_root": as_root,
            "disk_mb": max(4 * max_file_mb, 16),
            "env": _ENV if level == "namespaces" else {**_ENV, "HOME": str(work), "TMPDIR": str(work)},
            "limits": {"cpu": int(timeout_s) + 1, "as": memory_mb << 20, "nproc": max_processes,
                       "fsize": max_file_mb << 20, "nofile": 64},
        }
        cmd = [python, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(spec)]
        if level == "namespaces":
            cmd = ["unshare", *_UNSHARE, *([] if as_root else ["--user", "--map-root-user"]), "--", *cmd]
        try:
            with open(stdin_path, "rb") as stdin_file:
                proc = subprocess.Popen(
                    cmd, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    pass_fds=(status_w,), start_new_session=True, env=_ENV, cwd=tmp,
                )
        except OSError as exc:
            os.close(status_r)
            wall = time.monotonic() - t0
            return Verdict("error", None, "", "", f"cannot start the sandbox: {exc}", wall, level)
        finally:
            os.close(status_w)
        try:
            out, err, status_raw, why = _collect(proc, status_r, t0 + timeout_s, max_output_bytes)
        finally:
            _kill_all(proc, uid)
            os.close(status_r)
    wall = time.monotonic() - t0
    level = level if level == "namespaces" or uid is None else "rlimits+uid"
    cut = len(out) > max_output_bytes or len(err) > max_output_bytes
    stdout = out[:max_output_bytes].decode("utf-8", "replace")
    stderr = err[:max_output_bytes].decode("utf-8", "replace")
    status, rc, reason = _judge(why, status_raw, stderr, timeout_s, max_output_bytes)
    return Verdict(status, rc, stdout, stderr, reason, wall, level, cut)


def _collect(proc, status_r: int, deadline: float, cap: int) -> tuple[bytes, bytes, bytes, str | None]:
    """Read stdout/stderr/status until the launcher reports, the deadline passes or output overflows."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), status_r: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    why, grace_until = None, None
    try:
        while sel.get_map():
            now = time.monotonic()
            if grace_until is None and now >= deadline:
                why = "timeout"
                break
            if grace_until is not None and now >= grace_until:
                break  # the program is done; something it left behind still holds a pipe
            limit = (grace_until or deadline) - now
            for key, _ in sel.select(timeout=min(limit, 0.5)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    if key.fd == status_r:
                        grace_until = time.monotonic() + 0.5
                    continue
                bufs[key.fd] += chunk
                if key.fd != status_r and len(bufs[key.fd]) > cap:
                    why = "output"
            if why:
                break
    finally:
        sel.close()
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), bytes(bufs[status_r]), why


def _kill_all(proc, uid: int | None) -> None:
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    with contextlib.suppress(ProcessLookupError):  # its own session: the launcher and all still in the group
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if uid is not None:  # processes that left the group (setsid, double fork): kill(-1) as their uid
        subprocess.run(["kill", "-9", "-1"], user=uid, group=uid, extra_groups=[], env=_ENV,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def _judge(why, status_raw: bytes, stderr: str, timeout_s: float, cap: int) -> tuple[Status, int | None, str]:
    if why == "timeout":
        return "timeout", None, f"wall-clock limit of {timeout_s:g}s exceeded"
    if why == "output":
        return "killed", None, f"output limit of {cap} bytes exceeded"
    try:
        status = json.loads(status_raw) if status_raw else {}
    except ValueError:
        status = {}
    if "error" in status:
        return "error", None, status["error"]
    if "signal" in status:
        sig = status["signal"]
        if sig == signal.SIGXCPU:
            return "timeout", -sig, "CPU time limit exceeded"
        if sig == signal.SIGXFSZ:
            return "killed", -sig, "file size limit exceeded"
        return "killed", -sig, f"killed by signal {signal.Signals(sig).name}"
    if "exit" not in status:
        return "error", None, "the sandbox ended without reporting the program's status"
    code = status["exit"]
    if code == 0:
        return "passed", 0, "exited with status 0"
    last = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    if code == _SETUP_FAILED and last.startswith("polyrl-sandbox:"):
        return "error", code, last
    if last.startswith("MemoryError"):
        return "failed", code, "memory limit exceeded (MemoryError)"
    return "failed", code, (last[:200] or f"exited with status {code}")


def _python() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _world_readable(*paths: str) -> bool:
    for p in paths:
        d = Path(p)
        for parent in [d, *d.parents]:
            if parent.exists() and not os.stat(parent).st_mode & 0o005:
                return False
    return True


def _site_dirs() -> list[str]:
    import sysconfig

    return sorted({sysconfig.get_path(k, vars={"base": sys.base_prefix, "platbase": sys.base_prefix})
                   for k in ("purelib", "platlib")})


# ---------------------------------------------------------------------------------------------------------
# The launcher: runs as `python -I -S sandbox.py SPEC` (stdlib only), inside the namespaces if there are any.

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 32, 4096, 16384
_MNT_DETACH, _CLONE_NEWUSER, _PR_SET_NO_NEW_PRIVS = 2, 0x10000000, 38
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    _check(_libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {dst}")


def _bind_ro(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True) if os.path.isdir(src) else open(dst, "a").close()
    _mount(src, dst, None, _MS_BIND | _MS_REC)
    # Flags the host mount carries (nodev, noexec, atime mode) must be kept on remount in a user namespace.
    st = os.statvfs(src).f_flag
    keep = st & (os.ST_NODEV | os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME)
    keep |= (1 << 21) if st & os.ST_RELATIME else 0
    _mount(None, dst, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | keep)


def _build_root(spec: dict) -> str:
    """Make the new root (read-only system dirs + tmpfs /sandbox), pivot into it, detach the host tree."""
    root, uid = spec["root"], spec["uid"]
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            os.symlink(os.readlink(top), root + top)
        elif os.path.isdir(top):
            _bind_ro(top, root + top)
    prefix = os.path.realpath(spec["prefix"])
    if not prefix.startswith("/usr/"):
        _bind_ro(prefix, root + prefix)
    for hidden in spec["hide"]:  # the trainer's packages are not the program's business
        if os.path.isdir(root + hidden):
            _mount("tmpfs", root + hidden, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "size=4k")
    os.mkdir(root + "/dev")
    for dev in ("null", "zero", "random", "urandom"):
        open(root + "/dev/" + dev, "w").close()
        _mount("/dev/" + dev, root + "/dev/" + dev, None, _MS_BIND)
    box = root + "/sandbox"
    os.mkdir(box)
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    _mount("tmpfs", box, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={spec['disk_mb']}m,mode=0700{owner}")
    shutil.copyfile(os.path.join(spec["work"], "main.py"), box + "/main.py")
    if uid is not None:
        os.chown(box + "/main.py", uid, uid)
    if not os.path.lexists(root + "/tmp"):  # (it exists when the interpreter itself lives under /tmp)
        os.symlink("sandbox", root + "/tmp")
    os.chdir(root)
    nr = _SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise OSError(f"pivot_root: unsupported machine {platform.machine()}")
    _check(_libc.syscall(nr, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", _MNT_DETACH), "detach host root")
    os.chdir("/")
    _mount(None, "/", None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    return "/sandbox"


def _enter(spec: dict, workdir: str) -> None:
    """In the forked child: drop privileges, set limits, exec the program. Never returns."""
    os.chdir(workdir)
    uid = spec["uid"]
    if uid is not None and spec["host_root"]:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    elif spec["level"] == "namespaces":
        # Root of our user namespace: a nested one with no uid map leaves no capabilities after exec. Made
        # before the limits, so RLIMIT_NPROC counts only the processes inside it, not all of the caller's.
        _check(_libc.unshare(_CLONE_NEWUSER), "unshare user namespace")
    lim = spec["limits"]
    for res, value in ((resource.RLIMIT_CPU, lim["cpu"]), (resource.RLIMIT_AS, lim["as"]),
                       (resource.RLIMIT_NPROC, lim["nproc"]), (resource.RLIMIT_FSIZE, lim["fsize"]),
                       (resource.RLIMIT_NOFILE, lim["nofile"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    os.execve(spec["python"], [spec["python"], "-I", "-S", "-B", "main.py"], spec["env"])


def _launch(spec: dict) -> int:
    fd = spec["status_fd"]
    os.set_inheritable(fd, False)
    try:
        workdir = _build_root(spec) if spec["level"] == "namespaces" else spec["work"]
    except OSError as exc:
        os.write(fd, json.dumps({"error": f"sandbox setup failed: {exc}"}).encode())
        return _SETUP_FAILED
    pid = os.fork()
    if pid == 0:
        try:
            os.close(fd)
            _enter(spec, workdir)
        except BaseException as exc:  # noqa: BLE001 - report anything, then leave without cleanup
            os.write(2, f"polyrl-sandbox: cannot start the program: {exc}\n".encode())
        os._exit(_SETUP_FAILED)
    while True:  # as PID 1 of the namespace we also reap orphans; our own child decides when we are done
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return _SETUP_FAILED
        if done == pid:
            break
    signalled = os.WIFSIGNALED(status)
    report = {"signal": os.WTERMSIG(status)} if signalled else {"exit": os.waitstatus_to_exitcode(status)}
    os.write(fd, json.dumps(report).encode())
    return 0


if __name__ == "__main__":
    sys.exit(_launch(json.loads(sys.argv[1])))
