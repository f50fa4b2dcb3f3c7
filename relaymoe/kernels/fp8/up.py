"""The fp8 up-projection: x rows gathered in fp8 through the routing index (quantised once over
(T, H)), gate and up tiles of the fp8 w13 together, and the activation in the epilogue, which
also quantises ``a`` for the down projection where its scale is known there.

Epilogue outputs (any subset): h (the pre-activation, for the backward), ``a`` in x's dtype,
the amax of that ``a`` (one atomic max a program: the tensor-scaled recipes' scale of ``a`` is
its amax over the whole range, known only after the kernel), and ``a`` quantised in 1x128 blocks
(blockwise: each block's scale is local to the tile, ``BLOCK_N == 128``). ``a`` is quantised as
it would be stored in x's dtype (the value TE's separate cast would read)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from relaymoe.fp8_recipe import BLOCK
from relaymoe.kernels import interpret_mode
from relaymoe.kernels.fp8.quantize import quantize_row_blocks
from relaymoe.kernels.fp8.rows import scaled_dot
from relaymoe.kernels.grouped.activation import act_fwd, act_meta
from relaymoe.kernels.grouped.tiles import (
    check_expert_span,
    expert_block_size,
    row_grid,
    row_group_m,
    row_tile,
)

__all__ = ["DTYPE_NAMES", "fp8_up", "round_to"]


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@triton.jit
def round_to(v, NAME: tl.constexpr):
    """fp32 ``v`` rounded to the dtype ``NAME`` (``DTYPE_NAMES``' values), kept in fp32."""
    if NAME == "bf16":
        v = v.to(tl.bfloat16).to(tl.float32)
    elif NAME == "fp16":
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _fp8_up_kernel(
    x_ptr, sx_ptr, w_ptr, sw_ptr, idx_ptr, offs_ptr, prob_ptr, h_ptr, a_ptr, aq_ptr, sa_ptr,
    amax_ptr,
    n_experts, H, I,
    stride_xt, stride_sxt, stride_we, stride_wn, stride_swe, stride_swn, stride_hp, stride_ap,
    stride_aqp, stride_sap,
    BLOCKWISE: tl.constexpr, SAVE_H: tl.constexpr, STORE_A: tl.constexpr, AMAX_A: tl.constexpr,
    QUANT_A: tl.constexpr, SCALE: tl.constexpr, EVEN_K: tl.constexpr, FMT: tl.constexpr,
    POW2: tl.constexpr, EXACT: tl.constexpr, A_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr, ACT_FN: tl.constexpr = "silu", GATED: tl.constexpr = True,
    ALPHA: tl.constexpr = 1.0, HAS_LIMIT: tl.constexpr = False, LIMIT: tl.constexpr = 0.0,
    OFFSET: tl.constexpr = 0.0,
):  # fmt: skip
    """h[q] = dequant(xq[tok[q]]) @ dequant(w13[e])^T (gate and up tiles when ``GATED``);
    a = act(h) (* p with ``SCALE``). The fc1 accumulates in the tensor core (TE's fast fprop)
    when tensor-scaled; blockwise promotes each 128-wide K block with its scales."""
    e, pid_n, row_ok, lrows, tok, cols, col_ok = row_tile(
        I, offs_ptr, idx_ptr, n_experts, True, BLOCK_M, BLOCK_N, BLOCK_E, GROUP_M
    )
    if e >= n_experts:
        return
    cols_c = tl.where(col_ok, cols, 0).to(tl.int64)
    e64 = e.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + ks[None, :]
    g_ptrs = w_ptr + e64 * stride_we + cols_c[None, :] * stride_wn + ks[:, None]
    u_ptrs = g_ptrs + I * stride_wn
    sx_ptrs = sx_ptr + tok * stride_sxt  # blockwise: + the K block
    sg_ptrs = sw_ptr + e64 * stride_swe + cols_c // 128 * stride_swn
    su_ptrs = sw_ptr + e64 * stride_swe + (cols_c + I) // 128 * stride_swn
    sx = tl.zeros((BLOCK_M,), dtype=tl.float32)
    sg = tl.zeros((BLOCK_N,), dtype=tl.float32)
    su = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # stays zero when not GATED
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            xa = tl.load(x_ptrs)
            wg = tl.load(g_ptrs)
            if GATED:
                wu = tl.load(u_ptrs)
        else:
            k_ok = ks < H - k0
            xa = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            if GATED:
                wu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if BLOCKWISE:
            sx = tl.load(sx_ptrs + k0 // 128)
            sg = tl.load(sg_ptrs + k0 // 128)
            if GATED:
                su = tl.load(su_ptrs + k0 // 128)
        acc_g = scaled_dot(acc_g, xa, wg, sx, sg, BLOCKWISE, False, BLOCK_K)
        if GATED:
            acc_u = scaled_dot(acc_u, xa, wu, sx, su, BLOCKWISE, False, BLOCK_K)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        if GATED:
            u_ptrs += BLOCK_K
    if not BLOCKWISE:
        s = tl.load(sx_ptr) * tl.load(sw_ptr + e64 * stride_swe)
        acc_g = acc_g * s
        acc_u = acc_u * s
    mask = row_ok[:, None] & col_ok[None, :]
    if SAVE_H:
        hp = h_ptr + lrows[:, None] * stride_hp + cols[None, :]
        tl.store(hp, acc_g.to(h_ptr.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(hp + I, acc_u.to(h_ptr.dtype.element_ty), mask=mask)
    if STORE_A or AMAX_A or QUANT_A:
        act = act_fwd(acc_g, acc_u, ACT_FN, GATED, ALPHA, HAS_LIMIT, LIMIT, OFFSET)
        if SCALE:
            act = act * tl.load(prob_ptr + lrows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        a_r = round_to(act, A_DTYPE)  # a as stored in x's dtype
        if STORE_A:
            tl.store(a_ptr + lrows[:, None] * stride_ap + cols[None, :],
                     a_r.to(a_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        a_f = tl.where(mask, a_r, 0.0)
        if AMAX_A:
            tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(a_f), axis=1), axis=0))
        if QUANT_A:  # BLOCK_N == 128: the tile's columns are one 1x128 block of each row
            q, inv = quantize_row_blocks(a_f, aq_ptr.dtype.element_ty, FMT, POW2, EXACT,
                                         BLOCK_M, BLOCK_N)  # fmt: skip
            tl.store(aq_ptr + lrows[:, None] * stride_aqp + cols[None, :], q, mask=mask)
            sp = sa_ptr + lrows[:, None] * stride_sap + pid_n + tl.arange(0, 1)[None, :]
            tl.store(sp, inv, mask=row_ok[:, None])


def _config(blockwise: bool) -> dict:
    """128-wide K steps and 128-column tiles (a blockwise ``a`` is quantised per tile); a
    blockwise tile holds four fp32 accumulators (gate, up and their partials), so 64 rows."""
    if interpret_mode():
        return {"BLOCK_M": 16, "BLOCK_N": BLOCK if blockwise else 32,
                "BLOCK_K": BLOCK if blockwise else 32}  # fmt: skip
    return {"BLOCK_M": 64 if blockwise else 128, "BLOCK_N": BLOCK, "BLOCK_K": BLOCK,
            "num_warps": 8, "num_stages": 3}  # fmt: skip


def fp8_up(xq_TH, x_inv, w, w_inv, idx_P, offs, prob_P, *, h_PJ=None, a_PI=None, a_amax=None,
           a_blocks=None, activation=None, fmt: str = "e4m3", pow2: bool = True,
           a_dtype=None):  # fmt: skip
    """h = dequant(xq[tok]) @ dequant(w13[e])^T into ``h_PJ`` (None: not stored); a = act(h)
    (* ``prob_P``) into ``a_PI`` (x's dtype), its amax max-ed into ``a_amax`` (one fp32 value),
    and/or quantised in 1x128 blocks into ``a_blocks = (aq_PI, inv_PB)`` (fp8 of ``fmt``,
    ``pow2`` scales). ``w``: fp8 (El, J, H); ``x_inv``/``w_inv``: one value and (El,), or the
    blockwise (T, H/128) and (El, J/128, H/128) scales (then H and I multiples of 128)."""
    meta_act = act_meta(activation)
    n_experts, rows_e, hidden = w.shape
    ffn = rows_e // 2 if meta_act["GATED"] else rows_e
    outs = [t for t in (a_PI, h_PJ, None if a_blocks is None else a_blocks[0]) if t is not None]
    if not outs:
        raise ValueError("fp8_up needs an output: h_PJ, a_PI, a_amax or a_blocks")
    n_pairs = outs[0].shape[0]
    if n_pairs == 0 or n_experts == 0:
        return
    check_expert_span(w, "w13", "fp8_up")
    blockwise = w_inv.dim() == 3
    meta = _config(blockwise)
    meta["EVEN_K"] = hidden % meta["BLOCK_K"] == 0
    meta["GROUP_M"] = row_group_m(ffn, meta["BLOCK_N"])
    any_out = outs[0]
    if a_dtype is None:
        a_dtype = (a_PI if a_PI is not None else h_PJ if h_PJ is not None else any_out).dtype
    aq, inv = a_blocks if a_blocks is not None else (any_out, any_out)
    h = h_PJ if h_PJ is not None else any_out
    a = a_PI if a_PI is not None else h
    _fp8_up_kernel[row_grid(n_pairs, n_experts, ffn)](
        xq_TH, x_inv, w, w_inv, idx_P, offs, prob_P if prob_P is not None else any_out,
        h, a, aq, inv, a_amax if a_amax is not None else any_out,
        n_experts, hidden, ffn,
        xq_TH.stride(0), x_inv.stride(0) if blockwise else 0, w.stride(0), w.stride(1),
        w_inv.stride(0), w_inv.stride(1) if blockwise else 0, h.stride(0), a.stride(0),
        aq.stride(0), inv.stride(0),
        BLOCKWISE=blockwise, SAVE_H=h_PJ is not None, STORE_A=a_PI is not None,
        AMAX_A=a_amax is not None, QUANT_A=a_blocks is not None, SCALE=prob_P is not None,
        FMT=fmt, POW2=pow2, EXACT=interpret_mode(), A_DTYPE=DTYPE_NAMES[a_dtype],
        BLOCK_E=expert_block_size(n_experts), **meta_act, **meta,
    )  # fmt: skip
