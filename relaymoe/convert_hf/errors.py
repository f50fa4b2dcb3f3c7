"""The one error of ``relaymoe convert-hf``: ``ConvertError``, a checkpoint it cannot convert."""

from __future__ import annotations


class ConvertError(ValueError):
    """A checkpoint or setting ``relaymoe convert-hf`` cannot convert (the message names why)."""
