"""This rank's experts as ``ring_moe`` receives them: stacked tensors or per-expert lists.

Two input forms (shape legend in ``engine.py``):

* **tensor form**: ``w13 (El, 2I, H)``, ``w2 (El, H, I)``;
* **list form**: ``El`` tensors ``(2I, H)`` and ``El`` tensors ``(H, I)``, e.g. a Megatron experts
  module's parameters. Each element is an autograd input of its own (its gradient lands in its
  ``.grad``) and is what the ring saves for backward: no stacked copy outlives a pass.

Where a pass needs the ``(El, ...)`` form of the local experts (token mode, where the local
experts compute at every hop; a world of one), :meth:`LocalExperts.stacked` returns

* a zero-copy strided view when the elements lie back to back in one storage in list order
  (``"forward"``), or in exactly reverse list order (``"reversed"``: Megatron's DDP buffer holds
  parameters in reverse registration order). A reversed view's row ``j`` is expert ``El-1-j``;
  the caller remaps routing ids with :func:`reverse_local_ids` (``e -> q*El + (El-1-l)`` for
  ``e = q*El + l``, the same elementwise map on every rank, so ownership is unchanged);
* otherwise a transient ``torch.stack`` (one copy of the rank's experts), which the pass drops
  when it ends.

In expert mode the rank's own experts are packed into ring slot 0 at the start of every pass
(:meth:`LocalExperts.pack`, per element, in expert order) and hop 0 computes from that slot, so
the list form costs nothing extra there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "LocalExperts",
    "copied_weight_bytes",
    "layout_order",
    "reverse_local_ids",
    "stacked_view",
]

FORWARD, REVERSED = "forward", "reversed"

_COPIED = [0]  # bytes of expert weights copied by stacks and slot packs, this process


def copied_weight_bytes() -> int:
    """Bytes of expert weights the ring has copied in this process (transient stacks of list-form
    weights not back to back, and the packs of a rank's experts into ring slot 0): the step
    report's per-step difference of it is what a training step copies of its expert weights."""
    return _COPIED[0]


def layout_order(ws: Sequence[Tensor]) -> str | None:
    """``"forward"`` when ``ws`` lie back to back in one storage in list order, ``"reversed"``
    when back to back in reverse list order, None otherwise.

    Back to back: same shape, dtype and device, each contiguous, one storage, storage offsets
    stepping by ``+numel`` (forward) or ``-numel`` (reversed) from one element to the next. One
    element is ``"forward"``.
    """
    if not ws or not all(isinstance(w, Tensor) for w in ws):
        return None
    w0 = ws[0]
    if not w0.is_contiguous() or w0.layout != torch.strided:
        return None
    if len(ws) == 1:
        return FORWARD
    step = w0.numel()
    base = w0.untyped_storage().data_ptr()
    for w in ws[1:]:
        if (
            w.shape != w0.shape
            or w.dtype != w0.dtype
            or w.device != w0.device
            or not w.is_contiguous()
            or w.untyped_storage().data_ptr() != base
        ):
            return None
    offs = [w.storage_offset() for w in ws]
    if all(offs[j] == offs[0] + j * step for j in range(len(ws))):
        return FORWARD
    if all(offs[j] == offs[0] - j * step for j in range(len(ws))):
        return REVERSED
    return None


def stacked_view(ws: Sequence[Tensor], order: str) -> Tensor:
    """The ``(El, *shape)`` zero-copy view of back-to-back ``ws`` (``layout_order(ws) == order``).

    ``"forward"``: row ``j`` is ``ws[j]``; ``"reversed"``: row ``j`` is ``ws[El-1-j]``."""
    first = ws[0] if order == FORWARD else ws[-1]  # the lowest storage offset
    n = len(ws)
    return first.as_strided((n, *first.shape), (first.numel(), *first.stride()))


def reverse_local_ids(ids: Tensor, num_local: int) -> Tensor:
    """Global expert id ``q*El + l`` -> ``q*El + (El-1-l)`` (elementwise; a fresh tensor)."""
    if num_local == 1:
        return ids
    return ids + (num_local - 1) - 2 * torch.remainder(ids, num_local)


class LocalExperts:
    """This rank's ``El`` experts in either input form (see the module docstring)."""

    def __init__(self, w13, w2):
        self.listed = not isinstance(w13, Tensor)
        if self.listed:
            self.w13, self.w2 = list(w13), list(w2)
        else:
            self.w13, self.w2 = w13, w2

    @property
    def num_local(self) -> int:
        return len(self.w13) if self.listed else self.w13.shape[0]

    def inputs(self) -> tuple[Tensor, ...]:
        """The autograd inputs: ``(w13, w2)`` or ``(*w13_list, *w2_list)``."""
        if self.listed:
            return (*self.w13, *self.w2)
        return (self.w13, self.w2)

    @staticmethod
    def from_inputs(listed: bool, ws: Sequence[Tensor]) -> LocalExperts:
        if not listed:
            return LocalExperts(ws[0], ws[1])
        n = len(ws) // 2
        return LocalExperts(list(ws[:n]), list(ws[n:]))

    def preferred_order(self) -> str:
        """The row order :meth:`stacked` uses: the order of whichever list is back to back
        (w13's first, the larger); forward when neither is (or in tensor form)."""
        if not self.listed:
            return FORWARD
        return layout_order(self.w13) or layout_order(self.w2) or FORWARD

    def stacked(self, order: str | None = None) -> tuple[Tensor, Tensor, str]:
        """``(w13 (El, 2I, H), w2 (El, H, I), order)``: zero-copy views where the elements are
        back to back in ``order`` (default :meth:`preferred_order`), else a transient stack in
        that order. Tensor form: the tensors themselves, ``"forward"``."""
        if not self.listed:
            return self.w13, self.w2, FORWARD
        order = self.preferred_order() if order is None else order
        return self._one(self.w13, order), self._one(self.w2, order), order

    @staticmethod
    def _one(ws: list[Tensor], order: str) -> Tensor:
        if layout_order(ws) == order:
            return stacked_view(ws, order)
        rows = ws if order == FORWARD else ws[::-1]
        _COPIED[0] += sum(w.numel() * w.element_size() for w in rows)
        return torch.stack([w.detach() for w in rows])  # transient: dropped when the pass ends

    def pack(self, name: str, dst: Tensor) -> None:
        """Copy ``w13``/``w2`` (``name``) into ``dst (El, ...)`` in expert order."""
        src = self.w13 if name.endswith("w13") else self.w2
        _COPIED[0] += dst.numel() * dst.element_size()
        if not self.listed:
            dst.copy_(src)
            return
        for j, w in enumerate(src):
            dst[j].copy_(w)

    def split(self, dw13: Tensor, dw2: Tensor, order: str) -> tuple[Tensor, ...]:
        """Gradients ``(El, ...)`` in ``order``'s row order -> one per autograd input (views)."""
        if not self.listed:
            return (dw13, dw2)
        rows13, rows2 = list(dw13.unbind(0)), list(dw2.unbind(0))
        if order == REVERSED:
            rows13, rows2 = rows13[::-1], rows2[::-1]
        return (*rows13, *rows2)
