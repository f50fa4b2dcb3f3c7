"""The inputs of ``relaymoe data``: their chunks of bytes and the documents each chunk holds.

A line belongs to the chunk it starts in; a paragraph- or file-document input is one chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from relaymoe.data.errors import DataError

TEXT_MODES = ("line", "paragraph", "file")
INPUT_FORMATS = ("auto", "jsonl", "text")
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[start, end)`` of one input: the lines starting there (JSON lines, text lines),
    or the whole file (paragraph or file documents)."""

    index: int
    path: str
    fmt: str  # jsonl | text
    start: int
    end: int
    size: int
    mtime_ns: int

    @property
    def name(self) -> str:
        return f"{self.index:06d}"


def input_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = path.lower()
    if name.endswith((".gz", ".bz2", ".xz", ".zst", ".zip")):
        raise DataError(
            f"--input {path}: compressed inputs are not read; decompress it first "
            "(e.g. 'gunzip -k') and pass the JSON lines or text file"
        )
    return "jsonl" if name.endswith(_JSONL_SUFFIXES) else "text"


def plan_chunks(inputs: list[str], fmt: str, text_mode: str, chunk_bytes: int) -> list[Chunk]:
    chunks: list[Chunk] = []
    for path in inputs:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"--input {path}: no such file")
        st = p.stat()
        kind = input_format(path, fmt)
        whole = kind == "text" and text_mode != "line"
        step = st.st_size if whole or st.st_size == 0 else chunk_bytes
        start = 0
        while True:
            end = st.st_size if whole else min(st.st_size, start + step)
            chunks.append(
                Chunk(len(chunks), str(p.resolve()), kind, start, end, st.st_size, st.st_mtime_ns)
            )
            start = end
            if start >= st.st_size:
                break
    return chunks


def _lines(chunk: Chunk):
    """(line number, bytes, end offset) of the lines starting in ``[chunk.start, chunk.end)``."""
    with open(chunk.path, "rb") as f:
        pos = chunk.start
        if pos > 0:
            f.seek(pos - 1)
            if f.read(1) != b"\n":  # inside a line that the chunk before owns: skip it
                pos += len(f.readline())
        f.seek(pos)
        while pos < chunk.end:
            line = f.readline()
            if not line:
                break
            pos += len(line)
            yield line, pos


def documents(chunk: Chunk, keys: tuple[str, ...], text_mode: str):
    """Yield ``(dict key -> text, end offset)`` per document of the chunk."""
    if chunk.fmt == "text" and text_mode != "line":
        text = Path(chunk.path).read_text(encoding="utf-8")
        parts = [text] if text_mode == "file" else _paragraphs(text)
        for i, part in enumerate(parts):
            yield {keys[0]: part}, chunk.end if i == len(parts) - 1 else chunk.start
        return
    for line, pos in _lines(chunk):
        if chunk.fmt == "text":
            yield {keys[0]: line.decode("utf-8").rstrip("\r\n")}, pos
            continue
        if not line.strip():
            yield {}, pos
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{chunk.path}: the line at byte {pos - len(line)} is not JSON ({e}); "
                "fix the line, or read the file as plain text with --input-format text"
            ) from None
        if not isinstance(row, dict):
            raise DataError(
                f"{chunk.path}: the line at byte {pos - len(line)} is a JSON "
                f"{type(row).__name__}, not an object with the key(s) {list(keys)}"
            )
        out = {}
        for k in keys:
            if k not in row:
                raise DataError(
                    f"{chunk.path}: the line at byte {pos - len(line)} has no key {k!r} "
                    f"(it has {sorted(row)[:8]}); {_keys_hint(row)}"
                )
            if not isinstance(row[k], str):
                raise DataError(
                    f"{chunk.path}: key {k!r} of the line at byte {pos - len(line)} is a "
                    f"{type(row[k]).__name__}, not a string"
                )
            out[k] = row[k]
        yield out, pos


def _keys_hint(row: dict) -> str:
    """The fix for a missing key: the line's text fields, the only ones that can be tokenised."""
    texts = sorted(k for k, v in row.items() if isinstance(v, str))
    if not texts:
        return "fix: no field of that line is a string (text to tokenise); check the input"
    return f"fix: --json-keys {texts[0]}" + (
        f" (its text fields: {', '.join(texts[:8])})" if len(texts) > 1 else ""
    )


def _paragraphs(text: str) -> list[str]:
    out, cur = [], []
    for line in text.splitlines():
        if line.strip():
            cur.append(line)
        elif cur:
            out.append("\n".join(cur))
            cur = []
    if cur:
        out.append("\n".join(cur))
    return out
