"""The README's options table is the one generated from ``relaymoe.options``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "make_options_table", ROOT / "scripts" / "make_options_table.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_options_table_is_generated():
    assert _script().main(["--check"]) == 0, "run: python scripts/make_options_table.py"


def test_every_option_has_a_row_and_a_reason():
    """Each field of RingConfig and KernelOptions is in the table, with what it does."""
    import dataclasses

    from relaymoe.options import KernelOptions, RingConfig

    table = _script().table()
    for cls, prefix in ((RingConfig, ""), (KernelOptions, "kernels.")):
        for f in dataclasses.fields(cls):
            if f.name == "kernels":
                continue
            assert f"| `{prefix}{f.name}` |" in table
            assert f.metadata.get("why"), f"{cls.__name__}.{f.name} has no why= metadata"
