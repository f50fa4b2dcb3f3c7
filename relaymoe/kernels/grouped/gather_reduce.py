"""The deterministic gather-reduce combine: ``out[t] (+)= sum_k y[pair of (t, k)]``, no atomics;
with the fc2 bias also ``+ p[t, k] * b2[e]`` for each pair of the range (``out[t] += sum_k p_k
b2[e_k]``, summed in the same fixed order, no (T, H) pass of its own).
"""

from __future__ import annotations

import triton
import triton.language as tl

from relaymoe.kernels import interpret_mode


@triton.jit
def _combine_kernel(
    y_ptr, map_ptr, offs_ptr, out_ptr, b_ptr, p_ptr, te_ptr,
    T, N, K, n_experts, e0,
    stride_yp, stride_ot, stride_be,
    ACCUMULATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
):  # fmt: skip
    """Deterministic gather-reduce: each output element sums its K rows in k order in fp32
    (``HAS_BIAS``: each row followed by ``p * b2[expert - e0]``)."""
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
        if HAS_BIAS:
            p = tl.load(p_ptr + t64 * K + k, mask=live, other=0.0).to(tl.float32)
            e = tl.load(te_ptr + t64 * K + k, mask=live, other=0).to(tl.int64) - e0
            b = tl.load(b_ptr + tl.where(live, e, 0)[:, None] * stride_be + n[None, :],
                        mask=live[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
            acc += p[:, None] * b.to(tl.float32)
    op = out_ptr + t64[:, None] * stride_ot + n[None, :]
    mask = t_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(op, mask=mask, other=0.0).to(tl.float32)
    tl.store(op, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(y_PN, token_index_map, offs, out_TN, topk: int, *, accumulate: bool, config=None,
            bias=None):  # fmt: skip
    """out[t] (+)= sum_k y[map[t*K+k] - offs[0]] over pairs inside the range; deterministic.
    ``config``: (BLOCK_T, BLOCK_N, num_warps), for sweeps. ``bias``: None, or
    ``(b2_EN, probs_TK, token_expert, e0)``: the range's fc2 bias columns (unit column stride),
    the contiguous router probabilities, the index's (T*K,) global expert ids and the range's
    first expert; each pair then adds ``p * b2[expert - e0]``."""
    num_tokens, ncols = out_TN.shape
    if num_tokens == 0 or ncols == 0:
        return
    n_experts = offs.shape[0] - 1
    if config is not None:
        bt, bn, warps = config
    elif interpret_mode():
        bt, bn, warps = 16, 16, 4
    else:  # the fastest of COMBINE_CONFIGS, each timed alone
        bt, bn, warps = 32, min(256, triton.next_power_of_2(ncols)), 8
    b2, probs, token_expert, e0 = bias if bias is not None else (y_PN, y_PN, token_index_map, 0)
    grid = (triton.cdiv(num_tokens, bt), triton.cdiv(ncols, bn))
    _combine_kernel[grid](
        y_PN, token_index_map, offs, out_TN, b2, probs, token_expert,
        num_tokens, ncols, topk, n_experts, e0,
        y_PN.stride(0), out_TN.stride(0), b2.stride(0),
        ACCUMULATE=accumulate, BLOCK_T=bt, BLOCK_N=bn, HAS_BIAS=bias is not None,
        num_warps=warps,
    )  # fmt: skip
