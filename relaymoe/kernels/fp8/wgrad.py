"""fp8 weight gradients of the tensor-scaled recipes: ``c[e] (+)= sum over expert e's pairs of
dequant(a[row])^T dequant(b[row])``, one operand gathered through the routing index (x or dy,
quantised once over (T, H)), the other in pair order (dh or p*a, quantised once over the
range's pairs); both with one scale, which leaves the sum over pairs and is applied once.

Two layouts of the operands (``KernelOptions.fp8_wgrad_layout``):

* ``rows`` (:func:`fp8_wgrad`): the operands as the rest of the backward stores them, by pair
  rows. The contraction runs over pairs, across those rows (not K-major), and Hopper's fp8
  tensor cores take both operands K-major: Triton transposes each tile through registers and
  does not pipeline the loads (one shared-memory stage).
* ``columnwise`` (:func:`fp8_wgrad_columnwise`, TE's word): both operands transposed, pairs along
  the contiguous axis, each expert's columns padded to a multiple of 16 pairs
  (``relaymoe.kernels.fp8.columns``): every tile is a 16-byte-aligned K-major load, which Triton
  pipelines (``cp.async``, several stages).

The sum is promoted into fp32 every ``BLOCK_K`` pairs (TE's split accumulator for wgrad).
Blockwise weight gradients run in bf16 (``relaymoe.fp8_recipe``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from relaymoe.kernels import interpret_mode
from relaymoe.kernels.grouped.tiles import check_expert_span

__all__ = ["fp8_wgrad", "fp8_wgrad_columnwise"]


@triton.jit
def _expert_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(e, rm, rn)`` of this program: one (expert, M tile, N tile) a program, N tiles
    fastest."""
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    per_e = tl.cdiv(M, BLOCK_M) * n_tiles_n
    e = pid // per_e
    pid_m = (pid % per_e) // n_tiles_n
    pid_n = pid % n_tiles_n
    return e, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _store_tile(acc, sa_ptr, sb_ptr, c_ptr, e, rm, rn, m_ok, n_ok, stride_ce, stride_cm,
                stride_cn, ACCUMULATE: tl.constexpr):  # fmt: skip
    """The fp32 tile times both operands' inverse scales, added to (``ACCUMULATE``) or written
    over expert e's tile of c."""
    acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    mask = m_ok[:, None] & n_ok[None, :]
    cp = c_ptr + e.to(tl.int64) * stride_ce + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    if ACCUMULATE:
        acc += tl.load(cp, mask=mask, other=0.0).to(tl.float32)
    tl.store(cp, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_wgrad_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, idx_ptr, offs_ptr, c_ptr,
    M, N,
    stride_a, stride_b, stride_ce, stride_cm, stride_cn,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One (expert, M tile, N tile) program, N tiles fastest. Accumulating, an expert without
    pairs leaves its tile untouched; else it writes zeros."""
    e, rm, rn = _expert_tile(M, N, BLOCK_M, BLOCK_N)
    base = tl.load(offs_ptr)
    lo = tl.load(offs_ptr + e)
    hi = tl.load(offs_ptr + e + 1)
    if ACCUMULATE:
        if hi == lo:  # nothing to add: the tile is neither read nor written
            return
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for q0 in range(lo, hi, BLOCK_K):
        q = q0 + tl.arange(0, BLOCK_K)
        q_ok = q < hi
        local = tl.where(q_ok, q - base, 0).to(tl.int64)
        tok = tl.load(idx_ptr + q, mask=q_ok, other=0).to(tl.int64)
        a_rows = tok if A_GATHER else local
        b_rows = tok if B_GATHER else local
        at = tl.load(a_ptr + a_rows[:, None] * stride_a + rm[None, :],
                     mask=q_ok[:, None] & m_ok[None, :], other=0.0)  # fmt: skip
        bt = tl.load(b_ptr + b_rows[:, None] * stride_b + rn[None, :],
                     mask=q_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(tl.trans(at), bt, acc, max_num_imprecise_acc=BLOCK_K)
    _store_tile(acc, sa_ptr, sb_ptr, c_ptr, e, rm, rn, m_ok, n_ok, stride_ce, stride_cm,
                stride_cn, ACCUMULATE)  # fmt: skip


def fp8_wgrad(a, a_inv, b, b_inv, idx_P, offs, c_EMN, *, a_gather: bool, accumulate: bool):
    """c[e] (+)= sum over e's pairs q of dequant(a[row])^T dequant(b[row]): the gathered operand
    (``a`` with ``a_gather``, else ``b``) read at row ``idx_P[q]``, the other at ``q - offs[0]``;
    ``a_inv``/``b_inv`` one-element fp32 tensors; ``c_EMN`` any float dtype and strides."""
    n_experts, m, n = c_EMN.shape
    if n_experts == 0 or m == 0 or n == 0:
        return
    check_expert_span(c_EMN, "the weight gradient", "fp8_wgrad")
    if interpret_mode():
        meta = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16}
    else:  # 128-pair steps: one promotion per 128 products, as the other fp8 GEMMs
        meta = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}

    def grid(meta_):
        return (n_experts * triton.cdiv(m, meta_["BLOCK_M"]) * triton.cdiv(n, meta_["BLOCK_N"]),)

    _fp8_wgrad_kernel[grid(meta)](
        a, b, a_inv, b_inv, idx_P, offs, c_EMN,
        m, n,
        a.stride(0), b.stride(0), c_EMN.stride(0), c_EMN.stride(1), c_EMN.stride(2),
        A_GATHER=a_gather, B_GATHER=not a_gather, ACCUMULATE=accumulate, **meta,
    )  # fmt: skip


@triton.jit
def _fp8_wgrad_cols_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, poffs_ptr, c_ptr,
    M, N,
    stride_a, stride_b, stride_ce, stride_cm, stride_cn,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One (expert, M tile, N tile) program, N tiles fastest, over K-major operands: ``a (M, W)``
    and ``b (N, W)`` with expert e's pairs in columns ``[poffs[e], poffs[e+1])`` (multiples of
    16, zero past the pairs). Accumulating, an expert without pairs leaves its tile untouched;
    else it writes zeros."""
    e, rm, rn = _expert_tile(M, N, BLOCK_M, BLOCK_N)
    lo = tl.multiple_of(tl.load(poffs_ptr + e).to(tl.int32), 16)
    hi = tl.multiple_of(tl.load(poffs_ptr + e + 1).to(tl.int32), 16)
    if ACCUMULATE:
        if hi == lo:  # nothing to add: the tile is neither read nor written
            return
    m_ok = rm < M  # masks, not clamps: the loads stay contiguous along the pairs
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_a
    b_rows = b_ptr + rn.to(tl.int64)[:, None] * stride_b
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k = tl.multiple_of(k0, 16) + rk
        k_ok = (k < hi)[None, :]
        at = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
        bt = tl.load(b_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
        acc = tl.dot(at, tl.trans(bt), acc, max_num_imprecise_acc=BLOCK_K)
    _store_tile(acc, sa_ptr, sb_ptr, c_ptr, e, rm, rn, m_ok, n_ok, stride_ce, stride_cm,
                stride_cn, ACCUMULATE)  # fmt: skip


def fp8_wgrad_columnwise(a_MW, a_inv, b_NW, b_inv, poffs, c_EMN, *, accumulate: bool):
    """c[e] (+)= dequant(a[:, cols_e]) @ dequant(b[:, cols_e])^T over K-major fp8 operands
    (``relaymoe.kernels.fp8.columns``): ``a_MW (M, W)`` and ``b_NW (N, W)`` with unit column
    stride, expert e's pairs in columns ``[poffs[e], poffs[e+1])`` (int64 on the device,
    multiples of 16, the columns past an expert's pairs zero); ``a_inv``/``b_inv`` one-element
    fp32 tensors; ``c_EMN`` any float dtype and strides. With ``accumulate`` an expert without
    pairs leaves ``c`` untouched; without it its gradient is written as zeros."""
    n_experts, m, n = c_EMN.shape
    if n_experts == 0 or m == 0 or n == 0:
        return
    check_expert_span(c_EMN, "the weight gradient", "fp8_wgrad_columnwise")
    for name, t, rows in (("a", a_MW, m), ("b", b_NW, n)):
        if t.shape[0] != rows or t.stride(1) != 1 or t.shape[1] % 16 or t.stride(0) % 16:
            raise ValueError(
                f"fp8_wgrad_columnwise: {name} has shape {tuple(t.shape)} and strides "
                f"{tuple(t.stride())}; it needs {rows} rows, unit column stride and its width "
                "and row stride multiples of 16 (build it with relaymoe.kernels.fp8.columns)"
            )
    if interpret_mode():
        meta = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16}
    else:  # 128-pair steps: one promotion per 128 products, as the other fp8 GEMMs
        meta = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4}
    grid = (n_experts * triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
    _fp8_wgrad_cols_kernel[grid](
        a_MW, b_NW, a_inv, b_inv, poffs, c_EMN,
        m, n,
        a_MW.stride(0), b_NW.stride(0), c_EMN.stride(0), c_EMN.stride(1), c_EMN.stride(2),
        ACCUMULATE=accumulate, **meta,
    )  # fmt: skip
