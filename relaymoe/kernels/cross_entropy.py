"""Triton row kernels of the chunked linear + cross-entropy (``relaymoe.loss``).

Shape legend: C rows of one chunk (tokens), Vl vocabulary columns on this rank.

The torch path of one chunk makes about eight passes over a ``(C, Vl)`` fp32 copy of the logits.
These two kernels replace them with one read, then one read and one in-place write, of the logits
in their own dtype; between the two, the caller combines the per-row statistics across the
tensor-parallel group (max, then the rescaled sum and the target logit).

1. ``row_stats``: per row, an online max / sum-exp over the row in ``BLOCK_V`` tiles (every lane
   keeps its own running pair, merged once at the end: no reduction inside the loop), the target
   logit when the target column lies on this rank, and optionally the row sum (label smoothing).
2. ``row_grad``: per row, ``scale * (exp(z - lse) - smooth - target_weight * onehot)`` in the
   logits' dtype, written over the logits (or into another buffer).

One program per row, the columns walked in a fixed order: no atomics, bitwise deterministic.
Statistics are computed in fp32 (fp64 for fp64 logits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["row_stats", "row_grad"]

_MAX_BLOCK_V = 4096
# A finite "minus infinity" for the running max: masked lanes load -inf, and exp(-inf - (-inf))
# would be NaN, while exp(-inf - _NEG_BIG) and exp(_NEG_BIG - x) are exactly 0.
_NEG_BIG = -3.0e38


def _block_v(vocab_local: int) -> int:
    return min(_MAX_BLOCK_V, triton.next_power_of_2(max(vocab_local, 16)))


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


@triton.jit
def _row_stats_kernel(
    logits_ptr,  # (C, Vl) any float dtype, rows ``stride_row`` apart
    tgt_ptr,  # (C,) int64: the target's local column, or -1 when it is not on this rank
    max_ptr,  # (C,) ACC out: row max
    sumexp_ptr,  # (C,) ACC out: sum(exp(z - row max))
    target_ptr,  # (C,) ACC out: z[target] (0 when the target is not on this rank)
    rowsum_ptr,  # (C,) ACC out: sum(z), written only when WANT_SUM
    stride_row,
    vocab_local,
    NEG_BIG: tl.constexpr,
    ACC: tl.constexpr,
    WANT_SUM: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    m_vec = tl.full([BLOCK_V], NEG_BIG, ACC)
    s_vec = tl.zeros([BLOCK_V], ACC)
    z_vec = tl.zeros([BLOCK_V], ACC)
    for v0 in range(0, vocab_local, BLOCK_V):
        offs = v0 + cols
        inside = offs < vocab_local
        z = tl.load(base + offs, mask=inside, other=-float("inf")).to(ACC)
        m_new = tl.maximum(m_vec, z)
        s_vec = s_vec * tl.exp(m_vec - m_new) + tl.exp(z - m_new)
        m_vec = m_new
        if WANT_SUM:
            z_vec += tl.where(inside, z, 0.0)
    m = tl.max(m_vec, 0)
    s = tl.sum(s_vec * tl.exp(m_vec - m), 0)
    tgt = tl.load(tgt_ptr + row)
    has = tgt >= 0
    zt = tl.load(base + tl.where(has, tgt, 0), mask=has, other=0.0).to(ACC)
    tl.store(max_ptr + row, m)
    tl.store(sumexp_ptr + row, s)
    tl.store(target_ptr + row, zt)
    if WANT_SUM:
        tl.store(rowsum_ptr + row, tl.sum(z_vec, 0))


@triton.jit
def _row_grad_kernel(
    logits_ptr,  # (C, Vl) read
    grad_ptr,  # (C, Vl) written (may be logits_ptr itself: each element is read before written)
    tgt_ptr,  # (C,) int64 local target column or -1
    lse_ptr,  # (C,) ACC: the global log-sum-exp of the row
    scale_ptr,  # (C,) ACC: the row's weight (0 for ignored tokens)
    consts_ptr,  # (2,) ACC: [smooth, target_weight] (a tensor: scalars would travel as fp32)
    stride_in,
    stride_out,
    vocab_local,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    src = logits_ptr + row * stride_in
    dst = grad_ptr + row * stride_out
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)
    tgt = tl.load(tgt_ptr + row)
    smooth = tl.load(consts_ptr)  # subtracted from every probability: smoothing / Vl
    target_weight = tl.load(consts_ptr + 1)  # subtracted at the target column: 1 - smoothing
    for v0 in range(0, vocab_local, BLOCK_V):
        offs = v0 + cols
        inside = offs < vocab_local
        z = tl.load(src + offs, mask=inside, other=0.0).to(ACC)
        d = tl.exp(z - lse) - smooth - tl.where(offs == tgt, target_weight, 0.0)
        tl.store(dst + offs, (d * scale).to(grad_ptr.dtype.element_ty), mask=inside)


def _check_rows(logits_CV: Tensor, *vectors: Tensor) -> None:
    if logits_CV.dim() != 2 or logits_CV.stride(1) != 1:
        raise ValueError(
            f"logits must be a (C, Vl) tensor with unit column stride, got shape "
            f"{tuple(logits_CV.shape)} strides {logits_CV.stride()}; pass a row-major buffer"
        )
    for v in vectors:
        if v.shape != (logits_CV.shape[0],) or not v.is_contiguous():
            raise ValueError(
                f"per-row vectors must be contiguous of shape ({logits_CV.shape[0]},), got "
                f"{tuple(v.shape)}"
            )


def row_stats(
    logits_CV: Tensor, tgt_C: Tensor, *, want_sum: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Per-row ``(max_C, sumexp_C, target_C, rowsum_C | None)`` of ``logits_CV`` in fp32 (fp64
    for fp64 logits): ``sumexp = sum(exp(z - max))``, ``target = z[tgt]`` (0 where ``tgt < 0``),
    ``rowsum = sum(z)`` when ``want_sum``."""
    _check_rows(logits_CV, tgt_C)
    rows, vocab_local = logits_CV.shape
    acc = torch.float64 if logits_CV.dtype == torch.float64 else torch.float32
    out = torch.empty(4 if want_sum else 3, rows, dtype=acc, device=logits_CV.device)
    if rows:
        _row_stats_kernel[(rows,)](
            logits_CV, tgt_C, out[0], out[1], out[2], out[3] if want_sum else out[2],
            logits_CV.stride(0), vocab_local,
            NEG_BIG=_NEG_BIG, ACC=_acc(logits_CV.dtype), WANT_SUM=want_sum,
            BLOCK_V=_block_v(vocab_local), num_warps=8,
        )  # fmt: skip
    return out[0], out[1], out[2], (out[3] if want_sum else None)


def row_grad(
    logits_CV: Tensor,
    tgt_C: Tensor,
    lse_C: Tensor,
    scale_C: Tensor,
    *,
    smooth: float,
    target_weight: float,
    out_CV: Tensor | None = None,
) -> Tensor:
    """``out[c, v] = scale[c] * (exp(z[c, v] - lse[c]) - smooth - target_weight * [v == tgt[c]])``
    in ``out_CV``'s dtype (default: written over ``logits_CV``, which is then returned).
    ``lse_C`` and ``scale_C`` are fp32 (fp64 for fp64 logits)."""
    out_CV = logits_CV if out_CV is None else out_CV
    _check_rows(logits_CV, tgt_C, lse_C, scale_C)
    _check_rows(out_CV)
    if out_CV.shape != logits_CV.shape:
        raise ValueError(f"out shape {tuple(out_CV.shape)} != logits {tuple(logits_CV.shape)}")
    rows, vocab_local = logits_CV.shape
    if rows:
        # filled on the device: torch.tensor([...], device="cuda") would copy and sync the host
        consts = torch.full((2,), smooth, dtype=lse_C.dtype, device=lse_C.device)
        consts[1].fill_(target_weight)
        _row_grad_kernel[(rows,)](
            logits_CV, out_CV, tgt_C, lse_C, scale_C, consts,
            logits_CV.stride(0), out_CV.stride(0), vocab_local,
            ACC=_acc(logits_CV.dtype), BLOCK_V=_block_v(vocab_local), num_warps=8,
        )  # fmt: skip
    return out_CV
