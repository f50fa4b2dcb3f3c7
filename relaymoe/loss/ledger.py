"""The ledger of speculative weight gradients: what an accumulator holds that no backward settled.

``linear_cross_entropy(weight_grad_into=acc, expected_grad=c)`` adds the ``c``-weighted weight
gradient into ``acc`` during its forward, before the loss's real upstream gradient is known; its
backward settles that contribution (nothing more to do, or an exact correction). A forward whose
backward never runs would leave its contribution in ``acc`` without anyone knowing: its graph
freed (the loss dropped, a forward under grad mode used only for logging, the extra forward of
an activation recompute), or its backward raising. The ledger makes that loud:

* each speculative forward opens a :class:`Claim` on the accumulator's :class:`Ledger`
  (``in_flight`` + 1) and arms it just before its first addition;
* its backward settles the claim (``in_flight`` - 1);
* an armed claim dropped unsettled (its autograd graph freed, its forward or backward raised)
  marks the ledger ``abandoned``;
* every later call with that accumulator (:func:`check_not_abandoned`) and
  :func:`check_settled`, which a caller runs where every backward must have run (Megatron's
  finalize point, before the optimizer reads the gradients), raise ``RuntimeError`` naming the
  count and the fix, until :func:`reset_ledger` (after the caller zeroed or restored ``acc``).

Several forwards may be in flight at once: a pipeline schedule runs several micro-batches'
forwards before their backwards. Only a dropped claim, or one still in flight where the caller
says every backward has run, is refused.

The ledger lives on the accumulator tensor object itself (its attribute ``relaymoe_ledger``),
as Megatron's own marks live on a parameter: pass the same tensor object every call (Megatron's
``main_grad`` is one).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["Claim", "Ledger", "check_not_abandoned", "check_settled", "ledger_of", "reset_ledger"]

ATTR = "relaymoe_ledger"
_FIX = (
    "run forwards whose backward will not run under torch.no_grad() (or without "
    "weight_grad_into); then zero the accumulator (or restore it) and call "
    "relaymoe.loss.reset_ledger(accumulator)"
)


@dataclass
class Ledger:
    """Speculative forwards of one accumulator: still waiting for their backward, and dropped."""

    in_flight: int = 0
    abandoned: int = 0


class Claim:
    """One speculative forward's contribution, from its first addition to its backward."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.armed = False
        self.settled = False
        ledger.in_flight += 1

    def arm(self) -> None:
        """The accumulator is about to receive this forward's first addition."""
        self.armed = True

    def settle(self) -> None:
        """The backward took charge of the contribution (idempotent)."""
        if not self.settled:
            self.settled = True
            self.ledger.in_flight -= 1

    def __del__(self):
        # the autograd graph holding this claim was freed, or its forward raised
        if not self.settled:
            self.settled = True
            self.ledger.in_flight -= 1
            if self.armed:
                self.ledger.abandoned += 1


def ledger_of(acc: Tensor) -> Ledger:
    """The accumulator's ledger (made on first use)."""
    ledger = getattr(acc, ATTR, None)
    if ledger is None:
        ledger = Ledger()
        setattr(acc, ATTR, ledger)
    return ledger


def check_not_abandoned(acc: Tensor) -> None:
    """Raise ``RuntimeError`` when a speculative forward into ``acc`` was dropped unsettled."""
    ledger = getattr(acc, ATTR, None)
    if ledger is not None and ledger.abandoned:
        raise RuntimeError(
            f"linear_cross_entropy: {ledger.abandoned} forward(s) added a speculative weight "
            "gradient into this accumulator (weight_grad_into) and their backward never ran "
            "(their graph was freed: the loss dropped, a forward under grad mode used only for "
            "logging, an activation recompute's extra forward; or it raised): the accumulator "
            f"holds a gradient no loss asked for. Fix: {_FIX}"
        )


def check_settled(acc: Tensor) -> None:
    """Where every backward must have run (before the gradients are reduced or read): raise
    ``RuntimeError`` when a speculative forward into ``acc`` is still waiting for its backward
    or was dropped unsettled."""
    check_not_abandoned(acc)
    ledger = getattr(acc, ATTR, None)
    if ledger is not None and ledger.in_flight:
        raise RuntimeError(
            f"linear_cross_entropy: {ledger.in_flight} forward(s) added a speculative weight "
            "gradient into this accumulator (weight_grad_into) and their backward has not run "
            "where every backward should have: the accumulator holds a gradient that no "
            f"backward settled. Fix: run each such loss's backward first, or {_FIX}"
        )


def reset_ledger(acc: Tensor) -> None:
    """Forget ``acc``'s dropped and pending forwards: call it after zeroing or restoring it.
    Claims still alive stay harmless: their backward or their drop no longer counts here."""
    setattr(acc, ATTR, Ledger())
