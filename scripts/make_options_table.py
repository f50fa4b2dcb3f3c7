"""Generate the README's options table from ``relaymoe.options``, so names, flags, variables,
choices and defaults live in one place (the dataclass fields and their metadata).

  python scripts/make_options_table.py           # rewrite the section in place
  python scripts/make_options_table.py --check   # exit 1 if README.md differs from the output

The table goes between ``<!-- options:begin -->`` and ``<!-- options:end -->`` in README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from relaymoe.options import INT64_MAX, KernelOptions, RingConfig  # noqa: E402

BEGIN = "<!-- options:begin -->"
END = "<!-- options:end -->"
README = ROOT / "README.md"


def _cell(text: str) -> str:
    return text.replace("%%", "%").replace("|", "\\|")


def _kind(f: dataclasses.Field) -> str:
    choices = f.metadata.get("choices")
    if choices is not None:
        return ", ".join(f"`{c}`" for c in choices)
    least, most = f.metadata.get("least", 1), f.metadata.get("most", INT64_MAX)
    ints = f"int >= {least}" if most == INT64_MAX else f"int in [{least}, {most}]"
    kinds = {"int": ints, "int | None": f"{ints} or none", "bool": "true, false",
             "float | None": f"seconds in (0, {most:g}] or none"}  # fmt: skip
    return kinds.get(str(f.type), str(f.type))


def _rows(cls, prefix: str) -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        if f.name == "kernels":
            continue
        m = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else None
        shown_default = "none" if default is None else f"`{default}`"
        flag = f"`{m['flag']}`" if m.get("flag") else "-"
        env = f"`{m['env']}`" if m.get("env") else "-"
        spell = m.get("env_values") or {}
        if spell:
            env += " (" + ", ".join(f"`{k}` = `{v}`" for k, v in spell.items()) + ")"
        out.append(f"| `{prefix}{f.name}` | {flag} | {env} | {_kind(f)} | {shown_default} | "
                   f"{_cell(m.get('why', ''))} |")  # fmt: skip
    return out


def table() -> str:
    lines = [
        "| option | Megatron flag | environment (read at the entry points) | values | default "
        "| what |",
        "| --- | --- | --- | --- | --- | --- |",
        *_rows(RingConfig, ""),
        *_rows(KernelOptions, "kernels."),
    ]
    return "\n".join(lines) + "\n"


def render(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} section")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date")
    a = ap.parse_args(argv)
    old = README.read_text()
    new = render(old)
    if a.check:
        if new != old:
            print("README.md's options table is out of date: python scripts/make_options_table.py")
            return 1
        return 0
    if new != old:
        README.write_text(new)
        print(f"updated {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
