"""``moe_experts(..., fp8=...)``: the expert MLPs with fp8 GEMMs, as an autograd function over
the fp8 hop primitives (``relaymoe.kernels.fp8.hop``).

The forward quantises x once over (T, H), takes the layer's fp8 weights from its
``Fp8State`` (quantised once per optimizer step) and keeps for the backward the fp8 x, the
pre-activation h (``recompute`` ``act``/``act_retain``; ``fc1`` recomputes it in fp8) and, for
blockwise (bf16 weight gradients), x. Which GEMMs run in fp8 and how each tensor is scaled:
``relaymoe.fp8_recipe``.
"""

from __future__ import annotations

import torch

from relaymoe.fp8_state import Fp8State
from relaymoe.kernels import unit_cols
from relaymoe.kernels.experts import HopOptions
from relaymoe.kernels.fp8.hop import fp8_hop_backward, fp8_hop_forward

__all__ = ["fp8_experts"]


class _MoEExpertsFp8(torch.autograd.Function):
    """As ``relaymoe.experts._MoEExperts``: ``out`` first (a view written in place routes its
    gradient to its base)."""

    @staticmethod
    def forward(ctx, out, x, w13, w2, probs, index, expert_range, recompute, kernels, act,
                state: Fp8State, originals):  # fmt: skip
        x, probs = unit_cols(x), probs.contiguous()
        wq = state.expert_weights(w13, w2, originals)
        e0, e1 = expert_range if expert_range is not None else (0, index.num_experts)
        options = HopOptions(backend="triton", kernels=kernels, activation=act)
        with torch.no_grad():
            result, saved = fp8_hop_forward(
                x, wq, probs, index, e0, e1, out, recompute != "fc1", recipe=state.recipe,
                scales=state.scales, options=options,
            )  # fmt: skip
        if out is not None:
            ctx.mark_dirty(out)
        blockwise_x = saved.x
        saved.x = None  # x goes through save_for_backward (it is an input)
        ctx.fp8 = (state, wq, saved, (e0, e1), index, options)
        ctx.consume_h, ctx.h_consumed = recompute == "act", False
        ctx.save_for_backward(blockwise_x, probs)
        return result

    @staticmethod
    def backward(ctx, dy):
        from relaymoe.experts import SECOND_ORDER_ERROR

        if torch.is_grad_enabled():
            raise NotImplementedError(SECOND_ORDER_ERROR)
        if ctx.h_consumed:
            raise RuntimeError(
                "moe_experts(recompute='act', fp8=...) backward ran twice on one graph; the "
                "first overwrote its saved pre-activation: use recompute='act_retain' or 'fc1'"
            )
        state, wq, saved, (e0, e1), index, options = ctx.fp8
        x, probs = ctx.saved_tensors
        saved.x = x
        dx, dprobs, dw13, dw2 = fp8_hop_backward(
            unit_cols(dy), saved, wq, probs, index, e0, e1, recipe=state.recipe,
            scales=state.scales, consume_saved_h=ctx.consume_h, options=options,
        )  # fmt: skip
        saved.x = None
        ctx.h_consumed = ctx.consume_h and saved.h is not None
        d_out = dy if ctx.needs_input_grad[0] else None
        return d_out, dx, dw13, dw2, dprobs, None, None, None, None, None, None, None


def fp8_experts(out, x, w13, w2, topk_probs, index, expert_range, recompute, kernels, act,
                state: Fp8State, originals):  # fmt: skip
    """The fp8 ``moe_experts`` on checked inputs (``moe_experts`` validates and builds the
    index); ``originals``: the weights as the caller passed them (the cache's key)."""
    return _MoEExpertsFp8.apply(out, x, w13, w2, topk_probs, index, expert_range, recompute,
                                kernels, act, state, originals)  # fmt: skip
