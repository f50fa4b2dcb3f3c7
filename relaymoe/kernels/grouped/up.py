"""The up-projection: x rows gathered through the routing index, gate and up tiles together, the
SwiGLU epilogue (the router probability folded into a)."""

from __future__ import annotations

import triton
import triton.language as tl

from relaymoe.kernels import select
from relaymoe.kernels.grouped.configs import _UP_CONFIGS, _UP_KEY, _pick, _set_descriptor_allocator
from relaymoe.kernels.grouped.tiles import (
    _block_e,
    _check_expert_span,
    _even_k,
    _group_m,
    _ieee,
    _mma,
    _row_col_tile,
    _row_grid,
)


@triton.jit
def _up_swiglu_kernel(
    x_ptr, w_ptr, idx_ptr, offs_ptr, prob_ptr, h_ptr, a_ptr,
    n_experts, H, I,
    stride_xt, stride_we, stride_wn, stride_wk, stride_hp, stride_ap,
    SAVE_H: tl.constexpr, SCALE: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    TMA_W: tl.constexpr = False, SAVE_A: tl.constexpr = True, GROUP_M: tl.constexpr = 1,
):  # fmt: skip
    """h[q] = x[tok[q]] @ w13[e]^T (gate and up tiles together); a = silu(gate) * up (* p).
    ``SAVE_A=False``: h only (the fc1 recompute of the backward, which needs no a).

    ``TMA_W``: the weight tiles come through a tensor descriptor over w13 as (El*2I, H) rows
    (TMA on sm90; the launcher checks contiguity and 16-byte strides). A gate tile that runs
    past row I reads up rows and an up tile past the last expert reads zeros: those columns are
    masked at the store, as the pointer path's clamped columns are."""
    e, row0, row_end, pid_n = _row_col_tile(I, offs_ptr, n_experts, BLOCK_M, BLOCK_N, BLOCK_E,
                                            GROUP_M)  # fmt: skip
    if e >= n_experts:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    tok = tl.load(idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    base = tl.load(offs_ptr)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    cols_c = tl.where(col_ok, cols, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + ks[None, :]
    g_ptrs = (
        w_ptr + e.to(tl.int64) * stride_we + cols_c[None, :] * stride_wn + ks[:, None] * stride_wk
    )
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA_W:
        w_desc = tl.make_tensor_descriptor(
            w_ptr, shape=[n_experts * 2 * I, H], strides=[H, 1], block_shape=[BLOCK_N, BLOCK_K]
        )
        g_row = (e * 2 * I + pid_n * BLOCK_N).to(tl.int32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            xa = tl.load(x_ptrs)
        else:
            xa = tl.load(x_ptrs, mask=(ks < H - k0)[None, :], other=0.0)
        if TMA_W:  # rows past H are zero-filled by the descriptor
            wg = w_desc.load([g_row, k0]).T
            wu = w_desc.load([g_row + I, k0]).T
        elif EVEN_K:
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            k_ok = ks < H - k0
            wg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            wu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        acc_g = _mma(xa, wg, acc_g, IEEE)
        acc_u = _mma(xa, wu, acc_u, IEEE)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    lrows = tl.where(row_ok, rows - base, 0)
    mask = row_ok[:, None] & col_ok[None, :]
    if SAVE_H:
        hp = h_ptr + lrows[:, None] * stride_hp + cols[None, :]
        tl.store(hp, acc_g.to(h_ptr.dtype.element_ty), mask=mask)
        tl.store(hp + I, acc_u.to(h_ptr.dtype.element_ty), mask=mask)
    if SAVE_A:
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        if SCALE:
            p = tl.load(prob_ptr + lrows, mask=row_ok, other=0.0)
            act = act * p[:, None]
        ap = a_ptr + lrows[:, None] * stride_ap + cols[None, :]
        tl.store(ap, act.to(a_ptr.dtype.element_ty), mask=mask)


_up_tuned = triton.autotune(_UP_CONFIGS, key=list(_UP_KEY))(
    triton.heuristics({"EVEN_K": _even_k("H"), "GROUP_M": _group_m("I")})(_up_swiglu_kernel)
)


def up_swiglu(x_TH, w13_E2IH, idx_P, offs, prob_P, h_P2I, a_PI, *, config=None, kernels=None):
    """h = x[tok] @ w13[e]^T into ``h_P2I`` (skipped when None); a = silu(gate)*up(*prob_P when
    given) into ``a_PI`` (skipped when None: the fc1 recompute needs h alone). Rows are the
    range's pairs, ``n_pairs`` the rows of ``a_PI`` (else of ``h_P2I``).

    On sm90 the warp-specialised Gluon kernel runs (``kernels.gather_ws``, ``gather_ws.py``)
    unless a Triton ``config`` is passed; its a comes from h rounded to the output dtype.
    ``kernels``: the ``KernelOptions`` (default: the process's)."""
    if h_P2I is None and a_PI is None:
        raise ValueError("up_swiglu needs an output: h_P2I, a_PI or both")
    n_experts, two_i, hidden = w13_E2IH.shape
    ffn = two_i // 2
    n_pairs = (a_PI if a_PI is not None else h_P2I).shape[0]
    if n_pairs == 0 or n_experts == 0:
        return
    _check_expert_span(w13_E2IH, "w13", "up_swiglu")
    k = select.kernel_options(kernels)
    ws = (
        select.gather_ws_for("up_swiglu", x_TH, w13_E2IH, h_P2I, a_PI, k=k)
        if config is None
        else None
    )
    if ws is not None and select.launch_ws(
        "up_swiglu", lambda: ws.up_swiglu(x_TH, w13_E2IH, idx_P, offs, prob_P, h_P2I, a_PI)
    ):
        return
    key = dict(zip(_UP_KEY, (hidden, ffn, n_experts, h_P2I is not None, prob_P is not None),
                   strict=True))  # fmt: skip
    kernel, meta = _pick(_up_tuned, _up_swiglu_kernel, config, hidden, "up_swiglu", key,
                         x_TH.dtype, k, ncols=ffn)  # fmt: skip
    h = h_P2I if h_P2I is not None else a_PI
    a = a_PI if a_PI is not None else h_P2I  # an unused pointer when a is not stored
    p = prob_P if prob_P is not None else a
    tma = select.tma_weights(w13_E2IH, k)
    if tma and w13_E2IH.is_cuda:
        _set_descriptor_allocator()
    kernel[_row_grid(n_pairs, n_experts, ffn)](
        x_TH, w13_E2IH, idx_P, offs, p, h, a,
        n_experts, hidden, ffn,
        x_TH.stride(0), w13_E2IH.stride(0), w13_E2IH.stride(1), w13_E2IH.stride(2),
        h.stride(0), a.stride(0),
        SAVE_H=h_P2I is not None, SCALE=prob_P is not None, IEEE=_ieee(x_TH),
        BLOCK_E=_block_e(n_experts), TMA_W=tma, SAVE_A=a_PI is not None, **meta,
    )  # fmt: skip
