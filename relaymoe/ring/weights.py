"""This rank's experts as ``ring_moe`` receives them: stacked tensors or per-expert lists.

Two input forms (shape legend in ``engine.py``; J the fc1 rows, 2I gated, I not):

* **tensor form**: ``w13 (El, J, H)``, ``w2 (El, H, I)``, optional biases ``b13 (El, J)``,
  ``b2 (El, H)``;
* **list form**: ``El`` tensors ``(J, H)`` and ``El`` tensors ``(H, I)``, e.g. a Megatron experts
  module's parameters, and the biases as ``El`` 1-D tensors ``(J,)`` / ``(H,)``. Each element is
  an autograd input of its own (its gradient lands in its ``.grad``) and is what the ring saves
  for backward: no stacked copy outlives a pass.

The biases come in the weights' form and are handled as the weights are (views, stacks, packs,
gradient splits), each list on its own: a bias list back to back in the weights' order is
viewed, else stacked (``El*(J + H)`` elements, small beside the weights).

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

What a pass hands the hop primitives from them is here too: the local experts' parts by name
(:func:`local_parts`), a hop's options, biases and gradient buffers (:func:`hop_options`,
:func:`biases`, :func:`hop_grads`), the rank's own experts packed into slot 0
(:func:`pack_own`) and its gradients returned home in the weights' dtype (:func:`home_grads`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from relaymoe.experts import HopGrads, HopOptions
from relaymoe.ring.plan import RingProblem
from relaymoe.ring.runtime import KernelChoice

__all__ = [
    "LocalExperts",
    "biases",
    "home_grads",
    "hop_grads",
    "hop_options",
    "layout_order",
    "local_parts",
    "pack_own",
    "present",
    "reverse_local_ids",
    "stacked_view",
]

FORWARD, REVERSED = "forward", "reversed"


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


PARTS = ("w13", "w2", "b13", "b2")  # the order of the autograd inputs and of the gradients


class LocalExperts:
    """This rank's ``El`` experts in either input form (see the module docstring); ``b13`` /
    ``b2`` None when the experts carry no such bias.

    ``tally``: an object whose ``copied_weight_bytes`` (an int) counts the bytes of expert
    weights copied here (transient stacks of list-form weights not back to back, and the packs
    into ring slot 0): the call's ``RingRuntime``, whose per-step difference the step report
    shows; None: not counted."""

    def __init__(self, w13, w2, b13=None, b2=None, tally=None):
        self.tally = tally
        self.listed = not isinstance(w13, Tensor)
        form = list if self.listed else (lambda t: t)
        self.w13, self.w2 = form(w13), form(w2)
        self.b13 = None if b13 is None else form(b13)
        self.b2 = None if b2 is None else form(b2)

    @property
    def num_local(self) -> int:
        return len(self.w13) if self.listed else self.w13.shape[0]

    @property
    def parts(self) -> tuple[str, ...]:
        """The names of what this rank's experts hold, in ``PARTS`` order (weights, biases)."""
        return tuple(n for n in PARTS if getattr(self, n) is not None)

    def inputs(self) -> tuple[Tensor, ...]:
        """The autograd inputs: ``(w13, w2[, b13][, b2])`` or the lists' elements, list after
        list in the same order."""
        if self.listed:
            return tuple(t for n in self.parts for t in getattr(self, n))
        return tuple(getattr(self, n) for n in self.parts)

    @staticmethod
    def from_inputs(
        listed: bool, ws: Sequence[Tensor], has_b13: bool = False, has_b2: bool = False,
        tally=None,
    ) -> LocalExperts:  # fmt: skip
        """The inverse of :meth:`inputs` (which biases are there: ``has_b13``, ``has_b2``)."""
        names = [n for n, has in zip(PARTS, (True, True, has_b13, has_b2), strict=True) if has]
        if not listed:
            return LocalExperts(**dict(zip(names, ws, strict=True)), tally=tally)
        n = len(ws) // len(names)
        parts = {m: list(ws[j * n : (j + 1) * n]) for j, m in enumerate(names)}
        return LocalExperts(**parts, tally=tally)

    def _count(self, nbytes: int) -> None:
        if self.tally is not None:
            self.tally.copied_weight_bytes += nbytes

    def preferred_order(self) -> str:
        """The row order :meth:`stacked` uses: the order of whichever list is back to back
        (w13's first, the larger); forward when neither is (or in tensor form)."""
        if not self.listed:
            return FORWARD
        return layout_order(self.w13) or layout_order(self.w2) or FORWARD

    def biases(self, order: str | None = None) -> tuple[Tensor | None, Tensor | None]:
        """``(b13 (El, J), b2 (El, H))`` in :meth:`stacked`'s row order ``order`` (default
        :meth:`preferred_order`), each None when absent: views or transient stacks as there."""
        if not self.listed:
            return self.b13, self.b2
        order = self.preferred_order() if order is None else order
        return tuple(None if b is None else self._one(b, order) for b in (self.b13, self.b2))

    def stacked(self, order: str | None = None) -> tuple[Tensor, Tensor, str]:
        """``(w13 (El, J, H), w2 (El, H, I), order)``: zero-copy views where the elements are
        back to back in ``order`` (default :meth:`preferred_order`), else a transient stack in
        that order. Tensor form: the tensors themselves, ``"forward"``."""
        if not self.listed:
            return self.w13, self.w2, FORWARD
        order = self.preferred_order() if order is None else order
        return self._one(self.w13, order), self._one(self.w2, order), order

    def _one(self, ws: list[Tensor], order: str) -> Tensor:
        if layout_order(ws) == order:
            return stacked_view(ws, order)
        rows = ws if order == FORWARD else ws[::-1]
        self._count(sum(w.numel() * w.element_size() for w in rows))
        return torch.stack([w.detach() for w in rows])  # transient: dropped when the pass ends

    def pack(self, name: str, dst: Tensor) -> None:
        """Copy ``w13``/``w2``/``b13``/``b2`` (``name``, one of :attr:`parts`) into
        ``dst (El, ...)`` in expert order."""
        src = getattr(self, name)
        self._count(dst.numel() * dst.element_size())
        if not self.listed:
            dst.copy_(src)
            return
        for j, w in enumerate(src):
            dst[j].copy_(w)

    def split(
        self, dw13: Tensor, dw2: Tensor, order: str, db13: Tensor | None = None,
        db2: Tensor | None = None,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        """Gradients ``(El, ...)`` in ``order``'s row order -> one per autograd input (views),
        in :meth:`inputs`' order; ``db13``/``db2`` those of the biases the experts carry. A
        weight gradient None (accumulated into a caller's targets) gives None for its inputs."""
        grads = dict(w13=dw13, w2=dw2, b13=db13, b2=db2)
        if not self.listed:
            return tuple(grads[n] for n in self.parts)
        out = []
        for n in self.parts:
            if grads[n] is None:
                out += [None] * len(getattr(self, n))
                continue
            rows = list(grads[n].unbind(0))
            out += rows[::-1] if order == REVERSED else rows
        return tuple(out)


# ---------------------------------------------------------------------------------------------
# what a pass hands the hop primitives
# ---------------------------------------------------------------------------------------------
def present(parts: dict[str, Tensor | None]) -> dict[str, Tensor]:
    """``parts`` without the absent (None) ones."""
    return {k: v for k, v in parts.items() if v is not None}


def local_parts(experts: LocalExperts, order: str) -> dict[str, Tensor | None]:
    """The local experts' ``(El, ...)`` forms by part name (``w13``, ``w2``, ``b13``, ``b2``;
    None for an absent bias) in ``order``'s rows, for a pass that computes with them directly
    (token mode, all-to-all mode, a world of one): views, or stacks for this pass only."""
    w13, w2, _ = experts.stacked(order)
    b13, b2 = experts.biases(order)
    return {"w13": w13, "w2": w2, "b13": b13, "b2": b2}


def biases(parts: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    """The hop primitives' bias keywords: the biases among ``parts`` (a partition's views by
    name, or :func:`local_parts`; None when absent)."""
    return {"b13": parts.get("b13"), "b2": parts.get("b2")}


def hop_options(
    problem: RingProblem, kernel_choice: KernelChoice, rows: dict[str, int] | None = None,
    grad_dtype: torch.dtype | None = None,
) -> HopOptions:  # fmt: skip
    """The hop primitives' options of one hop: the call's backend and kernels, the agreed
    activation, the hop's pair count (``rows``: ``plan.pair_rows``' keyword, ``n_pairs`` or
    ``max_pairs``) and the dtype of the weight gradients a backward allocates."""
    return HopOptions(
        backend=kernel_choice.backend, kernels=kernel_choice.kernels,
        activation=problem.activation, grad_dtype=grad_dtype, **(rows or {}),
    )  # fmt: skip


def hop_grads(
    named: dict[str, Tensor | None], dw_accumulate: bool = True, dw_reversed: bool = False
) -> HopGrads:
    """The hop backward's gradient buffers among ``named`` (a trail's views, local
    accumulators, a caller's ``main_grad`` spans, ...: ``dx``, ``dprobs``, ``dw13``, ``dw2``,
    ``db13``, ``db2``; an absent name is allocated by the primitive, a bias's is required with
    its bias); ``dw_reversed``: the weight gradients' rows run in reverse expert order."""
    return HopGrads(
        dx_TH=named.get("dx"), dprobs_TK=named.get("dprobs"), dw13=named.get("dw13"),
        dw2=named.get("dw2"), db13=named.get("db13"), db2=named.get("db2"),
        dw_accumulate=dw_accumulate, dw_reversed=dw_reversed,
    )  # fmt: skip


def home_grads(problem: RingProblem, grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """The weight and bias gradients of this rank's experts by part name (``w13``, ...), from
    accumulators keyed ``dw13``, ... (any dtype), in the weights' dtype."""
    return {name[1:]: g.to(problem.dtype) for name, g in grads.items()}


def pack_own(experts: LocalExperts, views: dict[str, Tensor]) -> None:
    """The rank's own experts (weights and biases) into slot 0, in expert order (per element
    in list form)."""
    for name, view in views.items():
        experts.pack(name, view)
