"""The memory-bound SwiGLU passes: the backward (SiLU recomputed from h, dprob, dh, p*a) and the
forward of an h a GEMM made."""

from __future__ import annotations

import triton
import triton.language as tl

from relaymoe.kernels import interpret_mode
from relaymoe.kernels.grouped.tiles import _check_rows


@triton.jit
def _swiglu_bwd_kernel(
    h_ptr, g_ptr, prob_ptr, dh_ptr, dprob_ptr,
    n_pairs, I,
    stride_hp, stride_gp, stride_dhp,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Memory-bound pass over BLOCK_R pair rows, I in BLOCK_C column steps (SiLU recomputed from
    h): dprob = rowsum(g * a) with a = silu(gate) * up, exact per row (no partials); da = p * g;
    dh = [da * up * silu'(gate), da * silu(gate)]; g is overwritten with p * a (for dw2).

    ``dh_ptr`` may equal ``h_ptr``: each element is read, then written, by the same program.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_pairs
    r64 = rows.to(tl.int64)
    p = tl.load(prob_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    dprob = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, I, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < I)[None, :]
        hp = h_ptr + r64[:, None] * stride_hp + cols[None, :]
        gp = g_ptr + r64[:, None] * stride_gp + cols[None, :]
        gate = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(hp + I, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gp, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        act = silu * up
        dprob += tl.sum(g * act, axis=1)
        da = g * p
        dhp = dh_ptr + r64[:, None] * stride_dhp + cols[None, :]
        tl.store(dhp, (da * up * sig * (1.0 + gate * (1.0 - sig))).to(dh_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
        tl.store(dhp + I, (da * silu).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(gp, (act * p).to(g_ptr.dtype.element_ty), mask=mask)
    tl.store(dprob_ptr + rows, dprob, mask=row_ok)


@triton.jit
def _swiglu_fwd_kernel(
    h_ptr, prob_ptr, a_ptr,
    n_pairs, I,
    stride_hp, stride_ap,
    SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Memory-bound pass over BLOCK_R pair rows of h = [gate, up], I in BLOCK_C column steps."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_pairs
    r64 = rows.to(tl.int64)
    if SCALE:
        p = tl.load(prob_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    for c0 in range(0, I, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < I)[None, :]
        hp = h_ptr + r64[:, None] * stride_hp + cols[None, :]
        gate = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(hp + I, mask=mask, other=0.0).to(tl.float32)
        act = gate * tl.sigmoid(gate) * up
        if SCALE:
            act = act * p
        tl.store(a_ptr + r64[:, None] * stride_ap + cols[None, :], act.to(a_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip


def swiglu_backward(h_P2I, g_PI, prob_P, dh_P2I, dprob_P, *, block_rows=None, block_cols=None):
    """See ``_swiglu_bwd_kernel``: reads h and g = dy[tok] @ w2[e] (unscaled), writes dh (may be
    ``h_P2I`` itself), dprob_P (fp32, every row) and overwrites g with p * a."""
    n_pairs, ffn = g_PI.shape
    if n_pairs == 0:
        return
    _check_rows(n_pairs, "swiglu_backward")  # row ids are int32 in the kernel
    if ffn == 0:
        dprob_P.zero_()
        return
    if interpret_mode():
        br, bc, warps = block_rows or 16, block_cols or 16, 4
    else:  # 16 x 256: 32 elements per thread per tile at 4 warps, I=768 in 3 steps
        br, bc, warps = block_rows or 16, block_cols or min(256, triton.next_power_of_2(ffn)), 4
    _swiglu_bwd_kernel[(triton.cdiv(n_pairs, br),)](
        h_P2I, g_PI, prob_P, dh_P2I, dprob_P,
        n_pairs, ffn,
        h_P2I.stride(0), g_PI.stride(0), dh_P2I.stride(0),
        BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
    )  # fmt: skip


def swiglu_forward(h_P2I, prob_P, a_PI):
    """a = silu(gate) * up (* prob_P when given) over the rows of ``h_P2I`` = [gate, up] (the
    forward when a GEMM made h; ``up_swiglu`` fuses this into its epilogue instead)."""
    n_pairs, ffn = a_PI.shape
    if n_pairs == 0 or ffn == 0:
        return
    _check_rows(n_pairs, "swiglu_forward")
    if interpret_mode():
        br, bc, warps = 16, 16, 4
    else:  # as swiglu_backward: 16 x 256 a tile at 4 warps
        br, bc, warps = 16, min(256, triton.next_power_of_2(ffn)), 4
    _swiglu_fwd_kernel[(triton.cdiv(n_pairs, br),)](
        h_P2I, prob_P if prob_P is not None else a_PI, a_PI,
        n_pairs, ffn,
        h_P2I.stride(0), a_PI.stride(0),
        SCALE=prob_P is not None, BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
    )  # fmt: skip
