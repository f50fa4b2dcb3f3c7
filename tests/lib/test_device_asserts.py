"""Every device-side assertion message in the library fits ``torch._assert_async``'s limit.

``torch._assert_async(cond, msg)`` raises ``RuntimeError: Message length must be smaller than
255`` at the call itself when ``msg`` is longer: a captured step that meant to refuse bad data
on the device instead crashes while being recorded (found on an H100 under
``--cuda-graph-impl full_iteration``). The messages are module constants or literals, so this
reads them from the source without running any CUDA.
"""

from __future__ import annotations

import ast
from pathlib import Path

LIMIT = 254  # torch: "Message length must be smaller than 255"
ROOT = Path(__file__).resolve().parents[2] / "relaymoe"


def _constants(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = node.value.value
    return out


def _messages(path: Path) -> list[tuple[int, str | None]]:
    """(line, message) of each ``_assert_async`` call in ``path``; None where unreadable."""
    tree = ast.parse(path.read_text())
    consts = _constants(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        if name != "_assert_async":
            continue
        msg = node.args[1]
        if isinstance(msg, ast.Constant) and isinstance(msg.value, str):
            found.append((node.lineno, msg.value))
        elif isinstance(msg, ast.Name):
            found.append((node.lineno, consts.get(msg.id)))
        else:
            found.append((node.lineno, None))
    return found


def test_device_assert_messages_fit_torch_limit():
    calls = [(p, line, m) for p in sorted(ROOT.rglob("*.py")) for line, m in _messages(p)]
    assert calls, "no torch._assert_async call found: the scan is broken"
    for path, line, msg in calls:
        where = f"{path.relative_to(ROOT.parent)}:{line}"
        assert msg is not None, f"{where}: the message is not a literal or module constant"
        assert len(msg) <= LIMIT, f"{where}: {len(msg)} characters > {LIMIT}: shorten it"
