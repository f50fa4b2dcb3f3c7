"""The library reads the process environment only at its entry points and never writes it.

Options come from ``relaymoe.options`` (``from_env`` at the entry points, which returns a
``RingConfig`` handed down from there), so a module deeper in ``relaymoe/`` that read
``os.environ`` would be a second,
hidden way to configure it, and one that wrote it would change other code's behaviour behind
its back. The check is on the source (the AST), so it needs neither torch nor Megatron.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "relaymoe"

# the entry points that may read the environment, and why
READERS = {
    "relaymoe/options.py": "from_env: the RELAYMOE_* variables, called by the entry points",
    "relaymoe/convert_hf/host.py": "torchrun detection (WORLD_SIZE, MASTER_ADDR) for convert-hf "
    "and check-hf",
}

_MUTATORS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` (or a bare ``environ`` imported from os)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _uses(tree: ast.AST) -> tuple[list[int], list[int]]:
    """(lines that touch the environment, lines that write it)."""
    touch, write = [], []
    for node in ast.walk(tree):
        if _is_environ(node):
            touch.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(a.name in ("environ", "getenv", "putenv", "unsetenv") for a in node.names):
                touch.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if isinstance(f.value, ast.Name) and f.value.id == "os":
                if f.attr == "getenv":
                    touch.append(node.lineno)
                elif f.attr in ("putenv", "unsetenv"):
                    touch.append(node.lineno)
                    write.append(node.lineno)
            if _is_environ(f.value) and f.attr in _MUTATORS:
                write.append(node.lineno)
        targets = []
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in targets:
            rebound = isinstance(t, ast.Attribute) and _is_environ(t)  # os.environ = ...
            if (isinstance(t, ast.Subscript) and _is_environ(t.value)) or rebound:
                write.append(node.lineno)
    return sorted(set(touch)), sorted(set(write))


def _scan() -> dict[str, tuple[list[int], list[int]]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        touch, write = _uses(ast.parse(path.read_text(), filename=rel))
        if touch or write:
            found[rel] = (touch, write)
    return found


def test_only_entry_points_read_the_environment():
    found = _scan()
    outside = {rel: lines for rel, (lines, _) in found.items() if rel not in READERS}
    assert not outside, (
        f"os.environ/os.getenv outside the entry points {sorted(READERS)}: {outside}; read "
        "options through relaymoe.options (from_env at an entry point, a RingConfig handed down)"
    )
    assert set(READERS) <= set(found), (
        f"entry points that no longer read the environment: {sorted(set(READERS) - set(found))}"
        "; drop them from READERS"
    )


def test_no_module_writes_the_environment():
    found = _scan()
    writes = {rel: w for rel, (_, w) in found.items() if w}
    assert not writes, f"relaymoe/ writes os.environ: {writes}"


def test_the_scan_sees_reads_and_writes():
    src = (
        "import os\nfrom os import environ\n"
        "a = os.environ.get('X')\nb = os.getenv('Y')\n"
        "os.environ['Z'] = '1'\nos.environ.setdefault('W', '0')\ndel environ['Z']\n"
        "os.putenv('V', '1')\n"
    )
    touch, write = _uses(ast.parse(src))
    assert touch == [2, 3, 4, 5, 6, 7, 8]
    assert write == [5, 6, 7, 8]
