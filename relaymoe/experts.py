"""Expert computation through the routing index: hop primitives and the public ``moe_experts``.

Shape legend: T tokens, H hidden, I expert FFN width, E experts, K top-k, P pairs in the computed
expert range (expert-grouped order, the order of ``RoutingIndex.expert_token_indices``), J fc1
rows per expert (``ExpertActivation.fc1_rows(I)``: 2I gated, I not).

The expert MLP is any ``relaymoe.activation.ExpertActivation`` (SwiGLU by default; GeGLU, GELU,
squared ReLU, GPT-OSS's clamped SwiGLU, ...) with optional fc1/fc2 biases, as Megatron builds it.

Two layers:
- hop primitives ``expert_hop_forward`` / ``expert_hop_backward`` (no autograd): compute the
  pairs of an expert range and accumulate into caller-owned buffers; a ring hop calls these. Their
  tensors are arguments of their own; how they compute (backend, kernels, activation, pair count,
  gradient dtype) is one :class:`HopOptions`, and the backward's gradient buffers one
  :class:`HopGrads`.
- ``moe_experts``: an ``autograd.Function`` over the hop primitives with the oracle's semantics.

Backends: ``"triton"`` (``relaymoe.kernels.experts``: gather-on-load grouped GEMMs, fused SwiGLU,
deterministic gather-reduce combine; on CPU only under ``TRITON_INTERPRET=1``) and ``"torch"``
(index-based plain torch for users without Triton; it gathers each expert's rows, so it is the
reference-speed path, not the memory-lean one; its activation backward is
``relaymoe.activation_torch``). ``"auto"`` picks Triton on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import torch
from torch import Tensor

from relaymoe.activation import ExpertActivation, as_activation
from relaymoe.activation_torch import activation_backward, activation_forward
from relaymoe.expert_inputs import (
    check_bias_grads,
    check_fc1_rows,
    check_index,
    check_moe_inputs,
    expert_range_of,
    stack_experts,
)
from relaymoe.fp8_state import check_fp8_call, resolve_fp8
from relaymoe.kernels import unit_cols
from relaymoe.kernels.experts import HopGrads, HopOptions
from relaymoe.kernels.select import kernel_options
from relaymoe.options import KernelOptions
from relaymoe.routing import RoutingIndex, build_routing_index

__all__ = [
    "HopGrads",
    "HopOptions",
    "expert_hop_backward",
    "expert_hop_forward",
    "moe_experts",
    "resolve_backend",
]

Backend = Literal["auto", "triton", "torch"]
Recompute = Literal["act", "act_retain", "fc1"]
Save = Literal["act", "none"]
RECOMPUTES = ("act", "act_retain", "fc1")
SAVES = ("act", "none")
HOP_DEFAULTS = HopOptions()  # a hop call without options
GRAD_DEFAULTS = HopGrads()  # a hop backward that allocates every gradient
# What the Triton kernels compute in: fp32 accumulation of 16-bit or fp32 operands. float64
# cannot be honoured there; the torch backend keeps it (the oracle comparisons run on it).
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def resolve_backend(
    backend: Backend, device: torch.device, dtype: torch.dtype | None = None
) -> str:
    """``"triton"`` or ``"torch"`` for inputs on ``device`` of ``dtype`` (None: not checked).

    ``auto`` -> Triton on CUDA when the kernels import and ``dtype`` is one they compute
    (``TRITON_DTYPES``), else torch (so float64 stays float64). An explicit ``"triton"`` that
    cannot run raises ``ValueError`` naming why and the fix: Triton missing, a CPU device
    without ``TRITON_INTERPRET=1``, or a dtype outside ``TRITON_DTYPES``."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return backend
    from relaymoe.kernels import interpret_mode, triton_available

    runs = triton_available() and (device.type == "cuda" or (
        device.type == "cpu" and interpret_mode()))  # fmt: skip
    dtype_ok = dtype is None or dtype in TRITON_DTYPES
    if backend == "auto":
        return "triton" if device.type == "cuda" and runs and dtype_ok else "torch"
    if not runs:
        raise ValueError(
            f"backend='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 on CPU, "
            f"set before triton is imported); the inputs are on {device}"
            f"{'' if triton_available() else ' and triton does not import'}; "
            "use backend='torch' (or 'auto')"
        )
    if not dtype_ok:
        raise ValueError(
            f"backend='triton' computes in float32 and cannot honour {dtype} inputs; use "
            f"backend='torch' (it keeps {dtype}) or cast x, w13 and w2 to float32 "
            "(the Triton kernels take float16, bfloat16 and float32)"
        )
    return backend


def _range(expert_range: tuple[int, int] | None, index: RoutingIndex) -> tuple[int, int]:
    return (0, index.num_experts) if expert_range is None else expert_range


def _pair_of_position(index: RoutingIndex, start: int, stop: int) -> Tensor:
    """Flat pair id ``t*K + k`` of positions ``[start, stop)`` (inverse of token_index_map)."""
    inv = torch.empty(index.num_pairs, dtype=torch.int64, device=index.token_index_map.device)
    inv[index.token_index_map.long()] = torch.arange(
        index.num_pairs, dtype=torch.int64, device=inv.device
    )
    return inv[start:stop]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation for 16-bit inputs; fp32/fp64 stay as they are."""
    return torch.promote_types(dtype, torch.float32)


def _fc1(x_nH: Tensor, w13_JH: Tensor, b13_E, j: int) -> Tensor:
    """``h (n, J) = x @ w13[j]^T (+ b13[j])``, in x's dtype (the bias inside the GEMM)."""
    if b13_E is None:
        return x_nH @ w13_JH.t()
    return torch.addmm(b13_E[j], x_nH, w13_JH.t())


# ---------------------------------------------------------------------------------------------
# plain-torch backend
# ---------------------------------------------------------------------------------------------
def _torch_hop_forward(x_TH, w13, w2, probs_TK, index, e0, e1, out_TH, save, act, b13, b2):
    offs = index.expert_token_offsets[e0 : e1 + 1].tolist()  # host sync (torch path only)
    start, stop = offs[0], offs[-1]
    rows = w13.shape[1]
    if stop == start:
        return None if save != "act" else x_TH.new_empty(0, rows)
    acc = _acc_dtype(x_TH.dtype)
    pair = _pair_of_position(index, start, stop)
    p_P = probs_TK.reshape(-1)[pair].to(acc)
    saved = x_TH.new_empty(stop - start, rows) if save == "act" else None
    for j in range(e1 - e0):
        lo, hi = offs[j] - start, offs[j + 1] - start
        if hi == lo:
            continue
        tok = index.expert_token_indices[start + lo : start + hi].long()
        h = _fc1(x_TH[tok], w13[j], b13, j)
        if saved is not None:
            saved[lo:hi] = h
        a = activation_forward(act, h.to(acc))
        y = a.to(x_TH.dtype) @ w2[j].t()
        if b2 is not None:
            y = y + b2[j]
        y = y.to(acc) * p_P[lo:hi, None]
        out_TH.index_add_(0, tok, y.to(out_TH.dtype))  # deterministic on CPU
    return saved


def _torch_hop_backward(
    dy_TH, x_TH, w13, w2, probs_TK, index, e0, e1, saved_h, grads: HopGrads, act, b13, b2
):
    """Per-expert loop into ``grads`` (every buffer given, the bias gradients' with their
    biases); every sum is a GEMM or a reduction of one expert's rows, in a fixed order (no
    atomics): ``db2[e] = sum p * dy[tok]``, ``db13[e] = sum dh``. The weight gradients' row of
    expert ``e0 + j`` is ``j``, or ``El-1-j`` with ``grads.dw_reversed``."""
    dx, dprobs, dw13, dw2 = grads.dx_TH, grads.dprobs_TK, grads.dw13, grads.dw2
    db13, db2 = grads.db13, grads.db2
    offs = index.expert_token_offsets[e0 : e1 + 1].tolist()  # host sync (torch path only)
    start, stop = offs[0], offs[-1]
    if stop == start:
        return
    acc = _acc_dtype(x_TH.dtype)
    pair = _pair_of_position(index, start, stop)
    p_P = probs_TK.reshape(-1)[pair].to(acc)
    dprob_P = torch.empty(stop - start, dtype=acc, device=x_TH.device)
    for j in range(e1 - e0):
        lo, hi = offs[j] - start, offs[j + 1] - start
        if hi == lo:
            continue
        tok = index.expert_token_indices[start + lo : start + hi].long()
        x_n = x_TH[tok]
        h = saved_h[lo:hi] if saved_h is not None else _fc1(x_n, w13[j], b13, j)
        dy_n = dy_TH[tok]
        da_raw = (dy_n @ w2[j]).to(acc)  # (n, I): dy @ w2[e], before the probability
        p = p_P[lo:hi, None]
        dh_acc, a = activation_backward(act, h.to(acc), da_raw * p)
        dprob = (da_raw * a).sum(1)
        dy_p = dy_n.to(acc) * p
        if b2 is not None:  # y = a @ w2^T + b2, so dprob gains dy . b2[e]
            dprob = dprob + dy_n.to(acc) @ b2[j].to(acc)
            db2[j] += dy_p.sum(0).to(db2.dtype)
        dprob_P[lo:hi] = dprob
        row = e1 - e0 - 1 - j if grads.dw_reversed else j
        dw2[row] += (dy_p.t() @ a).to(dw2.dtype)
        if b13 is not None:
            db13[j] += dh_acc.sum(0).to(db13.dtype)
        dh = dh_acc.to(x_TH.dtype)
        dw13[row] += (dh.t().to(acc) @ x_n.to(acc)).to(dw13.dtype)
        dx.index_add_(0, tok, (dh @ w13[j]).to(dx.dtype))
    if dprobs.is_contiguous():
        dprobs.view(-1).index_add_(0, pair, dprob_P.to(dprobs.dtype))
    else:  # a caller's strided buffer: the flat (t*K + k) sums through a contiguous one
        flat = dprobs.new_zeros(dprobs.numel())
        dprobs.add_(flat.index_add_(0, pair, dprob_P.to(dprobs.dtype)).view(dprobs.shape))


# ---------------------------------------------------------------------------------------------
# hop primitives
# ---------------------------------------------------------------------------------------------
def expert_hop_forward(
    x_TH: Tensor,
    w13_ElJH: Tensor,
    w2_ElHI: Tensor,
    probs_TK: Tensor,
    index: RoutingIndex,
    *,
    expert_range: tuple[int, int] | None = None,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
    out_TH: Tensor | None = None,
    save: Save = "act",
    options: HopOptions | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Add the pairs of experts ``expert_range=(e0, e1)`` (default: all) into ``out_TH``.

    ``w13_ElJH`` (El, J, H) / ``w2_ElHI`` (El, H, I) hold exactly experts ``[e0, e1)``; J is
    ``activation.fc1_rows(I)`` (2I gated, I not). ``b13 (El, J)``, ``b2 (El, H)``: the range's
    fc1/fc2 biases, w13's dtype (None: none); ``out[t] += p * (a @ w2[e]^T + b2[e])``. Returns
    ``(out_TH, saved)``: the range's pre-activation ``h (P, J)`` (fc1 bias included) in
    expert-grouped order when ``save="act"``; None when ``save="none"`` (the backward then
    recomputes it from ``x``, ``w13`` and ``b13``).
    ``options``: how it computes (:class:`HopOptions`; None: the defaults): the backend, the
    Triton kernels' options, the activation (None: SwiGLU), and the range's pair count
    (``n_pairs``, ``offsets[e1] - offsets[e0]``, when the caller knows it: it spares the Triton
    backend the host sync that sizes a partial range's buffers; else ``max_pairs``, an upper
    bound, which does the same: ``save="act"`` needs the exact count).
    """
    if save not in SAVES:
        raise ValueError(f"save must be one of {SAVES}, got {save!r}")
    options = HOP_DEFAULTS if options is None else options
    act = as_activation(options.activation)
    check_fc1_rows("expert_hop_forward", w13_ElJH, w2_ElHI, act)
    e0, e1 = _range(expert_range, index)
    if resolve_backend(options.backend, x_TH.device, x_TH.dtype) == "triton":
        from relaymoe.kernels.experts import triton_hop_forward

        # out_TH=None: the combine writes every row (no zero fill, no read of zeros)
        return triton_hop_forward(
            x_TH, w13_ElJH, w2_ElHI, probs_TK, index, e0, e1, out_TH, save == "act",
            b13=b13, b2=b2, options=options,
        )  # fmt: skip
    if out_TH is None:
        out_TH = torch.zeros_like(x_TH)
    saved = _torch_hop_forward(
        x_TH, w13_ElJH, w2_ElHI, probs_TK, index, e0, e1, out_TH, save, act, b13, b2
    )
    return out_TH, saved


def expert_hop_backward(
    dy_TH: Tensor,
    x_TH: Tensor,
    w13_ElJH: Tensor,
    w2_ElHI: Tensor,
    probs_TK: Tensor,
    index: RoutingIndex,
    *,
    expert_range: tuple[int, int] | None = None,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
    saved_h: Tensor | None = None,
    consume_saved_h: bool = False,
    grads: HopGrads | None = None,
    options: HopOptions | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the pairs of ``expert_range``; ADDS into the buffers of ``grads`` (zeros
    otherwise). Returns ``(dx_TH, dprobs_TK, dw13, dw2)``.

    Recomputes the pre-activation from ``x``, ``w13`` and ``b13`` when ``saved_h`` is None (the
    activation is always recomputed from the pre-activation).
    ``consume_saved_h=True`` lets the Triton backend overwrite ``saved_h`` with its gradient
    (one (P, J) buffer less at the backward's peak); ``saved_h`` is garbage afterwards.
    ``b13``, ``b2`` and ``options``: as in :func:`expert_hop_forward` (the same as its
    forward's); ``options.grad_dtype``: the dtype of the weight gradients allocated here when
    ``grads.dw13``/``dw2`` are None (default the weights').
    ``grads`` (:class:`HopGrads`; None: every gradient allocated): ``dx_TH``, ``dprobs_TK``,
    ``dw13``, ``dw2`` are added into; ``db13 (El, J)`` / ``db2 (El, H)``: the bias gradients
    are ADDED into these caller-owned buffers (any float dtype, e.g. fp32 accumulators); each is
    required when its bias is given (``ValueError`` otherwise). ``db2[e] = sum over e's pairs of
    p * dy[tok]``, ``db13[e] = sum of the pre-activation gradients dh`` (the probability
    included), and each pair's router gradient gains ``dy[tok] . b2[e]``.
    ``grads.dw_accumulate=False``: the given ``dw13``/``dw2`` are written over instead of added
    into (their old values never read), bitwise what fresh buffers would get: a recorded ring
    hop's first weight gradient into a bound buffer. ``grads.dw_reversed``: the given
    ``dw13``/``dw2`` hold the range's experts in reverse row order (a caller's accumulators in
    reverse expert order, e.g. Megatron's ``main_grad``), added into (or written) in place.
    """
    options = HOP_DEFAULTS if options is None else options
    grads = GRAD_DEFAULTS if grads is None else grads
    act = as_activation(options.activation)
    check_bias_grads(b13, b2, grads.db13, grads.db2)
    check_fc1_rows("expert_hop_backward", w13_ElJH, w2_ElHI, act)
    e0, e1 = _range(expert_range, index)
    if resolve_backend(options.backend, x_TH.device, x_TH.dtype) == "triton":
        from relaymoe.kernels.experts import triton_hop_backward

        # buffers passed as None are allocated and written by the kernels (no zero fill)
        return triton_hop_backward(
            dy_TH, x_TH, w13_ElJH, w2_ElHI, probs_TK, index, e0, e1, saved_h, b13=b13, b2=b2,
            consume_saved_h=consume_saved_h, grads=grads, options=options,
        )  # fmt: skip
    grads = _torch_grads(grads, x_TH, w13_ElJH, w2_ElHI, probs_TK, options.grad_dtype)
    _torch_hop_backward(
        dy_TH, x_TH, w13_ElJH, w2_ElHI, probs_TK, index, e0, e1, saved_h, grads, act, b13, b2
    )
    return grads.dx_TH, grads.dprobs_TK, grads.dw13, grads.dw2


def _torch_grads(grads: HopGrads, x_TH, w13, w2, probs_TK, grad_dtype) -> HopGrads:
    """``grads`` with every buffer the torch backward adds into: zeros where none was given,
    and the given weight gradients zeroed when written over (``dw_accumulate=False``: the torch
    path adds into zeros, as into fresh buffers)."""
    if not grads.dw_accumulate:
        for dw in (grads.dw13, grads.dw2):
            if dw is not None:
                dw.zero_()
    dx = torch.zeros_like(x_TH) if grads.dx_TH is None else grads.dx_TH
    dprobs = grads.dprobs_TK
    if dprobs is None:
        dprobs = torch.zeros(probs_TK.shape, dtype=probs_TK.dtype, device=probs_TK.device)
    dw13 = torch.zeros_like(w13, dtype=grad_dtype) if grads.dw13 is None else grads.dw13
    dw2 = torch.zeros_like(w2, dtype=grad_dtype) if grads.dw2 is None else grads.dw2
    return replace(grads, dx_TH=dx, dprobs_TK=dprobs, dw13=dw13, dw2=dw2)


# ---------------------------------------------------------------------------------------------
# autograd + public API
# ---------------------------------------------------------------------------------------------
SECOND_ORDER_ERROR = (  # a backward with create_graph=True
    "moe_experts: second-order gradients (create_graph=True: a gradient penalty, a Hessian-vector "
    "product) are not supported: its backward is hand-written in every mode and backend. Take "
    "first-order gradients without create_graph=True, or compute that term with "
    "relaymoe.reference.moe_experts_reference (plain autograd, any order)"
)


class _MoEExperts(torch.autograd.Function):
    """``backend`` arrives resolved (``"triton"`` or ``"torch"``). ``out`` is the first input:
    when it is a view written in place, autograd routes the gradient of the first input to the
    view's base (``CopySlices``), so the accumulated buffer must come first."""

    @staticmethod
    def forward(ctx, out, x, w13, w2, probs, b13, b2, index, expert_range, recompute, backend,
                kernels, act):  # fmt: skip
        if backend == "triton":
            # the kernels read x rows at unit column stride: a transposed or column-strided x is
            # copied here, once, and the copy is what the backward reads (no second copy there)
            x, probs = unit_cols(x), probs.contiguous()
        save = "none" if recompute == "fc1" else "act"
        options = HopOptions(backend=backend, kernels=kernels, activation=act)
        with torch.no_grad():
            result, saved_h = expert_hop_forward(
                x, w13, w2, probs, index, expert_range=expert_range, b13=b13, b2=b2, out_TH=out,
                save=save, options=options,
            )  # fmt: skip
        if out is not None:
            ctx.mark_dirty(out)
        ctx.index, ctx.expert_range, ctx.options = index, expert_range, options
        # recompute="act" on Triton: the backward overwrites h with dh (a (P, J) buffer less at
        # the peak), so a second backward through the same graph must refuse.
        ctx.consume_h = recompute == "act" and backend == "triton"
        ctx.h_consumed = False
        ctx.save_for_backward(x, w13, w2, probs, saved_h, b13, b2)
        return result

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():  # only under create_graph=True: refused before computing
            raise NotImplementedError(SECOND_ORDER_ERROR)
        if ctx.h_consumed:
            raise RuntimeError(
                "moe_experts(recompute='act') backward ran twice on one graph; the first "
                "overwrote its saved pre-activation. To backward twice with retain_graph=True "
                "(first-order gradients) use recompute='act_retain' (keeps it) or 'fc1'"
            )
        x, w13, w2, probs, saved_h, b13, b2 = ctx.saved_tensors
        if ctx.options.backend == "triton":
            dy = unit_cols(dy)  # an expanded or transposed upstream gradient: one copy
        # bias gradients summed in fp32 or wider, returned in the biases' dtype
        db13 = None if b13 is None else torch.zeros_like(b13, dtype=_acc_dtype(b13.dtype))
        db2 = None if b2 is None else torch.zeros_like(b2, dtype=_acc_dtype(b2.dtype))
        dx, dprobs, dw13, dw2 = expert_hop_backward(
            dy, x, w13, w2, probs, ctx.index, expert_range=ctx.expert_range, b13=b13, b2=b2,
            saved_h=saved_h, consume_saved_h=ctx.consume_h, grads=HopGrads(db13=db13, db2=db2),
            options=ctx.options,
        )  # fmt: skip
        ctx.h_consumed = ctx.consume_h and saved_h is not None
        d_out = dy if ctx.needs_input_grad[0] else None
        db13 = None if db13 is None else db13.to(b13.dtype)
        db2 = None if db2 is None else db2.to(b2.dtype)
        return d_out, dx, dw13, dw2, dprobs, db13, db2, None, None, None, None, None, None


def moe_experts(
    x: Tensor,
    w13: Tensor | Sequence[Tensor],
    w2: Tensor | Sequence[Tensor],
    topk_idx: Tensor,
    topk_probs: Tensor,
    *,
    index: RoutingIndex | None = None,
    expert_range: tuple[int, int] | None = None,
    recompute: Recompute = "act",
    out: Tensor | None = None,
    backend: Backend = "auto",
    kernels: KernelOptions | None = None,
    activation: ExpertActivation | str | None = None,
    b13: Tensor | Sequence[Tensor] | None = None,
    b2: Tensor | Sequence[Tensor] | None = None,
    fp8=None,
) -> Tensor:
    """Expert MLPs with the oracle's semantics, differentiable in x, w13, w2, topk_probs, b13, b2.

    x (T, H); w13 (E, J, H) with J = 2I for a gated activation (rows ``[gate; linear]``, the
    default SwiGLU) and J = I otherwise; w2 (E, H, I); topk_idx (T, K) global expert ids;
    topk_probs (T, K). ``activation``: an ``relaymoe.activation.ExpertActivation`` or a name
    (``"swiglu"``, ``"geglu"``, ``"gelu"``, ``"squared_relu"``, ...: ``as_activation``); None is
    SwiGLU. ``b13`` (E, J) / ``b2`` (E, H): optional fc1 / fc2 biases (Megatron's
    ``add_bias_linear``): ``out[t] = sum_k p * (act(x @ w13[e]^T + b13[e]) @ w2[e]^T + b2[e])``.
    ``w13``/``w2`` may also be lists (or tuples) of E per-expert tensors (J, H) / (H, I), and
    ``b13``/``b2`` lists of E 1-D tensors; they are stacked (``torch.stack``, one copy per call)
    and each element gets its own gradient.
    ``expert_range=(e0, e1)`` computes only pairs whose expert is in ``[e0, e1)`` with w13/w2
    (and the biases) holding just those experts (needs ``index``). ``out`` (T, H) is
    accumulated into and returned.
    ``recompute`` (the activation is always recomputed from the pre-activation):

    * ``"act"`` saves the (P, J) pre-activation (fc1 bias included); on Triton the backward
      overwrites it with its gradient (one (P, J) buffer less at the peak), so the graph can be
      backwarded once;
    * ``"act_retain"`` saves it and leaves it intact (``retain_graph=True`` backward twice);
    * ``"fc1"`` saves nothing but the inputs and recomputes the up-projection in backward.

    Every mode is first-order: a backward with ``create_graph=True`` raises NotImplementedError.

    ``kernels``: how the Triton backend's kernels run (``relaymoe.options.KernelOptions``:
    GEMM backends, tile configurations, buffer budget; every choice computes the same layer up
    to rounding); default: ``KernelOptions()``, fixed for the forward and its backward.

    Dtypes: x, w13, w2 (and the biases) share one of float16, bfloat16, float32, float64;
    topk_probs any of those (computed in fp32 or wider); topk_idx any integer dtype.
    ``backend="triton"`` takes float16, bfloat16 and float32 (it accumulates in fp32) and
    refuses float64; ``"auto"`` runs float64 on the torch backend, which keeps it. The output
    has x's dtype; the gradients have their inputs' dtypes.

    Layouts: any strides for every tensor argument (transposed, sliced, expanded), and for the
    upstream gradient. The Triton backend reads x and dy rows at unit column stride: an x or
    dy without it is copied once (x in the forward, where the copy is also what the backward
    reads; dy in the backward), and topk_probs is made contiguous (T*K elements). A row-major
    x (contiguous, a row slice, a block of a wider tensor) is read in place. An ``out`` whose
    columns are not at unit stride is written through one row-major (T, chunk) buffer per
    column chunk; the torch backend reads and writes any strides directly.

    ``fp8``: None (the GEMMs in the inputs' dtype), or the expert GEMMs in fp8 on a Hopper GPU
    (``relaymoe.fp8_recipe``): a recipe name (``"tensorwise"``, ``"blockwise"``), a
    ``relaymoe.Fp8Recipe``, or a ``relaymoe.Fp8State`` the caller keeps across calls (its
    cached fp8 weights are quantised once per optimizer step; ``"delayed"`` scaling needs one:
    its amax history). Refused with ``ValueError``: a GPU before Hopper (its capability named),
    a CPU without ``TRITON_INTERPRET=1``, ``backend="torch"``, dtypes other than bfloat16,
    float16, float32, biases, and for ``"blockwise"`` H or I not a multiple of 128.

    Validated at call time (``ValueError`` naming the value, the limit and the fix): types,
    shapes, dtypes and devices of every argument (w13's rows against the activation, the
    biases against the weights); the activation; ``out`` (shape, dtype, device, not
    expanded, not overlapping an input, not a leaf requiring grad); ``expert_range``; the
    backend (``"triton"`` needs CUDA, or ``TRITON_INTERPRET=1`` on CPU); the routing, when
    ``index`` is None (ids in ``[0, E)``, distinct per row: one host sync, in
    ``build_routing_index``). A prebuilt ``index`` must be the routing of ``topk_idx``: free to
    check when it was built from this ``topk_idx`` tensor, unmodified since; otherwise its ids
    are compared with ``topk_idx`` on the device (one host sync). Trusted: that a prebuilt
    index's arrays are the build of its ids and, when it was built with ``validate=False``,
    that those ids are valid.
    """
    if recompute not in RECOMPUTES:
        raise ValueError(f"moe_experts: recompute must be one of {RECOMPUTES}, got {recompute!r}")
    act = as_activation(activation)
    originals = (w13, w2)
    w13 = stack_experts("w13", w13, "(E, J, H)")
    w2 = stack_experts("w2", w2, "(E, H, I)")
    b13 = None if b13 is None else stack_experts("b13", b13, "(E, J)", ndim=1)
    b2 = None if b2 is None else stack_experts("b2", b2, "(E, H)", ndim=1)
    expert_range = expert_range_of(expert_range)
    check_moe_inputs(x, w13, w2, topk_idx, topk_probs, index, expert_range, out, act, b13, b2)
    fp8_state = resolve_fp8(fp8)
    if fp8_state is not None:
        check_fp8_call(fp8_state, x, w13, w2, backend=backend, b13=b13, b2=b2)
    resolved = resolve_backend(backend, x.device, x.dtype)
    kernels = kernel_options(kernels)
    if index is None:
        index = build_routing_index(topk_idx, w13.shape[0])
    else:
        check_index(index, topk_idx)
    if fp8_state is not None:
        from relaymoe.experts_fp8 import fp8_experts

        return fp8_experts(out, x, w13, w2, topk_probs, index, expert_range, recompute, kernels,
                           act, fp8_state, originals)  # fmt: skip
    return _MoEExperts.apply(out, x, w13, w2, topk_probs, b13, b2, index, expert_range,
                             recompute, resolved, kernels, act)  # fmt: skip
