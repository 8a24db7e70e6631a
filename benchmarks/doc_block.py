"""Benchmarks write their tables into docs between two marker comments; this is the one place that does it."""

from __future__ import annotations

from pathlib import Path


def replace_block(doc: Path, start: str, end: str, table: str, heading: str) -> None:
    """Replace the text between ``start`` and ``end`` in ``doc``; with no markers yet, append a section under
    ``heading``. The rest of the page is left as it is."""
    text = doc.read_text() if doc.exists() else ""
    block = f"{start}\n{table}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + f"\n\n## {heading}\n\n{block}\n"
    doc.write_text(text)
