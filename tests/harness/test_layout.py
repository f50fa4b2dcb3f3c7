"""The test suite's layout: the library's tests (``tests/lib``) import nothing from
``benchmarks``, directly, inside a function, in code they hand a child process, or through the
modules of ``tests/`` they import (``tests.fixtures``, ``tests.worlds``, ...); every test file
lives in ``tests/lib``, ``tests/harness`` or ``tests/gpu``. benchmarks/README.md names every
script of ``benchmarks/`` and ``benchmarks/lab/``, and no table script imports the lab."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
_CODE_IMPORT = re.compile(r"^\s*(?:from|import)\s+([\w.]+)", re.M)


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def imported(path: Path) -> list[tuple[int, str]]:
    """``(line, what)`` for every module ``path`` imports (function bodies too), every import in
    a string of code (``python -c`` scripts) and every string naming a ``benchmarks`` path or
    module (``root / "benchmarks" / ...``, ``"-m", "benchmarks.x"``); docstrings are prose."""
    tree = ast.parse(path.read_text(), str(path))
    prose = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module.split(".")[0] == "tests":  # from tests import fixtures: a module
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in prose:
                continue
            found += [(node.lineno, m) for m in _CODE_IMPORT.findall(node.value)]
            if re.match(r"benchmarks($|[./])", node.value):
                found.append((node.lineno, node.value))
    return found


def _test_module_file(name: str) -> Path | None:
    """The file of ``tests.<...>`` (a module or a package), None for anything else."""
    if name != "tests" and not name.startswith("tests."):
        return None
    base = TESTS.parent.joinpath(*name.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def benchmark_imports(roots: list[Path]) -> list[str]:
    """Every import of ``benchmarks`` reachable from the ``.py`` files under ``roots``, following
    imports of other modules of ``tests/``; each as ``path:line: what (via ...)``."""
    todo = [(f, ()) for r in roots for f in ([r] if r.is_file() else sorted(r.rglob("*.py")))]
    seen, bad = set(), []
    while todo:
        path, via = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for line, name in imported(path):
            where = f"{path.relative_to(TESTS.parent)}:{line}"
            if name == "benchmarks" or name.startswith(("benchmarks.", "benchmarks/")):
                chain = f" (via {' -> '.join(via)})" if via else ""
                bad.append(f"{where}: {name}{chain}")
            elif (f := _test_module_file(name)) is not None:
                todo.append((f, (*via, where)))
    return bad


def test_library_tests_import_no_benchmarks_module():
    bad = benchmark_imports([TESTS / "lib"])
    assert not bad, "library tests must not import benchmarks:\n" + "\n".join(bad)


def test_the_check_finds_every_kind_of_benchmarks_import(tmp_path, monkeypatch):
    """The check can fail: each way a test can reach ``benchmarks`` is caught, one through a
    module of ``tests/``, and prose is not."""
    helper = tmp_path / "tests" / "helper_mod.py"
    helper.parent.mkdir()
    (helper.parent / "__init__.py").write_text("")
    helper.write_text("def f():\n    from benchmarks.numerics import oracle\n")
    lib = tmp_path / "tests" / "lib"
    lib.mkdir()
    (lib / "test_a.py").write_text(
        '"""Runs benchmarks/fault.py in prose only."""\n'
        "import benchmarks.sim\n"
        "from tests import helper_mod\n"
        "SCRIPT = 'import os\\nfrom benchmarks.e2e import pretrain_args\\n'\n"
        "CMD = ['-m', 'benchmarks.soak_pretrain']\n"
        "PATH = ('benchmarks', 'relay_host_cost.py')\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "TESTS", tmp_path / "tests")
    bad = benchmark_imports([lib])
    want = ["test_a.py:2: benchmarks.sim", "test_a.py:4: benchmarks.e2e",
            "test_a.py:5: benchmarks.soak_pretrain", "test_a.py:6: benchmarks",
            "helper_mod.py:2: benchmarks.numerics (via tests/lib/test_a.py:3)"]  # fmt: skip
    for w in want:
        assert any(b.endswith(w) for b in bad), (w, bad)
    assert len(bad) == len(want), bad


def test_every_test_file_is_in_lib_harness_or_gpu():
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not loose, f"tests/ holds test files outside lib/, harness/, gpu/: {loose}"
    for sub in ("lib", "harness", "gpu"):
        assert (TESTS / sub / "__init__.py").is_file(), sub


def test_benchmarks_readme_names_every_script():
    """A script nobody lists is a script nobody can find: each file of benchmarks/ (helpers
    included) and of benchmarks/lab/ is named in benchmarks/README.md."""
    bench = TESTS.parent / "benchmarks"
    readme = (bench / "README.md").read_text()
    files = [p for d in (bench, bench / "lab") for p in sorted(d.glob("*.py"))]
    named = [p for p in files if re.search(f"[`/]{re.escape(p.name)}", readme)]
    missing = [p.relative_to(bench).as_posix() for p in files
               if p.name != "__init__.py" and p not in named]  # fmt: skip
    assert not missing, f"benchmarks/README.md lists no row for: {missing}"


def test_no_table_script_imports_the_lab():
    """The lab depends on the benchmarks, never the reverse."""
    bench = TESTS.parent / "benchmarks"
    outside = [p for p in sorted(bench.rglob("*.py")) if "lab" not in p.relative_to(bench).parts]
    lab = ("benchmarks.lab", "benchmarks/lab")
    bad = [f"{p.relative_to(bench.parent)}:{line}: {name}"
           for p in outside for line, name in imported(p) if name.startswith(lab)]  # fmt: skip
    assert not bad, "outside benchmarks/lab/, nothing imports it:\n" + "\n".join(bad)


def test_no_benchmark_script_reaches_into_another_ones_private_names():
    """The library's rule on private names (``tests/lib/test_private_imports.py``) between the
    benchmark scripts (``benchmarks/``, the lab included): a name one script takes from
    another is public there. The probes may still read the library's internals, as tests do."""
    from tests.lib.test_private_imports import private_imports

    def ours(module: str) -> bool:
        return module == "benchmarks" or module.startswith("benchmarks.")

    root = TESTS.parent
    files = [p for p in sorted((root / "benchmarks").rglob("*.py")) if "results" not in p.parts]
    assert len(files) > 30, files
    bad = {str(f.relative_to(root)): h for f in files if (h := private_imports(f, ours=ours))}
    assert not bad, f"private names used across benchmark scripts; make them public: {bad}"
