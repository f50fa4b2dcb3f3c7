"""Expert computation through the routing index: hop primitives and the public ``moe_experts``.

Shape legend: T tokens, H hidden, I expert FFN width, E experts, K top-k, P pairs in the computed
expert range (expert-grouped order, the order of ``RoutingIndex.expert_token_indices``).

Two layers:
- hop primitives ``expert_hop_forward`` / ``expert_hop_backward`` (no autograd): compute the
  pairs of an expert range and accumulate into caller-owned buffers; a ring hop calls these.
- ``moe_experts``: an ``autograd.Function`` over the hop primitives with the oracle's semantics.

Backends: ``"triton"`` (``relaymoe.kernels.experts``: gather-on-load grouped GEMMs, fused SwiGLU,
deterministic gather-reduce combine; on CPU only under ``TRITON_INTERPRET=1``) and ``"torch"``
(index-based plain torch for users without Triton; it gathers each expert's rows, so it is the
reference-speed path, not the memory-lean one). ``"auto"`` picks Triton on CUDA.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from relaymoe.routing import RoutingIndex, build_routing_index

__all__ = ["moe_experts", "expert_hop_forward", "expert_hop_backward", "resolve_backend"]

Backend = Literal["auto", "triton", "torch"]
Recompute = Literal["act", "act_retain", "fc1"]
Save = Literal["act", "none"]
RECOMPUTES = ("act", "act_retain", "fc1")
SAVES = ("act", "none")
# Old spellings, still accepted with a DeprecationWarning: ``recompute="none"`` saved the
# pre-activation (it recomputed the SiLU like "act"), ``save="fc1"`` saved nothing like "none".
_OLD_RECOMPUTE = {"none": "act_retain"}
_OLD_SAVE = {"fc1": "none"}


def _renamed(value: str, old: dict[str, str], what: str) -> str:
    if value in old:
        warnings.warn(
            f"{what}={value!r} is deprecated: it means {what}={old[value]!r}; pass that",
            DeprecationWarning,
            stacklevel=3,  # the caller of moe_experts / expert_hop_forward
        )
        return old[value]
    return value


def resolve_backend(backend: Backend, device: torch.device) -> str:
    """``auto`` -> ``triton`` on CUDA when the kernels import, else ``torch``."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend != "auto":
        return backend
    if device.type == "cuda":
        from relaymoe.kernels import triton_available

        if triton_available():
            return "triton"
    return "torch"


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


def _silu_grad(gate: Tensor) -> Tensor:
    sig = torch.sigmoid(gate)
    return sig * (1 + gate * (1 - sig))


# ---------------------------------------------------------------------------------------------
# plain-torch backend
# ---------------------------------------------------------------------------------------------
def _torch_hop_forward(x_TH, w13, w2, probs_TK, index, e0, e1, out_TH, save):
    offs = index.expert_token_offsets[e0 : e1 + 1].tolist()  # host sync (torch path only)
    start, stop = offs[0], offs[-1]
    if stop == start:
        return None if save != "act" else x_TH.new_empty(0, w13.shape[1])
    acc = _acc_dtype(x_TH.dtype)
    pair = _pair_of_position(index, start, stop)
    p_P = probs_TK.reshape(-1)[pair].to(acc)
    ffn = w2.shape[2]
    saved = x_TH.new_empty(stop - start, 2 * ffn) if save == "act" else None
    for j in range(e1 - e0):
        lo, hi = offs[j] - start, offs[j + 1] - start
        if hi == lo:
            continue
        tok = index.expert_token_indices[start + lo : start + hi].long()
        h = x_TH[tok] @ w13[j].t()
        if saved is not None:
            saved[lo:hi] = h
        a = F.silu(h[:, :ffn].to(acc)) * h[:, ffn:].to(acc)
        y = (a.to(x_TH.dtype) @ w2[j].t()).to(acc) * p_P[lo:hi, None]
        out_TH.index_add_(0, tok, y.to(out_TH.dtype))  # deterministic on CPU
    return saved


def _torch_hop_backward(
    dy_TH, x_TH, w13, w2, probs_TK, index, e0, e1, saved_h, dx, dprobs, dw13, dw2
):
    offs = index.expert_token_offsets[e0 : e1 + 1].tolist()  # host sync (torch path only)
    start, stop = offs[0], offs[-1]
    if stop == start:
        return
    acc = _acc_dtype(x_TH.dtype)
    pair = _pair_of_position(index, start, stop)
    p_P = probs_TK.reshape(-1)[pair].to(acc)
    dprob_P = torch.empty(stop - start, dtype=acc, device=x_TH.device)
    ffn = w2.shape[2]
    for j in range(e1 - e0):
        lo, hi = offs[j] - start, offs[j + 1] - start
        if hi == lo:
            continue
        tok = index.expert_token_indices[start + lo : start + hi].long()
        x_n = x_TH[tok]
        h = saved_h[lo:hi] if saved_h is not None else x_n @ w13[j].t()
        gate, up = h[:, :ffn].to(acc), h[:, ffn:].to(acc)
        s = F.silu(gate)
        a = s * up
        dy_n = dy_TH[tok]
        da_raw = (dy_n @ w2[j]).to(acc)  # (n, I): dy @ w2[e], before the probability
        dprob_P[lo:hi] = (da_raw * a).sum(1)
        p = p_P[lo:hi, None]
        dw2[j] += ((dy_n.to(acc) * p).t() @ a).to(dw2.dtype)
        da = da_raw * p
        dh = torch.cat([da * up * _silu_grad(gate), da * s], dim=1).to(x_TH.dtype)
        dw13[j] += (dh.t().to(acc) @ x_n.to(acc)).to(dw13.dtype)
        dx.index_add_(0, tok, (dh @ w13[j]).to(dx.dtype))
    dprobs.view(-1).index_add_(0, pair, dprob_P.to(dprobs.dtype))


# ---------------------------------------------------------------------------------------------
# hop primitives
# ---------------------------------------------------------------------------------------------
def expert_hop_forward(
    x_TH: Tensor,
    w13_El2IH: Tensor,
    w2_ElHI: Tensor,
    probs_TK: Tensor,
    index: RoutingIndex,
    *,
    expert_range: tuple[int, int] | None = None,
    out_TH: Tensor | None = None,
    save: Save = "act",
    backend: Backend = "auto",
    n_pairs: int | None = None,
    max_pairs: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Add the pairs of experts ``expert_range=(e0, e1)`` (default: all) into ``out_TH``.

    ``w13_El2IH``/``w2_ElHI`` hold exactly experts ``[e0, e1)``. Returns ``(out_TH, saved)``: the
    range's pre-activation ``h (P, 2I)`` in expert-grouped order when ``save="act"``; None
    when ``save="none"`` (the backward then recomputes it from ``x`` and ``w13``).
    ``n_pairs``: the range's pair count when the caller knows it (``offsets[e1] - offsets[e0]``);
    it spares the Triton backend the host sync that sizes a partial range's buffers. Else
    ``max_pairs``: an upper bound on it, which does the same (buffers sized from the bound;
    ``save="act"`` needs the exact count).
    """
    save = _renamed(save, _OLD_SAVE, "save")
    if save not in SAVES:
        raise ValueError(f"save must be one of {SAVES}, got {save!r}")
    e0, e1 = _range(expert_range, index)
    if resolve_backend(backend, x_TH.device) == "triton":
        from relaymoe.kernels.experts import triton_hop_forward

        # out_TH=None: the combine writes every row (no zero fill, no read of zeros)
        return triton_hop_forward(
            x_TH, w13_El2IH, w2_ElHI, probs_TK, index, e0, e1, out_TH, save == "act",
            n_pairs=n_pairs, max_pairs=max_pairs,
        )  # fmt: skip
    if out_TH is None:
        out_TH = torch.zeros_like(x_TH)
    saved = _torch_hop_forward(x_TH, w13_El2IH, w2_ElHI, probs_TK, index, e0, e1, out_TH, save)
    return out_TH, saved


def expert_hop_backward(
    dy_TH: Tensor,
    x_TH: Tensor,
    w13_El2IH: Tensor,
    w2_ElHI: Tensor,
    probs_TK: Tensor,
    index: RoutingIndex,
    *,
    expert_range: tuple[int, int] | None = None,
    saved_h: Tensor | None = None,
    dx_TH: Tensor | None = None,
    dprobs_TK: Tensor | None = None,
    dw13: Tensor | None = None,
    dw2: Tensor | None = None,
    backend: Backend = "auto",
    consume_saved_h: bool = False,
    n_pairs: int | None = None,
    max_pairs: int | None = None,
    grad_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the pairs of ``expert_range``; ADDS into the given buffers (zeros otherwise).

    Recomputes the pre-activation from ``x`` and ``w13`` when ``saved_h`` is None (SiLU is always
    recomputed from the pre-activation). Returns ``(dx_TH, dprobs_TK, dw13, dw2)``.
    ``consume_saved_h=True`` lets the Triton backend overwrite ``saved_h`` with its gradient
    (one (P, 2I) buffer less at the backward's peak); ``saved_h`` is garbage afterwards.
    ``n_pairs``, ``max_pairs``: as in :func:`expert_hop_forward`. ``grad_dtype``: the dtype of
    the weight gradients allocated here when ``dw13``/``dw2`` are None (default the weights').
    """
    e0, e1 = _range(expert_range, index)
    if resolve_backend(backend, x_TH.device) == "triton":
        from relaymoe.kernels.experts import triton_hop_backward

        # buffers passed as None are allocated and written by the kernels (no zero fill)
        return triton_hop_backward(
            dy_TH, x_TH, w13_El2IH, w2_ElHI, probs_TK, index, e0, e1,
            saved_h, dx_TH, dprobs_TK, dw13, dw2, consume_saved_h=consume_saved_h,
            n_pairs=n_pairs, max_pairs=max_pairs, grad_dtype=grad_dtype,
        )  # fmt: skip
    dx_TH = torch.zeros_like(x_TH) if dx_TH is None else dx_TH
    dprobs_TK = torch.zeros_like(probs_TK) if dprobs_TK is None else dprobs_TK
    dw13 = torch.zeros_like(w13_El2IH, dtype=grad_dtype) if dw13 is None else dw13
    dw2 = torch.zeros_like(w2_ElHI, dtype=grad_dtype) if dw2 is None else dw2
    _torch_hop_backward(
        dy_TH, x_TH, w13_El2IH, w2_ElHI, probs_TK, index, e0, e1,
        saved_h, dx_TH, dprobs_TK, dw13, dw2,
    )  # fmt: skip
    return dx_TH, dprobs_TK, dw13, dw2


# ---------------------------------------------------------------------------------------------
# autograd + public API
# ---------------------------------------------------------------------------------------------
class _MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w13, w2, probs, out, index, expert_range, recompute, backend):
        save = "none" if recompute == "fc1" else "act"
        with torch.no_grad():
            result, saved_h = expert_hop_forward(
                x, w13, w2, probs, index,
                expert_range=expert_range, out_TH=out, save=save, backend=backend,
            )  # fmt: skip
        if out is not None:
            ctx.mark_dirty(out)
        ctx.index, ctx.expert_range, ctx.backend = index, expert_range, backend
        # recompute="act" on Triton: the backward overwrites h with dh (a (P, 2I) buffer less at
        # the peak), so a second backward through the same graph must refuse.
        ctx.consume_h = recompute == "act" and resolve_backend(backend, x.device) == "triton"
        ctx.h_consumed = False
        ctx.save_for_backward(x, w13, w2, probs, saved_h)
        return result

    @staticmethod
    def backward(ctx, dy):
        if ctx.h_consumed:
            raise RuntimeError(
                "moe_experts(recompute='act') backward ran twice on one graph; its saved "
                "pre-activation was overwritten by the first backward. Use "
                "recompute='act_retain' (keeps it) to backward twice with retain_graph=True"
            )
        x, w13, w2, probs, saved_h = ctx.saved_tensors
        dx, dprobs, dw13, dw2 = expert_hop_backward(
            dy.contiguous(), x, w13, w2, probs, ctx.index,
            expert_range=ctx.expert_range, saved_h=saved_h, backend=ctx.backend,
            consume_saved_h=ctx.consume_h,
        )  # fmt: skip
        ctx.h_consumed = ctx.consume_h and saved_h is not None
        d_out = dy if ctx.needs_input_grad[4] else None
        return dx, dw13, dw2, dprobs, d_out, None, None, None, None


def _check_inputs(x, w13, w2, topk_idx, topk_probs, index, expert_range, recompute, out):
    if recompute not in RECOMPUTES:
        raise ValueError(f"recompute must be one of {RECOMPUTES}, got {recompute!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be (T, H), got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"w13 must be (E, 2I, H) and w2 (E, H, I); got {tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    n_local, two_i, h13 = w13.shape
    if h13 != hidden or two_i % 2 or w2.shape != (n_local, hidden, two_i // 2):
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)} "
            f"(want (E, 2I, {hidden})), "
            f"w2 {tuple(w2.shape)} (want ({n_local}, {hidden}, {two_i // 2}))"
        )
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx must be (T={num_tokens}, K), got {tuple(topk_idx.shape)}")
    if topk_probs.shape != topk_idx.shape:
        raise ValueError(
            f"topk_probs shape {tuple(topk_probs.shape)} must equal "
            f"topk_idx's {tuple(topk_idx.shape)}"
        )
    if not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"x, w13, w2 dtypes differ: {x.dtype}, {w13.dtype}, {w2.dtype}")
    devices = {t.device for t in (x, w13, w2, topk_idx, topk_probs)}
    if len(devices) != 1:
        raise ValueError(f"inputs are on different devices: {sorted(map(str, devices))}")
    if expert_range is not None:
        e0, e1 = expert_range
        if e1 - e0 != n_local:
            raise ValueError(
                f"expert_range {expert_range} spans {e1 - e0} experts but w13/w2 hold {n_local}"
            )
        if index is None:
            raise ValueError(
                "expert_range needs a prebuilt index over all experts: "
                "pass index=build_routing_index(topk_idx, num_experts)"
            )
        if not 0 <= e0 <= e1 <= index.num_experts:
            raise ValueError(f"expert_range {expert_range} outside [0, {index.num_experts}]")
    elif index is not None and index.num_experts != n_local:
        raise ValueError(
            f"index has {index.num_experts} experts but w13 holds {n_local}; "
            "pass expert_range=(e0, e1) for a slice of the experts"
        )
    if index is not None and (index.num_tokens, index.topk) != tuple(topk_idx.shape):
        raise ValueError(
            f"index was built for (T, K)=({index.num_tokens}, {index.topk}), "
            f"topk_idx is {tuple(topk_idx.shape)}"
        )
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(
            f"out must be {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}"
        )


def moe_experts(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_idx: Tensor,
    topk_probs: Tensor,
    *,
    index: RoutingIndex | None = None,
    expert_range: tuple[int, int] | None = None,
    recompute: Recompute = "act",
    out: Tensor | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """SwiGLU experts with the oracle's semantics, differentiable in x, w13, w2, topk_probs.

    x (T, H); w13 (E, 2I, H); w2 (E, H, I); topk_idx (T, K) global expert ids; topk_probs (T, K).
    ``expert_range=(e0, e1)`` computes only pairs whose expert is in ``[e0, e1)`` with w13/w2
    holding just those experts (needs ``index``). ``out`` (T, H) is accumulated into and returned.
    ``recompute`` (the SiLU is always recomputed from the pre-activation):

    * ``"act"`` saves the (P, 2I) pre-activation; on Triton the backward overwrites it with its
      gradient (one (P, 2I) buffer less at the peak), so the graph can be backwarded once;
    * ``"act_retain"`` saves it and leaves it intact (``retain_graph=True`` backward twice);
    * ``"fc1"`` saves nothing but the inputs and recomputes the up-projection in backward.

    ``"none"`` (the old name of ``"act_retain"``) is accepted with a DeprecationWarning.
    """
    recompute = _renamed(recompute, _OLD_RECOMPUTE, "recompute")
    _check_inputs(x, w13, w2, topk_idx, topk_probs, index, expert_range, recompute, out)
    if index is None:
        index = build_routing_index(topk_idx, w13.shape[0])
    return _MoEExperts.apply(x, w13, w2, topk_probs, out, index, expert_range, recompute, backend)
