"""The fp8 row GEMM ``c[q] = a[q] @ b[e]`` over the routing index: the forward's down
projection (``a`` the quantised activation), the dgrad of fc2 (``a`` = dy rows gathered through
the index, fp8 on load) and of fc1 (``a`` = the quantised dh).

``a`` is fp8 (e4m3 or e5m2) with its inverse scale: one value (tensor-scaled) or one per row
and 128-wide K block (blockwise: ``(rows, ceil(K/128))``). ``b`` is an fp8 weight read through
strides as (K, N) per expert, K-major (unit stride along K: ``weights.Fp8ExpertWeights`` holds
the layout each GEMM needs), with its inverse scales: one per expert, or per 128x128 block
(``[e, n // 128, k // 128]`` through strides). The K loop accumulates fp32: blockwise multiplies
each 128-wide K block's partial product by the row's and the block's scales before adding it
(the promotion of DeepSeek-V3); tensor-scaled accumulates in the tensor core (``PROMOTE=False``,
the fprop) or promotes every ``BLOCK_K`` (the dgrad), and multiplies by the two scales once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from relaymoe.fp8_recipe import BLOCK
from relaymoe.kernels import interpret_mode
from relaymoe.kernels.grouped.tiles import (
    check_expert_span,
    expert_block_size,
    load_k_step,
    row_grid,
    row_group_m,
    row_tile,
)

__all__ = ["fp8_rows_gemm", "scaled_dot"]


@triton.jit
def scaled_dot(acc, a, b, sa, sb, BLOCKWISE: tl.constexpr, PROMOTE: tl.constexpr,
               BLOCK_K: tl.constexpr):  # fmt: skip
    """One K step: blockwise ``acc + (a @ b) * sa[:, None] * sb[None, :]`` (the partial product
    promoted with its scales), else ``a @ b`` accumulated into ``acc`` (in fp32 every
    ``BLOCK_K`` with ``PROMOTE``)."""
    if BLOCKWISE:
        return acc + tl.dot(a, b) * (sa[:, None] * sb[None, :])
    if PROMOTE:
        return tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    return tl.dot(a, b, acc)


@triton.jit
def _fp8_rows_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, idx_ptr, offs_ptr, c_ptr,
    n_experts, N, K,
    stride_ap, stride_sap, stride_be, stride_bk, stride_bn, stride_sbe, stride_sbn, stride_sbk,
    stride_cp,
    A_GATHER: tl.constexpr, BLOCKWISE: tl.constexpr, PROMOTE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """c[q] = dequant(A[q]) @ dequant(B[e]) for the range's pairs; A's row is ``tok[q]`` with
    ``A_GATHER``, else ``q - offs[0]``. Blockwise needs ``BLOCK_K == 128``."""
    e, pid_n, row_ok, lrows, a_rows, cols, col_ok = row_tile(
        N, offs_ptr, idx_ptr, n_experts, A_GATHER, BLOCK_M, BLOCK_N, BLOCK_E, GROUP_M
    )
    if e >= n_experts:
        return
    e64 = e.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_ap + ks[None, :]
    b_ptrs = b_ptr + e64 * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk
    sa_ptrs = sa_ptr + a_rows * stride_sap  # blockwise: + the K block
    sb_ptrs = sb_ptr + e64 * stride_sbe + tl.where(col_ok, cols, 0) // 128 * stride_sbn
    sa = tl.zeros((BLOCK_M,), dtype=tl.float32)
    sb = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a, b = load_k_step(a_ptrs, b_ptrs, ks, k0, K, col_ok, EVEN_K)
        if BLOCKWISE:
            sa = tl.load(sa_ptrs + k0 // 128)
            sb = tl.load(sb_ptrs + (k0 // 128) * stride_sbk)
        acc = scaled_dot(acc, a, b, sa, sb, BLOCKWISE, PROMOTE, BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if not BLOCKWISE:
        acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr + e64 * stride_sbe))
    cp = c_ptr + lrows[:, None] * stride_cp + cols[None, :]
    tl.store(cp, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _config(blockwise: bool) -> dict:
    """Tile configuration: 128x128 output tiles with 128-wide K steps on the GPU (the fp8 tiles
    of one stage are 32 KiB; a blockwise partial doubles the fp32 registers, so one stage
    less); small tiles under the interpreter, so odd shapes cross tile edges (blockwise sizes
    are multiples of 128: its tiles are as wide, fewer programs to interpret)."""
    if interpret_mode():
        return {"BLOCK_M": 16, "BLOCK_N": BLOCK if blockwise else 32,
                "BLOCK_K": BLOCK if blockwise else 32}  # fmt: skip
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": BLOCK, "num_warps": 8,
            "num_stages": 3 if blockwise else 4}  # fmt: skip


def fp8_rows_gemm(a_PK, a_inv, b_EKN, b_inv, offs, c_PN, *, a_idx=None, b_inv_strides=None,
                  promote: bool = True):  # fmt: skip
    """c[q] = dequant(a[q]) @ dequant(b[e]) for the range's pairs (``n_pairs = c_PN.shape[0]``).

    ``a_PK``: fp8 (P, K), or (T, K) read at row ``a_idx[q]`` (the full
    ``expert_token_indices``) when ``a_idx`` is given; ``a_inv``: a one-element tensor or
    (rows of a, ceil(K/128)) (blockwise). ``b_EKN``: an fp8 (E, K, N) view, unit stride along K;
    ``b_inv``: (E,) or the per-block scales, whose (e, n-block, k-block) strides are
    ``b_inv_strides`` (blockwise). ``promote``: tensor-scaled only, fp32 promotion every K step."""
    n_experts, kdim, ncols = b_EKN.shape
    n_pairs = c_PN.shape[0]
    if n_pairs == 0 or n_experts == 0 or ncols == 0:
        return
    check_expert_span(b_EKN, "the fp8 weight operand", "fp8_rows_gemm")
    blockwise = b_inv_strides is not None
    meta = _config(blockwise)
    meta["EVEN_K"] = kdim % meta["BLOCK_K"] == 0
    meta["GROUP_M"] = row_group_m(ncols, meta["BLOCK_N"])
    sb = b_inv_strides if blockwise else (b_inv.stride(0), 0, 0)
    _fp8_rows_kernel[row_grid(n_pairs, n_experts, ncols)](
        a_PK, a_inv, b_EKN, b_inv, a_idx if a_idx is not None else offs, offs, c_PN,
        n_experts, ncols, kdim,
        a_PK.stride(0), a_inv.stride(0) if blockwise else 0,
        b_EKN.stride(0), b_EKN.stride(1), b_EKN.stride(2), *sb, c_PN.stride(0),
        A_GATHER=a_idx is not None, BLOCKWISE=blockwise, PROMOTE=promote,
        BLOCK_E=expert_block_size(n_experts), **meta,
    )  # fmt: skip
