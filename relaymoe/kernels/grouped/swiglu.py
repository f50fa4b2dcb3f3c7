"""The memory-bound activation passes over pair rows: the backward (the activation recomputed from
h, dprob, dh, p*a) and the forward of an h a GEMM made (the fc1 bias added there).

Any ``ExpertActivation`` (``activation.act_meta``'s constexprs; None: SwiGLU, whose compiled
code is the plain SwiGLU pass). Shape legend: P pair rows, I expert FFN width, J fc1 rows
(2I gated, I not).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from relaymoe.kernels import interpret_mode
from relaymoe.kernels.fp8.quantize import quantize_row_blocks
from relaymoe.kernels.grouped.activation import act_bwd, act_fwd, act_meta
from relaymoe.kernels.grouped.tiles import check_rows, expert_block_size, row_expert


@dataclass(frozen=True, eq=False)
class SwigluFp8:
    """What an fp8 backward takes from ``swiglu_backward`` besides dh, p*a and dprob:
    ``amax``: a (2,) fp32 buffer the amax of dh and of p*a (as stored) are max-ed into (the
    tensor-scaled recipes); ``dh_blocks``: ``(dhq_PJ, inv_PB)``, dh quantised in 1x128 blocks
    of ``fmt`` with ``pow2`` scales (blockwise; I a multiple of 128); ``store_dh``: False skips
    dh in its own dtype (``dh_PJ`` is then not written)."""

    amax: object = None
    dh_blocks: tuple | None = None
    fmt: str = "e4m3"
    pow2: bool = True
    store_dh: bool = True


@triton.jit
def _load_h(hp, mask, cols, col_ok, e_R, b_ptr, stride_be, n_experts, I,
            GATED: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """(gate, lin) fp32 tiles of h at ``hp`` (lin: the columns ``I`` on, gated; gate again
    otherwise), plus b13 of each row's expert ``e_R`` with ``HAS_BIAS`` (none past the range)."""
    gate = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        lin = tl.load(hp + I, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        e_ok = e_R < n_experts
        bp = b_ptr + tl.where(e_ok, e_R, 0).to(tl.int64)[:, None] * stride_be + cols[None, :]
        b_mask = e_ok[:, None] & col_ok[None, :]
        gate += tl.load(bp, mask=b_mask, other=0.0).to(tl.float32)
        if GATED:
            lin += tl.load(bp + I, mask=b_mask, other=0.0).to(tl.float32)
    if not GATED:
        lin = gate
    return gate, lin


@triton.jit
def _pair_rows(n_pairs, offs_ptr, n_experts, BLOCK_R: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK_E: tl.constexpr):  # fmt: skip
    """This program's ``BLOCK_R`` pair rows: (rows, which are below ``n_pairs``, the rows as
    int64 offsets, each row's expert with ``HAS_BIAS``: where its b13 is; else unused)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r64 = rows.to(tl.int64)
    e_R = rows
    if HAS_BIAS:
        e_R = row_expert(r64 + tl.load(offs_ptr), offs_ptr, n_experts, BLOCK_E)
    return rows, rows < n_pairs, r64, e_R


@triton.jit
def _fp8_outputs(d_gate, d_up, pa, mask, r64, row_ok, cols, c0, I, amax_dh, amax_pa, dhq_ptr,
                 dhinv_ptr, stride_dhq, stride_dhinv, dh_dtype: tl.constexpr,
                 pa_dtype: tl.constexpr, GATED: tl.constexpr, AMAX: tl.constexpr,
                 QUANT_DH: tl.constexpr, FMT: tl.constexpr, POW2: tl.constexpr,
                 EXACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """The fp8 side of one column step: the running amax of dh and p*a as stored (``AMAX``),
    and dh quantised in 1x128 blocks with their inverse scales (``QUANT_DH``; ``BLOCK_C`` and I
    multiples of 128: the gate half's blocks, then the up half's from column I)."""
    dg = tl.where(mask, d_gate.to(dh_dtype).to(tl.float32), 0.0)
    du = tl.where(mask, d_up.to(dh_dtype).to(tl.float32), 0.0)
    if AMAX:
        amax_dh = tl.maximum(amax_dh, tl.max(tl.max(tl.abs(dg), axis=1), axis=0))
        if GATED:
            amax_dh = tl.maximum(amax_dh, tl.max(tl.max(tl.abs(du), axis=1), axis=0))
        pa_f = tl.where(mask, pa.to(pa_dtype).to(tl.float32), 0.0)
        amax_pa = tl.maximum(amax_pa, tl.max(tl.max(tl.abs(pa_f), axis=1), axis=0))
    if QUANT_DH:
        NB: tl.constexpr = BLOCK_C // 128
        bcols = c0 // 128 + tl.arange(0, NB)
        inv_mask = row_ok[:, None] & (bcols < tl.cdiv(I, 128))[None, :]
        for half in tl.static_range(2 if GATED else 1):
            v = dg if half == 0 else du
            q, inv = quantize_row_blocks(v, dhq_ptr.dtype.element_ty, FMT, POW2, EXACT,
                                         BLOCK_R, BLOCK_C)  # fmt: skip
            off = half * I
            tl.store(dhq_ptr + r64[:, None] * stride_dhq + off + cols[None, :], q, mask=mask)
            ip = dhinv_ptr + r64[:, None] * stride_dhinv + off // 128 + bcols[None, :]
            tl.store(ip, inv, mask=inv_mask)
    return amax_dh, amax_pa


@triton.jit
def _swiglu_bwd_kernel(
    h_ptr, g_ptr, prob_ptr, dh_ptr, dprob_ptr, b_ptr, offs_ptr, amax_ptr, dhq_ptr, dhinv_ptr,
    n_pairs, I, n_experts,
    stride_hp, stride_gp, stride_dhp, stride_be, stride_dhq, stride_dhinv,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr = False, BLOCK_E: tl.constexpr = 16, ACT_FN: tl.constexpr = "silu",
    GATED: tl.constexpr = True, ALPHA: tl.constexpr = 1.0, HAS_LIMIT: tl.constexpr = False,
    LIMIT: tl.constexpr = 0.0, OFFSET: tl.constexpr = 0.0, STORE_DH: tl.constexpr = True,
    AMAX: tl.constexpr = False, QUANT_DH: tl.constexpr = False, FMT: tl.constexpr = "e4m3",
    POW2: tl.constexpr = True, EXACT: tl.constexpr = False,
):  # fmt: skip
    """Memory-bound pass over BLOCK_R pair rows, I in BLOCK_C column steps (the activation
    recomputed from h, plus b13 of the row's expert with ``HAS_BIAS``: an h made without it):
    dprob = rowsum(g * a), exact per row (no partials); da = p * g; dh = da * act'(h) (both
    halves when gated: SwiGLU's ``[da * up * silu'(gate), da * silu(gate)]``); g is overwritten
    with p * a (for dw2).

    ``dh_ptr`` may equal ``h_ptr``: each element is read, then written, by the same program.
    fp8 (``_fp8_outputs``): ``AMAX`` max-es the amax of dh and of p*a into ``amax_ptr[0:2]``
    (one atomic each a program), ``QUANT_DH`` writes dh's 1x128 quantisation; ``STORE_DH=False``
    skips dh in its own dtype.
    """
    rows, row_ok, r64, e_R = _pair_rows(n_pairs, offs_ptr, n_experts, BLOCK_R, HAS_BIAS, BLOCK_E)
    p = tl.load(prob_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    dprob = tl.zeros((BLOCK_R,), dtype=tl.float32)
    amax_dh = 0.0
    amax_pa = 0.0
    for c0 in range(0, I, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < I
        mask = row_ok[:, None] & col_ok[None, :]
        hp = h_ptr + r64[:, None] * stride_hp + cols[None, :]
        gp = g_ptr + r64[:, None] * stride_gp + cols[None, :]
        gate, up = _load_h(hp, mask, cols, col_ok, e_R, b_ptr, stride_be, n_experts, I, GATED,
                           HAS_BIAS)  # fmt: skip
        g = tl.load(gp, mask=mask, other=0.0).to(tl.float32)
        da = g * p
        act, d_gate, d_up = act_bwd(gate, up, da, ACT_FN, GATED, ALPHA, HAS_LIMIT, LIMIT, OFFSET)
        dprob += tl.sum(g * act, axis=1)
        if STORE_DH:
            dhp = dh_ptr + r64[:, None] * stride_dhp + cols[None, :]
            tl.store(dhp, d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
            if GATED:
                tl.store(dhp + I, d_up.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(gp, (act * p).to(g_ptr.dtype.element_ty), mask=mask)
        if AMAX or QUANT_DH:
            amax_dh, amax_pa = _fp8_outputs(
                d_gate, d_up, act * p, mask, r64, row_ok, cols, c0, I, amax_dh, amax_pa, dhq_ptr,
                dhinv_ptr, stride_dhq, stride_dhinv, dh_ptr.dtype.element_ty,
                g_ptr.dtype.element_ty, GATED, AMAX, QUANT_DH, FMT, POW2, EXACT, BLOCK_R, BLOCK_C,
            )  # fmt: skip
    tl.store(dprob_ptr + rows, dprob, mask=row_ok)
    if AMAX:
        tl.atomic_max(amax_ptr, amax_dh)
        tl.atomic_max(amax_ptr + 1, amax_pa)


@triton.jit
def _swiglu_fwd_kernel(
    h_ptr, prob_ptr, a_ptr, b_ptr, offs_ptr,
    n_pairs, I, n_experts,
    stride_hp, stride_ap, stride_be,
    SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr = False, STORE_H: tl.constexpr = False, BLOCK_E: tl.constexpr = 16,
    ACT_FN: tl.constexpr = "silu", GATED: tl.constexpr = True, ALPHA: tl.constexpr = 1.0,
    HAS_LIMIT: tl.constexpr = False, LIMIT: tl.constexpr = 0.0, OFFSET: tl.constexpr = 0.0,
):  # fmt: skip
    """Memory-bound pass over BLOCK_R pair rows of h (``[gate, up]`` gated), I in BLOCK_C column
    steps: a = act(h + b13[e]) (* p). ``STORE_H``: h + b13[e] written back over h (the saved
    pre-activation holds the bias: the backward recomputes the activation from it)."""
    rows, row_ok, r64, e_R = _pair_rows(n_pairs, offs_ptr, n_experts, BLOCK_R, HAS_BIAS, BLOCK_E)
    if SCALE:
        p = tl.load(prob_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    for c0 in range(0, I, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < I
        mask = row_ok[:, None] & col_ok[None, :]
        hp = h_ptr + r64[:, None] * stride_hp + cols[None, :]
        gate, up = _load_h(hp, mask, cols, col_ok, e_R, b_ptr, stride_be, n_experts, I, GATED,
                           HAS_BIAS)  # fmt: skip
        if STORE_H:
            tl.store(hp, gate.to(h_ptr.dtype.element_ty), mask=mask)
            if GATED:
                tl.store(hp + I, up.to(h_ptr.dtype.element_ty), mask=mask)
        act = act_fwd(gate, up, ACT_FN, GATED, ALPHA, HAS_LIMIT, LIMIT, OFFSET)
        if SCALE:
            act = act * p
        tl.store(a_ptr + r64[:, None] * stride_ap + cols[None, :], act.to(a_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip


def _bias_args(b13_EJ, offs, where: str, unused) -> tuple:
    """(b pointer, offs pointer, El, its row stride, HAS_BIAS, BLOCK_E) of an optional b13;
    without one, ``unused`` stands in for both pointers (never read)."""
    if b13_EJ is None:
        return unused, unused, 0, 0, False, 16
    if offs is None:
        raise ValueError(f"{where}: b13 needs the range's offs (each row's expert)")
    n_experts = offs.shape[0] - 1
    return b13_EJ, offs, n_experts, b13_EJ.stride(0), True, expert_block_size(n_experts)


def swiglu_backward(h_PJ, g_PI, prob_P, dh_PJ, dprob_P, *, block_rows=None, block_cols=None,
                    activation=None, b13_EJ=None, offs=None, fp8=None):  # fmt: skip
    """See ``_swiglu_bwd_kernel``: reads h and g = dy[tok] @ w2[e] (unscaled), writes dh (may be
    ``h_PJ`` itself), dprob_P (fp32, every row) and overwrites g with p * a. ``activation``: an
    ``ExpertActivation`` (None: SwiGLU). ``b13_EJ`` (with the range's ``offs``): added to h on
    load, for an h made without the bias (the fc1 recompute through ``torch._grouped_mm``).
    ``fp8``: None, or a :class:`SwigluFp8` (what the fp8 backward also takes from this pass)."""
    n_pairs, ffn = g_PI.shape
    if n_pairs == 0:
        return
    check_rows(n_pairs, "swiglu_backward")  # row ids are int32 in the kernel
    if ffn == 0:
        dprob_P.zero_()
        return
    b, o, n_experts, stride_be, has_bias, block_e = _bias_args(
        b13_EJ, offs, "swiglu_backward", h_PJ
    )
    quant = fp8 is not None and fp8.dh_blocks is not None
    if interpret_mode():
        br, bc, warps = block_rows or 16, block_cols or (128 if quant else 16), 4
    else:  # 16 x 256: 32 elements per thread per tile at 4 warps, I=768 in 3 steps
        br, bc, warps = block_rows or 16, block_cols or min(256, triton.next_power_of_2(ffn)), 4
    if quant and bc % 128:
        raise ValueError(f"swiglu_backward: fp8 dh blocks need block_cols a multiple of 128 ({bc})")
    f = fp8 if fp8 is not None else SwigluFp8()
    amax = f.amax if f.amax is not None else dprob_P
    dhq, dhinv = f.dh_blocks if quant else (dprob_P, dprob_P)
    _swiglu_bwd_kernel[(triton.cdiv(n_pairs, br),)](
        h_PJ, g_PI, prob_P, dh_PJ, dprob_P, b, o, amax, dhq, dhinv,
        n_pairs, ffn, n_experts,
        h_PJ.stride(0), g_PI.stride(0), dh_PJ.stride(0), stride_be, dhq.stride(0), dhinv.stride(0),
        BLOCK_R=br, BLOCK_C=bc, HAS_BIAS=has_bias, BLOCK_E=block_e, **act_meta(activation),
        STORE_DH=f.store_dh, AMAX=f.amax is not None, QUANT_DH=quant, FMT=f.fmt, POW2=f.pow2,
        EXACT=interpret_mode(), num_warps=warps,
    )  # fmt: skip


def swiglu_forward(h_PJ, prob_P, a_PI, *, activation=None, b13_EJ=None, offs=None,
                   store_h=False):  # fmt: skip
    """a = act(h) (* prob_P when given) over the rows of ``h_PJ`` (``[gate, up]`` gated: the
    forward when a GEMM made h; ``up_swiglu`` fuses this into its epilogue instead).
    ``activation``: an ``ExpertActivation`` (None: SwiGLU). ``b13_EJ`` (with the range's
    ``offs``): added to each row's h first; ``store_h``: h + b13 written back into ``h_PJ``."""
    n_pairs, ffn = a_PI.shape
    if n_pairs == 0 or ffn == 0:
        return
    check_rows(n_pairs, "swiglu_forward")
    b, o, n_experts, stride_be, has_bias, block_e = _bias_args(b13_EJ, offs, "swiglu_forward", h_PJ)
    if interpret_mode():
        br, bc, warps = 16, 16, 4
    else:  # as swiglu_backward: 16 x 256 a tile at 4 warps
        br, bc, warps = 16, min(256, triton.next_power_of_2(ffn)), 4
    _swiglu_fwd_kernel[(triton.cdiv(n_pairs, br),)](
        h_PJ, prob_P if prob_P is not None else a_PI, a_PI, b, o,
        n_pairs, ffn, n_experts,
        h_PJ.stride(0), a_PI.stride(0), stride_be,
        SCALE=prob_P is not None, BLOCK_R=br, BLOCK_C=bc, HAS_BIAS=has_bias,
        STORE_H=store_h and has_bias, BLOCK_E=block_e, **act_meta(activation), num_warps=warps,
    )  # fmt: skip
