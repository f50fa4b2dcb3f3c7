"""The loops over the chunks of tokens that every mode of ``linear_cross_entropy`` runs.

``forward_chunks`` computes each chunk's logits and statistics (the loss and the log-sum-exp)
and, when given a per-token scale, the chunk's logits gradient scaled by it, applied at once:
``dh_out[C] = dlogits @ W`` and ``wgrad_into += dlogits.T @ h_C``. ``backward_chunks``
recomputes each chunk's logits from the saved log-sum-exp (no collective) and applies a scaled
logits gradient the same way. One ``(C, Vl)`` buffer serves every chunk of a pass. The chunks
run in a fixed order with the same kernels every time, so a pass that repeats a forward's
chunks with the same scale reproduces its logits gradient bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relaymoe.loss.chunk import accumulate_wgrad, chunk_grad, chunk_stats, combine_stats
from relaymoe.loss.inputs import LossSetup

__all__ = ["backward_chunks", "forward_chunks", "refuse_second_order", "targets"]


def targets(labels_T: Tensor, setup: LossSetup) -> tuple[Tensor, Tensor]:
    """``(tgt_T, valid_T)``: the label's local column (-1 when ignored or on another rank) and
    whether the token counts."""
    valid = labels_T != setup.ignore_index
    local = labels_T - setup.vocab_start
    here = valid & (local >= 0) & (local < setup.vocab_local)
    return torch.where(here, local, -1), valid


def _chunk_buffer(hidden: Tensor, setup: LossSetup) -> Tensor:
    return torch.empty(min(setup.chunk, hidden.shape[0]), setup.vocab_local, dtype=hidden.dtype,
                       device=hidden.device)  # fmt: skip


def forward_chunks(hidden, weight, tgt, valid, setup: LossSetup, *, scale_T=None, dh_out=None,
                   wgrad_into=None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(loss_T, lse_T)``; with ``scale_T`` (per token, ``setup.work``), each chunk's logits
    gradient times it goes into ``dh_out`` (written) and ``wgrad_into`` (added), either may be
    None."""
    tokens = hidden.shape[0]
    dev = hidden.device
    loss = torch.zeros(tokens, dtype=setup.work, device=dev)
    lse = torch.empty(tokens, dtype=setup.work, device=dev)
    if not tokens:
        return loss, lse
    buf = _chunk_buffer(hidden, setup)
    w_t = weight.t()
    for s in range(0, tokens, setup.chunk):
        e = min(s + setup.chunk, tokens)
        h = hidden[s:e]
        logits = torch.mm(h, w_t, out=buf[: e - s])
        stats = chunk_stats(logits, tgt[s:e], setup)
        loss_c, lse[s:e] = combine_stats(*stats, tgt[s:e] >= 0, setup)
        loss[s:e] = torch.where(valid[s:e], loss_c, 0.0)
        if scale_T is not None:
            dlogits = chunk_grad(logits, tgt[s:e], lse[s:e], scale_T[s:e], setup)
            if dh_out is not None:
                torch.mm(dlogits, weight, out=dh_out[s:e])
            if wgrad_into is not None:
                accumulate_wgrad(wgrad_into, dlogits, h)
    return loss, lse


def backward_chunks(hidden, weight, tgt, lse, scale_T, setup: LossSetup, *, dh_out=None,
                    wgrad_into=None) -> None:  # fmt: skip
    """Each chunk's logits again, its gradient times ``scale_T`` into ``dh_out`` (written) and
    ``wgrad_into`` (added)."""
    tokens = hidden.shape[0]
    if not tokens:
        return
    buf = _chunk_buffer(hidden, setup)
    w_t = weight.t()
    for s in range(0, tokens, setup.chunk):
        e = min(s + setup.chunk, tokens)
        logits = torch.mm(hidden[s:e], w_t, out=buf[: e - s])
        dlogits = chunk_grad(logits, tgt[s:e], lse[s:e], scale_T[s:e].contiguous(), setup)
        if dh_out is not None:
            torch.mm(dlogits, weight, out=dh_out[s:e])
        if wgrad_into is not None:
            accumulate_wgrad(wgrad_into, dlogits, hidden[s:e])


def refuse_second_order() -> None:
    """In a hand-written backward: grad mode is on there only under ``create_graph=True``, whose
    gradients would leave the op out of their graph (a penalty's term silently dropped)."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            "linear_cross_entropy: second-order gradients (create_graph=True: a gradient "
            "penalty, a Hessian-vector product) are not supported: its backward is "
            "hand-written. Take first-order gradients without create_graph=True, or "
            "compute that term with torch.nn.functional.cross_entropy on the logits"
        )
