"""The library's files: each at most 500 lines, each opening with a docstring (issue #33)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 500


def _library_files() -> list[Path]:
    files = sorted((ROOT / "relaymoe").rglob("*.py"))
    assert len(files) > 40, files
    return files


def test_no_library_file_exceeds_500_lines():
    long = {}
    for f in _library_files():
        name = f.relative_to(ROOT).as_posix()
        n = len(f.read_text().splitlines())
        if n > MAX_LINES:
            long[name] = n
    assert not long, f"split these by concept (at most {MAX_LINES} lines a file): {long}"


def test_every_library_file_opens_with_a_docstring():
    bad = []
    for f in _library_files():
        doc = ast.get_docstring(ast.parse(f.read_text()))
        if not doc or not doc.splitlines()[0].strip():
            bad.append(f.relative_to(ROOT).as_posix())
    assert not bad, f"give these a module docstring whose first line says what they hold: {bad}"
