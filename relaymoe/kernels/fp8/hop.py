"""fp8 hop primitives: the expert forward and backward of one expert range with fp8 GEMMs, the
Triton backend's twins (``relaymoe.kernels.experts``) with the same index, combine and
activation passes.

Shape legend: T tokens, H hidden, I expert FFN width, J fc1 rows (2I gated, I not), El local
experts, P pairs of the range.

Forward:  x quantised once over (T, H) (e4m3: one scale, or 1x128 blocks) -> fp8_up (x rows
          gathered in fp8, h saved in x's dtype, ``a`` in its epilogue: 1x128-quantised there
          (blockwise), or stored with its amax and then cast with its scale) -> fp8 rows GEMM
          ``y = a @ w2[e]^T`` per column chunk -> combine (deterministic, as bf16).
Backward: dy quantised once over (T, H) (the recipe's gradient format) -> fp8 rows GEMM
          ``g = dy[tok] @ w2[e]`` (dy gathered in fp8) -> swiglu_backward (dh, p*a, dprob; their
          amax, or dh's 1x128 quantisation) -> weight gradients (fp8 with one scale per operand,
          in the layout ``KernelOptions.fp8_wgrad_layout`` names, or bf16: blockwise,
          ``fp8_wgrad=False``) -> fp8 rows GEMM ``dh @ w13[e]`` per column chunk -> combine.
Which scales: ``recipe`` (``relaymoe.fp8_recipe``) and, for one-scale tensors, ``scales``
(``scaling.CurrentScaling`` or ``DelayedScaling``). Weights arrive quantised
(``weights.Fp8ExpertWeights``). No biases (refused by the callers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relaymoe.activation import as_activation
from relaymoe.fp8_recipe import BLOCK, Fp8Recipe
from relaymoe.kernels import pairs, select, unit_cols
from relaymoe.kernels.experts import (
    GRAD_DEFAULTS,
    HOP_DEFAULTS,
    HopGrads,
    HopGroups,
    HopOptions,
    check_hop_sizes,
    combine_chunks,
    hop_wgrad,
    pair_count,
    zero_weight_grads,
)
from relaymoe.kernels.fp8.columns import ColumnLayout, column_layout, write_columns
from relaymoe.kernels.fp8.quant_torch import fp8_dtype
from relaymoe.kernels.fp8.quantize import quantize_rows, quantize_rows_into
from relaymoe.kernels.fp8.rows import fp8_rows_gemm
from relaymoe.kernels.fp8.up import fp8_up
from relaymoe.kernels.fp8.weights import Fp8ExpertWeights
from relaymoe.kernels.fp8.wgrad import fp8_wgrad, fp8_wgrad_columnwise
from relaymoe.kernels.grouped.swiglu import SwigluFp8, swiglu_backward

__all__ = ["Fp8Saved", "fp8_hop_backward", "fp8_hop_forward", "quantize_input"]


@dataclass(eq=False)
class Fp8Saved:
    """What an fp8 forward keeps for its backward: x quantised (``xq (T, H)`` e4m3, ``x_inv``
    its inverse scale(s)), the pre-activation ``h (P, J)`` when saved (else recomputed from
    ``xq`` in ``dtype``, x's), and x itself where the weight gradients run in bf16 (blockwise,
    or ``fp8_wgrad=False``; a caller may drop it and set it back before the backward)."""

    xq: Tensor
    x_inv: Tensor
    h: Tensor | None
    x: Tensor | None
    dtype: torch.dtype


def quantize_input(t_TH: Tensor, role: str, fmt: str, recipe: Fp8Recipe, scales):
    """``(q, inv)`` of x or dy (``role``), once over its rows: 1x128 blocks (blockwise) or one
    scale from ``scales`` given the amax (no host sync)."""
    if recipe.blockwise:
        return quantize_rows(t_TH, fmt, pow2=recipe.power_2_scales)
    amax = torch.linalg.vector_norm(t_TH, float("inf")).float() if t_TH.numel() else (
        torch.zeros((), device=t_TH.device))  # fmt: skip
    s = scales.scale(role, amax, fmt)
    q, _ = quantize_rows(t_TH, fmt, scale=s)
    return q, 1.0 / s


def _cast(t_PC: Tensor, amax: Tensor, role: str, fmt: str, scales) -> tuple[Tensor, Tensor]:
    """A one-scale intermediate (a, dh, p*a) cast to fp8 with the scale its amax gives."""
    s = scales.scale(role, amax, fmt)
    q = torch.empty(t_PC.shape, dtype=fp8_dtype(fmt), device=t_PC.device)
    quantize_rows_into(t_PC, q, fmt, scale=s)
    return q, 1.0 / s


def _b_operand(w_q: Tensor, inv: Tensor, c0: int, c1: int, blockwise: bool, n_first: bool):
    """``(b (El, K, c1-c0), b_inv, its block strides)``: columns ``[c0, c1)`` of an fp8 weight
    stored (El, N, K) as the rows GEMM's K-major (El, K, N) view; ``inv`` indexed
    ``[e, n-block, k-block]`` when ``n_first``, else ``[e, k-block, n-block]``."""
    b = w_q[:, c0:c1, :].transpose(1, 2)
    if not blockwise:
        return b, inv, None
    blk = inv[:, c0 // BLOCK :, :] if n_first else inv[:, :, c0 // BLOCK :]
    s = blk.stride()
    return b, blk, (s[0], s[1], s[2]) if n_first else (s[0], s[2], s[1])


def _forward_a(xq, x_inv, wq: Fp8ExpertWeights, groups, prob_P, h_PJ, x_dtype, act, recipe,
               scales) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(aq (P, I), inv)``: the up-projection (h into ``h_PJ`` when saved) and ``a``
    quantised: in its epilogue (blockwise) or cast with its amax's scale."""
    n_pairs, ffn = groups.n_pairs, wq.w2.shape[2]
    args = (xq, x_inv, wq.w13, wq.inv13, groups.idx_P, groups.offs, prob_P)
    if recipe.blockwise:
        aq = torch.empty(n_pairs, ffn, dtype=fp8_dtype("e4m3"), device=xq.device)
        inv = torch.empty(n_pairs, ffn // BLOCK, dtype=torch.float32, device=xq.device)
        fp8_up(*args, h_PJ=h_PJ, a_blocks=(aq, inv), activation=act, pow2=recipe.power_2_scales,
               a_dtype=x_dtype)  # fmt: skip
        return aq, inv
    a_PI = torch.empty(n_pairs, ffn, dtype=x_dtype, device=xq.device)
    amax = torch.zeros(1, dtype=torch.float32, device=xq.device)
    fp8_up(*args, h_PJ=h_PJ, a_PI=a_PI, a_amax=amax, activation=act)
    return _cast(a_PI, amax, "a", "e4m3", scales)


def fp8_hop_forward(x_TH: Tensor, wq: Fp8ExpertWeights, probs_TK: Tensor, index, e0: int,
                    e1: int, out_TH: Tensor | None, save_h: bool, *, recipe: Fp8Recipe,
                    scales=None, options: HopOptions | None = None,
                    x_fp8: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Fp8Saved]:  # fmt: skip
    """Add experts ``[e0, e1)``'s pairs into ``out_TH`` (written when None), fp8 GEMMs.
    Returns ``(out_TH, saved)`` (:class:`Fp8Saved`; its ``h`` with ``save_h``). ``options``:
    the activation and the pair count (``n_pairs``/``max_pairs``) as the Triton hop's.
    ``x_fp8``: x already quantised, ``quantize_input(x_TH, "x", "e4m3", recipe, scales)``, for
    a caller that runs several ranges over one x (the ring's hops): quantised once, one scale
    (and one delayed-scaling history entry) for every range."""
    options = HOP_DEFAULTS if options is None else options
    act, k = as_activation(options.activation), select.kernel_options(options.kernels)
    x_TH = unit_cols(x_TH)
    n_local, rows_e, _ = wq.w13.shape
    accumulate = out_TH is not None
    if out_TH is None:
        out_TH = x_TH.new_empty(x_TH.shape)
    offs = index.offsets_for(e0, e1)
    n_pairs, exact = pair_count(index, e0, e1, options.n_pairs, options.max_pairs)
    check_hop_sizes(x_TH.shape[0], n_pairs, "fp8_hop_forward")
    if save_h and not exact:
        raise ValueError("save_h needs the exact pair count (n_pairs), not max_pairs")
    xq, x_inv = x_fp8 if x_fp8 is not None else quantize_input(x_TH, "x", "e4m3", recipe, scales)
    saved = Fp8Saved(xq, x_inv, None, None if recipe.fp8_wgrad else x_TH, x_TH.dtype)
    if n_pairs == 0 or n_local == 0 or x_TH.shape[0] == 0 or x_TH.shape[1] == 0:
        if not accumulate:
            out_TH.zero_()
        saved.h = x_TH.new_zeros(n_pairs, rows_e) if save_h else None
        return out_TH, saved
    prob_P = pairs.pair_probs(probs_TK, index.token_index_map, offs, n_pairs)
    groups = HopGroups(index.expert_token_indices, offs, n_pairs, exact)
    saved.h = x_TH.new_empty(n_pairs, rows_e) if save_h else None
    aq, a_inv = _forward_a(xq, x_inv, wq, groups, prob_P, saved.h, x_TH.dtype, act, recipe,
                           scales)  # fmt: skip

    def product(c0, c1):  # y (P, c) = a @ w2[e]^T: w2 (El, H, I) is K-major along I
        b, b_inv, strides = _b_operand(wq.w2, wq.inv2, c0, c1, wq.blockwise, n_first=True)
        y = x_TH.new_empty(n_pairs, c1 - c0)
        fp8_rows_gemm(aq, a_inv, b, b_inv, offs, y, b_inv_strides=strides, promote=False)
        return y

    combine_chunks(product, n_pairs, x_TH.element_size(), index, offs, out_TH, accumulate, k)
    return out_TH, saved


def _backward_h(saved: Fp8Saved, wq, groups, act, consume: bool) -> tuple[Tensor, Tensor]:
    """``(h, dh buffer)``: the saved pre-activation (its buffer reused for dh when it may be
    consumed), or h recomputed from the saved fp8 x."""
    if saved.h is not None:
        if saved.h.shape != (groups.n_pairs, wq.w13.shape[1]):
            raise ValueError(f"saved h has shape {tuple(saved.h.shape)}, expected "
                             f"({groups.n_pairs}, {wq.w13.shape[1]})")  # fmt: skip
        return saved.h, (saved.h if consume else torch.empty_like(saved.h))
    if not groups.exact:
        raise ValueError("recomputing h needs the exact pair count (n_pairs), not max_pairs")
    h = torch.empty(groups.n_pairs, wq.w13.shape[1], dtype=saved.dtype, device=saved.xq.device)
    fp8_up(saved.xq, saved.x_inv, wq.w13, wq.inv13, groups.idx_P, groups.offs, None, h_PJ=h,
           activation=act)  # fmt: skip
    return h, h


@dataclass(eq=False)
class _Grads:
    """The backward's fp8 operands after the activation pass: dh and p*a in fp8 (each with its
    inverse scale; p*a None where the weight gradients run in bf16), by pair rows (``dhq``,
    ``paq``: p*a None in the columnwise layout) and transposed in ``layout`` (``dh_cols``,
    ``pa_cols``: the columnwise layout's), and in their own dtype (``dh``, ``pa``)."""

    dhq: Tensor
    dh_inv: Tensor
    paq: Tensor | None
    pa_inv: Tensor | None
    dh: Tensor
    pa: Tensor
    layout: ColumnLayout | None = None
    dh_cols: Tensor | None = None
    pa_cols: Tensor | None = None


def _activation_grads(dyq, dy_inv, wq, h, dh, prob_P, groups, act, recipe, scales, dtype,
                      layout: ColumnLayout | None) -> tuple[_Grads, Tensor]:  # fmt: skip
    """``g = dy[tok] @ w2[e]`` (fp8, dy gathered), then the activation backward; returns the
    fp8 operands of the weight gradients and dgrad (the weight gradients' transposed in
    ``layout`` when given), and each pair's dprob (fp32)."""
    n_pairs, ffn, gf = groups.n_pairs, wq.w2.shape[2], recipe.grad_format
    g = torch.empty(n_pairs, ffn, dtype=dtype, device=dyq.device)
    b, b_inv, strides = _b_operand(wq.w2_t, wq.inv2, 0, ffn, wq.blockwise, n_first=False)
    fp8_rows_gemm(dyq, dy_inv, b, b_inv, groups.offs, g, a_idx=groups.idx_P,
                  b_inv_strides=strides, promote=True)  # fmt: skip
    dprob_P = torch.empty(n_pairs, dtype=torch.float32, device=dyq.device)
    if recipe.blockwise:
        dhq = torch.empty(dh.shape, dtype=fp8_dtype(gf), device=dyq.device)
        inv = torch.empty(n_pairs, dh.shape[1] // BLOCK, dtype=torch.float32, device=dyq.device)
        f8 = SwigluFp8(dh_blocks=(dhq, inv), fmt=gf, pow2=recipe.power_2_scales)
        swiglu_backward(h, g, prob_P, dh, dprob_P, activation=act, fp8=f8)
        return _Grads(dhq, inv, None, None, dh, g), dprob_P
    amax = torch.zeros(2, dtype=torch.float32, device=dyq.device)
    swiglu_backward(h, g, prob_P, dh, dprob_P, activation=act, fp8=SwigluFp8(amax=amax))
    if layout is not None:  # fp8 weight gradients over K-major operands
        return _columnwise_grads(dh, g, amax, layout, gf, scales), dprob_P
    dhq, dh_inv = _cast(dh, amax[0:1], "dh", gf, scales)
    paq, pa_inv = _cast(g, amax[1:2], "pa", "e4m3", scales) if recipe.fp8_wgrad else (None, None)
    return _Grads(dhq, dh_inv, paq, pa_inv, dh, g), dprob_P


def _columnwise_grads(dh, pa, amax, layout: ColumnLayout, gf: str, scales) -> _Grads:
    """dh and p*a cast with their amaxes' scales as :func:`_cast` does: dh by rows (the dgrad's
    operand) and transposed from one read, p*a transposed only."""
    s_dh, s_pa = scales.scale("dh", amax[0:1], gf), scales.scale("pa", amax[1:2], "e4m3")
    dev = dh.device
    dhq = torch.empty(dh.shape, dtype=fp8_dtype(gf), device=dev)
    dh_cols = torch.empty(dh.shape[1], layout.width, dtype=fp8_dtype(gf), device=dev)
    write_columns(dh, layout, dh_cols, scale=s_dh, fmt=gf, rows_out=dhq)
    pa_cols = torch.empty(pa.shape[1], layout.width, dtype=fp8_dtype("e4m3"), device=dev)
    write_columns(pa, layout, pa_cols, scale=s_pa, fmt="e4m3")
    return _Grads(dhq, 1.0 / s_dh, None, 1.0 / s_pa, dh, pa, layout, dh_cols, pa_cols)


def _weight_grad(a, a_inv, b, b_inv, c_given, like_shape, dtype, groups, *, a_gather: bool,
                 accumulate: bool) -> Tensor:  # fmt: skip
    """A tensor-scaled fp8 weight gradient into ``c_given`` (added, or written over without
    ``accumulate``), or into a new buffer of ``like_shape`` and ``dtype``."""
    c = c_given if c_given is not None else torch.empty(like_shape, dtype=dtype, device=a.device)
    fp8_wgrad(a, a_inv, b, b_inv, groups.idx_P, groups.offs, c, a_gather=a_gather,
              accumulate=accumulate and c_given is not None)  # fmt: skip
    return c


def _gathered_cols(tq: Tensor, groups, layout: ColumnLayout) -> Tensor:
    """x or dy (fp8, quantised once over (T, H)) gathered through the routing index and
    transposed in ``layout``: the same bytes."""
    out = torch.empty(tq.shape[1], layout.width, dtype=tq.dtype, device=tq.device)
    write_columns(tq, layout, out, idx_P=groups.idx_P, offs=groups.offs)
    return out


def _weight_grad_columnwise(a_cols, a_inv, b_cols, b_inv, c_given, like_shape, dtype,
                            layout: ColumnLayout, *, accumulate: bool) -> Tensor:  # fmt: skip
    """:func:`_weight_grad` over K-major operands (``wgrad.fp8_wgrad_columnwise``)."""
    c = c_given if c_given is not None else torch.empty(like_shape, dtype=dtype,
                                                        device=a_cols.device)  # fmt: skip
    fp8_wgrad_columnwise(a_cols, a_inv, b_cols, b_inv, layout.poffs, c,
                         accumulate=accumulate and c_given is not None)  # fmt: skip
    return c


def _weight_grads(dy_TH, dyq, dy_inv, saved: Fp8Saved, gr: _Grads, wq, groups, grads: HopGrads,
                  grad_dtype, k, fp8_wgrad: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(dw13, dw2)``: fp8 GEMMs with one scale per operand (``fp8_wgrad``: the tensor-scaled
    recipes' default; over K-major copies where ``gr`` has them, ``k.fp8_wgrad_layout`` =
    ``columnwise``), else the bf16 Triton/torch path on the unquantised operands."""
    dtype = grad_dtype or wq.dtype
    acc = grads.dw_accumulate
    if fp8_wgrad and gr.layout is not None:
        dw2 = _weight_grad_columnwise(_gathered_cols(dyq, groups, gr.layout), dy_inv, gr.pa_cols,
                                      gr.pa_inv, grads.dw2, wq.w2.shape, dtype, gr.layout,
                                      accumulate=acc)  # fmt: skip
        gr.pa_cols = None  # freed before x's copy is made
        dw13 = _weight_grad_columnwise(gr.dh_cols, gr.dh_inv, _gathered_cols(saved.xq, groups,
                                       gr.layout), saved.x_inv, grads.dw13, wq.w13.shape, dtype,
                                       gr.layout, accumulate=acc)  # fmt: skip
        gr.dh_cols = None  # the dgrad reads dh's rows only
        return dw13, dw2
    if not fp8_wgrad:
        like13 = torch.empty(wq.w13.shape, dtype=wq.dtype, device="meta")
        like2 = torch.empty(wq.w2.shape, dtype=wq.dtype, device="meta")
        dw2 = hop_wgrad(dy_TH, gr.pa, groups.idx_P, groups.offs, grads.dw2, groups,
                        a_gather=True, b_gather=False, like=like2, grad_dtype=grad_dtype, k=k,
                        accumulate=acc)  # fmt: skip
        dw13 = hop_wgrad(gr.dh, saved.x, groups.idx_P, groups.offs, grads.dw13, groups,
                         a_gather=False, b_gather=True, like=like13, grad_dtype=grad_dtype,
                         k=k, accumulate=acc)  # fmt: skip
        return dw13, dw2
    dw2 = _weight_grad(dyq, dy_inv, gr.paq, gr.pa_inv, grads.dw2, wq.w2.shape, dtype, groups,
                       a_gather=True, accumulate=acc)  # fmt: skip
    dw13 = _weight_grad(gr.dhq, gr.dh_inv, saved.xq, saved.x_inv, grads.dw13, wq.w13.shape,
                        dtype, groups, a_gather=False, accumulate=acc)  # fmt: skip
    return dw13, dw2


def fp8_hop_backward(dy_TH: Tensor, saved: Fp8Saved, wq: Fp8ExpertWeights, probs_TK: Tensor,
                     index, e0: int, e1: int, *, recipe: Fp8Recipe, scales=None,
                     consume_saved_h: bool = False, grads: HopGrads | None = None,
                     options: HopOptions | None = None,
                     dy_fp8: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Gradients of experts ``[e0, e1)``'s pairs from the forward's ``saved``, fp8 GEMMs where
    the recipe runs them; ``grads``: as ``triton_hop_backward``'s (ADDED into the buffers
    given; dw written over with ``dw_accumulate=False``). Returns ``(dx, dprobs, dw13, dw2)``;
    ``consume_saved_h``: dh may be written over the saved h. ``dy_fp8``: dy already quantised
    (``quantize_input(dy_TH, "dy", recipe.grad_format, recipe, scales)``), as ``x_fp8``."""
    options = HOP_DEFAULTS if options is None else options
    grads = GRAD_DEFAULTS if grads is None else grads
    if grads.dw_reversed:  # the fp8 weight-gradient kernel writes rows in expert order only
        raise NotImplementedError(
            "fp8_hop_backward: grads.dw_reversed (weight gradients in reverse expert order) is "
            "not supported; pass the gradient buffers in expert order"
        )
    act, k = as_activation(options.activation), select.kernel_options(options.kernels)
    dy_TH = unit_cols(dy_TH)
    acc_dx = grads.dx_TH is not None
    dx_TH = dy_TH.new_empty(dy_TH.shape) if grads.dx_TH is None else grads.dx_TH
    dprobs_TK = grads.dprobs_TK
    if dprobs_TK is None:
        dprobs_TK = torch.zeros(probs_TK.shape, dtype=probs_TK.dtype, device=probs_TK.device)
    offs = index.offsets_for(e0, e1)
    n_pairs, exact = (pair_count(index, e0, e1, options.n_pairs, options.max_pairs)
                      if wq.num_experts > 0 else (0, True))  # fmt: skip
    check_hop_sizes(dy_TH.shape[0], n_pairs, "fp8_hop_backward")
    if n_pairs == 0 or dy_TH.shape[0] == 0 or dy_TH.shape[1] == 0:
        if not acc_dx:
            dx_TH.zero_()
        like = _meta_weights(wq)
        return (dx_TH, dprobs_TK, *zero_weight_grads(*like, grads, options.grad_dtype))
    dyq, dy_inv = dy_fp8 if dy_fp8 is not None else quantize_input(
        dy_TH, "dy", recipe.grad_format, recipe, scales)  # fmt: skip
    prob_P = pairs.pair_probs(probs_TK, index.token_index_map, offs, n_pairs)
    groups = HopGroups(index.expert_token_indices, offs, n_pairs, exact)
    h, dh = _backward_h(saved, wq, groups, act, consume_saved_h)
    layout = None
    if recipe.fp8_wgrad and k.fp8_wgrad_layout == "columnwise":
        layout = column_layout(offs, n_pairs)
    gr, dprob_P = _activation_grads(dyq, dy_inv, wq, h, dh, prob_P, groups, act, recipe, scales,
                                    dy_TH.dtype, layout)  # fmt: skip
    pairs.add_pair_dprobs(dprob_P, index.token_index_map, offs, dprobs_TK)
    dw13, dw2 = _weight_grads(dy_TH, dyq, dy_inv, saved, gr, wq, groups, grads,
                              options.grad_dtype, k, recipe.fp8_wgrad)  # fmt: skip

    def product(c0, c1):  # dx chunk (P, c) = dh @ w13[e]: w13_t (El, H, J) is K-major along J
        b, b_inv, strides = _b_operand(wq.w13_t, wq.inv13, c0, c1, wq.blockwise, n_first=False)
        y = dy_TH.new_empty(n_pairs, c1 - c0)
        fp8_rows_gemm(gr.dhq, gr.dh_inv, b, b_inv, offs, y, b_inv_strides=strides, promote=True)
        return y

    combine_chunks(product, n_pairs, dy_TH.element_size(), index, offs, dx_TH, acc_dx, k)
    return dx_TH, dprobs_TK, dw13, dw2


def _meta_weights(wq: Fp8ExpertWeights) -> tuple[Tensor, Tensor]:
    """Tensors shaped and typed as the range's weights (zero weight gradients of an empty range
    are allocated from them)."""
    dev = wq.w13.device
    return (torch.empty(wq.w13.shape, dtype=wq.dtype, device=dev),
            torch.empty(wq.w2.shape, dtype=wq.dtype, device=dev))  # fmt: skip
