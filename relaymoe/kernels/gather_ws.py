"""The up-projection as a warp-specialised, persistent Gluon kernel for sm90 (Triton >= 3.6).

What it fixes (issue #15, H200, qwen3 T32k, ``benchmarks/probe_gather.py``): the gather itself
costs nothing (the Triton kernel ran 3.19 ms over gathered rows, 3.26 over a sorted copy), but
each program's epilogue does: storing h (64 KB a 128-row tile) took 0.38 ms of 3.38, with the
tensor cores idle while a program stores. Here each program walks many tiles, and three warp
partitions overlap:
- producer (4 warps): gathers each step's x rows with ``cp.async`` (the stage's mbarrier counts
  every producer thread's copies: ``cp.async.mbarrier.arrive.noinc``) and brings the gate and up
  weight tiles by TMA onto the same barrier; it runs ahead across tiles;
- consumer (the kernel's warps): waits, fences (``cp.async`` writes through the generic proxy,
  ``wgmma`` reads through the async one) and issues the gate and up ``wgmma``; at a tile's end
  it writes both accumulators, rounded to the output dtype, into shared memory;
- storer (4 warps): stores h from there in 16-byte vectors and computes a = silu(gate) * up (* p)
  from the stored values while the consumer runs the next tile.

Shape legend as in ``grouped``: T tokens, H hidden, I expert FFN width, El local experts, P pairs
of the range (rows ``offs[0]:offs[El]`` of the routing index).

Barriers: ``ready[s]`` / ``empty[s]`` per slot (step ``c`` of the program uses slot
``c % STAGES`` with parity ``(c // STAGES) & 1``; ``ready`` expects the producer's threads plus
the TMA's ``expect``); ``epi_ready`` / ``epi_empty`` for the one epilogue buffer. An arrive is one
thread's, so a partition of two warp groups meets at a partition barrier first.

Only this module imports ``triton.experimental.gluon``; ``grouped.up_swiglu`` imports it lazily
on sm90 (``RELAYMOE_GATHER_WS``), so CPU runs never touch it.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["UP_CONFIG", "supports_up_swiglu", "up_swiglu"]

PRODUCER_WARPS = 4
STORER_WARPS = 4
# tiles, slots, consumer warps, the storer's row slice, the workers' registers and the cap
# H200, qwen3 T32k (benchmarks/sweep_kernels.py --kernels up_swiglu, c91189d): 2.91 ms against
# 3.18 for the Triton kernel's best; 2 slots 4.54 ms, a 32-column K step with 6 slots 3.11,
# producer/storer registers 56/80 3.03 (the cap 128 is 16 warps' share of the register file)
UP_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 3, "EPI_ROWS": 32,
             "num_warps": 8, "producer_regs": 72, "storer_regs": 72, "maxnreg": 128}  # fmt: skip


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _expert_tile(pid_m, offs_ptr, n_experts, BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr,
                 num_warps: gl.constexpr):  # fmt: skip
    """(local expert, first global row, end global row) of M tile ``pid_m`` (as in
    ``grouped._expert_tile``); expert == n_experts when the program has no tile. Every warp holds
    all ``BLOCK_E`` offsets, so the scan and sums stay inside a warp (no shared-memory round)."""
    lay: gl.constexpr = gl.BlockedLayout([BLOCK_E // 32], [32], [num_warps], [0])
    j = gl.arange(0, BLOCK_E, layout=lay)
    live = j < n_experts
    lo = gl.load(offs_ptr + j, mask=live, other=0)
    hi = gl.load(offs_ptr + j + 1, mask=live, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    last = gl.associative_scan(tiles, 0, _add)
    e = gl.sum((last <= pid_m).to(gl.int32), 0)
    pick = j == e
    first_tile = gl.sum(gl.where(pick, last - tiles, 0), 0)
    row0 = gl.sum(gl.where(pick, lo, 0), 0) + (pid_m - first_tile) * BLOCK_M
    row_end = gl.sum(gl.where(pick, hi, 0), 0)
    return e, row0, row_end


@gluon.jit
def _tile_of(t, n_tiles_n, offs_ptr, n_experts, BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr,
             WARPS: gl.constexpr):  # fmt: skip
    """Work item ``t`` of the persistent loop: (expert, first row, end row, N tile); N tiles
    fastest, so the programs running at once share the gathered rows of one M tile in L2."""
    e, row0, row_end = _expert_tile(t // n_tiles_n, offs_ptr, n_experts, BLOCK_M, BLOCK_E, WARPS)
    return e, row0, row_end, t % n_tiles_n


@gluon.jit
def _gather_producer(x_ptr, idx_ptr, offs_ptr, w_desc, x_bufs, wg_bufs, wu_bufs, ready, empty,
                     n_experts, I, n_tiles, n_tiles_n, n_k, stride_xt,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                     BLOCK_E: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """Fills slot after slot, across tiles: the gate and up weight tiles by TMA, the x rows of
    the tile's tokens by ``cp.async`` (16-byte vectors, 8 columns a thread)."""
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    TK: gl.constexpr = BLOCK_K // 8
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TK, TK], [WARPS, 1], [1, 0])
    ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, lay))
    step = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        e, row0, row_end, pid_n = _tile_of(t, n_tiles_n, offs_ptr, n_experts, BLOCK_M, BLOCK_E,
                                           WARPS)  # fmt: skip
        if e < n_experts:
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lay))
            tok = gl.load(idx_ptr + rows, mask=rows < row_end, other=0).to(gl.int64)
            x_ptrs = x_ptr + tok[:, None] * stride_xt + ks[None, :]
            g_row = (e * 2 * I + pid_n * BLOCK_N).to(gl.int32)
            for i in range(n_k):
                s = step % STAGES
                mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [g_row, i * BLOCK_K], bar,
                                                wg_bufs.index(s))  # fmt: skip
                tma.async_copy_global_to_shared(w_desc, [g_row + I, i * BLOCK_K], bar,
                                                wu_bufs.index(s))  # fmt: skip
                async_copy.async_copy_global_to_shared(x_bufs.index(s), x_ptrs + i * BLOCK_K)
                async_copy.mbarrier_arrive(bar, increment_count=False)
                step += 1


@gluon.jit
def _dual_mma_consumer(x_bufs, wg_bufs, wu_bufs, ready, empty, g_epi, u_epi, epi_ready,
                       epi_empty, offs_ptr, n_experts, n_tiles, n_tiles_n, n_k,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_E: gl.constexpr,
                       num_warps: gl.constexpr):  # fmt: skip
    """gate and up accumulators of each tile (one step's two MMAs stay in flight), handed to the
    storer through shared memory in the output dtype."""
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    step = 0
    done = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        e, row0, row_end, pid_n = _tile_of(t, n_tiles_n, offs_ptr, n_experts, BLOCK_M, BLOCK_E,
                                           num_warps)  # fmt: skip
        if e < n_experts:
            acc_g = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
            acc_u = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
            for i in range(n_k):
                s = step % STAGES
                mbarrier.wait(ready.index(s), (step // STAGES) & 1)
                fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads async
                xs = x_bufs.index(s)
                acc_g = warpgroup_mma(xs, wg_bufs.index(s).permute((1, 0)), acc_g, is_async=True)
                acc_u = warpgroup_mma(xs, wu_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
                if num_warps > 4:
                    gl.thread_barrier()
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=i > 0)
                step += 1
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
            if num_warps > 4:
                gl.thread_barrier()
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
            mbarrier.wait(epi_empty, (done & 1) ^ 1)
            g_epi.store(acc_g.to(g_epi.dtype))
            u_epi.store(acc_u.to(u_epi.dtype))
            gl.thread_barrier()
            mbarrier.arrive(epi_ready)
            done += 1


@gluon.jit
def _swiglu_storer(g_epi, u_epi, epi_ready, epi_empty, offs_ptr, prob_ptr, h_ptr, a_ptr,
                   n_experts, I, n_tiles, n_tiles_n, stride_hp, stride_ap,
                   SAVE_H: gl.constexpr, SCALE: gl.constexpr, SAVE_A: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_E: gl.constexpr,
                   ROWS: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """Drains each tile's gate and up from shared memory in ``ROWS``-row slices while the
    consumer runs the next tile: h stored (16-byte vectors), a = silu(gate) * up (* p) from the
    stored values, rows masked at the expert's end and columns at I."""
    TN: gl.constexpr = BLOCK_N // 8
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TN, TN], [WARPS, 1], [1, 0])
    base = gl.load(offs_ptr)
    done = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        e, row0, row_end, pid_n = _tile_of(t, n_tiles_n, offs_ptr, n_experts, BLOCK_M, BLOCK_E,
                                           WARPS)  # fmt: skip
        if e < n_experts:
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, lay))
            col_ok = cols < I
            mbarrier.wait(epi_ready, done & 1)
            for r in gl.static_range(0, BLOCK_M, ROWS):
                rows = row0 + r + gl.arange(0, ROWS, layout=gl.SliceLayout(1, lay))
                row_ok = rows < row_end
                lrows = gl.where(row_ok, rows - base, 0)
                mask = row_ok[:, None] & col_ok[None, :]
                gate = g_epi.slice(r, ROWS).load(lay)
                up = u_epi.slice(r, ROWS).load(lay)
                if SAVE_H:
                    hp = h_ptr + lrows[:, None] * stride_hp + cols[None, :]
                    gl.store(hp, gate, mask=mask)
                    gl.store(hp + I, up, mask=mask)
                if SAVE_A:
                    g32 = gate.to(gl.float32)
                    act = g32 / (1.0 + gl.exp(-g32)) * up.to(gl.float32)
                    if SCALE:
                        p = gl.load(prob_ptr + lrows, mask=row_ok, other=0.0)
                        act = act * p.to(gl.float32)[:, None]
                    ap = a_ptr + lrows[:, None] * stride_ap + cols[None, :]
                    gl.store(ap, act.to(a_ptr.dtype.element_ty), mask=mask)
            gl.thread_barrier()
            mbarrier.arrive(epi_empty)
            done += 1


@gluon.jit
def _up_swiglu_ws_kernel(
    x_ptr, w_desc, idx_ptr, offs_ptr, prob_ptr, h_ptr, a_ptr,
    n_experts, H, I, n_tiles,
    stride_xt, stride_hp, stride_ap,
    x_layout: gl.constexpr, epi_layout: gl.constexpr,
    SAVE_H: gl.constexpr, SCALE: gl.constexpr, SAVE_A: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
    STAGES: gl.constexpr, EPI_ROWS: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    STORER_WARPS: gl.constexpr, STORER_REGS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """h[q] = x[tok[q]] @ w13[e]^T, a = silu(gate) * up (* p): ``grouped._up_swiglu_kernel``'s
    contract, with ``H % BLOCK_K == 0`` and w13 read as (El*2I, H) rows through ``w_desc``.
    Persistent: each program walks work items ``pid, pid + nprog, ...`` of the ``n_tiles``
    (M tiles, an upper bound, x N tiles); the three partitions walk the same items."""
    x_bufs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BLOCK_M, BLOCK_K],
                                       x_layout)  # fmt: skip
    wg_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape,
                                        w_desc.layout)  # fmt: skip
    wu_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape,
                                        w_desc.layout)  # fmt: skip
    g_epi = gl.allocate_shared_memory(h_ptr.dtype.element_ty, [BLOCK_M, BLOCK_N], epi_layout)
    u_epi = gl.allocate_shared_memory(h_ptr.dtype.element_ty, [BLOCK_M, BLOCK_N], epi_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    epi_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    epi_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=PRODUCER_WARPS * 32 + 1)
        mbarrier.init(empty.index(s), count=1)
    mbarrier.init(epi_ready, count=1)
    mbarrier.init(epi_empty, count=1)
    n_tiles_n = gl.cdiv(I, BLOCK_N)
    n_k = H // BLOCK_K
    # fmt: off
    # (argument tuples written in place: a tuple bound to a name first loses its constexprs)
    gl.warp_specialize(
        [(_dual_mma_consumer, (x_bufs, wg_bufs, wu_bufs, ready, empty, g_epi, u_epi, epi_ready,
                               epi_empty, offs_ptr, n_experts, n_tiles, n_tiles_n, n_k,
                               BLOCK_M, BLOCK_N, BLOCK_E, num_warps)),
         (_gather_producer, (x_ptr, idx_ptr, offs_ptr, w_desc, x_bufs, wg_bufs, wu_bufs, ready,
                             empty, n_experts, I, n_tiles, n_tiles_n, n_k, stride_xt,
                             BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, PRODUCER_WARPS)),
         (_swiglu_storer, (g_epi, u_epi, epi_ready, epi_empty, offs_ptr, prob_ptr, h_ptr, a_ptr,
                           n_experts, I, n_tiles, n_tiles_n, stride_hp, stride_ap,
                           SAVE_H, SCALE, SAVE_A, BLOCK_M, BLOCK_N, BLOCK_E, EPI_ROWS,
                           STORER_WARPS))],
        [PRODUCER_WARPS, STORER_WARPS],
        [PRODUCER_REGS, STORER_REGS],
    )
    # fmt: on
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    mbarrier.invalidate(epi_ready)
    mbarrier.invalidate(epi_empty)


def supports_up_swiglu(x_TH, w13_E2IH, config=None) -> bool:
    """Whether this kernel takes the call: bf16/fp16 CUDA tensors on sm90, H a multiple of the K
    step, a contiguous w13 whose (El*2I, H) rows a tensor descriptor takes, 16-byte x rows."""
    cfg = config or UP_CONFIG
    if not (x_TH.is_cuda and x_TH.dtype in (torch.bfloat16, torch.float16)):
        return False
    if w13_E2IH.dtype != x_TH.dtype or not w13_E2IH.is_contiguous():
        return False
    if torch.cuda.get_device_capability(x_TH.device)[0] != 9:
        return False
    hidden = w13_E2IH.shape[2]
    elt = x_TH.element_size()
    return (
        hidden % cfg["BLOCK_K"] == 0
        and x_TH.stride(1) == 1
        and (x_TH.stride(0) * elt) % 16 == 0
        and x_TH.data_ptr() % 16 == 0
        and w13_E2IH.data_ptr() % 16 == 0
        and (hidden * elt) % 16 == 0
    )


@functools.cache
def _layouts(bm: int, bn: int, bk: int, dtype: torch.dtype):
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([bm, bk], gdt),
            gl.NVMMASharedLayout.get_default_for([bn, bk], gdt),
            gl.NVMMASharedLayout.get_default_for([bm, bn], gdt))  # fmt: skip


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def up_swiglu(x_TH, w13_E2IH, idx_P, offs, prob_P, h_P2I, a_PI, *, config=None) -> None:
    """``grouped.up_swiglu``'s contract (outputs passed in, ``h_P2I`` or ``a_PI`` may be None);
    call only where :func:`supports_up_swiglu` holds. ``a`` is computed from h rounded to the
    output dtype (the storer's input), not from the fp32 accumulators."""
    cfg = config or UP_CONFIG
    n_experts, two_i, hidden = w13_E2IH.shape
    ffn = two_i // 2
    n_pairs = (a_PI if a_PI is not None else h_P2I).shape[0]
    if n_pairs == 0 or n_experts == 0:
        return
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x_layout, w_layout, epi_layout = _layouts(bm, bn, bk, x_TH.dtype)
    w_desc = TensorDescriptor.from_tensor(w13_E2IH.view(n_experts * two_i, hidden), [bn, bk],
                                          w_layout)  # fmt: skip
    h = h_P2I if h_P2I is not None else a_PI
    a = a_PI if a_PI is not None else h_P2I
    p = prob_P if prob_P is not None else a
    n_tiles = (triton.cdiv(n_pairs, bm) + n_experts) * triton.cdiv(ffn, bn)
    grid = (min(n_tiles, _sm_count(x_TH.device.index or 0) * cfg.get("ctas_per_sm", 1)),)
    _up_swiglu_ws_kernel[grid](
        x_TH, w_desc, idx_P, offs, p, h, a,
        n_experts, hidden, ffn, n_tiles,
        x_TH.stride(0), h.stride(0), a.stride(0),
        x_layout, epi_layout,
        SAVE_H=h_P2I is not None, SCALE=prob_P is not None, SAVE_A=a_PI is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=max(32, triton.next_power_of_2(n_experts)),
        STAGES=cfg["STAGES"], EPI_ROWS=cfg["EPI_ROWS"],
        PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=cfg["producer_regs"],
        STORER_WARPS=STORER_WARPS, STORER_REGS=cfg["storer_regs"], num_warps=cfg["num_warps"],
        maxnreg=cfg["maxnreg"],
    )  # fmt: skip
