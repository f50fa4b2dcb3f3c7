"""The up-projection: x rows gathered through the routing index, gate and up tiles together (one
tile when the activation is not gated), the fc1 bias and the activation in the epilogue (the
router probability folded into a)."""

from __future__ import annotations

import triton
import triton.language as tl

from relaymoe.kernels import interpret_mode, select
from relaymoe.kernels.grouped.activation import act_fwd, act_meta
from relaymoe.kernels.grouped.configs import (
    UP_CONFIGS,
    UP_KEY,
    UP_SINGLE_CONFIGS,
    pick_config,
    set_descriptor_allocator,
    single_tile_config,
)
from relaymoe.kernels.grouped.tiles import (
    check_expert_span,
    even_k,
    exact_fp32,
    expert_block_size,
    group_m,
    mma,
    row_col_tile,
    row_grid,
)
from relaymoe.kernels.tuned import shipped_config


@triton.jit
def _up_swiglu_kernel(
    x_ptr, w_ptr, idx_ptr, offs_ptr, prob_ptr, h_ptr, a_ptr, b_ptr,
    n_experts, H, I,
    stride_xt, stride_we, stride_wn, stride_wk, stride_hp, stride_ap, stride_be,
    SAVE_H: tl.constexpr, SCALE: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    TMA_W: tl.constexpr = False, SAVE_A: tl.constexpr = True, GROUP_M: tl.constexpr = 1,
    HAS_BIAS: tl.constexpr = False, ACT_FN: tl.constexpr = "silu", GATED: tl.constexpr = True,
    ALPHA: tl.constexpr = 1.0, HAS_LIMIT: tl.constexpr = False, LIMIT: tl.constexpr = 0.0,
    OFFSET: tl.constexpr = 0.0, EPI_HALVES: tl.constexpr = False,
):  # fmt: skip
    """h[q] = x[tok[q]] @ w13[e]^T (+ b13[e] with ``HAS_BIAS``; gate and up tiles together when
    ``GATED``, w13 (El, 2I, H), else one tile of w13 (El, I, H)); a = act(h) (* p), the
    activation of the ``ACT_FN`` ... ``OFFSET`` constexprs (``activation.act_fwd``).
    ``SAVE_A=False``: h only (the fc1 recompute of the backward, which needs no a).
    ``EPI_HALVES`` (not gated): a is computed and stored one half of the tile's columns at a
    time, so that a wide tile's activation temporaries (erf, tanh) fit in registers.

    ``TMA_W``: the weight tiles come through a tensor descriptor over w13 as (El*J, H) rows
    (TMA on sm90; the launcher checks contiguity and 16-byte strides). A gate tile that runs
    past row I reads up rows (or the next expert's) and an up tile past the last expert reads
    zeros: those columns are masked at the store, as the pointer path's clamped columns are."""
    e, row0, row_end, pid_n = row_col_tile(I, offs_ptr, n_experts, BLOCK_M, BLOCK_N, BLOCK_E,
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
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # stays zero when not GATED
    if TMA_W:
        if GATED:  # fc1 rows of one expert
            rows_e = 2 * I
        else:
            rows_e = I
        w_desc = tl.make_tensor_descriptor(
            w_ptr, shape=[n_experts * rows_e, H], strides=[H, 1], block_shape=[BLOCK_N, BLOCK_K]
        )
        g_row = (e * rows_e + pid_n * BLOCK_N).to(tl.int32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            xa = tl.load(x_ptrs)
        else:
            xa = tl.load(x_ptrs, mask=(ks < H - k0)[None, :], other=0.0)
        if TMA_W:  # rows past H are zero-filled by the descriptor
            wg = w_desc.load([g_row, k0]).T
            if GATED:
                wu = w_desc.load([g_row + I, k0]).T
        elif EVEN_K:
            wg = tl.load(g_ptrs)
            if GATED:
                wu = tl.load(u_ptrs)
        else:
            k_ok = ks < H - k0
            wg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            if GATED:
                wu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        acc_g = mma(xa, wg, acc_g, IEEE)
        if GATED:
            acc_u = mma(xa, wu, acc_u, IEEE)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        if GATED:
            u_ptrs += BLOCK_K * stride_wk
    lrows = tl.where(row_ok, rows - base, 0)
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_BIAS:  # b13[e] (El, J): the gate half at cols, the up half at I + cols
        b_ptrs = b_ptr + e.to(tl.int64) * stride_be + cols_c
        acc_g += tl.load(b_ptrs).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_ptrs + I).to(tl.float32)[None, :]
    if SAVE_H:
        hp = h_ptr + lrows[:, None] * stride_hp + cols[None, :]
        tl.store(hp, acc_g.to(h_ptr.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(hp + I, acc_u.to(h_ptr.dtype.element_ty), mask=mask)
    if SAVE_A:
        if SCALE:
            p = tl.load(prob_ptr + lrows, mask=row_ok, other=0.0)
        if EPI_HALVES:  # columns [0, BLOCK_N/2) and [BLOCK_N/2, BLOCK_N) of the tile
            lo, hi = tl.split(tl.permute(tl.reshape(acc_g, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            for j in tl.static_range(2):
                half = lo if j == 0 else hi
                act = act_fwd(half, half, ACT_FN, GATED, ALPHA, HAS_LIMIT, LIMIT, OFFSET)
                if SCALE:
                    act = act * p[:, None]
                hcols = pid_n * BLOCK_N + j * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                ap = a_ptr + lrows[:, None] * stride_ap + hcols[None, :]
                hmask = row_ok[:, None] & (hcols < I)[None, :]
                tl.store(ap, act.to(a_ptr.dtype.element_ty), mask=hmask)
        else:
            act = act_fwd(acc_g, acc_u, ACT_FN, GATED, ALPHA, HAS_LIMIT, LIMIT, OFFSET)
            if SCALE:
                act = act * p[:, None]
            ap = a_ptr + lrows[:, None] * stride_ap + cols[None, :]
            tl.store(ap, act.to(a_ptr.dtype.element_ty), mask=mask)


EPI_HALVES_MIN_N = 128  # the narrowest tile whose non-gated epilogue goes in halves


def _epilogue_halves(act_fn: str, gated: bool, block_n: int) -> bool:
    """Whether a launch computes its activation in two column halves (``EPI_HALVES``): not
    gated, an activation beyond a max (erf, tanh and SiLU hold temporaries per element), and a
    tile of at least ``EPI_HALVES_MIN_N`` columns."""
    return not gated and act_fn not in ("relu", "squared_relu") and block_n >= EPI_HALVES_MIN_N


up_tuned = triton.autotune(UP_CONFIGS, key=list(UP_KEY))(
    triton.heuristics({"EVEN_K": even_k("H"), "GROUP_M": group_m("I")})(_up_swiglu_kernel)
)
# not gated: its own candidates and cache (shipped under the name ``up_single``)
up_single_tuned = triton.autotune(UP_SINGLE_CONFIGS, key=list(UP_KEY))(
    triton.heuristics({
        "EVEN_K": even_k("H"), "GROUP_M": group_m("I"),
        "EPI_HALVES": lambda a: _epilogue_halves(a["ACT_FN"], a["GATED"], a["BLOCK_N"]),
    })(_up_swiglu_kernel)
)  # fmt: skip


def _single_config(config, key: dict, dtype, k) -> dict | None:
    """The configuration of a launch without a gate: ``config`` when given; else, with shipped
    configurations, the shipped ``up_single`` one, or the gated kernel's shipped one for the
    same key with BLOCK_N doubled (``configs.single_tile_config``); else None (the autotuner)."""
    if config is not None or k.autotune != "shipped" or interpret_mode():
        return config
    own = shipped_config("up_single", key, dtype)
    return own if own is not None else single_tile_config(shipped_config("up_swiglu", key, dtype))


def up_swiglu(x_TH, w13_EJH, idx_P, offs, prob_P, h_PJ, a_PI, *, config=None, kernels=None,
              activation=None, b13_EJ=None):  # fmt: skip
    """h = x[tok] @ w13[e]^T (+ b13[e]) into ``h_PJ`` (skipped when None); a = act(h) (* prob_P
    when given) into ``a_PI`` (skipped when None: the fc1 recompute needs h alone). Rows are the
    range's pairs, ``n_pairs`` the rows of ``a_PI`` (else of ``h_PJ``). ``activation``: an
    ``ExpertActivation`` (None: SwiGLU); J = 2I gated, I not. ``b13_EJ``: the range's fc1 bias
    (unit column stride), or None.

    On sm90 the warp-specialised Gluon kernel runs (``kernels.gather_ws``, ``gather_ws.py``)
    where ``select.gather_ws_for`` takes the activation and bias, unless a Triton ``config`` is
    passed; its a comes from h rounded to the output dtype. ``kernels``: the ``KernelOptions``
    (default: ``KernelOptions()``)."""
    if h_PJ is None and a_PI is None:
        raise ValueError("up_swiglu needs an output: h_PJ, a_PI or both")
    meta_act = act_meta(activation)
    n_experts, rows_e, hidden = w13_EJH.shape
    ffn = rows_e // 2 if meta_act["GATED"] else rows_e
    n_pairs = (a_PI if a_PI is not None else h_PJ).shape[0]
    if n_pairs == 0 or n_experts == 0:
        return
    check_expert_span(w13_EJH, "w13", "up_swiglu")
    k = select.kernel_options(kernels)
    ws = None
    if config is None:
        ws = select.gather_ws_for("up_swiglu", x_TH, w13_EJH, h_PJ, a_PI, k=k,
                                  activation=activation, bias=b13_EJ)  # fmt: skip
    if ws is not None and select.launch_ws(
        "up_swiglu", lambda: ws.up_swiglu(x_TH, w13_EJH, idx_P, offs, prob_P, h_PJ, a_PI)
    ):
        return
    key = dict(zip(UP_KEY, (hidden, ffn, n_experts, h_PJ is not None, prob_P is not None),
                   strict=True))  # fmt: skip
    if meta_act["GATED"]:
        kernel, meta = pick_config(up_tuned, _up_swiglu_kernel, config, hidden, "up_swiglu", key,
                             x_TH.dtype, k, ncols=ffn)  # fmt: skip
    else:
        config = _single_config(config, key, x_TH.dtype, k)
        kernel, meta = pick_config(up_single_tuned, _up_swiglu_kernel, config, hidden, "up_single",
                             key, x_TH.dtype, k, ncols=ffn)  # fmt: skip
        if meta:  # a fixed configuration (the autotuned kernel's heuristic decides otherwise)
            meta["EPI_HALVES"] = _epilogue_halves(meta_act["ACT_FN"], False, meta["BLOCK_N"])
    h = h_PJ if h_PJ is not None else a_PI
    a = a_PI if a_PI is not None else h_PJ  # an unused pointer when a is not stored
    p = prob_P if prob_P is not None else a
    b = b13_EJ if b13_EJ is not None else a  # an unused pointer without a bias
    tma = select.tma_weights(w13_EJH, k)
    if tma and w13_EJH.is_cuda:
        set_descriptor_allocator()
    kernel[row_grid(n_pairs, n_experts, ffn)](
        x_TH, w13_EJH, idx_P, offs, p, h, a, b,
        n_experts, hidden, ffn,
        x_TH.stride(0), w13_EJH.stride(0), w13_EJH.stride(1), w13_EJH.stride(2),
        h.stride(0), a.stride(0), b.stride(0),
        SAVE_H=h_PJ is not None, SCALE=prob_P is not None, IEEE=exact_fp32(x_TH),
        BLOCK_E=expert_block_size(n_experts), TMA_W=tma, SAVE_A=a_PI is not None,
        HAS_BIAS=b13_EJ is not None, **meta_act, **meta,
    )  # fmt: skip
