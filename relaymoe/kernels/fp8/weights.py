"""The fp8 copies of a range's expert weights, in both layouts the GEMMs read.

Hopper's fp8 tensor cores read both operands K-major (contiguous along the contraction). The
forward contracts over H (fc1: ``x w13[e]^T``) and I (fc2: ``a w2[e]^T``), which the weights'
own layouts (E, J, H) and (E, H, I) are; the backward's dgrad contracts over J (``dh w13[e]``)
and H (``dy w2[e]``), which their transposes are. So each weight is quantised once into both
(TE keeps the same two copies), fp8 either way: the two together hold the bytes of the bf16
weight. Scales: one per expert (tensor-scaled recipes) or one per 128x128 block (blockwise),
from the weight's own amax, shared by both layouts (a 128x128 block is the same block
transposed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relaymoe.fp8_recipe import BLOCK, Fp8Recipe
from relaymoe.kernels.fp8.quant_torch import (
    fp8_dtype,
    quantize_blocks,
    quantize_with,
    scale_from_amax,
)

__all__ = ["Fp8ExpertWeights", "quantize_expert_weights"]


@dataclass(frozen=True, eq=False)
class Fp8ExpertWeights:
    """fp8 experts ``[e0, e1)`` in e4m3: ``w13 (El, J, H)``, ``w13_t (El, H, J)``, ``w2 (El, H,
    I)``, ``w2_t (El, I, H)``, and the inverse scales ``inv13``/``inv2``: (El,) per expert, or
    (El, ceil(J/128), ceil(H/128)) / (El, ceil(H/128), ceil(I/128)) per block of the
    untransposed layout. ``dtype``: the bf16/fp16/fp32 weights' dtype (their gradients')."""

    w13: Tensor
    w13_t: Tensor
    inv13: Tensor
    w2: Tensor
    w2_t: Tensor
    inv2: Tensor
    blockwise: bool
    dtype: torch.dtype

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


def _quantize_one(w: Tensor, recipe: Fp8Recipe) -> tuple[Tensor, Tensor, Tensor]:
    """(q, q transposed, inv) of one (El, M, N) weight in e4m3: the amax in one pass
    (``vector_norm``, no temporary), then one Triton pass that scales and casts (where Triton
    runs and, blockwise, M and N are multiples of 128), else ``quant_torch``'s quantisers (the
    same values, with fp32 temporaries of the weight's size)."""
    n_experts, m, n = w.shape
    with torch.no_grad():
        if recipe.blockwise:
            if not (_triton_runs(w) and m % BLOCK == 0 and n % BLOCK == 0 and w.numel()):
                q, inv = quantize_blocks(w, "e4m3", pow2=recipe.power_2_scales)
                return q, q.transpose(1, 2).contiguous(), inv
            tiles = w.reshape(n_experts, m // BLOCK, BLOCK, n // BLOCK, BLOCK)
            amax = torch.linalg.vector_norm(tiles, float("inf"), dim=(2, 4))
            s = scale_from_amax(amax, "e4m3", pow2=recipe.power_2_scales)
            rows_per_scale, strides = BLOCK, (n // BLOCK, 1)
        else:
            amax = torch.linalg.vector_norm(w.reshape(n_experts, -1), float("inf"), dim=1) if (
                w.numel()) else w.new_zeros(n_experts)  # fmt: skip
            s = scale_from_amax(amax, "e4m3")
            rows_per_scale, strides = max(1, m), (1, 0)
        if _triton_runs(w) and w.numel():
            from relaymoe.kernels.fp8.quantize import quantize_rows_into

            q = torch.empty(w.shape, dtype=fp8_dtype("e4m3"), device=w.device)
            quantize_rows_into(w.reshape(-1, n), q.view(-1, n), "e4m3", scale=s.contiguous(),
                               rows_per_scale=rows_per_scale, scale_strides=strides)  # fmt: skip
        else:
            q = quantize_with(w, s[:, None, None], "e4m3")
        return q, q.transpose(1, 2).contiguous(), 1.0 / s


def _triton_runs(w: Tensor) -> bool:
    from relaymoe.kernels import interpret_mode, triton_available

    return triton_available() and (w.is_cuda or (w.device.type == "cpu" and interpret_mode()))


def quantize_expert_weights(w13: Tensor, w2: Tensor, recipe: Fp8Recipe) -> Fp8ExpertWeights:
    """Both weights of a range quantised for ``recipe`` (weights are always e4m3: TE's
    ``hybrid`` keeps e5m2 for gradients)."""
    q13, q13_t, inv13 = _quantize_one(w13, recipe)
    q2, q2_t, inv2 = _quantize_one(w2, recipe)
    return Fp8ExpertWeights(q13, q13_t, inv13, q2, q2_t, inv2, recipe.blockwise, w13.dtype)
