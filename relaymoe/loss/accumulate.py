"""The accumulate mode: the weight gradient added into the caller's accumulator, no ``(Vl, H)``
buffer of the loss's own.

``linear_cross_entropy(..., weight_grad_into=acc)`` adds its weight gradient into ``acc`` (fp32
or the weight's dtype; Megatron's ``main_grad`` under gradient-accumulation fusion) and returns
none to autograd. Two ways, by whether the caller knows the upstream gradient beforehand:

* ``expected_grad=c`` (the gradient the caller's loss will send to every counted token, a
  Python float or a 0-dim device tensor, read once at the forward): the forward runs the three
  GEMMs of each chunk as the default mode does, with the logits gradient scaled by ``c`` before
  its one rounding (the per-row scale the row kernel applies anyway): ``dh_c = c * dh`` is kept
  for the backward, and ``c * dW`` goes straight into ``acc`` (fp32 GEMM accumulation), a
  speculative contribution recorded in ``acc``'s ledger (``relaymoe.loss.ledger``). The backward
  compares the real gradient ``g`` with ``c`` on the counted tokens (on the device; one host
  sync when eager):

  - equal within ``EXPECTED_RTOL`` (relative, on each counted token): nothing more; the hidden
    gradient is ``dh_c`` itself (times ``g / c`` unless bitwise equal). Why a tolerance: a
    caller's expectation derived from an earlier micro-batch (``g_prev * n_prev / n``) and the
    loss's own ``1 / n`` round differently by an ulp or two; accepting them changes ``dW`` by a
    uniform factor within ``1 + EXPECTED_RTOL``, far below what rounding the logits gradient to
    the activations' dtype costs (2**-9 in bf16) and below fp32's accumulation over many tokens;
  - otherwise, an exact correction: each chunk's logits again and the ``(g - c)``-weighted
    weight gradient added into ``acc`` (two GEMMs a chunk), the hidden gradient ``dh_c * g / c``;
  - when the guess is so far off that the forward's contribution would dominate the correction's
    rounding (``sum(c^2 + (g - c)^2) > WELL_CONDITIONED * sum(g^2)`` over the counted tokens: a
    model where the two terms' roundings add in quadrature), the forward's contribution is first
    taken back exactly (the same chunks with the scale ``-c`` reproduce it bit for bit) and the
    ``g``-weighted gradients computed afresh (four GEMMs a chunk): the error is then that of a
    gradient computed from scratch, whatever the guess;
  - ``c`` zero or not finite (a device expectation is not read on the host: it is sanitised to 0
    there): the forward added nothing, the backward computes everything (three GEMMs a chunk).

  Under CUDA-graph capture the backward cannot branch on the host: it asserts on the device that
  ``g`` matches ``c`` (``_NOT_EXPECTED`` names the fix) and applies the equal case.
* no expectation: the forward computes the statistics only (one GEMM a chunk) and keeps no
  gradient; the backward recomputes each chunk's logits and computes the hidden gradient and the
  ``g``-weighted weight gradient into ``acc`` (three GEMMs a chunk, four in all, exact for any
  ``g``). A retained graph's second backward takes this path too (the first one settled the
  forward's contribution).

Transient memory, beyond the inputs, ``acc`` and the returned hidden gradient: one chunk's
working set (``relaymoe.lossmodel.fused_loss_bytes(wgrad="accumulate")``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relaymoe.loss.inputs import LossSetup
from relaymoe.loss.ledger import Claim, ledger_of
from relaymoe.loss.passes import backward_chunks, forward_chunks, refuse_second_order, targets

__all__ = ["EXPECTED_RTOL", "WELL_CONDITIONED", "AccumulateInto", "AccumulateLinearCrossEntropy"]

# relative tolerance on g == expected_grad, by the statistics' dtype (see the module doc)
EXPECTED_RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}
# sum(c^2 + (g - c)^2) / sum(g^2) beyond which the forward's contribution is taken back
WELL_CONDITIONED = 2.0
_NOT_EXPECTED = (  # at most 254 characters (torch._assert_async)
    "linear_cross_entropy in a CUDA graph: the upstream gradient differs from expected_grad, "
    "and a captured backward cannot correct the dW added in the forward. Fix: pass the exact "
    "expected_grad, pass none, or run this loss eagerly"
)


@dataclass
class AccumulateInto:
    """Where the weight gradient goes (a non-tensor argument of the autograd function, so that
    autograd neither tracks nor saves the accumulator)."""

    acc: Tensor
    expected: float | Tensor | None


def _snapshot(expected, setup: LossSetup, device) -> Tensor | None:
    """The expectation as a 0-dim tensor of the statistics' dtype, copied now (a caller may
    update its own tensor before this backward runs); not finite: 0 (checked on the device).
    Made on the device either way (a host copy could not be captured in a CUDA graph)."""
    if expected is None:
        return None
    if isinstance(expected, float):
        return torch.full((), expected, dtype=setup.work, device=device)
    c = expected.detach().to(device=device, dtype=setup.work, copy=True)
    return torch.where(torch.isfinite(c), c, 0.0)


class AccumulateLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, setup, need_dh, into: AccumulateInto):
        tgt, valid = targets(labels, setup)
        c = _snapshot(into.expected, setup, hidden.device)
        claim = dh_c = None
        if c is None:  # statistics only: the backward computes both gradients
            loss, lse = forward_chunks(hidden, weight, tgt, valid, setup)
        else:
            claim = Claim(ledger_of(into.acc))
            dh_c = _new_dh(hidden) if need_dh else None
            claim.arm()
            loss, lse = forward_chunks(hidden, weight, tgt, valid, setup,
                                       scale_T=valid.to(setup.work) * c, dh_out=dh_c,
                                       wgrad_into=into.acc)  # fmt: skip
        ctx.setup, ctx.need_dh, ctx.acc, ctx.c, ctx.claim = setup, need_dh, into.acc, c, claim
        ctx.dh_c = dh_c  # not saved: handed out as the gradient at most once, never copied
        ctx.save_for_backward(hidden, weight, lse, tgt, valid)
        return loss

    @staticmethod
    def backward(ctx, g_T):
        refuse_second_order()
        hidden, weight, lse, tgt, valid = ctx.saved_tensors
        setup, acc = ctx.setup, ctx.acc
        g = torch.where(valid, g_T.to(setup.work), 0.0)  # ignored tokens: zero, even if g is NaN
        dh_c, ctx.dh_c = ctx.dh_c, None
        claim = ctx.claim
        speculated = claim is not None and not claim.settled
        if claim is not None:
            claim.settle()
        if not speculated:  # no expectation, or a retained graph's second backward
            dh = _new_dh(hidden) if ctx.need_dh else None
            backward_chunks(hidden, weight, tgt, lse, g, setup, dh_out=dh, wgrad_into=acc)
            return dh, None, None, None, None, None
        c = ctx.c
        d = torch.where(valid, g - c, 0.0)
        match = ~(d.abs() > EXPECTED_RTOL[setup.work] * c.abs()).any()
        if g.is_cuda and torch.cuda.is_current_stream_capturing():
            torch._assert_async(match, _NOT_EXPECTED)
            return _scaled(dh_c, g, c, valid), None, None, None, None, None
        return _settle(ctx, hidden, weight, tgt, lse, valid, g, d, match, dh_c), *(None,) * 5


def _settle(ctx, hidden, weight, tgt, lse, valid, g, d, match, dh_c):
    """The eager backward of a speculative forward: the verdict read in one host sync, then the
    path it names (module doc). Returns the hidden gradient."""
    setup, acc, c = ctx.setup, ctx.acc, ctx.c
    exact = ~(d != 0).any()
    sq = torch.where(valid, c * c + d * d, 0.0).sum()
    well = sq <= WELL_CONDITIONED * torch.where(valid, g * g, 0.0).sum()
    verdict = torch.stack([match, exact, well, c == 0]).tolist()  # host sync
    is_match, is_exact, is_well, c_zero = verdict
    if c_zero:  # the forward added nothing: compute everything
        dh = dh_c if dh_c is not None else (_new_dh(hidden) if ctx.need_dh else None)
        backward_chunks(hidden, weight, tgt, lse, g, setup, dh_out=dh, wgrad_into=acc)
        return dh
    if is_match:
        return dh_c if is_exact or dh_c is None else _scaled(dh_c, g, c, valid)
    if is_well:  # add the difference
        backward_chunks(hidden, weight, tgt, lse, d, setup, wgrad_into=acc)
        return None if dh_c is None else _scaled(dh_c, g, c, valid)
    # far off: take the forward's contribution back, then compute afresh
    undo = torch.where(valid, -c, 0.0)  # the forward's scale, negated: its exact opposite
    backward_chunks(hidden, weight, tgt, lse, undo, setup, wgrad_into=acc)
    backward_chunks(hidden, weight, tgt, lse, g, setup, dh_out=dh_c, wgrad_into=acc)
    return dh_c


def _scaled(dh_c: Tensor | None, g: Tensor, c: Tensor, valid: Tensor) -> Tensor | None:
    """``dh_c * g / c`` per row, in place (ignored rows stay 0: the forward's scale was 0)."""
    if dh_c is None:
        return None
    ratio = torch.where(valid, g / torch.where(c == 0, 1.0, c), 0.0)
    return dh_c.mul_(ratio[:, None])


def _new_dh(hidden: Tensor) -> Tensor:
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)
