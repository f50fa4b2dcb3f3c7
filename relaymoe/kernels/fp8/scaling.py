"""Where the tensor-scaled recipes' scales come from: the tensor's own amax (current scaling) or
the amax history of the tensors quantised before it (delayed scaling).

A hop asks ``scales.scale(role, amax, fmt)`` for each tensor it quantises with one scale
(``role``: ``x``, ``a``, ``dy``, ``dh``, ``pa``), handing over the amax it measured (on the
device: no host sync). :class:`CurrentScaling` returns ``fmax / amax``; :class:`DelayedScaling`
returns the scale its history gave before this amax, then records the amax and computes the
role's next scale (TE's ``DelayedScaling``: ``max`` or ``most_recent`` of the window, initial
scale 1). The history is the object's, handed down by its owner (``relaymoe.fp8_state``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relaymoe.fp8_recipe import Fp8Recipe
from relaymoe.kernels.fp8.quant_torch import scale_from_amax

__all__ = ["CurrentScaling", "DelayedScaling", "scaling_for"]


class CurrentScaling:
    """Each tensor's scale from its own amax (``margin``: the scale divided by ``2**margin``)."""

    def __init__(self, margin: int = 0):
        self.margin = margin

    def scale(self, role: str, amax: Tensor, fmt: str) -> Tensor:
        return scale_from_amax(amax, fmt, margin=self.margin).reshape(1)


class DelayedScaling:
    """Per role, an amax history of ``history_len`` calls (newest first) and the scale the next
    quantisation of that role uses. ``state_dict``/``load_state_dict``: the histories and
    scales, for a checkpoint."""

    def __init__(self, history_len: int, algo: str, margin: int = 0):
        self.history_len, self.algo, self.margin = history_len, algo, margin
        self.history: dict[str, Tensor] = {}
        self.scales: dict[str, Tensor] = {}

    def scale(self, role: str, amax: Tensor, fmt: str) -> Tensor:
        amax = amax.detach().float().reshape(1)
        hist = self.history.get(role)
        if hist is None:
            hist = torch.zeros(self.history_len, dtype=torch.float32, device=amax.device)
        used = self.scales.get(role)
        if used is None:
            used = torch.ones(1, dtype=torch.float32, device=amax.device)
        self.set_history(role, torch.cat([amax, hist[:-1]]), fmt)
        return used

    def set_history(self, role: str, hist: Tensor, fmt: str) -> None:
        """Make ``hist`` (newest first, ``history_len`` fp32) the role's history and compute the
        scale its next quantisation uses from it (a history merged across ranks, or loaded)."""
        window = hist.amax() if self.algo == "max" else hist[0]
        self.history[role] = hist
        self.scales[role] = scale_from_amax(window, fmt, margin=self.margin).reshape(1)

    def state_dict(self) -> dict:
        return {"history": dict(self.history), "scales": dict(self.scales)}

    def load_state_dict(self, state: dict) -> None:
        self.history = dict(state["history"])
        self.scales = dict(state["scales"])


def scaling_for(recipe: Fp8Recipe):
    """A fresh scale source of a tensor-scaled ``recipe`` (None for blockwise)."""
    if recipe.recipe == "delayed":
        return DelayedScaling(recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin)
    if recipe.recipe == "tensorwise":
        return CurrentScaling(recipe.margin)
    return None
