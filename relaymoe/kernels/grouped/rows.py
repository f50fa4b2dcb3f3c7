"""The row GEMM ``c[q] = a[q] @ b[e]``: contiguous pair rows, or token rows gathered on load."""

from __future__ import annotations

import triton
import triton.language as tl

from relaymoe.kernels import select
from relaymoe.kernels.grouped.configs import ROWS_CONFIGS, ROWS_KEY, pick_config
from relaymoe.kernels.grouped.tiles import (
    check_expert_span,
    even_k,
    exact_fp32,
    expert_block_size,
    group_m,
    row_gemm_loop,
    row_grid,
    row_tile,
)


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
    e, pid_n, row_ok, lrows, a_rows, cols, col_ok = row_tile(
        N, offs_ptr, idx_ptr, n_experts, A_GATHER, BLOCK_M, BLOCK_N, BLOCK_E, GROUP_M
    )
    if e >= n_experts:
        return
    acc = row_gemm_loop(
        a_rows, a_ptr, stride_ap, b_ptr + e.to(tl.int64) * stride_be, stride_bk, stride_bn,
        cols, col_ok, K, IEEE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    cp = c_ptr + lrows[:, None] * stride_cp + cols[None, :]
    tl.store(cp, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


rows_tuned = triton.autotune(ROWS_CONFIGS, key=list(ROWS_KEY))(
    triton.heuristics({"EVEN_K": even_k("K"), "GROUP_M": group_m("N")})(_rows_gemm_kernel)
)


def rows_gemm(a_PK, b_EKN, offs, c_PN, *, a_idx=None, config=None, kernels=None):
    """c[q] = a[q] @ b[e] for the range's pairs; ``b_EKN`` may be any strided (E, K, N) view.

    With ``a_idx`` (the full ``expert_token_indices``) ``a`` is a (T, K) operand read at row
    ``a_idx[q]`` (gather on load); then ``n_pairs = c_PN.shape[0]``, and on sm90 the Gluon
    kernel runs unless a Triton ``config`` is passed (``kernels.gather_ws``)."""
    n_experts, kdim, ncols = b_EKN.shape
    n_pairs = c_PN.shape[0]
    if n_pairs == 0 or n_experts == 0:
        return
    check_expert_span(b_EKN, "the weight operand", "rows_gemm")
    k = select.kernel_options(kernels)
    gathered = a_idx is not None and config is None
    ws = select.gather_ws_for("rows_gemm", a_PK, b_EKN, c_PN, k=k) if gathered else None
    if ws is not None and select.launch_ws(
        "rows_gemm", lambda: ws.rows_gemm(a_PK, b_EKN, a_idx, offs, c_PN)
    ):
        return
    key = dict(zip(ROWS_KEY, (ncols, kdim, n_experts, a_idx is not None), strict=True))
    kernel, meta = pick_config(rows_tuned, _rows_gemm_kernel, config, kdim, "rows_gemm", key,
                         a_PK.dtype, k, ncols=ncols)  # fmt: skip
    kernel[row_grid(n_pairs, n_experts, ncols)](
        a_PK, b_EKN, a_idx if a_idx is not None else offs, offs, c_PN,
        n_experts, ncols, kdim,
        a_PK.stride(0), b_EKN.stride(0), b_EKN.stride(1), b_EKN.stride(2), c_PN.stride(0),
        A_GATHER=a_idx is not None, IEEE=exact_fp32(a_PK), BLOCK_E=expert_block_size(n_experts), **meta,
    )  # fmt: skip
