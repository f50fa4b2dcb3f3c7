"""Triton kernels and their launchers. Imports only torch and triton."""

from __future__ import annotations

import functools
import os

__all__ = ["triton_available", "interpret_mode"]


@functools.cache
def _import_triton() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # triton missing or broken: the plain-torch paths still work
        return False
    return True


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    """Triton is importable (kernels run on CUDA, or on CPU under the interpreter)."""
    return _import_triton()
