"""Rows from dataset files: .jsonl, .json, .csv, .parquet, a ``datasets`` ``save_to_disk`` folder, or a glob of
shards of one of those; read lazily where the format allows, so a file larger than memory costs an index.

A ``Rows`` is a sized, random-access sequence of dicts that also says where each row came from
(``where(i)``: file and line, for error messages) and reads them all in order (``scan``) for the one pass that
checks and splits them. JSONL is indexed by line offsets (8 bytes a row) and parsed on access;
parquet and arrow are read a record batch at a time through pyarrow's memory map; .json and .csv are small by
nature and read whole.
"""

from __future__ import annotations

import bisect
import csv
import glob
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

FORMATS = (".jsonl", ".json", ".csv", ".parquet", ".arrow")


class RowError(ValueError):
    """A row that cannot be read; the message names the file and line (or row)."""


class Rows(Sequence[dict[str, Any]]):
    """A finite, random-access table of rows."""

    def where(self, i: int) -> str:
        raise NotImplementedError

    def scan(self) -> Iterator[dict[str, Any] | RowError]:
        """Every row in order, or the error reading it; subclasses read sequentially, faster than by index."""
        for i in range(len(self)):
            try:
                yield self[i]
            except RowError as exc:
                yield exc

    def columns(self) -> list[str] | None:
        """The fields every row has when the format declares them (parquet, arrow, csv); None for JSON."""
        return None

    def blocks(self) -> np.ndarray | None:
        """Row ids where each block starts (and the end), for formats that read a block to read a row; None
        where any row is as cheap to read as any other."""
        return None


class ListRows(Rows):
    """Rows held in memory (inline in the config, a .json list, a .csv file)."""

    def __init__(self, rows: list[Any], source: str, line_of: list[int] | None = None, header: list[str] | None = None):
        self.rows, self.source, self._lines, self._header = rows, source, line_of, header

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        row = self.rows[i]
        if not isinstance(row, dict):
            raise RowError(f"{self.where(i)}: the row is a {type(row).__name__}, not an object")
        return row

    def where(self, i: int) -> str:
        return f"{self.source}: line {self._lines[i]}" if self._lines else f"{self.source}: row {i}"

    def columns(self) -> list[str] | None:
        return self._header


class JsonlRows(Rows):
    """A .jsonl file indexed by the byte offset of each non-blank line; a row is parsed when read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offsets, self.lines = line_index(path)
        self._file = None

    def __len__(self) -> int:
        return len(self.offsets)

    def _raw(self, i: int) -> bytes:
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115 - kept open for the run's random reads
        self._file.seek(int(self.offsets[i]))
        return self._file.readline()

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        try:
            row = json.loads(self._raw(i))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RowError(f"{self.where(i)}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
        if not isinstance(row, dict):
            raise RowError(f"{self.where(i)}: the row is a {type(row).__name__}, not an object")
        return row

    def where(self, i: int) -> str:
        return f"{self.path}: line {int(self.lines[i]) if self.lines is not None else i + 1}"

    def scan(self) -> Iterator[dict[str, Any] | RowError]:
        with open(self.path, "rb") as f:
            i = 0
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line.decode())  # text, so json need not guess the encoding of each line
                    yield row if isinstance(row, dict) else RowError(
                        f"{self.where(i)}: the row is a {type(row).__name__}, not an object")
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    yield RowError(f"{self.where(i)}: not valid JSON ({getattr(exc, 'msg', exc)})")
                i += 1

    def __getstate__(self) -> dict[str, Any]:  # an open file does not pickle (Ray workers, spawned ranks)
        return {**self.__dict__, "_file": None}


def line_index(path: Path, chunk: int = 1 << 23) -> tuple[np.ndarray, np.ndarray | None]:
    """(byte offset of each non-blank line, its 1-based line number or None when no line is blank), found
    with numpy a chunk at a time: a fraction of a second for a million lines, 8 bytes a row."""
    starts, pos = [np.zeros(1, dtype=np.int64)], 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            starts.append(np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10).astype(np.int64) + pos + 1)
            pos += len(block)
    begin = np.concatenate(starts)
    end = np.append(begin[1:], pos)
    keep = end - begin > 2  # a line of more than a newline (and a carriage return) may hold a row
    with open(path, "rb") as f:  # the few short lines are looked at one by one
        for i in np.flatnonzero(~keep & (end > begin)):
            f.seek(int(begin[i]))
            keep[i] = bool(f.read(int(end[i] - begin[i])).strip())
    if keep.all():
        return begin, None
    return begin[keep], (np.flatnonzero(keep) + 1).astype(np.int64)


class ArrowRows(Rows):
    """Parquet or Arrow IPC files, memory-mapped and decoded one row group at a time (the last one kept), so
    memory holds an index and a group, not the table. Parquet cannot read one row without decoding its group:
    ``blocks`` tells the item source, which then shuffles groups and rows within each group."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._open()
        self._cache: tuple[int, Any] | None = None

    def _open(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self.path.suffix == ".parquet":
            self._pq = pq.ParquetFile(self.path, memory_map=True)
            sizes = [self._pq.metadata.row_group(g).num_rows for g in range(self._pq.num_row_groups)]
            self._schema = self._pq.schema_arrow
        else:  # datasets' save_to_disk writes Arrow IPC streams
            self._pq = None
            source = pa.memory_map(str(self.path))
            try:
                self._table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                self._table = pa.ipc.open_file(pa.memory_map(str(self.path))).read_all()
            self._batches = self._table.to_batches()
            sizes = [b.num_rows for b in self._batches]
            self._schema = self._table.schema
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _group(self, b: int) -> Any:
        if self._cache is None or self._cache[0] != b:
            self._cache = (b, self._pq.read_row_group(b) if self._pq is not None else self._batches[b])
        return self._cache[1]

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        b = bisect.bisect_right(self.starts, i) - 1
        return self._group(b).slice(i - int(self.starts[b]), 1).to_pylist()[0]

    def where(self, i: int) -> str:
        return f"{self.path}: row {i}"

    def scan(self) -> Iterator[dict[str, Any] | RowError]:
        batches = self._pq.iter_batches(batch_size=8192) if self._pq is not None else self._batches
        for batch in batches:
            yield from batch.to_pylist()

    def blocks(self) -> np.ndarray | None:
        return self.starts

    def columns(self) -> list[str] | None:
        return list(self._schema.names)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self._cache = state["path"], None
        self._open()


class ConcatRows(Rows):
    """Several files' rows in order (a glob of shards, or a ``save_to_disk`` folder's arrow files)."""

    def __init__(self, parts: list[Rows]) -> None:
        self.parts = parts
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in parts], dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _locate(self, i: int) -> tuple[Rows, int]:
        p = bisect.bisect_right(self.starts, i) - 1
        return self.parts[p], i - int(self.starts[p])

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        part, j = self._locate(i)
        return part[j]

    def where(self, i: int) -> str:
        part, j = self._locate(i)
        return part.where(j)

    def scan(self) -> Iterator[dict[str, Any] | RowError]:
        for part in self.parts:
            yield from part.scan()

    def blocks(self) -> np.ndarray | None:
        parts = [p.blocks() for p in self.parts]
        if all(b is None for b in parts):
            return None
        starts = [np.asarray(b if b is not None else [0, len(p)], dtype=np.int64) + self.starts[k]
                  for k, (p, b) in enumerate(zip(self.parts, parts, strict=True))]
        return np.unique(np.concatenate(starts))

    def columns(self) -> list[str] | None:
        cols = [p.columns() for p in self.parts]
        if any(c is None for c in cols):
            return None
        return [c for c in cols[0] if all(c in other for other in cols[1:])]


def _read_json(path: Path) -> ListRows:
    try:
        rows = json.loads(path.read_text(encoding="utf-8-sig"))  # -sig: a byte-order mark is not a field
    except json.JSONDecodeError as exc:
        raise RowError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(rows, dict) and isinstance(rows.get("data"), list):  # {"data": [...]}, as some exports write
        rows = rows["data"]
    if not isinstance(rows, list):
        raise RowError(f"{path}: a .json dataset must hold a list of objects (or .jsonl, one object a line)")
    return ListRows(rows, str(path))


def _read_csv(path: Path) -> ListRows:
    with open(path, newline="", encoding="utf-8-sig") as f:  # spreadsheets write a byte-order mark
        reader = csv.DictReader(f)
        rows, lines = [], []
        for row in reader:
            if None in row:  # more cells than the header names
                raise RowError(f"{path}: line {reader.line_num} has more cells than the header's "
                               f"{len(reader.fieldnames or [])} columns")
            rows.append(row)
            lines.append(reader.line_num)
    return ListRows(rows, str(path), lines, list(reader.fieldnames or []))


def _read_file(path: Path) -> Rows:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return JsonlRows(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".csv":
        return _read_csv(path)
    if suffix in (".parquet", ".arrow"):
        return ArrowRows(path)
    raise RowError(f"{path}: unknown dataset format '{suffix}'; use {', '.join(FORMATS)}, or a datasets folder")


def _saved_dataset(folder: Path) -> Rows:
    """A ``datasets`` ``save_to_disk`` folder: its ``state.json`` lists the arrow shards in order; a
    ``DatasetDict`` folder (one subfolder a split) names its ``train`` split."""
    state = folder / "state.json"
    if not state.exists():
        if (folder / "dataset_dict.json").exists():
            raise RowError(f"{folder}: a DatasetDict folder; name one split's folder (e.g. {folder / 'train'})")
        shards = sorted(p for p in folder.iterdir() if p.suffix.lower() in FORMATS)
        if not shards:
            raise RowError(f"{folder}: no dataset files in this folder ({', '.join(FORMATS)})")
        return ConcatRows([_read_file(p) for p in shards])
    files = [folder / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    return ConcatRows([ArrowRows(p) for p in files])


def open_rows(source: str | list[Any], key: str) -> Rows:
    """The rows a config's ``items`` / ``eval_items`` names: an inline list, a file, a folder or a glob.
    Errors are one line naming the key or the file."""
    if isinstance(source, list):
        if not source:
            raise RowError(f"{key}: no items")
        return ListRows(source, key)
    if any(c in source for c in "*?["):
        paths = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
        if not paths:
            raise RowError(f"{key}: no file matches '{source}'")
    else:
        paths = [Path(os.path.expanduser(source))]
        if not paths[0].exists():
            raise RowError(f"{key}: no such file '{source}'")
    try:
        parts = [_saved_dataset(p) if p.is_dir() else _read_file(p) for p in paths]
    except RowError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        raise RowError(f"{key}: cannot read '{source}': {getattr(exc, 'strerror', None) or exc}") from None
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors for a corrupt or foreign file
        raise RowError(f"{key}: cannot read '{source}': {type(exc).__name__}: {str(exc).splitlines()[0]}") \
            from None
    rows = parts[0] if len(parts) == 1 else ConcatRows(parts)
    if len(rows) == 0:
        raise RowError(f"{key}: '{source}' holds no rows")
    return rows


def check_source(source: str | list[Any], key: str) -> None:
    """A config-time check that ``items`` names something to read (the rows are read and checked when the
    task is built)."""
    if isinstance(source, list):
        if not source:
            raise RowError(f"{key}: no items")
        return
    expanded = os.path.expanduser(source)
    if any(c in source for c in "*?["):
        if not glob.glob(expanded, recursive=True):
            raise RowError(f"{key}: no file matches '{source}'")
    elif not os.path.exists(expanded):
        raise RowError(f"{key}: no such file '{source}'")
