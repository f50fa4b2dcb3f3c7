"""fp8 quantisation in Triton: the ``@triton.jit`` helpers every fp8 kernel's epilogue uses, and
the row quantiser (x and dy once over (T, H); the tensor-scaled intermediates once over their
pair rows).

The helpers compute what ``quant_torch`` computes, bit for bit: ``s = fmax / amax`` (IEEE
division, ``div_rn``), 1 for a zero amax, the largest fp32 for an overflow, powers of two by
zeroing the mantissa; ``q = fp8(clamp(x * s, -fmax, fmax))`` rounded to nearest even. On a GPU
the cast is the hardware's ``cvt.rn.satfinite`` (nearest even). Triton's CPU interpreter casts
by truncation with a carry that can lose the exponent's increment, so under the interpreter
(``EXACT``) the value is first rounded in fp32 to the nearest even fp8 value, which the cast
then keeps exactly: the same numbers on both, and the CPU tests compare them with torch's cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from relaymoe.fp8_recipe import BLOCK
from relaymoe.kernels import interpret_mode
from relaymoe.kernels.fp8.quant_torch import FP8_DTYPES

__all__ = [
    "block_scale",
    "quantize_row_blocks",
    "quantize_rows",
    "quantize_rows_into",
    "quantize_rows_kernel",
    "to_fp8",
]

_FLT_MAX = tl.constexpr(3.4028234663852886e38)  # the largest fp32


@triton.jit
def _fmt_consts(FMT: tl.constexpr):
    """(fmax, mantissa bits, least normal exponent) of an fp8 format."""
    if FMT == "e4m3":
        return 448.0, 3, -6
    return 57344.0, 2, -14


@triton.jit
def _round_even(v, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """``v`` (fp32, within the format's range) rounded to the nearest even value of a format of
    ``MANT`` mantissa bits whose normal exponents start at ``MIN_EXP`` (subnormals below it):
    scaled by its ulp (a power of two: exact), rounded to an integer by the 1.5 * 2^23 addition
    (|v / ulp| < 2^(MANT+1)), scaled back, with v's sign (a negative value that rounds to zero
    is -0, as the hardware's cast gives)."""
    bits = v.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exp, MIN_EXP) - MANT
    ulp = ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23
    r = (((v * inv_ulp + magic) - magic) * ulp).to(tl.int32, bitcast=True)
    return ((r & 0x7FFFFFFF) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def to_fp8(v, dtype: tl.constexpr, FMT: tl.constexpr, EXACT: tl.constexpr):
    """``fp8(clamp(v))`` of an fp32 tensor already multiplied by its scale."""
    fmax, mant, min_exp = _fmt_consts(FMT)
    v = tl.minimum(tl.maximum(v, -fmax), fmax)
    if EXACT:
        v = _round_even(v, mant, min_exp)
    return v.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def block_scale(amax, FMT: tl.constexpr, POW2: tl.constexpr):
    """``s`` of blocks whose largest magnitudes are ``amax`` (fp32, any shape)."""
    fmax, _, _ = _fmt_consts(FMT)
    s = tl.math.div_rn(tl.zeros_like(amax) + fmax, tl.where(amax == 0.0, 1.0, amax))
    s = tl.where(s > _FLT_MAX, _FLT_MAX, s)
    s = tl.where(amax == 0.0, 1.0, s)
    if POW2:
        s = (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return s


@triton.jit
def quantize_row_blocks(v, dtype: tl.constexpr, FMT: tl.constexpr, POW2: tl.constexpr,
                        EXACT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):  # fmt: skip
    """``(q (ROWS, COLS), inv (ROWS, COLS // 128))``: each row's 128-wide blocks of the fp32
    tile ``v`` (``COLS`` a multiple of 128; masked entries 0) quantised by their own scale."""
    NB: tl.constexpr = COLS // 128
    vb = tl.reshape(v, (ROWS, NB, 128))
    s = block_scale(tl.max(tl.abs(vb), axis=2), FMT, POW2)
    q = tl.reshape(to_fp8(vb * s[:, :, None], dtype, FMT, EXACT), (ROWS, COLS))
    return q, tl.math.div_rn(tl.zeros_like(s) + 1.0, s)


@triton.jit
def quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, inv_ptr,
    R, C, rows_per_s,
    stride_x, stride_q, stride_inv, stride_sr, stride_sc,
    BLOCKWISE: tl.constexpr, FMT: tl.constexpr, POW2: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """q = fp8(x * s): ``s`` given, element (r, c) scaled by ``s_ptr[(r // rows_per_s) *
    stride_sr + (c // 128) * stride_sc]`` (one value: strides 0; one an expert of a weight's
    rows; one a 128x128 block), or with ``BLOCKWISE`` each row's 128-wide blocks' own
    (``BLOCK_C`` a multiple of 128), their ``1 / s`` into ``inv``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if BLOCKWISE:
        q, inv = quantize_row_blocks(x, q_ptr.dtype.element_ty, FMT, POW2, EXACT, BLOCK_R,
                                     BLOCK_C)  # fmt: skip
        bcols = tl.program_id(1) * (BLOCK_C // 128) + tl.arange(0, BLOCK_C // 128)
        inv_mask = row_ok[:, None] & (bcols < tl.cdiv(C, 128))[None, :]
        tl.store(inv_ptr + r64[:, None] * stride_inv + bcols[None, :], inv, mask=inv_mask)
    else:
        s_idx = (rows // rows_per_s).to(tl.int64)[:, None] * stride_sr + (cols // 128)[
            None, :] * stride_sc  # fmt: skip
        s = tl.load(s_ptr + s_idx, mask=mask, other=1.0)
        q = to_fp8(x * s, q_ptr.dtype.element_ty, FMT, EXACT)
    tl.store(q_ptr + r64[:, None] * stride_q + cols[None, :], q, mask=mask)


def quantize_rows_into(x_RC, q_RC, fmt: str, *, scale=None, inv_RB=None, pow2: bool = True,
                       rows_per_scale: int = 1, scale_strides: tuple[int, int] = (0, 0)):  # fmt: skip
    """Quantise ``x_RC`` (unit column stride) into ``q_RC`` (fp8 of ``fmt``): with ``scale`` (fp32
    on the device) each value by its scale: one value (the defaults), or the scale of row
    ``r // rows_per_scale`` and column block ``c // 128`` through ``scale_strides`` (a weight's
    experts or 128x128 blocks); else each row's 1x128 blocks by their own scale, whose inverses
    go into ``inv_RB`` (R, ceil(C/128)) fp32."""
    rows, cols = x_RC.shape
    if rows == 0 or cols == 0:
        return
    if q_RC.dtype != FP8_DTYPES[fmt]:
        raise ValueError(f"quantize_rows_into: q is {q_RC.dtype}, {fmt} needs {FP8_DTYPES[fmt]}")
    blockwise = scale is None
    if blockwise and inv_RB is None:
        raise ValueError("quantize_rows_into: blockwise quantisation needs inv_RB")
    interp = interpret_mode()
    block_r = 64 if interp else 32  # the interpreter: fewer, larger programs
    block_c = BLOCK if interp else 4 * BLOCK
    if not blockwise and not interp:
        block_c = min(block_c, max(BLOCK, triton.next_power_of_2(cols)))
    dummy = q_RC  # an unused pointer
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
    quantize_rows_kernel[grid](
        x_RC, q_RC, scale if scale is not None else dummy, inv_RB if inv_RB is not None else dummy,
        rows, cols, rows_per_scale,
        x_RC.stride(0), q_RC.stride(0), inv_RB.stride(0) if inv_RB is not None else 0,
        *scale_strides,
        BLOCKWISE=blockwise, FMT=fmt, POW2=pow2, EXACT=interp,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip


def quantize_rows(x_RC, fmt: str, *, scale=None, pow2: bool = True):
    """``(q, inv)`` of :func:`quantize_rows_into` in new buffers (``inv`` None with ``scale``)."""
    rows, cols = x_RC.shape
    q = torch.empty(rows, cols, dtype=FP8_DTYPES[fmt], device=x_RC.device)
    inv = None
    if scale is None:
        inv = torch.empty(rows, triton.cdiv(cols, BLOCK), dtype=torch.float32, device=x_RC.device)
    quantize_rows_into(x_RC, q, fmt, scale=scale, inv_RB=inv, pow2=pow2)
    return q, inv
