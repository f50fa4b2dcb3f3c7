"""``linear_cross_entropy``: the public op, and its default mode's autograd function.

The default mode's forward applies each chunk's gradient at once (``dh_unit``, ``dW_unit``);
the backward scales them by the upstream gradient, or recomputes the weight gradient when that
gradient is not uniform over the counted tokens (see the package doc, ``relaymoe.loss``). With
``weight_grad_into`` the accumulate mode (``relaymoe.loss.accumulate``) runs instead.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from relaymoe.loss.accumulate import AccumulateInto, AccumulateLinearCrossEntropy
from relaymoe.loss.inputs import (
    LossSetup,
    check_accumulate_args,
    check_labels,
    make_setup,
    wgrad_mode,
)
from relaymoe.loss.ledger import check_not_abandoned
from relaymoe.loss.passes import backward_chunks, forward_chunks, refuse_second_order, targets
from relaymoe.loss.tp import agree_tp, refuse_on_every_rank

Impl = Literal["auto", "torch", "triton"]
# the device-side refusal of a captured backward whose upstream gradient is not uniform
# (torch._assert_async takes at most 254 characters: tests/lib/test_device_asserts.py)
_NOT_UNIFORM = (
    "linear_cross_entropy in a CUDA graph: the upstream gradient differs between counted "
    "tokens; a captured backward needs a uniform one (a mean or sum over counted tokens). "
    "Fix: run this loss eagerly or average it uniformly"
)


def linear_cross_entropy(
    hidden_TH: Tensor,
    weight_VH: Tensor,
    labels_T: Tensor,
    *,
    tp_group=None,
    chunk_tokens: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    impl: Impl = "auto",
    validate: bool = True,
    weight_grad_into: Tensor | None = None,
    expected_grad: float | Tensor | None = None,
) -> Tensor:
    """Per-token cross-entropy of ``hidden_TH @ weight_full.T`` without materialising the logits.

    Args:
        hidden_TH: (T, H) activations: float16, bfloat16, float32 or float64 (the weight's).
        weight_VH: (Vl, H) this rank's vocabulary shard, global rows ``[r*Vl, (r+1)*Vl)``.
        labels_T: (T,) integer global token ids in ``[0, Vl * TP)``, or ``ignore_index``.
        tp_group: the tensor-parallel process group over which the vocabulary is split;
            ``None`` is a group of one (the whole vocabulary is ``weight_VH``).
        chunk_tokens: tokens per chunk (default ``lossmodel.default_chunk_tokens`` for this
            call's mode, impl and dtype: within 512 MiB of working set with
            ``weight_grad_into``).
        ignore_index: label (an int) whose tokens get loss 0 and zero gradients.
        label_smoothing: Megatron's label smoothing ``a`` in ``[0, 1)`` (see the module doc).
        impl: ``"triton"`` (row kernels, CUDA or ``TRITON_INTERPRET=1``), ``"torch"``, or
            ``"auto"`` (Triton on CUDA when it imports).
        validate: check the labels and, at TP > 1, the tensor-parallel contract (below).
        weight_grad_into: an accumulator of the weight's shape (float32, or the weight's dtype),
            contiguous, outside autograd (Megatron's ``main_grad``): the weight gradient is
            ADDED into it and none is returned to autograd (the accumulate mode,
            ``relaymoe.loss.accumulate``: no ``(Vl, H)`` buffer of the loss's own). It is
            computed whenever a gradient pass runs (grad mode on and ``hidden_TH`` or
            ``weight_VH`` requiring grad), whatever ``weight_VH.requires_grad``: pass
            ``weight.detach()`` to keep autograd away from the weight. A half-precision
            accumulator rounds at every addition (once per chunk and pass; a correction's
            passes add more of them): prefer fp32. Every call with it raises
            ``RuntimeError`` once a speculative forward into it was dropped without its
            backward (``relaymoe.loss.ledger``).
        expected_grad: with ``weight_grad_into``, the upstream gradient the caller's loss will
            send to every counted token (a Python float, finite and non-zero, or a 0-dim
            tensor on the activations' device, read once here): the forward then adds
            ``expected_grad * dW`` into the accumulator at once (three GEMMs a chunk, as the
            default mode) and the backward only corrects it where the real gradient differs
            (exact; two more GEMMs a chunk then). ``None``: the backward computes both
            gradients (four GEMMs a chunk in all).

    Returns:
        loss_T: (T,) float32 (float64 for float64 inputs). Differentiable into ``hidden_TH``
        (this rank's part, see the module doc) and ``weight_VH`` (into ``weight_grad_into``
        when given).

    Layouts: any strides for ``hidden_TH``, ``weight_VH``, ``labels_T`` and the upstream
    gradient (transposed, sliced, expanded); the GEMMs read them in place and the row kernels
    see only the loss's own contiguous chunk buffer, so nothing is copied. Labels of any integer
    dtype are widened to int64 (T elements).

    Validated at call time, always (``ValueError`` naming the value, the limit and the fix):
    types, shapes, dtypes and devices, ``chunk_tokens``, ``label_smoothing``, ``ignore_index``,
    ``impl``; at TP > 1 with ``validate=True``, a rank whose arguments fail enters the
    contract's all-reduce with its message, so every rank raises that same ``ValueError``.
    With ``validate=True`` (the default) also, with one host sync: every label is in
    ``[0, V)`` or ``ignore_index``; and at TP > 1 the contract the chunks' collectives rely on,
    on every rank at once in one small all-reduce read by that same host sync: the same T, H,
    Vl, chunk size, dtype, ignore_index, label_smoothing and labels on every rank of
    ``tp_group`` (every rank raises the same ``ValueError`` otherwise, instead of a hang or a
    wrong loss). ``validate=False`` (Megatron's output processor, whose ranks hold the same
    batch by construction) skips both, with no host sync and no extra collective: labels out of
    range then count as a target on no rank, and ranks that break the contract hang or fail in
    the first chunk's all-reduce. ``validate`` itself must be the same on every rank.
    Trusted always: that every rank passes the same ``hidden_TH`` values.
    """
    try:
        setup = make_setup(
            hidden_TH, weight_VH, labels_T, tp_group, chunk_tokens, ignore_index,
            label_smoothing, impl, wgrad_mode(weight_grad_into, expected_grad),
        )  # fmt: skip
        acc, expected = check_accumulate_args(weight_grad_into, expected_grad, hidden_TH,
                                              weight_VH)  # fmt: skip
        if acc is not None:
            check_not_abandoned(acc)  # RuntimeError: a dropped speculative forward
    except (ValueError, RuntimeError) as err:
        if validate:  # at TP > 1 the peers wait in the contract's all-reduce: they raise too
            refuse_on_every_rank(err, hidden_TH, tp_group)
        raise
    labels_T = labels_T.long()
    if validate and setup.world > 1:
        agree_tp(hidden_TH, labels_T, setup)
    elif validate:
        check_labels(labels_T, setup)
    grad_on = torch.is_grad_enabled()
    need_dh = grad_on and hidden_TH.requires_grad
    need_dw = grad_on and (weight_VH.requires_grad or (acc is not None and need_dh))
    if not (need_dh or need_dw):  # eval: statistics only, no gradient pass, nothing kept
        with torch.no_grad():
            return _forward(hidden_TH, weight_VH, labels_T, setup, False, False)[0]
    if acc is not None:
        into = AccumulateInto(acc, expected)
        return AccumulateLinearCrossEntropy.apply(hidden_TH, weight_VH, labels_T, setup, need_dh,
                                                  into)  # fmt: skip
    return _LinearCrossEntropy.apply(hidden_TH, weight_VH, labels_T, setup, need_dh, need_dw)


def _forward(hidden, weight, labels, setup: LossSetup, need_dh: bool, need_dw: bool):
    tgt, valid = targets(labels, setup)
    dh_unit = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_dh else None
    dw_unit = None
    if need_dw:
        dw_unit = torch.zeros(setup.vocab_local, hidden.shape[1], dtype=setup.work,
                              device=hidden.device)  # fmt: skip
    scale = valid.to(setup.work) if need_dh or need_dw else None
    loss, lse = forward_chunks(hidden, weight, tgt, valid, setup, scale_T=scale, dh_out=dh_unit,
                               wgrad_into=dw_unit)  # fmt: skip
    return loss, lse, tgt, valid, dh_unit, dw_unit


def _recompute_wgrad(hidden, weight, tgt, lse, scale, setup: LossSetup) -> Tensor:
    """``sum_t scale[t] * dlogits[t].T @ h[t]`` by chunks again (the backward's exact path)."""
    acc = torch.zeros(setup.vocab_local, hidden.shape[1], dtype=setup.work, device=hidden.device)
    backward_chunks(hidden, weight, tgt, lse, scale, setup, wgrad_into=acc)
    return acc


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, setup, need_dh, need_dw):
        loss, lse, tgt, valid, dh_unit, dw_unit = _forward(
            hidden, weight, labels, setup, need_dh, need_dw
        )
        ctx.setup, ctx.need_dh, ctx.need_dw = setup, need_dh, need_dw
        keep = (hidden, weight) if need_dw else (None, None)  # inputs: the recompute's operands
        ctx.save_for_backward(*keep, lse, tgt, valid, dh_unit, dw_unit)
        return loss

    @staticmethod
    def backward(ctx, g_T):
        refuse_second_order()
        hidden, weight, lse, tgt, valid, dh_unit, dw_unit = ctx.saved_tensors
        setup = ctx.setup
        g = torch.where(valid, g_T.to(setup.work), 0.0)  # ignored tokens: zero, even if g is NaN
        dh = dw = None
        if ctx.need_dh:
            dh = torch.mul(dh_unit, g[:, None], out=torch.empty_like(dh_unit))
        if ctx.need_dw:
            dw = torch.empty_like(weight)
            g_max = torch.where(valid, g, -torch.inf).amax() if g.numel() else g.new_zeros(())
            g_min = torch.where(valid, g, torch.inf).amin() if g.numel() else g.new_zeros(())
            any_valid = valid.any()
            uniform = (g_max == g_min) | ~any_valid
            if g.is_cuda and torch.cuda.is_current_stream_capturing():
                # a captured step cannot branch on the host: the uniform case, which every
                # loss averaged over the counted tokens gives (Megatron's); another gradient
                # stops the device with this message instead of training on a wrong dW
                torch._assert_async(uniform, _NOT_UNIFORM)
                torch.mul(dw_unit, torch.where(any_valid, g_max, 0.0), out=dw)
            # uniform over the counted tokens (or none counted): dW = c * dW_unit
            elif bool(uniform):  # host sync
                c = torch.where(any_valid, g_max, 0.0)
                torch.mul(dw_unit, c, out=dw)
            else:
                dw.copy_(_recompute_wgrad(hidden, weight, tgt, lse, g, setup))
        return dh, dw, None, None, None, None
