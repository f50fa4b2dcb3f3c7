"""The one error of ``relaymoe data``: ``DataError``, a refused input, tokenizer or setting."""

from __future__ import annotations


class DataError(ValueError):
    """A bad input, tokenizer or setting of ``relaymoe data`` (the message names the fix)."""
