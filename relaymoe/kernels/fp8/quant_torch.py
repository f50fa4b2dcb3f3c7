"""The fp8 quantisers in plain torch: the weights' quantiser, and the reference the Triton
quantisers match bit for bit (tests).

Scale convention (TE's): a scale ``s`` multiplies before the cast, ``q = fp8(clamp(x * s))``,
and the GEMMs dequantise with ``inv = 1 / s`` (``x ~ q * inv``). ``s = fmax / amax`` in fp32
(divided by ``2**margin``); ``amax == 0`` gives ``s = 1``, an overflow to inf gives the largest
fp32, and ``pow2`` rounds ``s`` down to a power of two (the mantissa bits zeroed), so that
scaling and unscaling are exact. The cast rounds to nearest even after the clamp to
``[-fmax, fmax]`` (saturating: no inf, no NaN from a finite input).

Blocks: ``rows`` scales each 128 consecutive values of a row (1x128; the last block of a row
may be short), ``blocks`` each 128x128 tile of the last two dimensions (weights).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relaymoe.fp8_recipe import BLOCK

__all__ = [
    "FP8_DTYPES",
    "FP8_MAX",
    "dequantize_blocks",
    "dequantize_rows",
    "fp8_dtype",
    "quantize_blocks",
    "quantize_rows",
    "quantize_with",
    "scale_from_amax",
]

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
_FLT_MAX = torch.finfo(torch.float32).max


def fp8_dtype(fmt: str) -> torch.dtype:
    return FP8_DTYPES[fmt]


def scale_from_amax(amax: Tensor, fmt: str, *, pow2: bool = False, margin: int = 0) -> Tensor:
    """``s`` (fp32, amax's shape) of values whose largest magnitude is ``amax`` (module
    docstring); on the device of ``amax``, no host sync."""
    amax = amax.float()
    s = torch.full_like(amax, FP8_MAX[fmt]) / amax
    if margin:
        s = s / 2.0**margin
    s = torch.where(torch.isinf(s), torch.full_like(s, _FLT_MAX), s)
    s = torch.where((amax == 0) | ~torch.isfinite(amax), torch.ones_like(s), s)
    if pow2:
        s = (s.view(torch.int32) & 0x7F800000).view(torch.float32)
    return s


def quantize_with(t: Tensor, s: Tensor, fmt: str) -> Tensor:
    """``fp8(clamp(t * s))`` in ``fmt``; ``s`` broadcasts against ``t`` (fp32)."""
    fmax = FP8_MAX[fmt]
    return (t.float() * s).clamp_(-fmax, fmax).to(FP8_DTYPES[fmt])


def _pad_last(t: Tensor, to: int) -> Tensor:
    extra = -t.shape[-1] % to
    return t if extra == 0 else torch.nn.functional.pad(t, (0, extra))


def quantize_rows(t_RC: Tensor, fmt: str, *, pow2: bool = True) -> tuple[Tensor, Tensor]:
    """``(q (R, C), inv (R, ceil(C/128)))``: each row's 128-wide blocks scaled by their own
    amax (the activations' 1x128 tiles of the blockwise recipe)."""
    rows, cols = t_RC.shape
    padded = _pad_last(t_RC.float(), BLOCK).reshape(rows, -1, BLOCK)
    s = scale_from_amax(padded.abs().amax(-1), fmt, pow2=pow2)  # (R, nb)
    q = quantize_with(padded, s[..., None], fmt).reshape(rows, -1)[:, :cols]
    return q.contiguous(), 1.0 / s


def dequantize_rows(q_RC: Tensor, inv_RB: Tensor) -> Tensor:
    """fp32 values of a :func:`quantize_rows` result."""
    cols = q_RC.shape[1]
    return (q_RC.float() * inv_RB.repeat_interleave(BLOCK, dim=1)[:, :cols]).contiguous()


def quantize_blocks(w: Tensor, fmt: str, *, pow2: bool = True) -> tuple[Tensor, Tensor]:
    """``(q, inv (..., ceil(M/128), ceil(N/128)))`` of ``w (..., M, N)``: each 128x128 tile of
    the last two dimensions scaled by its own amax (the blockwise recipe's weights)."""
    *lead, m, n = w.shape
    bm, bn = -(-m // BLOCK), -(-n // BLOCK)
    padded = torch.zeros(*lead, bm * BLOCK, bn * BLOCK, dtype=torch.float32, device=w.device)
    padded[..., :m, :n] = w
    tiles = padded.reshape(*lead, bm, BLOCK, bn, BLOCK)
    s = scale_from_amax(tiles.abs().amax(dim=(-3, -1)), fmt, pow2=pow2)  # (..., bm, bn)
    q = quantize_with(tiles, s[..., :, None, :, None], fmt)
    q = q.reshape(*lead, bm * BLOCK, bn * BLOCK)[..., :m, :n]
    return q.contiguous(), 1.0 / s


def dequantize_blocks(q: Tensor, inv: Tensor) -> Tensor:
    """fp32 values of a :func:`quantize_blocks` result."""
    m, n = q.shape[-2:]
    full = inv.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return q.float() * full[..., :m, :n]
