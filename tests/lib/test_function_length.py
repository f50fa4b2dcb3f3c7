"""No function in ``relaymoe/ring`` runs over 80 lines: each does one thing.

A function is measured from its ``def`` to its last line (its signature and docstring
included), on the source (the AST). A function past the limit is split by concept (the steps
it runs, each a function with one job), not by line count.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RING = ROOT / "relaymoe" / "ring"
MAX_LINES = 80
# what is longer, each with why
EXEMPT = {
    ("relaymoe/ring/engine.py", "ring_moe"): "the public entry point: its docstring (about 100 "
    "lines) is the reference of every argument; its code is about 45 lines",
}


def long_functions(source: str, limit: int = MAX_LINES) -> dict[str, int]:
    """``name: lines`` of each function (methods and nested ones too) over ``limit`` lines."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                out[node.name] = lines
    return out


def test_no_function_over_80_lines_in_ring():
    files = sorted(RING.rglob("*.py"))
    assert len(files) > 6, files
    bad = {}
    for path in files:
        where = str(path.relative_to(ROOT))
        for name, lines in long_functions(path.read_text()).items():
            if (where, name) not in EXEMPT:
                bad[f"{where}:{name}"] = lines
    assert not bad, f"functions over {MAX_LINES} lines (split them by the steps they run): {bad}"


def test_the_exemptions_are_still_needed():
    for (where, name), why in EXEMPT.items():
        assert name in long_functions((ROOT / where).read_text()), (where, name, why)


def test_the_check_counts_signature_body_and_nested_functions():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES - 1))
    assert long_functions(f"def f():\n{body}") == {}
    assert long_functions(f"def f():\n{body}    return x0\n") == {"f": MAX_LINES + 1}
    nested = "".join(f"        x{i} = {i}\n" for i in range(MAX_LINES))
    assert long_functions(f"class C:\n    def m(self):\n{nested}") == {"m": MAX_LINES + 1}
