"""Caller-owned accumulators of this rank's expert weight gradients (``ring_moe(main_grads=)``).

A caller that keeps its own gradient accumulators (Megatron's DDP: ``param.main_grad``, a view of
its gradient buffer, usually fp32) can have the ring ADD the gradients of ``w13`` and ``w2``
there instead of returning them: no gradient of the experts' size is handed to autograd, and no
per-parameter add runs after it (Megatron's hook ``main_grad.add_(grad)``, one launch a
parameter a micro-batch). :class:`MainGrads` names the accumulators and what autograd gets
instead (``finish``: Megatron's marks and dummy gradients, ``relaymoe/megatron/main_grad.py``).
The biases keep the returned-gradient path (``El*(J + H)`` values).

Where the add happens (:func:`direct_targets`, :func:`add_home`):

* **direct**, inside the weight-gradient kernel (it loads the accumulator, adds in fp32, stores
  in the accumulator's dtype), when the computed rows are this rank's experts (token mode,
  all-to-all mode, and expert mode in a world of one) and each part's accumulators form one
  ``(El, ...)`` span: a tensor, or per-expert tensors back to back in one storage in expert order
  or in reverse expert order (Megatron's buffer holds a layer's experts in reverse registration
  order), of float32 or of the ring's accumulator dtype. A span in the order opposite to the
  pass's rows is written through a negative expert stride (``HopGrads.dw_reversed``);
* **home**: expert mode over ``R > 1`` ranks (and node-batched rounds): the gradients trail around
  the ring and arrive home complete, in the accumulator dtype; one add into a forward span, else
  one multi-tensor add (``torch._foreach_add_``) over the experts;
* **fallback**: accumulators that are not one span (SequentialMLP under DDP interleaves fc1 and
  fc2), spans of w13 and w2 in different orders, or narrower than the accumulators: the
  gradients are computed as without targets, then added as at home.

Nothing here reads the device: the choice is made on the host from layouts, so a captured step
(``capturable``) records the same adds it would run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from relaymoe.ring.weights import REVERSED, layout_order, stacked_view

__all__ = ["MainGrads", "add_home", "direct_targets", "handed_back", "main_grads_problem"]

WEIGHTS = ("w13", "w2")  # the parts accumulated into a caller's targets
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True, eq=False)
class MainGrads:
    """Where ``ring_moe`` adds the gradients of this rank's expert weights.

    ``w13``: ``(El, J, H)`` or ``El`` tensors ``(J, H)``; ``w2``: ``(El, H, I)`` or ``El``
    tensors ``(H, I)``; expert order, either form whatever the weights' form; float16, bfloat16,
    float32 or float64 on the weights' device. Every backward ADDS the weights' gradients into
    them (gradient accumulation over micro-batches: the caller zeroes them when it wants).
    ``finish(weights)``: called once a backward has queued the adds, with the weights'
    autograd inputs (``w13``'s then ``w2``'s, as passed); returns what autograd gets for each,
    one entry a weight (None: no gradient). None: None for each. Compared by identity."""

    w13: Tensor | Sequence[Tensor]
    w2: Tensor | Sequence[Tensor]
    finish: Callable[[tuple[Tensor, ...]], Sequence[Tensor | None]] | None = None


def _per_expert(t: Tensor | Sequence[Tensor]) -> list[Tensor]:
    return list(t.unbind(0)) if isinstance(t, Tensor) else list(t)


def main_grads_problem(main_grads, w13, w2) -> str | None:
    """What is wrong with ``main_grads`` for this rank's weights ``w13``/``w2`` (``ring_moe``'s,
    either form), or None: the accumulators' form, shapes, dtypes and device. Weights that are
    themselves malformed are left to the agreement's checks (None here)."""
    if main_grads is None:
        return None
    if not isinstance(main_grads, MainGrads):
        return (
            f"main_grads={type(main_grads).__name__} must be a relaymoe.ring.MainGrads (the "
            "accumulators of w13 and w2) or None"
        )
    if main_grads.finish is not None and not callable(main_grads.finish):
        return "main_grads.finish must be callable or None"
    for name, w in (("w13", w13), ("w2", w2)):
        listed = isinstance(w, (list, tuple)) and len(w) > 0
        first = w if isinstance(w, Tensor) else (w[0] if listed else None)
        if not isinstance(first, Tensor) or first.dim() == 0:
            return None  # the agreement names what is wrong with the weights
        El, shape = len(w), tuple(first.shape[1:] if isinstance(w, Tensor) else first.shape)
        problem = _targets_problem(name, getattr(main_grads, name), El, shape, first.device)
        if problem:
            return problem
    return None


def _targets_problem(name: str, t, El: int, shape: tuple, device) -> str | None:
    want = f"a ({El}, {', '.join(map(str, shape))}) tensor or {El} tensors {shape}"
    if isinstance(t, Tensor):
        parts = [t] if tuple(t.shape) == (El, *shape) else []
    else:
        parts = list(t) if isinstance(t, (list, tuple)) else []
        if len(parts) != El or not all(
            isinstance(p, Tensor) and tuple(p.shape) == shape for p in parts
        ):
            parts = []
    if not parts:
        return f"main_grads.{name} must be {want}; fix: pass the accumulators of this rank's {name}"
    for p in parts:
        if p.dtype not in _DTYPES or p.device != device:
            return (
                f"main_grads.{name} is {p.dtype} on {p.device}; it must be one of float16, "
                f"bfloat16, float32, float64 on the weights' device ({device})"
            )
    return None


def _span(t: Tensor | Sequence[Tensor], order: str) -> tuple[Tensor, bool] | None:
    """``(view, reversed)``: the accumulators of one part as one ``(El, ...)`` tensor in memory
    order, and whether its rows run opposite to ``order`` (the pass's rows); None when they are
    not one span."""
    if isinstance(t, Tensor):
        return t, order == REVERSED
    lay = layout_order(t)
    if lay is None:
        return None
    return stacked_view(t, lay), lay != order


def direct_targets(
    main_grads: MainGrads, order: str, accum_dtype: torch.dtype
) -> tuple[dict[str, Tensor], bool] | None:
    """``({"dw13": view, "dw2": view}, reversed)`` where a pass whose rows are this rank's
    experts in ``order`` can add its weight gradients into the accumulators in place (module
    doc: one span each, both in the same order, of float32 or ``accum_dtype``; ``reversed``:
    the rows run opposite to ``order``, ``HopGrads.dw_reversed``); None: the fallback."""
    spans = {name: _span(getattr(main_grads, name), order) for name in WEIGHTS}
    if any(s is None for s in spans.values()):
        return None
    if len({rev for _, rev in spans.values()}) != 1:
        return None
    if any(v.dtype not in (torch.float32, accum_dtype) for v, _ in spans.values()):
        return None
    return {"d" + name: v for name, (v, _) in spans.items()}, spans["w13"][1]


def add_home(main_grads: MainGrads | None, grads: dict[str, Tensor], order: str) -> None:
    """Add the weight gradients among ``grads`` (``dw13``/``dw2``, rows in ``order``, any
    dtype) into ``main_grads``'s accumulators, and remove them from ``grads``; nothing without
    targets. One add where the accumulators in row order are one forward span, else one
    multi-tensor add over the experts."""
    if main_grads is None:
        return
    for name in WEIGHTS:
        g = grads.pop("d" + name, None)
        if g is None:
            continue
        t = getattr(main_grads, name)
        span = _span(t, order)
        if span is not None and not span[1]:
            span[0].add_(g)
            continue
        rows = _per_expert(t)
        if order == REVERSED:
            rows = rows[::-1]
        torch._foreach_add_(rows, list(g.unbind(0)))


def handed_back(main_grads: MainGrads, weights: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
    """What autograd gets for ``weights`` (the weights' autograd inputs, whose gradients went
    into the accumulators): ``main_grads.finish(weights)``, or None for each."""
    if main_grads.finish is None:
        return (None,) * len(weights)
    got = tuple(main_grads.finish(weights))
    if len(got) != len(weights):
        raise ValueError(
            f"ring_moe: main_grads.finish returned {len(got)} gradients for {len(weights)} "
            "weights; fix: return one (a tensor or None) for each weight it is given"
        )
    return got
