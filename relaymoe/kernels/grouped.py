"""Grouped GEMM kernels over the routing index (MoEBlaze §3-5). Imports only torch, triton and
``relaymoe.kernels`` (limits, the shipped tuned configurations).

Shape legend: T tokens, H hidden, I expert FFN width, El local experts, P pairs of the computed
expert range in expert-grouped order (positions ``offs[0]:offs[El]`` of the routing index).

Every kernel takes the full ``expert_token_indices`` (global positions -> token id) and an
``offs`` view of ``El+1`` expert offsets (``index.offsets_for(e0, e1)``). Pair buffers (``h``,
``a``, ``y``...) hold only the range's pairs: row ``q - offs[0]`` for global position ``q``.

Tile schedule: a program's M tile is found on device from ``offs`` (per-expert tile counts, their
prefix sum, and a count of prefix sums not above the program id), so no host sync and no
schedule tensor; the grid is sized from an upper bound (``cdiv(P, BLOCK_M) + El`` M tiles) and
surplus programs exit at once. Consecutive programs share one M tile (the gathered token rows
stay in L2) and walk the N tiles of one expert's weight.

Offsets: token rows, pair rows and expert bases are int64 in the kernels; what stays int32 is an
offset inside one expert's weight (a row or column index times a stride), the pair row ids of the
SwiGLU backward and the launch grid. The launchers check those on sizes before launching
(``ValueError`` naming the value, the 2^31 limit and the fix; ``relaymoe.kernels.check_int32``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from relaymoe.kernels import check_int32, interpret_mode, select, tile_group_m
from relaymoe.kernels.tuned import shipped_config


# ---------------------------------------------------------------------------------------------
# shared device helpers
# ---------------------------------------------------------------------------------------------
@triton.jit
def _expert_tile(pid_m, offs_ptr, n_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(local expert, first global row, end global row) of M tile ``pid_m``; expert == n_experts
    when the program has no tile."""
    j = tl.arange(0, BLOCK_E)
    live = j < n_experts
    lo = tl.load(offs_ptr + j, mask=live, other=0)
    hi = tl.load(offs_ptr + j + 1, mask=live, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    last = tl.cumsum(tiles, 0)  # inclusive: tiles of experts <= j
    e = tl.sum((last <= pid_m).to(tl.int32), 0)
    pick = j == e
    first_tile = tl.sum(tl.where(pick, last - tiles, 0), 0)
    row0 = tl.sum(tl.where(pick, lo, 0), 0) + (pid_m - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(pick, hi, 0), 0)
    return e, row0, row_end


@triton.jit
def _row_col_tile(
    n_cols, offs_ptr, n_experts, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``_expert_tile`` of this program plus its N tile, on a grid of (M tiles) x
    ``cdiv(n_cols, BLOCK_N)`` programs (``_row_grid``) taken in groups of ``GROUP_M`` M tiles,
    M fastest inside a group (``relaymoe.kernels.tile_group_m``; 1: N tiles fastest)."""
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(n_cols, BLOCK_N)
    n_m = tl.num_programs(0) // n_tiles_n
    per_group = GROUP_M * n_tiles_n
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(n_m - first_m, GROUP_M)
    rem = pid % per_group
    e, row0, row_end = _expert_tile(first_m + rem % size, offs_ptr, n_experts, BLOCK_M, BLOCK_E)
    return e, row0, row_end, rem // size


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _row_gemm_loop(
    a_rows,  # (BLOCK_M,) int64 row ids into a_ptr (already valid addresses)
    a_ptr,
    stride_a,
    b_ptr,  # base of this expert's (K, N) operand
    stride_bk,
    stride_bn,
    cols,  # (BLOCK_N,) column ids, unclamped: a clamp hides contiguity (scalar loads)
    col_ok,
    K,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + ks[None, :]
    b_ptrs = b_ptr + cols[None, :] * stride_bn + ks[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _mma(a, b, acc, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc


# ---------------------------------------------------------------------------------------------
# forward (1): up-projection, gather-on-load, SwiGLU epilogue
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# forward (2) / backward dgrad: rows of a contiguous pair buffer times the expert's weight
# ---------------------------------------------------------------------------------------------
@triton.jit
def _rows_gemm_kernel(
    a_ptr, b_ptr, idx_ptr, offs_ptr, c_ptr,
    n_experts, N, K,
    stride_ap, stride_be, stride_bk, stride_bn, stride_cp,
    A_GATHER: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr = 1,
):  # fmt: skip
    """c[q] = A[q] @ B[e] for the range's pairs (B[e] is (K, N) through strides). A's row is
    ``tok[q]`` when ``A_GATHER`` (a (T, K) operand read through the index), else ``q - offs[0]``."""
    e, row0, row_end, pid_n = _row_col_tile(N, offs_ptr, n_experts, BLOCK_M, BLOCK_N, BLOCK_E,
                                            GROUP_M)  # fmt: skip
    if e >= n_experts:
        return
    base = tl.load(offs_ptr)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    lrows = tl.where(row_ok, rows - base, 0).to(tl.int64)
    if A_GATHER:
        a_rows = tl.load(idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        a_rows = lrows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = _row_gemm_loop(
        a_rows, a_ptr, stride_ap, b_ptr + e.to(tl.int64) * stride_be, stride_bk, stride_bn,
        cols, col_ok, K, IEEE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    cp = c_ptr + lrows[:, None] * stride_cp + cols[None, :]
    tl.store(cp, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------------------------------------
# backward (1, split): SwiGLU backward, dprob and p*a over rows, after the GEMM g = dy[tok] @ w2[e]
# ---------------------------------------------------------------------------------------------
@triton.jit
def _swiglu_bwd_kernel(
    h_ptr, g_ptr, prob_ptr, dh_ptr, dprob_ptr,
    n_pairs, I,
    stride_hp, stride_gp, stride_dhp,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Memory-bound pass over BLOCK_R pair rows, I in BLOCK_C column steps (SiLU recomputed from
    h): dprob = rowsum(g * a) with a = silu(gate) * up, exact per row (no partials); da = p * g;
    dh = [da * up * silu'(gate), da * silu(gate)]; g is overwritten with p * a (for dw2).

    ``dh_ptr`` may equal ``h_ptr``: each element is read, then written, by the same program.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_pairs
    r64 = rows.to(tl.int64)
    p = tl.load(prob_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    dprob = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, I, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < I)[None, :]
        hp = h_ptr + r64[:, None] * stride_hp + cols[None, :]
        gp = g_ptr + r64[:, None] * stride_gp + cols[None, :]
        gate = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(hp + I, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gp, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        act = silu * up
        dprob += tl.sum(g * act, axis=1)
        da = g * p
        dhp = dh_ptr + r64[:, None] * stride_dhp + cols[None, :]
        tl.store(dhp, (da * up * sig * (1.0 + gate * (1.0 - sig))).to(dh_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
        tl.store(dhp + I, (da * silu).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(gp, (act * p).to(g_ptr.dtype.element_ty), mask=mask)
    tl.store(dprob_ptr + rows, dprob, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# forward SwiGLU alone: a = silu(gate) * up (* p) over rows of h (after a GEMM made h)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _swiglu_fwd_kernel(
    h_ptr, prob_ptr, a_ptr,
    n_pairs, I,
    stride_hp, stride_ap,
    SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Memory-bound pass over BLOCK_R pair rows of h = [gate, up], I in BLOCK_C column steps."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_pairs
    r64 = rows.to(tl.int64)
    if SCALE:
        p = tl.load(prob_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    for c0 in range(0, I, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < I)[None, :]
        hp = h_ptr + r64[:, None] * stride_hp + cols[None, :]
        gate = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(hp + I, mask=mask, other=0.0).to(tl.float32)
        act = gate * tl.sigmoid(gate) * up
        if SCALE:
            act = act * p
        tl.store(a_ptr + r64[:, None] * stride_ap + cols[None, :], act.to(a_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# backward wgrad: dW[e] = sum over the expert's pairs of A[q]^T B[q]
# ---------------------------------------------------------------------------------------------
@triton.jit
def _wgrad_tile(
    acc, q0, q_ok, a_ptr, b_ptr, idx_ptr, base, rm, rn, m_ok, n_ok, stride_a, stride_b,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, IEEE: tl.constexpr, MASK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """acc += A[q0:q0+BLOCK_K, rm]^T B[q0:q0+BLOCK_K, rn] by pointer loads; ``MASK_Q`` only on an
    expert's last, partial block (the full blocks need no row mask)."""
    q = q0 + tl.arange(0, BLOCK_K)
    if MASK_Q:
        local = tl.where(q_ok, q - base, 0).to(tl.int64)
        if A_GATHER or B_GATHER:
            tok = tl.load(idx_ptr + q, mask=q_ok, other=0).to(tl.int64)
        else:
            tok = local
    else:
        local = (q - base).to(tl.int64)
        if A_GATHER or B_GATHER:
            tok = tl.load(idx_ptr + q).to(tl.int64)
        else:
            tok = local
    a_rows = tok if A_GATHER else local
    b_rows = tok if B_GATHER else local
    a_mask = m_ok[None, :]
    b_mask = n_ok[None, :]
    if MASK_Q:
        a_mask = q_ok[:, None] & a_mask
        b_mask = q_ok[:, None] & b_mask
    at = tl.load(a_ptr + a_rows[:, None] * stride_a + rm[None, :], mask=a_mask, other=0.0)
    bt = tl.load(b_ptr + b_rows[:, None] * stride_b + rn[None, :], mask=b_mask, other=0.0)
    return _mma(tl.trans(at), bt, acc, IEEE)


@triton.jit
def _wgrad_kernel(
    a_ptr, b_ptr, idx_ptr, offs_ptr, c_ptr,
    M, N, n_rows,
    stride_a, stride_b, stride_ce, stride_cm, stride_cn,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, ACCUMULATE: tl.constexpr,
    IEEE: tl.constexpr, TMA_A: tl.constexpr = False, TMA_B: tl.constexpr = False,
    BLOCK_M: tl.constexpr = 64, BLOCK_N: tl.constexpr = 64, BLOCK_K: tl.constexpr = 32,
):  # fmt: skip
    """c[e] (M, N) (+)= sum_q A[q, :]^T B[q, :]; a gathered operand reads row tok[q], a
    contiguous one row q - offs[0]. An expert without pairs writes exact zeros (adds nothing).

    The expert's full BLOCK_K blocks of pairs run without a row mask, its last partial block
    after them with one. ``TMA_A`` / ``TMA_B``: that operand is contiguous (``n_rows`` rows in
    pair order) and its full blocks come through a tensor descriptor (TMA on sm90); the partial
    block stays a masked pointer load, so no row of the next expert is ever read. One program an
    output tile (expert, M tile, N tile), N tiles fastest. Measured slower on H200, qwen3 T32k
    (benchmarks/sweep_kernels.py): a persistent grid walking the tiles (session 11: equal with
    two programs an SM, 1.5-1.8x slower with one); the same with its tile loop flattened into
    the pair loop (``tl.range(flatten=True)``, session 12: with the gathered operand 1.07-1.13x
    slower at 5 stages, 1.00-1.05x at two programs an SM, up to 1.9x in other configurations;
    though 1.11-1.12x faster when both operands are contiguous and come through TMA);
    and Triton's warp specialisation of the pair loop (``warp_specialize=True``, Triton 3.6:
    equal with 8 warps, slower with 4)."""
    pid = tl.program_id(0)
    n_tiles_m = tl.cdiv(M, BLOCK_M)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    per_e = n_tiles_m * n_tiles_n
    e = pid // per_e
    r = pid % per_e
    pid_m = r // n_tiles_n
    pid_n = r % n_tiles_n
    base = tl.load(offs_ptr)
    lo = tl.load(offs_ptr + e)
    hi = tl.load(offs_ptr + e + 1)
    q_full = lo + (hi - lo) // BLOCK_K * BLOCK_K
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M  # masks, not clamps: the compiler must see rm/rn contiguous
    n_ok = rn < N
    a_desc = None
    b_desc = None
    if TMA_A:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[n_rows, M], strides=[stride_a, 1],
                                           block_shape=[BLOCK_K, BLOCK_M])  # fmt: skip
    if TMA_B:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[n_rows, N], strides=[stride_b, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])  # fmt: skip
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA_A or TMA_B:
        qs = tl.arange(0, BLOCK_K)
        for q0 in range(lo, q_full, BLOCK_K):
            row = (q0 - base).to(tl.int32)
            if A_GATHER or B_GATHER:
                tok = tl.load(idx_ptr + q0 + qs).to(tl.int64)
            else:
                tok = (q0 - base + qs).to(tl.int64)
            if TMA_A:
                at = a_desc.load([row, pid_m * BLOCK_M])
            else:
                at = tl.load(a_ptr + tok[:, None] * stride_a + rm[None, :], mask=m_ok[None, :],
                             other=0.0)  # fmt: skip
            if TMA_B:
                bt = b_desc.load([row, pid_n * BLOCK_N])
            else:
                bt = tl.load(b_ptr + tok[:, None] * stride_b + rn[None, :], mask=n_ok[None, :],
                             other=0.0)  # fmt: skip
            acc = _mma(tl.trans(at), bt, acc, IEEE)
    else:
        for q0 in range(lo, q_full, BLOCK_K):
            acc = _wgrad_tile(acc, q0, None, a_ptr, b_ptr, idx_ptr, base, rm, rn, m_ok, n_ok,
                              stride_a, stride_b, A_GATHER, B_GATHER, IEEE, False, BLOCK_K)  # fmt: skip
    if q_full < hi:
        q_ok = q_full + tl.arange(0, BLOCK_K) < hi
        acc = _wgrad_tile(acc, q_full, q_ok, a_ptr, b_ptr, idx_ptr, base, rm, rn, m_ok, n_ok,
                          stride_a, stride_b, A_GATHER, B_GATHER, IEEE, True, BLOCK_K)  # fmt: skip
    mask = m_ok[:, None] & n_ok[None, :]
    cp = c_ptr + e.to(tl.int64) * stride_ce + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    if ACCUMULATE:
        acc += tl.load(cp, mask=mask, other=0.0).to(tl.float32)
    tl.store(cp, acc.to(c_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# combine: out[t] (+)= sum_k y[token_index_map[t, k]] over pairs in the range (no atomics)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _combine_kernel(
    y_ptr, map_ptr, offs_ptr, out_ptr,
    T, N, K, n_experts,
    stride_yp, stride_ot,
    ACCUMULATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Deterministic gather-reduce: each output element sums its K rows in k order in fp32."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    start = tl.load(offs_ptr)
    stop = tl.load(offs_ptr + n_experts)
    t64 = t.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k in range(K):
        q = tl.load(map_ptr + t64 * K + k, mask=t_ok, other=-1).to(tl.int64)
        live = t_ok & (q >= start) & (q < stop)
        lq = tl.where(live, q - start, 0)
        v = tl.load(
            y_ptr + lq[:, None] * stride_yp + n[None, :],
            mask=live[:, None] & n_ok[None, :],
            other=0.0,
        )
        acc += v.to(tl.float32)
    op = out_ptr + t64[:, None] * stride_ot + n[None, :]
    mask = t_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(op, mask=mask, other=0.0).to(tl.float32)
    tl.store(op, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# configs and autotuning
# ---------------------------------------------------------------------------------------------
def _cfg(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps,
                         num_stages=stages)  # fmt: skip


# Short lists that fit H100/H200 shared memory (228 KB); autotune time counts on the device.
_UP_CONFIGS = [
    _cfg(128, 128, 64, 8, 3),
    _cfg(128, 64, 64, 4, 4),
    _cfg(64, 128, 64, 4, 4),
    _cfg(128, 128, 64, 8, 4),
]
_ROWS_CONFIGS = [
    _cfg(128, 128, 64, 4, 4),
    _cfg(128, 256, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4),
    _cfg(64, 128, 64, 4, 4),
]
_WGRAD_CONFIGS = [
    # H200, qwen3 T32k (benchmarks/sweep_kernels.py, each alone, session 11): 128x128x64 with 8
    # warps ran at 450-461 TFLOP/s with 5 stages, 416-437 with 3-4; 128x256 and 256x128 tiles
    # at 340-420, a 128-pair step at 300-340, a 32-pair step at 270-420 (left out)
    _cfg(128, 128, 64, 8, 5),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 128, 64, 8, 3),
    _cfg(128, 256, 64, 8, 3),
    _cfg(64, 128, 64, 4, 4),  # small M (narrow experts)
]
# Interpreter (CPU tests): small tiles so odd shapes cross tile edges.
_INTERP_CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}


def _even_k(kdim):
    return lambda meta: meta[kdim] % meta["BLOCK_K"] == 0


# autotune keys: the shipped configurations (tuned.py) are looked up by the same names
_UP_KEY = ("H", "I", "n_experts", "SAVE_H", "SCALE")
_ROWS_KEY = ("N", "K", "n_experts", "A_GATHER")
_WGRAD_KEY = ("M", "N", "A_GATHER", "B_GATHER", "ACCUMULATE")

# the gathered-row kernels' tile order: groups of ROW_GROUP_M M tiles (taller for wide experts,
# ``tile_group_m``)
ROW_GROUP_M = 8


def _row_group_m(ncols: int, block_n: int) -> int:
    return tile_group_m(triton.cdiv(ncols, block_n), ROW_GROUP_M)


def _group_m(ncols):
    return lambda meta: _row_group_m(meta[ncols], meta["BLOCK_N"])


_up_tuned = triton.autotune(_UP_CONFIGS, key=list(_UP_KEY))(
    triton.heuristics({"EVEN_K": _even_k("H"), "GROUP_M": _group_m("I")})(_up_swiglu_kernel)
)
_rows_tuned = triton.autotune(_ROWS_CONFIGS, key=list(_ROWS_KEY))(
    triton.heuristics({"EVEN_K": _even_k("K"), "GROUP_M": _group_m("N")})(_rows_gemm_kernel)
)
_wgrad_tuned = triton.autotune(
    _WGRAD_CONFIGS,
    key=list(_WGRAD_KEY),
    restore_value=["c_ptr"],  # accumulating launches must not add once per tried config
)(_wgrad_kernel)


def _pick(tuned, raw, config, kdim, name: str, key: dict, dtype, k, ncols: int | None = None):
    """The kernel and its meta-parameters. On GPU: the shipped configuration of (GPU, ``name``,
    bucket of the autotune ``key``) when ``kernels/tuned_configs.json`` has one, else the
    autotuner (``k.autotune``, ``tuned.py``). A fixed config (EVEN_K derived) under the
    interpreter, when a test passes one, or with ``autotune="first"`` (the first candidate).
    ``ncols``: a gathered-row kernel's output columns, for its GROUP_M (a config's own wins)."""
    if config is None and not interpret_mode():
        if k.autotune == "shipped":
            config = shipped_config(name, key, dtype)
        if config is None and k.autotune != "first":
            return tuned, {}
        if config is None:
            first = tuned.configs[0]
            config = {**first.kwargs, "num_warps": first.num_warps,
                      "num_stages": first.num_stages}  # fmt: skip
    cfg = dict(_INTERP_CFG if config is None else config)
    meta = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    for k in ("num_warps", "num_stages"):
        if k in cfg:
            meta[k] = cfg[k]
    if kdim is not None:
        meta["EVEN_K"] = kdim % meta["BLOCK_K"] == 0
    if ncols is not None:
        meta["GROUP_M"] = cfg.get("GROUP_M", _row_group_m(ncols, meta["BLOCK_N"]))
    return raw, meta


def _set_descriptor_allocator() -> None:
    """Give Triton an allocator for the descriptors' scratch in this thread, unless one is set.

    Triton keeps its allocator in a ``ContextVar``: one set in the forward's thread is not seen by
    autograd's backward thread, where the ring's per-hop recompute launches ``up_swiglu`` again.
    So this runs before every descriptor launch, not once per process. A user's own allocator is
    kept."""
    current = _triton_allocator()
    if current is not None and not isinstance(current, _NullAllocator):
        return
    triton.set_allocator(_torch_scratch)


def _torch_scratch(size: int, alignment: int, stream):
    # the caching allocator's blocks are 512-byte aligned, more than any descriptor asks
    return torch.empty(size, dtype=torch.int8, device="cuda")


try:  # where Triton keeps the allocator (3.4-3.8); without it every call sets ours
    from triton.runtime._allocation import NullAllocator as _NullAllocator
    from triton.runtime._allocation import _allocator as _TRITON_ALLOCATOR
except ImportError:  # pragma: no cover - a Triton that moved it
    _NullAllocator, _TRITON_ALLOCATOR = type(None), None


def _triton_allocator():
    return None if _TRITON_ALLOCATOR is None else _TRITON_ALLOCATOR.get()


def _block_e(n_experts: int) -> int:
    return max(16, triton.next_power_of_2(n_experts))


def _row_grid(n_pairs: int, n_experts: int, ncols: int):
    def grid(meta):
        tiles_m = triton.cdiv(n_pairs, meta["BLOCK_M"]) + n_experts
        n = tiles_m * triton.cdiv(ncols, meta["BLOCK_N"])
        check_int32(
            f"the launch grid ({n_pairs} pairs x {ncols} columns in "
            f"{meta['BLOCK_M']}x{meta['BLOCK_N']} tiles)", n, where="relaymoe row kernels",
            fix="use fewer tokens per call",
        )  # fmt: skip
        return (n,)

    return grid


_FIX_WEIGHT = "shard the expert FFN (tensor parallelism on the experts) to shrink each expert"


def _check_expert_span(t: torch.Tensor, name: str, where: str) -> None:
    """The largest element offset inside one expert of an (E, M, N) operand is computed in
    int32 by the kernels (index times stride)."""
    span = sum((d - 1) * abs(st) for d, st in zip(t.shape[1:], t.stride()[1:], strict=True))
    check_int32(f"the largest offset inside one expert of {name} {tuple(t.shape)}", span + 1,
                where=where, fix=_FIX_WEIGHT)  # fmt: skip


def _check_rows(n_rows: int, where: str) -> None:
    check_int32(f"the pair rows of the expert range ({n_rows})", n_rows, where=where,
                fix="use fewer tokens per call, or fewer experts per rank")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# launchers (no allocation policy here: callers pass every output)
# ---------------------------------------------------------------------------------------------
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


def rows_gemm(a_PK, b_EKN, offs, c_PN, *, a_idx=None, config=None, kernels=None):
    """c[q] = a[q] @ b[e] for the range's pairs; ``b_EKN`` may be any strided (E, K, N) view.

    With ``a_idx`` (the full ``expert_token_indices``) ``a`` is a (T, K) operand read at row
    ``a_idx[q]`` (gather on load); then ``n_pairs = c_PN.shape[0]``, and on sm90 the Gluon
    kernel runs unless a Triton ``config`` is passed (``kernels.gather_ws``)."""
    n_experts, kdim, ncols = b_EKN.shape
    n_pairs = c_PN.shape[0]
    if n_pairs == 0 or n_experts == 0:
        return
    _check_expert_span(b_EKN, "the weight operand", "rows_gemm")
    k = select.kernel_options(kernels)
    gathered = a_idx is not None and config is None
    ws = select.gather_ws_for("rows_gemm", a_PK, b_EKN, c_PN, k=k) if gathered else None
    if ws is not None and select.launch_ws(
        "rows_gemm", lambda: ws.rows_gemm(a_PK, b_EKN, a_idx, offs, c_PN)
    ):
        return
    key = dict(zip(_ROWS_KEY, (ncols, kdim, n_experts, a_idx is not None), strict=True))
    kernel, meta = _pick(_rows_tuned, _rows_gemm_kernel, config, kdim, "rows_gemm", key,
                         a_PK.dtype, k, ncols=ncols)  # fmt: skip
    kernel[_row_grid(n_pairs, n_experts, ncols)](
        a_PK, b_EKN, a_idx if a_idx is not None else offs, offs, c_PN,
        n_experts, ncols, kdim,
        a_PK.stride(0), b_EKN.stride(0), b_EKN.stride(1), b_EKN.stride(2), c_PN.stride(0),
        A_GATHER=a_idx is not None, IEEE=_ieee(a_PK), BLOCK_E=_block_e(n_experts), **meta,
    )  # fmt: skip


def swiglu_backward(h_P2I, g_PI, prob_P, dh_P2I, dprob_P, *, block_rows=None, block_cols=None):
    """See ``_swiglu_bwd_kernel``: reads h and g = dy[tok] @ w2[e] (unscaled), writes dh (may be
    ``h_P2I`` itself), dprob_P (fp32, every row) and overwrites g with p * a."""
    n_pairs, ffn = g_PI.shape
    if n_pairs == 0:
        return
    _check_rows(n_pairs, "swiglu_backward")  # row ids are int32 in the kernel
    if ffn == 0:
        dprob_P.zero_()
        return
    if interpret_mode():
        br, bc, warps = block_rows or 16, block_cols or 16, 4
    else:  # 16 x 256: 32 elements per thread per tile at 4 warps, I=768 in 3 steps
        br, bc, warps = block_rows or 16, block_cols or min(256, triton.next_power_of_2(ffn)), 4
    _swiglu_bwd_kernel[(triton.cdiv(n_pairs, br),)](
        h_P2I, g_PI, prob_P, dh_P2I, dprob_P,
        n_pairs, ffn,
        h_P2I.stride(0), g_PI.stride(0), dh_P2I.stride(0),
        BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
    )  # fmt: skip


def swiglu_forward(h_P2I, prob_P, a_PI):
    """a = silu(gate) * up (* prob_P when given) over the rows of ``h_P2I`` = [gate, up] (the
    forward when a GEMM made h; ``up_swiglu`` fuses this into its epilogue instead)."""
    n_pairs, ffn = a_PI.shape
    if n_pairs == 0 or ffn == 0:
        return
    _check_rows(n_pairs, "swiglu_forward")
    if interpret_mode():
        br, bc, warps = 16, 16, 4
    else:  # as swiglu_backward: 16 x 256 a tile at 4 warps
        br, bc, warps = 16, min(256, triton.next_power_of_2(ffn)), 4
    _swiglu_fwd_kernel[(triton.cdiv(n_pairs, br),)](
        h_P2I, prob_P if prob_P is not None else a_PI, a_PI,
        n_pairs, ffn,
        h_P2I.stride(0), a_PI.stride(0),
        SCALE=prob_P is not None, BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
    )  # fmt: skip


def wgrad(a, b, idx_P, offs, c_EMN, *, a_gather: bool, b_gather: bool, accumulate: bool,
          config=None, kernels=None):  # fmt: skip
    """c[e] (+)= sum over expert e's pairs of a[row]^T b[row] (gathered operands read tok[q]).
    A contiguous operand (in pair order) comes through a tensor descriptor where
    ``kernels.tma`` asks for it and its strides allow (``select.tma_operand``)."""
    n_experts, m, n = c_EMN.shape
    if n_experts == 0 or m == 0 or n == 0:
        return
    _check_expert_span(c_EMN, "the weight gradient", "wgrad")
    key = dict(zip(_WGRAD_KEY, (m, n, a_gather, b_gather, accumulate), strict=True))
    k = select.kernel_options(kernels)
    kernel, meta = _pick(_wgrad_tuned, _wgrad_kernel, config, None, "wgrad", key, a.dtype, k)
    tma_a = not a_gather and select.tma_operand(a, k)
    tma_b = not b_gather and select.tma_operand(b, k)
    if (tma_a or tma_b) and a.is_cuda:
        _set_descriptor_allocator()
    n_rows = b.shape[0] if a_gather else a.shape[0]

    def grid(meta_):
        return (n_experts * triton.cdiv(m, meta_["BLOCK_M"]) * triton.cdiv(n, meta_["BLOCK_N"]),)

    kernel[grid](
        a, b, idx_P, offs, c_EMN,
        m, n, n_rows,
        a.stride(0), b.stride(0), c_EMN.stride(0), c_EMN.stride(1), c_EMN.stride(2),
        A_GATHER=a_gather, B_GATHER=b_gather, ACCUMULATE=accumulate, IEEE=_ieee(a),
        TMA_A=tma_a, TMA_B=tma_b, **meta,
    )  # fmt: skip


def combine(y_PN, token_index_map, offs, out_TN, topk: int, *, accumulate: bool, config=None):
    """out[t] (+)= sum_k y[map[t*K+k] - offs[0]] over pairs inside the range; deterministic.
    ``config``: (BLOCK_T, BLOCK_N, num_warps), for sweeps."""
    num_tokens, ncols = out_TN.shape
    if num_tokens == 0 or ncols == 0:
        return
    n_experts = offs.shape[0] - 1
    if config is not None:
        bt, bn, warps = config
    elif interpret_mode():
        bt, bn, warps = 16, 16, 4
    else:  # H200, qwen3 T32k, a (P, 1024) chunk: 3.6 TB/s against 3.1 with 16 tokens, 4 warps
        bt, bn, warps = 32, min(256, triton.next_power_of_2(ncols)), 8
    grid = (triton.cdiv(num_tokens, bt), triton.cdiv(ncols, bn))
    _combine_kernel[grid](
        y_PN, token_index_map, offs, out_TN,
        num_tokens, ncols, topk, n_experts,
        y_PN.stride(0), out_TN.stride(0),
        ACCUMULATE=accumulate, BLOCK_T=bt, BLOCK_N=bn, num_warps=warps,
    )  # fmt: skip


def _ieee(t: torch.Tensor) -> bool:
    """fp32 inputs use exact fp32 products (no TF32), so fp32 results meet fp32 bounds."""
    return t.dtype == torch.float32
