"""Weight gradients ``c[e] (+)= sum over expert e's pairs of a[row]^T b[row]``, either operand
gathered through the routing index.
"""

from __future__ import annotations

import triton
import triton.language as tl

from relaymoe.kernels import select
from relaymoe.kernels.grouped.configs import (
    WGRAD_CONFIGS,
    WGRAD_KEY,
    pick_config,
    set_descriptor_allocator,
)
from relaymoe.kernels.grouped.tiles import check_expert_span, exact_fp32, mma
from relaymoe.kernels.tuned import pow2_bucket


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
    return mma(tl.trans(at), bt, acc, IEEE)


@triton.jit
def _expert_block(c_ptr, c_first, e, stride_ce, REVERSE: tl.constexpr):
    """Expert e's (M, N) block of the output: at ``e * stride_ce``, or with ``REVERSE`` at
    ``c_first + e * stride_ce`` (the forward order keeps the plain address)."""
    if REVERSE:
        return c_ptr + (c_first + e.to(tl.int64) * stride_ce)
    return c_ptr + e.to(tl.int64) * stride_ce


@triton.jit
def _wgrad_kernel(
    a_ptr, b_ptr, idx_ptr, offs_ptr, c_ptr,
    M, N, n_rows,
    stride_a, stride_b, c_first, stride_ce, stride_cm, stride_cn,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, ACCUMULATE: tl.constexpr,
    IEEE: tl.constexpr, TMA_A: tl.constexpr = False, TMA_B: tl.constexpr = False,
    BLOCK_M: tl.constexpr = 64, BLOCK_N: tl.constexpr = 64, BLOCK_K: tl.constexpr = 32,
    REVERSE: tl.constexpr = False, PRELOAD_C: tl.constexpr = False, PAIRS=0,
):  # fmt: skip
    """c[e] (M, N) (+)= sum_q A[q, :]^T B[q, :]; a gathered operand reads row tok[q], a
    contiguous one row q - offs[0]. An expert without pairs writes exact zeros, or, with
    ``ACCUMULATE``, leaves its block untouched (no read, no write: a hop slice or a ring hop
    without that expert costs it nothing).
    Expert e's block starts at element ``e * stride_ce`` of ``c_ptr``; with ``REVERSE`` at
    ``c_first + e * stride_ce``: a negative ``stride_ce`` from the last block (``c_first``)
    writes the experts in reverse memory order. The forward order keeps the plain address (no
    runtime offset in the epilogue's address arithmetic).

    The expert's full BLOCK_K blocks of pairs run without a row mask, its last partial block
    after them with one. ``TMA_A`` / ``TMA_B``: that operand is contiguous (``n_rows`` rows in
    pair order) and its full blocks come through a tensor descriptor (TMA on sm90); the partial
    block stays a masked pointer load, so no row of the next expert is ever read. One program an
    output tile (expert, M tile, N tile), N tiles fastest: a persistent grid, a flattened tile
    loop and Triton's warp specialisation were no faster with a gathered operand (module
    docstring's history).

    ``PAIRS`` is read by the autotuner only (its key's mean pairs an expert, ``WGRAD_KEY``).

    ``PRELOAD_C`` (an accumulating launch): read the output tile before the loop over pairs and
    accumulate onto it, instead of adding it after the loop. A configuration's choice: at 256
    pairs an expert (Megatron's fp32 ``main_grad``, EP 1) it made the small-tile dw2 1.17x
    faster and every 128x128 launch slower (1x H200)."""
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
    if ACCUMULATE:
        if hi == lo:  # nothing to add: the tile is not read nor written (a slice without e)
            return
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
    if ACCUMULATE and PRELOAD_C:
        c_e = _expert_block(c_ptr, c_first, e, stride_ce, REVERSE)
        acc = tl.load(c_e + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
                      mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
    else:
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
            acc = mma(tl.trans(at), bt, acc, IEEE)
    else:
        for q0 in range(lo, q_full, BLOCK_K):
            acc = _wgrad_tile(acc, q0, None, a_ptr, b_ptr, idx_ptr, base, rm, rn, m_ok, n_ok,
                              stride_a, stride_b, A_GATHER, B_GATHER, IEEE, False, BLOCK_K)  # fmt: skip
    if q_full < hi:
        q_ok = q_full + tl.arange(0, BLOCK_K) < hi
        acc = _wgrad_tile(acc, q_full, q_ok, a_ptr, b_ptr, idx_ptr, base, rm, rn, m_ok, n_ok,
                          stride_a, stride_b, A_GATHER, B_GATHER, IEEE, True, BLOCK_K)  # fmt: skip
    mask = m_ok[:, None] & n_ok[None, :]
    c_e = _expert_block(c_ptr, c_first, e, stride_ce, REVERSE)
    cp = c_e + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    if ACCUMULATE and not PRELOAD_C:
        acc += tl.load(cp, mask=mask, other=0.0).to(tl.float32)
    tl.store(cp, acc.to(c_ptr.dtype.element_ty), mask=mask)


wgrad_tuned = triton.autotune(
    WGRAD_CONFIGS,
    key=list(WGRAD_KEY),
    restore_value=["c_ptr"],  # accumulating launches must not add once per tried config
)(_wgrad_kernel)


def wgrad(a, b, idx_P, offs, c_EMN, *, a_gather: bool, b_gather: bool, accumulate: bool,
          config=None, kernels=None, reverse: bool = False):  # fmt: skip
    """c[e] (+)= sum over expert e's pairs of a[row]^T b[row] (gathered operands read tok[q]).
    A contiguous operand (in pair order) comes through a tensor descriptor where
    ``kernels.tma`` asks for it and its strides allow (``select.tma_operand``).

    ``reverse``: ``c_EMN``'s rows are the range's experts in reverse order (expert ``e`` of the
    range at row ``El-1-e``: Megatron's gradient buffer holds a layer's experts in reverse
    registration order), written through a negative expert stride from the last row, without
    a reordered copy. The whole ``c_EMN`` is what the kernel is given (and what an
    autotuning launch restores), whichever way its rows are walked."""
    n_experts, m, n = c_EMN.shape
    if n_experts == 0 or m == 0 or n == 0:
        return
    check_expert_span(c_EMN, "the weight gradient", "wgrad")
    n_rows = b.shape[0] if a_gather else a.shape[0]  # the pairs of the range (a static size)
    pairs = pow2_bucket(-(-n_rows // n_experts))  # the mean pairs an expert, rounded up
    key = dict(zip(WGRAD_KEY, (m, n, a_gather, b_gather, accumulate, pairs), strict=True))
    k = select.kernel_options(kernels)
    kernel, meta = pick_config(wgrad_tuned, _wgrad_kernel, config, None, "wgrad", key, a.dtype, k)
    tma_a = not a_gather and select.tma_operand(a, k)
    tma_b = not b_gather and select.tma_operand(b, k)
    if (tma_a or tma_b) and a.is_cuda:
        set_descriptor_allocator()

    def grid(meta_):
        return (n_experts * triton.cdiv(m, meta_["BLOCK_M"]) * triton.cdiv(n, meta_["BLOCK_N"]),)

    c_first, stride_ce = ((n_experts - 1) * c_EMN.stride(0), -c_EMN.stride(0)) if reverse else (
        0, c_EMN.stride(0))  # fmt: skip
    kernel[grid](
        a, b, idx_P, offs, c_EMN,
        m, n, n_rows,
        a.stride(0), b.stride(0), c_first, stride_ce, c_EMN.stride(1), c_EMN.stride(2),
        A_GATHER=a_gather, B_GATHER=b_gather, ACCUMULATE=accumulate, IEEE=exact_fp32(a),
        TMA_A=tma_a, TMA_B=tma_b, REVERSE=reverse, PAIRS=pairs, **meta,
    )  # fmt: skip
