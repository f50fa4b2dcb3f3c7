"""The bias gradients of an expert range, deterministic (fixed summation order, no atomics).

Shape legend: T tokens, K top-k, H hidden, J fc1 rows, El local experts, P the range's pair rows
(expert-grouped, row ``q - offs[0]`` for global position ``q``).

* :func:`segment_sum`: ``out[e] += sum over e's pair rows of (p *) src[row]``, one program per
  (expert, column block) walking its rows in order, in fp32: ``db13[e] = sum dh`` (src the
  (P, J) dh) and ``db2[e] = sum p * dy[tok]`` (src the (T, H) dy gathered through the index).
* :func:`add_bias_dprobs`: ``dprobs[t, k] += dy[t] . b2[e]`` for the range's pairs (the router
  gradient of ``p * b2[e]`` in the output), one program per token block, all K choices together.

Rows past the range's count (buffers sized from a bound) are never read: each expert's rows
are ``offs[e]:offs[e+1]`` read on the device, no host sync.
"""

from __future__ import annotations

import triton
import triton.language as tl

from relaymoe.kernels import interpret_mode
from relaymoe.kernels.grouped.tiles import check_rows

__all__ = ["add_bias_dprobs", "segment_sum"]


@triton.jit
def _segment_sum_kernel(
    src_ptr, idx_ptr, scale_ptr, offs_ptr, out_ptr,
    N, stride_src, stride_out,
    GATHER: tl.constexpr, SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """out[e, cols] += sum_{q in e} (scale[q] *) src[row(q), cols]; row(q) = idx[q] (a token,
    ``GATHER``) or q - offs[0]. Rows summed in order, BLOCK_R at a time, then across the block."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < N
    base = tl.load(offs_ptr)
    lo = tl.load(offs_ptr + e)
    hi = tl.load(offs_ptr + e + 1)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < hi
        local = tl.where(row_ok, rows - base, 0)
        if GATHER:
            src_rows = tl.load(idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        else:
            src_rows = local.to(tl.int64)
        v = tl.load(src_ptr + src_rows[:, None] * stride_src + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        if SCALE:
            v = v * tl.load(scale_ptr + local, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        acc += v
    op = out_ptr + e.to(tl.int64) * stride_out + cols
    total = tl.sum(acc, axis=0) + tl.load(op, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(op, total.to(out_ptr.dtype.element_ty), mask=col_ok)


def segment_sum(src, offs, out_EN, *, idx_P=None, scale_P=None) -> None:
    """``out_EN[e] += sum over expert e's pairs of (scale_P[q] *) src[row]`` for the range's
    experts (``offs``: its El+1 offsets). ``idx_P``: the full ``expert_token_indices``, src a
    (T, N) operand read at each pair's token (else src holds the range's (P, N) pair rows).
    ``scale_P``: the range's per-pair fp32 factor (the router probabilities) or None. Summed in
    fp32, added into ``out_EN`` once (any float dtype; unit column strides)."""
    n_experts, ncols = out_EN.shape
    if n_experts == 0 or ncols == 0:
        return
    if idx_P is None:
        check_rows(src.shape[0], "segment_sum")
    if interpret_mode():
        br, bc, warps = 16, 16, 4
    else:  # 32 rows x 128 columns a step at 4 warps: 32 fp32 accumulators a thread
        br, bc, warps = 32, min(128, triton.next_power_of_2(ncols)), 4
    _segment_sum_kernel[(n_experts, triton.cdiv(ncols, bc))](
        src, idx_P if idx_P is not None else offs, scale_P if scale_P is not None else src,
        offs, out_EN,
        ncols, src.stride(0), out_EN.stride(0),
        GATHER=idx_P is not None, SCALE=scale_P is not None, BLOCK_R=br, BLOCK_C=bc,
        num_warps=warps,
    )  # fmt: skip


@triton.jit
def _bias_dprobs_kernel(
    dy_ptr, b_ptr, te_ptr, map_ptr, offs_ptr, out_ptr,
    T, H, K, e0, n_experts,
    stride_dyt, stride_be,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """out[t*K + k] += dy[t] . b2[expert(t, k) - e0] for every (t, k) whose pair lies in the
    range; dy's rows read once for all K choices, the dot in fp32 over H in order."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    i = t.to(tl.int64)[:, None] * K + kk[None, :]  # (BLOCK_T, BLOCK_K) flat (t, k)
    ok = (t < T)[:, None] & (kk < K)[None, :]
    start = tl.load(offs_ptr).to(tl.int64)
    stop = tl.load(offs_ptr + n_experts).to(tl.int64)
    q = tl.load(map_ptr + i, mask=ok, other=-1).to(tl.int64)
    live = ok & (q >= start) & (q < stop)
    e = tl.load(te_ptr + i, mask=live, other=0).to(tl.int64) - e0
    e = tl.where(live, e, 0)
    acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    hs = tl.arange(0, BLOCK_H)
    t64 = tl.where(t < T, t, 0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        h_ok = (h0 + hs) < H
        d = tl.load(dy_ptr + t64[:, None] * stride_dyt + (h0 + hs)[None, :],
                    mask=(t < T)[:, None] & h_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        b = tl.load(b_ptr + e[:, :, None] * stride_be + (h0 + hs)[None, None, :],
                    mask=live[:, :, None] & h_ok[None, None, :], other=0.0).to(tl.float32)  # fmt: skip
        acc += tl.sum(d[:, None, :] * b, axis=2)
    cur = tl.load(out_ptr + i, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, (cur + acc).to(out_ptr.dtype.element_ty), mask=live)


def add_bias_dprobs(dy_TH, b2_EH, token_expert, token_index_map, offs, e0: int,
                    dprobs_TK) -> None:  # fmt: skip
    """``dprobs_TK[t, k] += dy[t] . b2[expert - e0]`` for the range's pairs (``offs``: its El+1
    offsets; ``token_expert``: the index's (T*K,) global expert ids; ``e0``: the range's first
    expert); other entries untouched. dy and b2 at unit column stride; ``dprobs_TK``
    contiguous."""
    num_tokens, hidden = dy_TH.shape
    topk = dprobs_TK.shape[1] if dprobs_TK.dim() == 2 else 1
    if num_tokens == 0 or hidden == 0 or b2_EH.shape[0] == 0:
        return
    block_k = triton.next_power_of_2(topk)
    if interpret_mode():
        bt, bh, warps = 16, 16, 4
    else:  # 16 tokens x K x 64 columns of b2 a step (8192 elements at K=8) at 4 warps
        bt, bh, warps = 16, max(16, min(64, 512 // block_k)), 4
    _bias_dprobs_kernel[(triton.cdiv(num_tokens, bt),)](
        dy_TH, b2_EH, token_expert, token_index_map, offs, dprobs_TK,
        num_tokens, hidden, topk, e0, offs.shape[0] - 1,
        dy_TH.stride(0), b2_EH.stride(0),
        BLOCK_T=bt, BLOCK_K=block_k, BLOCK_H=bh, num_warps=warps,
    )  # fmt: skip
