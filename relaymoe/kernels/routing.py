"""Atomic-free Triton build of the routing index (MoEBlaze §4.2), no global sort.

Shape legend: T tokens, K top-k, E experts (``E_PAD`` the next power of two), P = T*K pairs in
token-major order (pair ``i = t*K + k``), NB blocks of ``chunk`` consecutive pairs.

Two or three launches, each program owning a disjoint slice, so no two threads ever write one
address (small builds fuse step 2 into step 3: every program sums the small counts matrix):

1. ``_count_rank_kernel`` (grid NB): program ``b`` walks its block of pairs in tiles and gives
   every pair its rank among the earlier pairs of the block with the same expert (written into
   the ``token_index_map`` buffer as scratch) and the block's per-expert counts ``counts[b, :]``.
   It also writes ``token_expert_indices`` (the ids as int32).
   Two ways to rank a tile, picked by ``E_PAD`` (both exact and deterministic):
   * one-hot: a ``(TILE, E_PAD)`` compare, an exclusive scan down the tile, the running counts
     held in registers. Cost about ``E_PAD`` operations per pair: the choice for small E.
   * pairwise: a ``(TILE, TILE)`` compare of the tile with itself (earlier pairs, same expert),
     the running counts kept in the block's own row of ``counts`` (global memory, written only
     by this program, one writer per expert per tile: the tile's last pair of that expert).
     Cost about ``TILE`` operations per pair, independent of E: the choice for large E.
2. ``_scan_blocks_kernel`` (grid over expert columns): exclusive prefix of ``counts`` over
   blocks per expert, and the per-expert totals.
3. ``_scatter_kernel`` (grid NB): every program scans the totals over experts (the offsets;
   program 0 stores them), forms ``base[e] = offsets[e] + prefix[b, e]`` and, for each pair,
   ``pos = base[e] + rank``; writes ``token_index_map[i] = pos`` and
   ``expert_token_indices[pos] = i // K``.

Positions inside an expert follow the pair order, i.e. ascending token id (a row never repeats
an expert), which is exactly the stable sort of the torch build: the arrays are bitwise equal.
Positions and pair indices are int64 in the kernels, so P >= 2**31 works (the map is then int64).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from relaymoe.kernels import check_int32
from relaymoe.kernels.index_arrays import check_index_out, index_arrays_like

__all__ = ["build_routing_index_triton", "routing_config"]

# Largest expert count the kernels take (E is padded to a power of two in-kernel).
MAX_EXPERTS = 512
# Both builds timed on an H200: from E_PAD = 64 on, the pairwise tile rank beats the one-hot
# scan; at large T the pairwise build wants ~2048 blocks, one-hot ~1024.
PAIRWISE_MIN_E_PAD = 64
_ONEHOT_CELLS = 4096  # (pair, expert) cells of one one-hot tile
_PAIRWISE_TILE = 32  # faster than 64 at large T
_MAX_BLOCKS_PAIRWISE = 2048
_MAX_BLOCKS_ONEHOT = 1024
# Small builds are launch-bound: two launches (the scatter kernel sums the counts itself) while
# NB^2 * E_PAD <= _FUSED_READ_CELLS leaves each block at most _FUSED_MAX_TILES tiles.
_FUSED_READ_CELLS = 2**23
_FUSED_MAX_TILES = 32
_SCAN_CELLS = 4096  # cells of one tile of the block scan
_SCATTER_TILE = 1024


@triton.jit
def _safe_ids(e, live, E_PAD: tl.constexpr):
    """int32 ids whose live lanes lie in ``[0, E_PAD)``: an id out of range (never from a router
    or a validated input, but the garbage of a transfer a dead peer never filled) becomes
    ``E_PAD - 1`` so that no kernel of the build or after it addresses memory out of bounds; the
    ring names the dead peer, this only keeps the GPU from faulting first."""
    e = e.to(tl.int64)
    return tl.where(live & ((e < 0) | (e >= E_PAD)), E_PAD - 1, e).to(tl.int32)


@triton.jit
def _count_rank_kernel(
    topk_ptr,  # (P,) any integer dtype, token-major expert ids
    tei_ptr,  # (P,) int32 out: token_expert_indices
    rank_ptr,  # (P,) int32|int64 out: rank of the pair inside its block and expert
    counts_ptr,  # (NB, E_PAD) int64 out: pairs per (block, expert)
    num_pairs,
    chunk,  # pairs per block
    E_PAD: tl.constexpr,
    TILE: tl.constexpr,
    PAIRWISE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    start = b * chunk
    stop = tl.minimum(start + chunk, num_pairs)
    n_tiles = tl.cdiv(stop - start, TILE)
    cols = tl.arange(0, E_PAD)
    lane = tl.arange(0, TILE)
    row_ptr = counts_ptr + b * E_PAD
    if PAIRWISE:
        tl.store(row_ptr + cols, tl.zeros([E_PAD], dtype=tl.int64))
        tl.debug_barrier()
        earlier = lane[None, :] < lane[:, None]  # (i, j): j before i
        later = lane[None, :] > lane[:, None]
        for it in range(0, n_tiles):
            idx = start + it * TILE + lane
            live = idx < stop
            # Dead lanes get the id E_PAD: no real expert, and they sit after every live lane.
            e = _safe_ids(tl.load(topk_ptr + idx, mask=live, other=E_PAD), live, E_PAD)
            tl.store(tei_ptr + idx, e, mask=live)
            same = e[:, None] == e[None, :]
            before = tl.sum((same & earlier).to(tl.int32), axis=1)
            after = tl.sum((same & later).to(tl.int32), axis=1)
            seen = tl.load(row_ptr + e, mask=live, other=0)
            rank = seen + before
            tl.store(rank_ptr + idx, rank.to(rank_ptr.dtype.element_ty), mask=live)
            # Every lane has read the running counts before the single writer per expert
            # (the tile's last pair of it) moves them on; the next tile reads after both.
            tl.debug_barrier()
            tl.store(row_ptr + e, rank + 1, mask=live & (after == 0))
            tl.debug_barrier()
    else:
        seen = tl.zeros([E_PAD], dtype=tl.int32)
        for it in range(0, n_tiles):
            idx = start + it * TILE + lane
            live = idx < stop
            e = _safe_ids(tl.load(topk_ptr + idx, mask=live, other=E_PAD), live, E_PAD)
            tl.store(tei_ptr + idx, e, mask=live)
            hit = (e[:, None] == cols[None, :]).to(tl.int32)  # (TILE, E_PAD) one-hot
            upto = tl.cumsum(hit, axis=0)  # inclusive count per expert down the tile
            rank = tl.sum(tl.where(hit != 0, upto - 1 + seen[None, :], 0), axis=1)
            tl.store(rank_ptr + idx, rank.to(rank_ptr.dtype.element_ty), mask=live)
            seen += tl.sum(hit, axis=0)
        tl.store(row_ptr + cols, seen.to(tl.int64))


@triton.jit
def _scan_blocks_kernel(
    counts_ptr,  # (NB, E_PAD) int64 in
    prefix_ptr,  # (NB, E_PAD) int64 out: exclusive prefix over blocks
    totals_ptr,  # (E_PAD,) int64 out
    num_blocks,
    E_PAD: tl.constexpr,
    EB: tl.constexpr,
    RB: tl.constexpr,
):
    cols = tl.program_id(0) * EB + tl.arange(0, EB)
    rows = tl.arange(0, RB)
    carry = tl.zeros([EB], dtype=tl.int64)
    for r0 in range(0, num_blocks, RB):
        r = r0 + rows
        offs = r[:, None].to(tl.int64) * E_PAD + cols[None, :]
        m = (r < num_blocks)[:, None]
        c = tl.load(counts_ptr + offs, mask=m, other=0)
        tl.store(prefix_ptr + offs, tl.cumsum(c, axis=0) - c + carry[None, :], mask=m)
        carry += tl.sum(c, axis=0)
    tl.store(totals_ptr + cols, carry)


@triton.jit
def _scatter_kernel(
    tei_ptr,  # (P,) int32 expert ids
    map_ptr,  # (P,) int32|int64 in: rank in block; out: position (token_index_map)
    counts_ptr,  # (NB, E_PAD) int64 (FUSED: read whole to get the prefix and the totals)
    prefix_ptr,  # (NB, E_PAD) int64 (not FUSED: from _scan_blocks_kernel)
    totals_ptr,  # (E_PAD,) int64 (not FUSED)
    base_ptr,  # (NB, E_PAD) int64 scratch: this block's first position per expert
    offsets_ptr,  # (E+1,) int64 out
    eti_ptr,  # (P,) int32 out: expert_token_indices
    num_pairs,
    num_blocks,
    chunk,
    topk,
    num_experts,
    E_PAD: tl.constexpr,
    TILE: tl.constexpr,
    FUSED: tl.constexpr,
    RB: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, E_PAD)
    if FUSED:
        # Few blocks: every program sums the small counts matrix itself (saves a launch).
        totals = tl.zeros([E_PAD], dtype=tl.int64)
        before = tl.zeros([E_PAD], dtype=tl.int64)
        rows = tl.arange(0, RB)
        for r0 in range(0, num_blocks, RB):
            r = r0 + rows
            c = tl.load(
                counts_ptr + r[:, None].to(tl.int64) * E_PAD + cols[None, :],
                mask=(r < num_blocks)[:, None],
                other=0,
            )
            totals += tl.sum(c, axis=0)
            before += tl.sum(tl.where((r < b)[:, None], c, 0), axis=0)
    else:
        totals = tl.load(totals_ptr + cols)
        before = tl.load(prefix_ptr + b * E_PAD + cols)
    upto = tl.cumsum(totals, axis=0)
    if b == 0:
        tl.store(offsets_ptr + cols, tl.zeros([E_PAD], dtype=tl.int64), mask=cols == 0)
        tl.store(offsets_ptr + 1 + cols, upto, mask=cols < num_experts)
    tl.store(base_ptr + b * E_PAD + cols, upto - totals + before)
    tl.debug_barrier()  # the gathers below read the row other lanes just wrote
    start = b * chunk
    stop = tl.minimum(start + chunk, num_pairs)
    lane = tl.arange(0, TILE)
    for it in range(0, tl.cdiv(stop - start, TILE)):
        idx = start + it * TILE + lane
        live = idx < stop
        e = tl.load(tei_ptr + idx, mask=live, other=0)
        rank = tl.load(map_ptr + idx, mask=live, other=0)
        pos = tl.load(base_ptr + b * E_PAD + e, mask=live, other=0) + rank
        tl.store(map_ptr + idx, pos.to(map_ptr.dtype.element_ty), mask=live)
        tl.store(eti_ptr + pos, (idx // topk).to(tl.int32), mask=live)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=1024)
def routing_config(
    num_pairs: int,
    num_experts: int,
    *,
    pairwise: bool | None = None,
    fused: bool | None = None,
    max_blocks: int | None = None,
) -> dict:
    """Launch parameters for ``num_pairs`` pairs over ``num_experts`` experts.

    The keywords override the tuned choices (tests use them to cover every path):
    ``pairwise`` the tile-rank method, ``fused`` two launches (scan inside the scatter kernel)
    instead of three, ``max_blocks`` the cap on the number of blocks.
    """
    e_pad = max(2, _next_pow2(num_experts))
    if pairwise is None:
        pairwise = e_pad >= PAIRWISE_MIN_E_PAD
    tile = _PAIRWISE_TILE if pairwise else max(16, min(1024, _ONEHOT_CELLS // e_pad))
    # Fused: every program reads the whole (NB, E_PAD) counts, so NB^2 * E_PAD stays small.
    fused_blocks = max(1, math.isqrt(_FUSED_READ_CELLS // e_pad))
    if fused is None:  # fused while that few blocks still give each a short walk
        fused = num_pairs <= fused_blocks * tile * _FUSED_MAX_TILES
    if max_blocks is None:
        if fused:
            max_blocks = fused_blocks
        else:
            max_blocks = _MAX_BLOCKS_PAIRWISE if pairwise else _MAX_BLOCKS_ONEHOT
    chunk = -(-max(tile, -(-num_pairs // max_blocks)) // tile) * tile
    eb = min(e_pad, 16)
    return dict(
        e_pad=e_pad,
        pairwise=pairwise,
        fused=fused,
        tile=tile,
        chunk=chunk,
        num_blocks=max(1, -(-num_pairs // chunk)),
        scatter_tile=min(_SCATTER_TILE, _next_pow2(chunk)),
        eb=eb,
        scan_rb=_SCAN_CELLS // eb,
        fused_rb=max(1, _SCAN_CELLS // e_pad),
    )


def build_routing_index_triton(
    topk_idx: Tensor,
    num_experts: int,
    *,
    out: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    **overrides: bool | int | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Atomic-free build of ``(expert_token_indices, expert_token_offsets, token_expert_indices,
    token_index_map)`` for a validated ``topk_idx (T, K)``; bitwise equal to the torch build.

    ``out``: the four arrays to write, in that order (``index_arrays_like``'s shapes and dtypes,
    contiguous, on ``topk_idx``'s device), e.g. views of one buffer; default fresh ones.
    ``overrides``: ``routing_config``'s keywords (``pairwise``, ``fused``, ``max_blocks``), which
    override the tuned launch choices. No host sync.
    """
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be 2-D (T, K), got shape {tuple(topk_idx.shape)}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(
            f"num_experts={num_experts} is outside [1, {MAX_EXPERTS}] for the Triton routing "
            "build; use build_routing_index(..., impl='torch') for more experts"
        )
    num_tokens, topk = topk_idx.shape
    # expert_token_indices holds token ids as int32 (positions and pair ids are int64)
    check_int32("T (tokens)", num_tokens, where="build_routing_index_triton",
                fix="split the micro-batch so one build holds fewer tokens")  # fmt: skip
    num_pairs = num_tokens * topk
    # before the empty return, so that a misspelt override raises whatever the input
    cfg = routing_config(num_pairs, num_experts, **overrides)
    device = topk_idx.device
    if out is None:
        eti, offsets, tei, tim = (
            torch.empty(shape, dtype=dt, device=device)
            for shape, dt in index_arrays_like(num_pairs, num_experts)
        )
    else:
        check_index_out(out, num_pairs, num_experts, device)
        eti, offsets, tei, tim = out
    if num_pairs == 0:
        offsets.zero_()
        return eti, offsets, tei, tim
    e_pad, nb, fused = cfg["e_pad"], cfg["num_blocks"], cfg["fused"]
    # The kernels index flat[i]: a strided view (e.g. a column of a wider tensor) must be copied.
    flat = topk_idx.reshape(-1).contiguous()  # any integer dtype
    # One workspace: counts and bases (NB, E_PAD); unfused also prefix (NB, E_PAD), totals.
    cells = nb * e_pad
    work = torch.empty((2 if fused else 3) * cells + (0 if fused else e_pad), dtype=torch.int64,
                       device=device)  # fmt: skip
    counts, base = work[:cells], work[cells : 2 * cells]
    prefix, totals = (counts, counts) if fused else (work[2 * cells : 3 * cells], work[3 * cells :])
    _count_rank_kernel[(nb,)](
        flat,
        tei,
        tim,
        counts,
        num_pairs,
        cfg["chunk"],
        E_PAD=e_pad,
        TILE=cfg["tile"],
        PAIRWISE=cfg["pairwise"],
        num_warps=4,
    )
    if not fused:
        _scan_blocks_kernel[(e_pad // cfg["eb"],)](
            counts, prefix, totals, nb, E_PAD=e_pad, EB=cfg["eb"], RB=cfg["scan_rb"], num_warps=4
        )
    _scatter_kernel[(nb,)](
        tei,
        tim,
        counts,
        prefix,
        totals,
        base,
        offsets,
        eti,
        num_pairs,
        nb,
        cfg["chunk"],
        topk,
        num_experts,
        E_PAD=e_pad,
        TILE=cfg["scatter_tile"],
        FUSED=fused,
        RB=cfg["fused_rb"],
        num_warps=4,
    )
    return eti, offsets, tei, tim
