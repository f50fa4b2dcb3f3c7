"""The library's shape, guarded by what it holds rather than by a line cap.

* No mutable state at module level in ``relaymoe/ring``, ``relaymoe/megatron`` and
  ``relaymoe/options.py``: a module-level dict, list, set (literal, comprehension or
  constructor call) that the module writes into, or a ``global`` statement, is process state
  that two models (two dispatchers, two ``ring_moe`` callers) would share behind their backs.
  What a call keeps lives in its ``RingRuntime``, its options in its ``RingConfig``. Frozen
  constants (tuples, frozensets, ``MappingProxyType``, a dict only ever read) pass; so do pure
  memos of functions (``functools.cache``/``lru_cache``, which are decorators, not containers).
* Every library file opens with a docstring that says what it holds.

The check is on the source (the AST): it needs neither torch nor Megatron.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "relaymoe"
# where nothing mutable may live at module level
STATELESS = ("relaymoe/ring", "relaymoe/megatron", "relaymoe/options.py")
# what is left there, each with why: none of it is an option nor what a ring call keeps
EXEMPT = {
    ("relaymoe/megatron/pretrain.py", "_REPORT"): "the step report of the pretrain entry "
    "point's one run (its command line's --relaymoe-report), not library state",
    ("relaymoe/megatron/fused_loss.py", "_LOGGED"): "which one-time notices were printed",
}

_CONTAINER_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque"}
_CONTAINER_NODES = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
_MUTATORS = {
    "append", "extend", "insert", "add", "update", "setdefault", "clear", "pop", "popitem",
    "remove", "discard", "__setitem__", "__delitem__", "appendleft", "extendleft",
}  # fmt: skip


def _stateless_files() -> list[Path]:
    files = []
    for where in STATELESS:
        path = ROOT / where
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    assert len(files) > 20, files
    return files


def _is_container(value: ast.AST | None) -> bool:
    if isinstance(value, _CONTAINER_NODES):
        return True
    if isinstance(value, ast.Call):
        fn = value.func
        name = (
            fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
        )
        return name in _CONTAINER_CALLS
    return False


def _module_containers(tree: ast.Module) -> dict[str, int]:
    """Names bound at module level (if/try blocks included) to a mutable container: line."""
    out: dict[str, int] = {}
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If | ast.Try | ast.With):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo += getattr(node, field, [])
            continue
        if isinstance(node, ast.ExceptHandler):
            todo += node.body
            continue
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        if _is_container(value):
            out.update({t.id: node.lineno for t in targets if isinstance(t, ast.Name)})
    return out


def _root_name(node: ast.AST) -> str | None:
    """``X`` of ``X[...]``, ``X.attr``, ``X[...][...]``."""
    while isinstance(node, ast.Subscript | ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _writes(tree: ast.Module, names: set[str]) -> dict[str, int]:
    """The first line where the module writes into each of ``names`` (item or slice
    assignment, ``del``, augmented assignment, a mutating method)."""
    out: dict[str, int] = {}

    # a local name bound to one of them (``cache = X``) writes into it too
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            if node.value.id in names:
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        aliases[t.id] = node.value.id

    def hit(name, line):
        name = aliases.get(name, name)
        if name in names:
            out.setdefault(name, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript) or (
                    isinstance(node, ast.AugAssign) and isinstance(t, ast.Name)
                ):
                    hit(_root_name(t), node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _MUTATORS:
                hit(_root_name(node.func.value), node.lineno)
    return out


def mutable_module_state(source: str, exempt: frozenset[str] = frozenset()) -> list[str]:
    """What ``source`` keeps at module level and writes into, and its ``global`` statements."""
    tree = ast.parse(source)
    containers = {n: line for n, line in _module_containers(tree).items() if n not in exempt}
    found = [
        f"line {line}: {name} (bound line {containers[name]}) is written into"
        for name, line in sorted(_writes(tree, set(containers)).items())
    ]
    found += [
        f"line {node.lineno}: global {', '.join(node.names)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Global)
    ]
    return found


def test_no_mutable_module_state_in_ring_megatron_and_options():
    bad = {}
    for f in _stateless_files():
        rel = f.relative_to(ROOT).as_posix()
        exempt = frozenset(name for (path, name) in EXEMPT if path == rel)
        found = mutable_module_state(f.read_text(), exempt)
        if found:
            bad[f.relative_to(ROOT).as_posix()] = found
    assert not bad, (
        f"module-level state in {bad}: keep what a call keeps in its RingRuntime "
        "(relaymoe/ring/runtime.py) or on the object that owns it, options in a RingConfig"
    )


def test_every_exemption_is_still_needed():
    """Each exemption names a file inside the checked paths that still keeps that container and
    writes into it: a file moved out of them (or a container gone) takes its exemption along."""
    stale = []
    for path, name in EXEMPT:
        f = ROOT / path
        inside = any(path == w or path.startswith(w + "/") for w in STATELESS)
        if not (inside and f.is_file() and name in _writes_of(f.read_text())):
            stale.append((path, name))
    assert not stale, f"drop these exemptions from EXEMPT: nothing there needs them: {stale}"


def _writes_of(source: str) -> set[str]:
    tree = ast.parse(source)
    return set(_writes(tree, set(_module_containers(tree))))


def test_the_state_check_sees_each_kind_of_write():
    """The checker itself: each way of keeping state is seen, constants and locals are not."""
    kept = {
        "X = {}\ndef f():\n    X[1] = 2\n": "X",
        "X: dict = {}\ndef f(k):\n    X.setdefault(k, 0)\n": "X",
        "X = []\ndef f():\n    X.append(1)\n": "X",
        "X = set()\ndef f():\n    X.add(1)\n": "X",
        "from collections import defaultdict\nX = defaultdict(list)\ndef f():\n    X[1].append(2)\n": "X",  # noqa: E501
        "X = [0]\ndef f():\n    X[0] += 1\n": "X",
        "X = {}\ndef f():\n    del X[1]\n": "X",
        "X = {}\ndef f(k):\n    cache = X\n    cache[k] = 1\n": "X",  # through a local alias
        "X = 0\ndef f():\n    global X\n    X = 1\n": "global X",
    }
    for source, name in kept.items():
        found = mutable_module_state(source)
        assert found and name in found[0], (source, found)
    fine = (
        "X = (1, 2)\nY = frozenset({1})\n",
        "ERRORS = {1: 'a'}\ndef f(c):\n    return ERRORS[c]\n",  # read only
        "def f():\n    x = {}\n    x[1] = 2\n    return x\n",  # a local
        "import functools\n@functools.cache\ndef f(x):\n    return x\n",  # a pure memo
        "class C:\n    def __init__(self):\n        self.d = {}\n        self.d[1] = 2\n",
    )
    for source in fine:
        assert mutable_module_state(source) == [], source


def test_every_library_file_opens_with_a_docstring():
    bad = []
    for f in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(f.read_text()))
        if not doc or not doc.splitlines()[0].strip():
            bad.append(f.relative_to(ROOT).as_posix())
    assert not bad, f"give these a module docstring whose first line says what they hold: {bad}"
