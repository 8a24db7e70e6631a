"""``polyrl view RUN_DIR``: a local web page to browse the stored rollouts of a run (trajectories.jsonl).

Standard-library HTTP server plus static HTML/JS from ``polyrl/observe/static``. The page has no
authentication, so it is served on loopback addresses only. The index is refreshed on every listing request,
so a run that is still training can be browsed as it goes.

Endpoints: ``/`` (the page), ``/static/<file>``, ``/api/run``, ``/api/trajectories`` (one summary row per
stored trajectory) and ``/api/trajectory/<i>`` (the full record, with per-token text from the run's
tokenizer and the stored samples of the same group).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

log = logging.getLogger(__name__)

STATIC_FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
PREVIEW_CHARS = 120
FLAGS = ("truncated", "terminated_early", "replayed", "guided", "hinted")  # as report.SAMPLE_FLAGS and app.js
# Fields an ARPO-style branching rollout may carry (top level or under ``info``) to be drawn as a tree.
BRANCH_FIELDS = ("branch_id", "parent_id", "branch_at")


class ViewerError(ValueError):
    """The viewer cannot start or read the run; one line naming the file, row or option."""


def check_host(host: str) -> None:
    """Refuse anything but loopback: the viewer shows a run's data to whoever can reach it."""
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ViewerError(
            f"--host {host}: the viewer serves on a loopback address only (127.0.0.1, ::1, localhost)"
        )


def _finite(value: Any) -> Any:
    # JSON.parse rejects NaN/Infinity; a non-finite number reads as null on the page.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def branch_fields(row: dict[str, Any]) -> dict[str, Any]:
    info = row.get("info") if isinstance(row.get("info"), dict) else {}
    return {k: row.get(k, info.get(k)) for k in BRANCH_FIELDS if row.get(k, info.get(k)) is not None}


def summarise(index: int, row: dict[str, Any]) -> dict[str, Any]:
    """The listing row of one trajectory: what the filters and the table need, without token arrays."""
    text = str(row.get("text", ""))
    mask = row.get("loss_mask") or []
    info = row.get("info") if isinstance(row.get("info"), dict) else {}
    monitor = info.get("monitor_flags")
    return {
        "i": index,
        "step": row.get("step"),
        "task": row.get("task"),
        "item_id": row.get("item_id"),
        "group_id": row.get("group_id"),
        "reward": _finite(row.get("reward")),
        "advantage": _finite(row.get("advantage")),
        **{f: bool(row.get(f, False)) for f in FLAGS},
        # reward-hacking monitors (polyrl/rewards/monitors.py); absent for tasks they do not check
        "monitor_flags": [str(f) for f in monitor] if isinstance(monitor, list) else [],
        "model_tokens": int(sum(mask)),
        "tokens": len(row.get("input_ids") or []),
        "turns": len(row.get("turn_spans") or []),
        "preview": text[:PREVIEW_CHARS],
        **branch_fields(row),
    }


class RunIndex:
    """Byte offsets and summary rows of trajectories.jsonl, extended incrementally as the file grows."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise ViewerError(f"{self.run_dir}: no such run directory")
        self.path = self.run_dir / "trajectories.jsonl"
        self._lock = threading.Lock()
        self._reset(None)
        self.refresh()

    def _reset(self, inode: int | None) -> None:
        self.offsets: list[int] = []
        self.rows: list[dict[str, Any]] = []
        self._end, self._lineno, self._inode = 0, 0, inode

    def refresh(self) -> None:
        with self._lock:
            if not self.path.exists():
                self._reset(None)
                return
            st = self.path.stat()
            # A resumed run rewrites the file (new inode, maybe shorter): index it again from the start.
            if st.st_ino != self._inode or st.st_size < self._end:
                self._reset(st.st_ino)
            with open(self.path, "rb") as f:
                f.seek(self._end)
                while True:
                    start = f.tell()
                    line = f.readline()
                    if not line.endswith(b"\n"):  # nothing more, or a line still being written
                        break
                    self._end = f.tell()
                    self._lineno += 1
                    if not line.strip():
                        continue
                    row = self._parse(line, self._lineno)
                    self.offsets.append(start)
                    self.rows.append(summarise(len(self.rows), row))

    def _parse(self, line: bytes, lineno: int) -> dict[str, Any]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ViewerError(f"{self.path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("input_ids"), list):
            raise ViewerError(f"{self.path}:{lineno}: not a stored trajectory (no 'input_ids' list)")
        return row

    def record(self, i: int) -> dict[str, Any]:
        with self._lock:
            if not 0 <= i < len(self.offsets):
                raise IndexError(i)
            with open(self.path, "rb") as f:
                f.seek(self.offsets[i])
                return json.loads(f.readline())

    def group(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Stored samples of the same step, task and group (all leaves of a branching tree)."""
        key = (row.get("step"), row.get("task"), row.get("group_id"))
        return [r for r in self.rows if (r["step"], r["task"], r["group_id"]) == key]


class TokenText:
    """Per-token text from the run's tokenizer (model named in RUN_DIR/config.yaml), loaded on first use."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._lock = threading.Lock()
        self._loaded = False
        self.tokenizer: Any = None
        self.error: str | None = None
        self.special_ids: set[int] = set()

    def model_name(self) -> str | None:
        path = self.run_dir / "config.yaml"
        try:
            data = yaml.safe_load(path.read_text()) if path.is_file() else None
        except yaml.YAMLError:
            return None
        model = data.get("model") if isinstance(data, dict) else None
        return model.get("name") if isinstance(model, dict) else None

    def _load(self) -> None:
        # Here, not at the top: transformers takes seconds to import, and only a run's token view needs it.
        from polyrl.models.loading import load_tokenizer

        name = self.model_name()
        candidates = [name] if name else []
        # A checkpoint holds the tokenizer too: useful when the model path has moved since training.
        candidates += [str(p) for p in sorted((self.run_dir / "checkpoints").glob("step-*"), reverse=True)
                       if (p / "tokenizer_config.json").is_file()]
        for candidate in candidates:
            try:
                self.tokenizer = load_tokenizer(candidate)
                self.special_ids = set(self.tokenizer.all_special_ids)
                return
            except Exception as exc:  # noqa: BLE001 - fall through to the next candidate, then to plain text
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                self.error = f"tokenizer '{candidate}' did not load: {reason}"
        self.error = self.error or "no model named in config.yaml; token text is not available"

    def texts(self, ids: list[int]) -> list[str] | None:
        with self._lock:
            if not self._loaded:
                self._load()
                self._loaded = True
        if self.tokenizer is None:
            return None
        return token_texts(self.tokenizer, ids)


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """The text each token adds, so that ``"".join(result) == tokenizer.decode(ids)``.

    Each token is decoded after one token of context (SentencePiece drops a leading space otherwise); a
    token that ends inside a multi-byte character contributes "" and the token completing it carries it.
    """

    def decode(x: list[int]) -> str:
        return tokenizer.decode(x, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    out: list[str] = []
    pending = 0  # first token whose text has not been emitted yet
    for i in range(len(ids)):
        context = ids[pending - 1 : pending] if pending > 0 else []
        before = decode(context) if context else ""
        full = decode(context + ids[pending : i + 1])
        piece = full[len(before):] if full.startswith(before) else decode(ids[pending : i + 1])
        if piece.endswith("\ufffd") and i + 1 < len(ids) and i + 1 - pending < 4:
            out.append("")
            continue
        out.append(piece)
        pending = i + 1
    return out


class ViewerServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, run_dir: Path, host: str, port: int) -> None:
        check_host(host)
        self.index = RunIndex(run_dir)
        self.tokens = TokenText(Path(run_dir))
        super().__init__((host, port), _Handler)
        # Load the tokenizer (seconds: it imports transformers) while the user opens the page.
        threading.Thread(target=self.tokens.texts, args=([],), daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in str(host) else host}:{port}/"


class _Handler(BaseHTTPRequestHandler):
    server: ViewerServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        log.debug("viewer: " + format, *args)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", f"{content_type}; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, data: Any, status: int = HTTPStatus.OK) -> None:
        self._send(status, json.dumps(_finite(data)).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        path = urlparse(self.path).path
        try:
            if path == "/favicon.ico":
                self._send(HTTPStatus.NO_CONTENT, b"", "image/x-icon")
            elif path in ("/", "/index.html"):
                self._static("index.html")
            elif path.startswith("/static/"):
                self._static(path.removeprefix("/static/"))
            elif path == "/api/run":
                self._json(self._run_info())
            elif path == "/api/trajectories":
                self.server.index.refresh()
                self._json({"rows": self.server.index.rows})
            elif path.startswith("/api/trajectory/"):
                self._trajectory(path.removeprefix("/api/trajectory/"))
            else:
                self._json({"error": f"no such page: {path}"}, HTTPStatus.NOT_FOUND)
        except ViewerError as exc:
            self._json({"error": str(exc)}, HTTPStatus.INTERNAL_SERVER_ERROR)

    def _static(self, name: str) -> None:
        if name not in STATIC_FILES:  # a fixed list: no path from the URL ever reaches the file system
            self._json({"error": f"no such file: {name}"}, HTTPStatus.NOT_FOUND)
            return
        body = (files("polyrl.observe") / "static" / name).read_bytes()
        self._send(HTTPStatus.OK, body, STATIC_FILES[name])

    def _run_info(self) -> dict[str, Any]:
        run_dir = self.server.index.run_dir
        summary: dict[str, Any] = {}
        if (run_dir / "summary.json").is_file():
            try:
                summary = json.loads((run_dir / "summary.json").read_text())
            except json.JSONDecodeError:
                summary = {"error": "summary.json is not valid JSON"}
        config = run_dir / "config.yaml"
        return {
            "name": run_dir.resolve().name,
            "run_dir": str(run_dir),
            "model": self.server.tokens.model_name(),
            "summary": summary,
            "config": config.read_text() if config.is_file() else None,
        }

    def _trajectory(self, key: str) -> None:
        index = self.server.index
        if not key.isdigit():
            self._json({"error": f"bad trajectory index '{key}'"}, HTTPStatus.BAD_REQUEST)
            return
        try:
            record = index.record(int(key))
        except IndexError:
            self._json({"error": f"no trajectory {key} (have {len(index.rows)})"}, HTTPStatus.NOT_FOUND)
            return
        ids = record.get("input_ids") or []
        tokens = self.server.tokens
        record.update(
            i=int(key),
            token_text=tokens.texts(ids),
            token_error=tokens.error if tokens.tokenizer is None else None,
            special=[i in tokens.special_ids for i in ids],
            prompt_len=next((j for j, m in enumerate(record.get("loss_mask") or []) if m), len(ids)),
            group=index.group(index.rows[int(key)]),
            step_metrics=step_metrics(index.run_dir, record.get("step")),
            **branch_fields(record),
        )
        self._json(record)


STEP_METRIC_PREFIXES = ("mismatch/", "staleness/", "off_policy/")
"""The step's metrics shown beside a trajectory: how far the engine that sampled it was from the learner."""


def step_metrics(run_dir: Path, step: Any) -> dict[str, float]:
    """The ``STEP_METRIC_PREFIXES`` metrics of ``step`` in RUN_DIR/metrics.jsonl (its last row for that step,
    as a resumed run rewrites steps); empty when there are none or the file is missing or torn."""
    path = run_dir / "metrics.jsonl"
    found: dict[str, float] = {}
    if not isinstance(step, int) or not path.is_file():
        return found
    with path.open("rb") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("step") == step:
                found = {k: _finite(v) for k, v in row.items()
                         if k.startswith(STEP_METRIC_PREFIXES) and isinstance(v, int | float)}
    return found


def make_server(run_dir: Path, host: str = "127.0.0.1", port: int = 0) -> ViewerServer:
    """A server bound to ``host:port`` (port 0 picks a free one); call ``serve_forever`` to run it."""
    try:
        return ViewerServer(Path(run_dir), host, port)
    except OSError as exc:
        raise ViewerError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def serve(run_dir: Path, host: str = "127.0.0.1", port: int = 8765, echo=print) -> None:
    """Serve until interrupted (Ctrl-C)."""
    server = make_server(run_dir, host, port)
    echo(f"viewing {run_dir} ({len(server.index.rows)} trajectories) at {server.url}  (Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()

