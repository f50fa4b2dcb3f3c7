"""Per-(t, k) values moved between token order and an expert range's pair order, one launch each.

Shape legend: T tokens, K top-k, P the range's pair rows (``offs[0]:offs[El]`` of the routing
index, stored at row ``q - offs[0]``). ``token_index_map[t*K + k]`` is the pair position ``q`` of
token t's k-th choice; a pair lies in the range when ``offs[0] <= q < offs[El]``, read on the
device (no host sync; the pair buffers may be sized from a bound larger than the range).

Each launch replaces a chain of about ten small torch ops (positions, masks, a scatter or a
gather, a masked add) that a ring hop issued per pass: at 4-8k tokens per GPU the hop is
host-bound, each op costing the host tens of microseconds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["add_pair_dprobs", "pair_probs"]

_BLOCK = 1024


@triton.jit
def _block_pairs(map_ptr, offs_ptr, TK, n_experts, BLOCK: tl.constexpr):
    """This program's (t, k) entries ``i``, their range rows ``q - offs[0]`` (0 where outside)
    and whether each lies in the range."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    start = tl.load(offs_ptr).to(tl.int64)
    stop = tl.load(offs_ptr + n_experts).to(tl.int64)
    q = tl.load(map_ptr + i, mask=i < TK, other=-1).to(tl.int64)
    live = (i < TK) & (q >= start) & (q < stop)
    return i, tl.where(live, q - start, 0), live


@triton.jit
def _pair_probs_kernel(probs_ptr, map_ptr, offs_ptr, out_ptr, TK, n_experts, BLOCK: tl.constexpr):
    """out[map[i] - offs[0]] = probs[i] (fp32) for every pair i whose position is in the range."""
    i, row, live = _block_pairs(map_ptr, offs_ptr, TK, n_experts, BLOCK)
    p = tl.load(probs_ptr + i, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, p, mask=live)


@triton.jit
def _add_pair_dprobs_kernel(
    dprob_ptr, map_ptr, offs_ptr, out_ptr, TK, n_experts, BLOCK: tl.constexpr
):
    """out[i] += dprob[map[i] - offs[0]] for every pair i in the range (others untouched)."""
    i, row, live = _block_pairs(map_ptr, offs_ptr, TK, n_experts, BLOCK)
    d = tl.load(dprob_ptr + row, mask=live, other=0.0)
    cur = tl.load(out_ptr + i, mask=live, other=0.0)
    tl.store(out_ptr + i, (cur.to(tl.float32) + d).to(out_ptr.dtype.element_ty), mask=live)


def _check(token_index_map: Tensor, offs: Tensor, tk: int, where: str) -> None:
    if token_index_map.numel() != tk or not token_index_map.is_contiguous():
        raise ValueError(
            f"{where}: token_index_map has {token_index_map.numel()} entries "
            f"(contiguous: {token_index_map.is_contiguous()}), expected a contiguous T*K = {tk}"
        )
    if offs.dim() != 1 or offs.numel() < 1:
        raise ValueError(
            f"{where}: offs must be the range's (El+1,) offsets, got {tuple(offs.shape)}"
        )


def pair_probs(probs_TK: Tensor, token_index_map: Tensor, offs: Tensor, n_rows: int) -> Tensor:
    """The router probabilities of the range's pairs in pair order, fp32 ``(n_rows,)``.

    ``n_rows`` >= the range's pair count; rows past the count are left unwritten (the kernels
    reading this stop at each expert's end in ``offs``)."""
    tk = probs_TK.numel()
    _check(token_index_map, offs, tk, "pair_probs")
    out_P = torch.empty(n_rows, dtype=torch.float32, device=probs_TK.device)
    if tk == 0 or n_rows == 0:
        return out_P
    probs = probs_TK.contiguous()
    _pair_probs_kernel[(triton.cdiv(tk, _BLOCK),)](
        probs, token_index_map, offs, out_P, tk, offs.numel() - 1, BLOCK=_BLOCK
    )
    return out_P


def add_pair_dprobs(
    dprob_P: Tensor, token_index_map: Tensor, offs: Tensor, dprobs_TK: Tensor
) -> None:
    """``dprobs_TK[t, k] += dprob_P[q - offs[0]]`` for the range's pairs, in place (the sum in
    fp32, rounded once to ``dprobs_TK``'s dtype); entries of other pairs are untouched."""
    tk = dprobs_TK.numel()
    _check(token_index_map, offs, tk, "add_pair_dprobs")
    if tk == 0 or dprob_P.numel() == 0:
        return
    if not dprobs_TK.is_contiguous():  # a strided view: add through a contiguous buffer
        flat = torch.zeros(dprobs_TK.shape, dtype=torch.float32, device=dprobs_TK.device)
        add_pair_dprobs(dprob_P, token_index_map, offs, flat)
        dprobs_TK.add_(flat.to(dprobs_TK.dtype))
        return
    _add_pair_dprobs_kernel[(triton.cdiv(tk, _BLOCK),)](
        dprob_P, token_index_map, offs, dprobs_TK, tk, offs.numel() - 1, BLOCK=_BLOCK
    )
