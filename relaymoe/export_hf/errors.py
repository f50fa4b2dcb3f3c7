"""The one error of ``relaymoe export-hf``: ``ExportError``, a checkpoint it cannot export."""

from __future__ import annotations


class ExportError(ValueError):
    """A checkpoint or setting ``relaymoe export-hf`` cannot export (the message names why and
    the fix)."""
