"""No library module reaches into another's private names.

A name with a leading underscore belongs to its module. When another module needs it, it is an
interface and is public (no underscore); when it is not, the code lives where it is used. The
check is on the source (the AST) of every module under ``relaymoe/``:

* ``from relaymoe.x import _name`` and the relative ``from . import _name`` /
  ``from .x import _name``;
* ``import relaymoe.x._private`` (a private module of another package);
* ``module._name`` where ``module`` was imported from ``relaymoe`` (``import relaymoe.x as m``,
  ``from relaymoe import x``).

Dunder names (``__version__``) are public. Tests may poke internals; this is for the library
(``tests/harness/test_layout.py`` applies it between the benchmark scripts).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "relaymoe"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _source_module(node: ast.ImportFrom, path: Path) -> str:
    """The absolute module a ``from ... import`` names (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _ours(module: str) -> bool:
    return module == "relaymoe" or module.startswith("relaymoe.")


def private_imports(path: Path, source: str | None = None, *, ours=_ours) -> list[str]:
    """``line: what`` for each private name ``path`` takes from another module that ``ours``
    accepts by name (relaymoe's, by default)."""
    tree = ast.parse(path.read_text() if source is None else source)
    found, modules = [], set()  # modules: local names bound to a relaymoe module or its member
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _source_module(node, path)
            if not ours(src):
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {src} import {alias.name}")
                else:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not ours(alias.name):
                    continue
                if any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{node.lineno}: import {alias.name}")
                modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        base = node.value
        while isinstance(base, ast.Attribute):  # relaymoe.ring.agreement._x
            base = base.value
        if isinstance(base, ast.Name) and base.id in modules:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_cross_module_private_import():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 80, files
    bad = {str(f.relative_to(ROOT)): hits for f in files if (hits := private_imports(f))}
    assert not bad, (
        "private names used across modules; make the name public (and list it in the module's "
        f"__all__ where it has one) or move the code to where it is used: {bad}"
    )


@pytest.mark.parametrize(
    "where,source",
    [
        ("relaymoe/ring/agreement.py", "from relaymoe.ring.plan import _capacity\n"),
        ("relaymoe/ring/agreement.py", "from .plan import IDX, _pass_hops\n"),
        ("relaymoe/loss/__init__.py", "from . import _private\n"),
        ("relaymoe/ring/agreement.py", "from relaymoe.ring import plan\nplan._capacity()\n"),
        ("relaymoe/ring/agreement.py", "import relaymoe.ring.plan as p\np._flat\n"),
        ("relaymoe/ring/agreement.py", "import relaymoe.ring.plan\nrelaymoe.ring.plan._x\n"),
        ("relaymoe/ring/agreement.py", "def f():\n    from relaymoe.ring.plan import _h\n"),
    ],
)
def test_the_check_sees_each_form(where, source):
    assert private_imports(ROOT / where, source), source


@pytest.mark.parametrize(
    "source",
    [
        "from relaymoe import __version__\n",
        "from relaymoe.ring.plan import ring_plan as _local\n",  # a private local alias
        "from torch import _C\nimport torch\ntorch._grouped_mm\n",  # not ours
        "from relaymoe.ring import plan\nplan.ring_plan().__class__\n",
        "def _own(): pass\n_own()\n",
    ],
)
def test_the_check_passes_public_names(source):
    assert not private_imports(ROOT / "relaymoe/ring/agreement.py", source), source
