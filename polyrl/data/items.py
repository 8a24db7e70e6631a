"""Item sources: the one way items come into a task, for training and for held-out evaluation.

A source is either generated (reasoning-gym and procedural envs make item ``i`` from a seed) or a finite
dataset (rows from a file, inline in the config, or shipped with an env). Either way training reads
``train_item(index)``, a pure function of the index (so a resumed run and every learner rank or Ray worker
read the same stream), and evaluation reads ``eval_items(n)``, the same items every time.

A finite dataset runs in epochs, each its own seeded shuffle of the training rows. Without a separate
held-out file, a row is held out when a stable hash of its key (by default its prompt) falls below
``held_out_fraction``: the split depends on the row, not on its position or the run's seed, and rows that
share a key land on the same side.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from polyrl.config import TaskConfig
from polyrl.data.files import RowError, Rows, open_rows

RowCheck = Callable[[dict[str, Any]], str | None]
"""A row's problem in one phrase naming the field (``"no field 'answer'"``), or None for a good row."""
RowKey = Callable[[dict[str, Any]], bytes]
"""What identifies a row for the held-out split and the overlap count."""


class ItemSource(Protocol):
    """Where a task's items come from."""

    @property
    def has_eval(self) -> bool: ...

    def train_item(self, index: int) -> dict[str, Any]: ...

    def eval_items(self, n: int) -> list[dict[str, Any]]: ...


class GeneratedSource:
    """Items made from integer seeds: ``make_train(i)`` and ``make_eval(i)`` for i = 0, 1, ..."""

    has_eval = True

    def __init__(self, make_train: Callable[[int], dict[str, Any]], make_eval: Callable[[int], dict[str, Any]],
                 eval_limit: int | None = None) -> None:
        self.make_train, self.make_eval, self.eval_limit = make_train, make_eval, eval_limit

    def train_item(self, index: int) -> dict[str, Any]:
        return self.make_train(index)

    def eval_items(self, n: int) -> list[dict[str, Any]]:
        n = n if self.eval_limit is None else min(n, self.eval_limit)
        return [self.make_eval(i) for i in range(n)]


def split_bucket(key: bytes, split_seed: int, salted: Any = None) -> float:
    """A row's place in [0, 1) for the held-out split: a salted SHA-256 of its key (``salted``: the hash of
    the salt alone, to copy, when many rows are placed)."""
    digest = (salted or hashlib.sha256(f"{split_seed}:".encode())).copy()
    digest.update(key)
    return int.from_bytes(digest.digest()[:8], "big") / 2**64


def epoch_order(ids: np.ndarray, blocks: np.ndarray | None, seed: list[int]) -> np.ndarray:
    """A shuffle of positions 0..len(ids)-1. Where rows are read a block at a time (parquet row groups), the
    blocks are shuffled and the rows within each, so an epoch decodes each block once."""
    rng = np.random.default_rng(seed)
    if blocks is None or len(blocks) <= 2:
        return rng.permutation(len(ids))
    block_of = np.searchsorted(blocks, ids, side="right") - 1
    rank = rng.permutation(len(blocks))[block_of]  # each block's place in the epoch
    return np.lexsort((rng.random(len(ids)), rank))


PROMPT_FIELDS = ("question", "prompt", "messages")
"""Fields that hold a row's prompt in the common formats: the default split key."""


def rows_key(row: dict[str, Any]) -> bytes:
    """The row's prompt field as canonical JSON where it has one (so one question with two ids is not on both
    sides), else the whole row."""
    for name in PROMPT_FIELDS:
        if name in row:
            return json.dumps(row[name], sort_keys=True, default=str).encode()
    return json.dumps(row, sort_keys=True, default=str).encode()


@dataclass
class DataSummary:
    """What ``polyrl data`` reports and training logs once."""

    train_rows: int
    eval_rows: int
    skipped_rows: int
    overlap_rows: int
    """Distinct keys (prompts) found in both the training and the held-out file (with a separate eval file;
    the hash split puts rows that share a key on one side)."""
    first_skips: list[str]


class DatasetSource:
    """A finite dataset split into training and held-out rows, validated before anything trains.

    ``rows`` are the training file's rows; ``eval_rows`` a separate held-out file's, or None to hold out
    ``held_out_fraction`` of ``rows`` by hash. ``check`` finds a bad row's problem: a bad row is a one-line
    ``RowError`` naming its file, line and field, or with ``skip_bad_rows`` a counted skip.
    """

    def __init__(
        self,
        rows: Rows,
        eval_rows: Rows | None = None,
        *,
        held_out_fraction: float = 0.0,
        split_seed: int = 0,
        seed: int = 0,
        key: RowKey | None = None,
        check: RowCheck | None = None,
        skip_bad_rows: bool = False,
        name: str = "items",
    ) -> None:
        self.rows, self.eval_rows, self.seed, self.name = rows, eval_rows, seed, name
        self.key = key or rows_key
        self.check, self.skip_bad_rows = check, skip_bad_rows
        self.skipped: list[str] = []
        split = held_out_fraction if eval_rows is None else 0.0
        train_ids, held_ids, train_keys = self._scan(rows, split, split_seed, keep_keys=eval_rows is not None)
        self.overlap, self._held_rows = 0, rows
        if eval_rows is not None:
            held_ids, _, held_keys = self._scan(eval_rows, 0.0, split_seed, keep_keys=True)
            self.overlap = len(train_keys & held_keys)
            self._held_rows = eval_rows
        if len(train_ids) == 0:
            where = "every row was skipped as bad" if self.skipped and len(held_ids) == 0 else (
                f"all {len(held_ids)} rows fell in the held-out split (held_out_fraction {held_out_fraction}); "
                "add rows, give eval_items, or set held_out_fraction: 0")
            raise RowError(f"{name}: no training rows: {where}")
        self.train_ids, self.held_ids = train_ids, held_ids
        self._order: tuple[int, np.ndarray] | None = None

    def _scan(self, rows: Rows, split: float, split_seed: int, keep_keys: bool = False
              ) -> tuple[np.ndarray, np.ndarray, set[bytes]]:
        """One pass over the rows: check each, and send it to training or held out."""
        train, held, keys = array("q"), array("q"), set()
        salted = hashlib.sha256(f"{split_seed}:".encode())
        for i, row in enumerate(rows.scan()):
            k = b""
            if isinstance(row, RowError):
                problem = str(row).removeprefix(f"{rows.where(i)}: ")
            else:
                problem = self.check(row) if self.check is not None else None
                if problem is None:
                    try:
                        k = self.key(row)
                    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
                        problem = f"cannot make the row's prompt ({type(exc).__name__}: {exc})"
            if problem is not None:
                message = f"{rows.where(i)}: {problem}"
                if not self.skip_bad_rows:
                    raise RowError(f"{message} (on_bad_row: skip counts and skips such rows)")
                self.skipped.append(message)
                continue
            if split > 0 and split_bucket(k, split_seed, salted) < split:
                held.append(i)
            else:
                train.append(i)
                if keep_keys:
                    keys.add(k)
        return np.frombuffer(train, dtype=np.int64), np.frombuffer(held, dtype=np.int64), keys

    @property
    def has_eval(self) -> bool:
        return len(self.held_ids) > 0

    def __len__(self) -> int:
        return len(self.train_ids)

    def _row_id(self, index: int) -> int:
        """The row behind training index ``index``: epoch ``index // n`` is a seeded shuffle of the n rows."""
        n = len(self.train_ids)
        epoch = index // n
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.train_ids, self.rows.blocks(), [self.seed, epoch]))
        return int(self.train_ids[self._order[1][index % n]])

    def train_item(self, index: int) -> dict[str, Any]:
        return self.rows[self._row_id(index)]

    def train_where(self, index: int) -> str:
        """The file and line of training index ``index``'s row."""
        return self.rows.where(self._row_id(index))

    def epoch_of(self, index: int) -> int:
        return index // len(self.train_ids)

    def eval_items(self, n: int) -> list[dict[str, Any]]:
        """The first ``n`` held-out rows in file order (the same every call)."""
        return [self._held_rows[int(i)] for i in self.held_ids[:n]]

    def describe(self) -> str:
        """One line for the run's log: the counts, and the first skipped row if any."""
        s = self.summary()
        line = f"{self.name}: {s.train_rows} training rows, {s.eval_rows} held out"
        if s.overlap_rows:
            line += f", {s.overlap_rows} prompts in both"
        if s.skipped_rows:
            line += f", {s.skipped_rows} bad rows skipped (first: {s.first_skips[0]})"
        return line

    def summary(self) -> DataSummary:
        return DataSummary(len(self.train_ids), len(self.held_ids), len(self.skipped), self.overlap,
                           self.skipped[:3])



def dataset_source(config: TaskConfig, seed: int, key: RowKey | None = None, check: RowCheck | None = None,
                   prefix: str = "task") -> DatasetSource:
    """The finite source a task's ``items`` / ``eval_items`` describe, split and checked (errors name the
    config key, or the file, line and field)."""
    rows = open_rows(config.items, f"{prefix}.items")
    eval_rows = open_rows(config.eval_items, f"{prefix}.eval_items") if config.eval_items is not None else None
    return DatasetSource(rows, eval_rows, held_out_fraction=config.held_out_fraction, split_seed=config.split_seed,
                         seed=seed, key=key, check=check, skip_bad_rows=config.on_bad_row == "skip",
                         name=f"task '{config.name}'")
