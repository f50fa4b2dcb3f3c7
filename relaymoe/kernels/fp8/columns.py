"""The K-major ("columnwise", TE's word) operands of the tensor-scaled fp8 weight gradients:
x, dy, dh and p*a transposed, pairs along the contiguous axis.

Layout (:class:`ColumnLayout`): a (C, W) fp8 tensor whose column block ``[poffs[e],
poffs[e+1])`` holds expert e's pairs in the routing index's order, each block padded with
zero columns to a multiple of 16 pairs, so that every K tile of the weight-gradient GEMM starts
16-byte aligned (``wgrad.fp8_wgrad_columnwise``); the columns past ``poffs[-1]`` are zero too.
The padded offsets are computed on the device from the range's offsets (no host sync); the
width ``W`` is their static bound, ``n_pairs + 16 * n_experts`` rounded up to 16.

One kernel (:func:`write_columns`) walks the destination columns: each column reads its pair's
row (through the routing index for x and dy, in pair order for dh and p*a) and writes it
transposed, either the fp8 bytes as they are (x and dy, already quantised once over (T, H):
the same bytes, no requantisation) or quantised with the tensor's one scale (dh, p*a, with
``quantize.to_fp8``: the row quantiser's values bit for bit). dh's row-major fp8 copy (the
dgrad's operand) is written from the same read (``rows_out``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from relaymoe.kernels import interpret_mode
from relaymoe.kernels.fp8.quant_torch import FP8_DTYPES
from relaymoe.kernels.fp8.quantize import to_fp8

__all__ = ["ALIGN", "ColumnLayout", "column_layout", "write_columns"]

ALIGN = 16  # pairs: one 16-byte fp8 vector, and a multiple of the wgmma's K granularity


@dataclass(frozen=True, eq=False)
class ColumnLayout:
    """A range's padded column layout: ``poffs`` (El+1,) int64, expert e's columns
    ``[poffs[e], poffs[e+1])``; ``src`` (W,) int32, the pair (counted from the range's first)
    each column holds, -1 for a padding column; ``width`` W (a multiple of 16)."""

    poffs: torch.Tensor
    src: torch.Tensor
    width: int


def column_layout(offs: torch.Tensor, n_pairs: int) -> ColumnLayout:
    """The padded layout of a range whose expert e holds pairs ``[offs[e], offs[e+1])``
    (``offs`` (El+1,) on the device, ``offs[-1] - offs[0] <= n_pairs``), computed on the device."""
    n_experts = offs.shape[0] - 1
    dev = offs.device
    width = triton.cdiv(n_pairs + ALIGN * n_experts, ALIGN) * ALIGN
    counts = (offs[1:] - offs[:-1]).long()
    poffs = torch.zeros(n_experts + 1, dtype=torch.int64, device=dev)
    torch.cumsum((counts + ALIGN - 1) // ALIGN * ALIGN, 0, out=poffs[1:])
    col = torch.arange(width, dtype=torch.int64, device=dev)
    e = (torch.searchsorted(poffs, col, right=True) - 1).clamp_(0, max(n_experts - 1, 0))
    within = col - poffs[e]
    if n_experts == 0:
        return ColumnLayout(poffs, torch.full((width,), -1, dtype=torch.int32, device=dev), width)
    valid = (col < poffs[-1]) & (within < counts[e])
    src = torch.where(valid, offs[e].long() - offs[0].long() + within, -1).to(torch.int32)
    return ColumnLayout(poffs, src, width)


@triton.jit
def _columns_kernel(
    x_ptr, s_ptr, src_ptr, idx_ptr, offs_ptr, out_ptr, rows_ptr,
    C, W,
    stride_x, stride_out, stride_rows,
    GATHER: tl.constexpr, QUANT: tl.constexpr, ROWS: tl.constexpr, FMT: tl.constexpr,
    EXACT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """out[c, j] = q(x[row(j), c]) for a (BLOCK_P columns, BLOCK_C features) tile: ``row(j)``
    is column j's pair (``src``), through ``idx[offs[0] + pair]`` with ``GATHER``; 0 where j is
    padding. ``QUANT``: q = fp8(x * s), else the bytes as they are. ``ROWS``: q also into
    ``rows[pair, c]`` (row-major)."""
    j = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j_ok = j < W
    c_ok = c < C
    src = tl.load(src_ptr + j, mask=j_ok, other=-1)
    valid = src >= 0
    pair = tl.where(valid, src, 0).to(tl.int64)
    if GATHER:
        row = tl.load(idx_ptr + tl.load(offs_ptr) + pair, mask=valid, other=0).to(tl.int64)
    else:
        row = pair
    mask = valid[:, None] & c_ok[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
    if QUANT:
        q = to_fp8(x.to(tl.float32) * tl.load(s_ptr), out_ptr.dtype.element_ty, FMT, EXACT)
    else:
        q = x
    tl.store(out_ptr + c[:, None].to(tl.int64) * stride_out + j[None, :], tl.trans(q),
             mask=c_ok[:, None] & j_ok[None, :])  # fmt: skip
    if ROWS:
        tl.store(rows_ptr + pair[:, None] * stride_rows + c[None, :], q, mask=mask)


def write_columns(x_RC: torch.Tensor, layout: ColumnLayout, out_CW: torch.Tensor, *,
                  idx_P: torch.Tensor | None = None, offs: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None, fmt: str | None = None,
                  rows_out: torch.Tensor | None = None) -> None:  # fmt: skip
    """Fill ``out_CW`` (C, W) fp8 with ``x_RC``'s pair rows transposed in ``layout``.

    ``idx_P`` and ``offs``: gather column j's row as ``idx_P[offs[0] + pair]`` (x and dy),
    else row ``pair`` (dh, p*a in pair order). ``scale`` (one fp32 on the device) and ``fmt``:
    quantise ``x_RC`` (any float dtype) as ``quantize.quantize_rows_into`` with that scale
    does; without, ``x_RC`` is fp8 of ``out_CW``'s dtype and its bytes are copied. ``rows_out``
    (P, C) fp8: the quantised rows also row-major, from the same read. Unit column strides."""
    rows, cols = x_RC.shape
    if cols == 0 or layout.width == 0:
        return
    if out_CW.shape != (cols, layout.width) or out_CW.stride(1) != 1:
        raise ValueError(f"write_columns: out has shape {tuple(out_CW.shape)}, strides "
                         f"{tuple(out_CW.stride())}; expected ({cols}, {layout.width}), unit "
                         "column stride")  # fmt: skip
    quant = scale is not None
    if quant and (fmt is None or out_CW.dtype != FP8_DTYPES[fmt]):
        raise ValueError(f"write_columns: out is {out_CW.dtype}; fmt={fmt!r} needs "
                         f"{FP8_DTYPES.get(fmt)}")  # fmt: skip
    if not quant and x_RC.dtype != out_CW.dtype:
        raise ValueError(f"write_columns: copying {x_RC.dtype} bytes into {out_CW.dtype}; pass "
                         "scale and fmt to quantise")  # fmt: skip
    if rows_out is not None and (not quant or rows_out.dtype != out_CW.dtype):
        raise ValueError("write_columns: rows_out is written with the quantised values: it needs "
                         "scale and fmt, and out's dtype")  # fmt: skip
    if (idx_P is None) != (offs is None):
        raise ValueError("write_columns: idx_P and offs go together (the gathered operands)")
    x, out, rows_t = x_RC, out_CW, rows_out
    if not quant:  # the fp8 bytes as they are
        x, out = x_RC.view(torch.uint8), out_CW.view(torch.uint8)
    interp = interpret_mode()
    block_p, block_c = (64, 64) if interp else (64, 128)
    grid = (triton.cdiv(layout.width, block_p), triton.cdiv(cols, block_c))
    dummy = layout.src
    _columns_kernel[grid](
        x, scale if quant else dummy, layout.src, idx_P if idx_P is not None else dummy,
        offs if offs is not None else dummy, out, rows_t if rows_t is not None else out,
        cols, layout.width,
        x.stride(0), out.stride(0), rows_t.stride(0) if rows_t is not None else 0,
        GATHER=idx_P is not None, QUANT=quant, ROWS=rows_t is not None, FMT=fmt or "e4m3",
        EXACT=interp, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
