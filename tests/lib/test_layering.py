"""Dependencies in relaymoe/ point one way: kernels <- ops <- ring <- megatron <- the entry points
(cli, convert_hf, export_hf, check_hf), with the torch-free modules (options, cost, planner,
config, lossmodel, data, host_warnings) and the oracle beside the stack.

Megatron (the ``megatron`` package) is imported by five parts only: ``megatron/`` (the
integration), ``data/`` (megatron-core's tokenizer and ``IndexedDatasetBuilder``: the dataset is
Megatron's format, written by Megatron's own code), ``convert_hf/`` and ``check_hf/`` (the model
built as pretrain builds it) and ``export_hf/`` (megatron-core's reader of a checkpoint's saved
arguments). All but ``megatron/`` import it inside functions only, so their subcommands'
parsers, and ``import relaymoe``, need no Megatron.

Every import in every module is read from its source (function-level lazy imports included), so
an upward import fails here even when no test happens to execute it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "relaymoe"

# level of each top-level part of relaymoe; a module may import only parts of its level or below
LEVELS = {
    "options": 0, "activation": 0, "cost": 0, "lossmodel": 0, "config": 0, "planner": 0,
    "reference": 0, "data": 0, "host_warnings": 0, "fp8_recipe": 0,
    "kernels": 1, "activation_torch": 1,
    "routing": 2, "experts": 2, "expert_inputs": 2, "loss": 2, "fp8_state": 2, "experts_fp8": 2,
    "ring": 3,
    "megatron": 4,
    "cli": 5, "convert_hf": 5, "export_hf": 5, "check_hf": 5, "__main__": 5, "__init__": 5,
}  # fmt: skip
TORCH_FREE = (
    "options",
    "activation",
    "cost",
    "lossmodel",
    "config",
    "planner",
    "data",
    "host_warnings",
    "fp8_recipe",
)
# the parts that may import Megatron, and whether at import time (False: inside functions only)
MEGATRON_IMPORTERS = {"megatron": True, "data": False, "convert_hf": False, "export_hf": False,
                      "check_hf": False}  # fmt: skip


def _part(rel: Path) -> str:
    first = rel.parts[0]
    return first[:-3] if first.endswith(".py") else first


def _module_level(tree: ast.AST):
    """The nodes that run when the module is imported (function bodies left out)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                todo.append(child)


def _imports(path: Path, *, lazy: bool = True) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``path`` (``lazy=False``: only those that run at
    import time), relative imports resolved."""
    tree = ast.parse(path.read_text())
    here = list(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree) if lazy else _module_level(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            if node.module is None or node.level:
                out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


MODULES = sorted(p for p in PKG.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_upward_import(path):
    rel = path.relative_to(PKG)
    part = _part(rel)
    assert part in LEVELS, f"relaymoe/{rel}: add its part {part!r} to LEVELS"
    bad = []
    for line, mod in _imports(path):
        names = mod.split(".")
        if names[0] != "relaymoe" or len(names) < 2:
            continue
        target = names[1]
        if target not in LEVELS:
            continue  # a name imported from the package root's namespace
        if LEVELS[target] > LEVELS[part]:
            bad.append(f"line {line}: {mod} (level {LEVELS[target]} > {part}'s {LEVELS[part]})")
    assert not bad, f"relaymoe/{rel} imports upward:\n" + "\n".join(bad)


@pytest.mark.parametrize("part", TORCH_FREE)
def test_pure_python_parts_import_no_torch(part):
    """Importable without torch: a function may import it lazily where it needs a device."""
    paths = [PKG / f"{part}.py"] if (PKG / f"{part}.py").is_file() else sorted(
        (PKG / part).rglob("*.py"))  # fmt: skip
    found = [(p, line, mod) for p in paths for line, mod in _imports(p, lazy=False)]
    bad = [f"{p.relative_to(PKG)}:{line} {mod}" for p, line, mod in found
           if mod.split(".")[0] in ("torch", "triton")]  # fmt: skip
    assert not bad, f"{part} must stay torch-free: " + ", ".join(bad)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_only_the_megatron_parts_import_megatron(path):
    part = _part(path.relative_to(PKG))
    at_import_time = MEGATRON_IMPORTERS.get(part)
    if at_import_time:
        return
    allowed_lazily = at_import_time is False
    imports = _imports(path, lazy=not allowed_lazily)
    found = [f"line {line}: {mod}" for line, mod in imports if mod.split(".")[0] == "megatron"]
    where = "at import time (only inside functions)" if allowed_lazily else "at all"
    assert not found, f"relaymoe/{path.relative_to(PKG)} may not import Megatron {where}: {found}"
