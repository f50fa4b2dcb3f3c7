"""The one error of ``relaymoe check-hf``: ``CheckError``, a pair it cannot compare."""

from __future__ import annotations


class CheckError(ValueError):
    """A checkpoint, a folder or a setting ``relaymoe check-hf`` cannot compare (the message
    names why and the fix). A comparison that runs and disagrees is no error: it is a FAIL."""
