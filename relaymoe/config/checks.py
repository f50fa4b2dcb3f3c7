"""Type checks of config values: positive integers, known keys, and the YAML types of a section.

A value YAML gives (int, float, bool, str, list, null) is checked against the field's annotation
(a string: the schema uses postponed annotations); lists become tuples. Every refusal is a
``ValueError`` naming the key and the value.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any


def check_keys(sec: str, raw: dict, cls) -> None:
    known = [f.name for f in fields(cls)]
    for k in raw:
        if k not in known:
            raise ValueError(f"unknown key {sec}.{k!r}; known keys of {sec}: {', '.join(known)}")


def coerce(sec: str, raw: dict, cls) -> dict:
    """Type checks (YAML gives int/float/bool/str/list); lists become tuples."""
    types = {f.name: f.type for f in fields(cls)}
    out = {}
    for k, v in raw.items():
        t = str(types[k])
        if isinstance(v, list):
            v = tuple(v)
        if "tuple" in t and v is not None:
            _check_sequence(f"{sec}.{k}", v, t)
            out[k] = v
            continue
        if v is None:
            if "None" not in t:
                raise ValueError(f"{sec}.{k} may not be null")
        elif t.startswith("bool"):
            if not isinstance(v, bool):
                raise ValueError(f"{sec}.{k}={v!r} must be true or false")
        elif t.startswith("int") and "tuple" not in t:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{sec}.{k}={v!r} must be an integer")
        elif t.startswith("float"):
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ValueError(f"{sec}.{k}={v!r} must be a number")
            v = float(v)
        elif t.startswith("str") and not isinstance(v, str):
            raise ValueError(f"{sec}.{k}={v!r} must be a string")
        out[k] = v
    return out


def _check_sequence(name: str, v: Any, t: str) -> None:
    """A field typed with a tuple (``moe_layer_freq: int | tuple[int, ...]``,
    ``recompute_modules: tuple[str, ...] | None``): a YAML list of the element type, or the
    scalar form the field also takes (an int; one module name)."""
    elem = "int" if "tuple[int" in t else "str"
    if isinstance(v, tuple):
        wrong = [x for x in v if isinstance(x, bool) or type(x).__name__ != elem]
        if wrong:
            raise ValueError(
                f"{name}={list(v)!r} must be a list of {'integers' if elem == 'int' else 'names'}"
                f", but holds {wrong[0]!r}"
            )
        return
    scalar_ok = (elem == "str" and isinstance(v, str)) or (
        "int |" in t and isinstance(v, int) and not isinstance(v, bool)
    )
    if not scalar_ok:
        form = "an integer or a list of 0/1 per layer" if elem == "int" else "a list of names"
        raise ValueError(f"{name}={v!r} must be {form}")


def check_pos_int(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive integer")
