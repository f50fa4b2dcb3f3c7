"""What every pass of a ring call shares: the layouts of what travels, the pass plans and their
slot capacity, the transport, and the call (``runtime.RingCall``: its group, runtime, how a hop's
compute runs and this rank's options).

Shape legend as in ``engine.py``.

The layouts and pass plans of a problem are memoised by the (frozen, hashable) problem
(``functools.lru_cache``: a pure function of the problem, no state any call could change):
every pass of every layer asks for them, and building them again (a layout per partition and
direction, a plan's tables) was a tenth of a recorded pass's host time.
"""

from __future__ import annotations

from torch import Tensor

from relaymoe.ring.plan import RingProblem
from relaymoe.ring.weights import LocalExperts


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


def mlp(prob: RingProblem, parts: dict[str, Tensor | None]) -> dict:
    """The hop primitives' expert-MLP keywords: the agreed activation and the biases of
    ``parts`` (a partition's views by name, or :func:`local_parts`; None when absent)."""
    return {"activation": prob.activation, "b13": parts.get("b13"), "b2": parts.get("b2")}


def bias_grads(grads: dict[str, Tensor | None]) -> dict:
    """The hop backward's bias-gradient buffers among ``grads`` (a trail's views, or local
    accumulators keyed ``db13``/``db2``): the present biases' only."""
    return {"db13": grads.get("db13"), "db2": grads.get("db2")}


def home_grads(prob: RingProblem, grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """The weight and bias gradients of this rank's experts by part name (``w13``, ...), from
    accumulators keyed ``dw13``, ... (any dtype), in the weights' dtype."""
    return {name[1:]: g.to(prob.dtype) for name, g in grads.items()}


def pack_own(experts: LocalExperts, views: dict[str, Tensor]) -> None:
    """The rank's own experts (weights and biases) into slot 0, in expert order (per element
    in list form)."""
    for name, view in views.items():
        experts.pack(name, view)
