"""The gathered-row GEMMs as warp-specialised, persistent Gluon kernels for sm90 (Triton >= 3.6):
the up-projection ``x[tok] @ w13[e]^T`` with its SwiGLU, and the down projection's backward
``dy[tok] @ w2[e]``.

Why: gathering the rows on load costs about nothing against a pre-sorted copy of the rows, but a one-tile-a-program kernel leaves the tensor cores idle while each
program stores its epilogue. Here each program walks many tiles, and three warp partitions
overlap:
- producer (``producer_warps``, 4): gathers each step's x rows with ``cp.async`` (the stage's
  mbarrier counts every producer thread's copies: ``cp.async.mbarrier.arrive.noinc``) and brings
  the gate and up weight tiles by TMA onto the same barrier; it runs ahead across tiles;
- consumer (the kernel's warps): waits, fences (``cp.async`` writes through the generic proxy,
  ``wgmma`` reads through the async one) and issues the gate and up ``wgmma``; at a tile's end
  it writes both accumulators, rounded to the output dtype, into shared memory;
- storer (``storer_warps``, 4): stores h from there in 16-byte vectors and computes
  a = silu(gate) * up (* p) from the stored values while the consumer runs the next tile.
The plain GEMM is the same kernel with its (K, N) weight tiles taken as two adjacent column
blocks in place of gate and up (``W_KN``), and no SwiGLU.

Shape legend as in ``grouped``: T tokens, H hidden, I expert FFN width, El local experts, P pairs
of the range (rows ``offs[0]:offs[El]`` of the routing index).

Barriers: ``ready[s]`` / ``empty[s]`` per slot (step ``c`` of the program uses slot
``c % STAGES`` with parity ``(c // STAGES) & 1``; ``ready`` expects the producer's threads plus
the TMA's ``expect``); ``epi_ready`` / ``epi_empty`` for the one epilogue buffer. An arrive is one
thread's, so a partition of two warp groups meets at a partition barrier first.

Only the up-projection and the down projection's backward run here: the weight gradients and a
SwiGLU backward fused into the storer were slower in this form than the Triton kernels, which
keep them. The main loop is bound by the producer's gather issue, not by the slot count; Triton
caps a kernel at 16 warps (512 threads), so the producer cannot grow without taking the storer's
warps.

Only this module imports ``triton.experimental.gluon``; ``grouped.up_swiglu`` and
``grouped.rows_gemm`` import it lazily on sm90 (``KernelOptions.gather_ws``), so CPU runs never touch
it.
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

from relaymoe.kernels import tile_group_m

# a barrier among the warps of one partition: ``thread_barrier`` in Triton 3.6, ``barrier`` later
_partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

__all__ = ["ROWS_CONFIG", "UP_CONFIG", "rows_gemm", "supports_rows_gemm", "supports_up_swiglu",
           "up_swiglu"]  # fmt: skip

# tiles, slots, consumer warps, the storer's row slice, the tile order's M group, the workers'
# registers and the cap (128: 16 warps' share of the register file); the fastest combination
# when each was timed alone.
UP_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 3, "EPI_ROWS": 16,
             "GROUP_M": 8, "num_warps": 8, "producer_warps": 4, "storer_warps": 4,
             "producer_regs": 72, "storer_regs": 72, "maxnreg": 128}  # fmt: skip
# the plain gathered GEMM (down projection's backward, dy[tok] @ w2[e]): a tile is two adjacent
# 128-column blocks, drained in 32-row slices (faster than 16 here)
ROWS_CONFIG = dict(UP_CONFIG, EPI_ROWS=32)


def _default_config(cfg: dict, n_tiles_n: int) -> dict:
    """``cfg`` with the GROUP_M of its shape (``relaymoe.kernels.tile_group_m``)."""
    return dict(cfg, GROUP_M=tile_group_m(n_tiles_n, cfg["GROUP_M"]))


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _expert_tile(pid_m, offs_ptr, n_experts, BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr,
                 num_warps: gl.constexpr):  # fmt: skip
    """(local expert, first global row, end global row) of M tile ``pid_m`` (as in
    ``grouped.tiles._expert_tile``); expert == n_experts when the program has no tile. Every warp holds
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
def _tile_of(t, n_tiles, n_tiles_n, offs_ptr, n_experts, BLOCK_M: gl.constexpr,
             BLOCK_E: gl.constexpr, GROUP_M: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """Work item ``t`` of the persistent loop: (expert, first row, end row, N tile). Items run
    in groups of ``GROUP_M`` M tiles, M fastest inside a group: the programs running at once
    share a few M tiles' gathered rows and a few weight column blocks in L2. (N fastest, the
    old order, had every program of a wide expert (moeblaze conf4: 64 N tiles) read the whole
    weight again for each M tile.)"""
    n_m = n_tiles // n_tiles_n
    per_group = GROUP_M * n_tiles_n
    first_m = (t // per_group) * GROUP_M
    size = gl.minimum(n_m - first_m, GROUP_M)
    rem = t % per_group
    e, row0, row_end = _expert_tile(first_m + rem % size, offs_ptr, n_experts, BLOCK_M, BLOCK_E,
                                    WARPS)  # fmt: skip
    return e, row0, row_end, rem // size


@gluon.jit
def _halves(pid_n, n_cols, W_KN: gl.constexpr, BLOCK_N: gl.constexpr):
    """(first column of the lo half, offset of the hi half, end of lo, end of hi) of N tile
    ``pid_n``. Up-projection (``W_KN`` False): lo = gate columns, hi = the up columns I further
    (h's second half). Plain GEMM: lo and hi are two adjacent BLOCK_N column blocks."""
    if W_KN:
        return pid_n * 2 * BLOCK_N, BLOCK_N, n_cols, n_cols
    return pid_n * BLOCK_N, n_cols, n_cols, 2 * n_cols


@gluon.jit
def _gather_producer(x_ptr, idx_ptr, offs_ptr, w_desc, x_bufs, lo_bufs, hi_bufs, ready, empty,
                     n_experts, K, n_cols, n_tiles, n_tiles_n, stride_xt,
                     W_KN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr, GROUP_M: gl.constexpr,
                     WARPS: gl.constexpr):  # fmt: skip
    """Fills slot after slot, across tiles: the two weight tiles by TMA, the x rows of the
    tile's tokens by ``cp.async`` (16-byte vectors, 8 columns a thread)."""
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    TK: gl.constexpr = BLOCK_K // 8
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TK, TK], [WARPS, 1], [1, 0])
    ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, lay))
    n_k = K // BLOCK_K
    step = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        e, row0, row_end, pid_n = _tile_of(t, n_tiles, n_tiles_n, offs_ptr, n_experts, BLOCK_M,
                                           BLOCK_E, GROUP_M, WARPS)  # fmt: skip
        if e < n_experts:
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lay))
            tok = gl.load(idx_ptr + rows, mask=rows < row_end, other=0).to(gl.int64)
            x_ptrs = x_ptr + tok[:, None] * stride_xt + ks[None, :]
            col0, hi_off, lo_end, hi_end = _halves(pid_n, n_cols, W_KN, BLOCK_N)
            if W_KN:  # w as (El*K, N) rows
                w_row = (e * K).to(gl.int32)
            else:  # w13 as (El*2I, H) rows
                w_row = (e * 2 * n_cols + col0).to(gl.int32)
            for i in range(n_k):
                s = step % STAGES
                mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)
                if W_KN:
                    tma.async_copy_global_to_shared(w_desc, [w_row + i * BLOCK_K, col0], bar,
                                                    lo_bufs.index(s))  # fmt: skip
                    tma.async_copy_global_to_shared(w_desc, [w_row + i * BLOCK_K, col0 + hi_off],
                                                    bar, hi_bufs.index(s))  # fmt: skip
                else:
                    tma.async_copy_global_to_shared(w_desc, [w_row, i * BLOCK_K], bar,
                                                    lo_bufs.index(s))  # fmt: skip
                    tma.async_copy_global_to_shared(w_desc, [w_row + hi_off, i * BLOCK_K], bar,
                                                    hi_bufs.index(s))  # fmt: skip
                async_copy.async_copy_global_to_shared(x_bufs.index(s), x_ptrs + i * BLOCK_K)
                async_copy.mbarrier_arrive(bar, increment_count=False)
                step += 1


@gluon.jit
def _dual_mma_consumer(x_bufs, lo_bufs, hi_bufs, ready, empty, lo_epi, hi_epi, epi_ready,
                       epi_empty, offs_ptr, h_ptr, n_experts, K, n_tiles, n_tiles_n,
                       W_KN: gl.constexpr, EPI: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
                       GROUP_M: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """The lo and hi accumulators of each tile (one step's two MMAs stay in flight), handed to
    the storer through shared memory in the output dtype (``EPI``; else reduced to row sums
    stored only where one is NaN, so the MMAs stay live: a diagnostic that times the main loop
    alone)."""
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    n_k = K // BLOCK_K
    step = 0
    done = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        e, row0, row_end, pid_n = _tile_of(t, n_tiles, n_tiles_n, offs_ptr, n_experts, BLOCK_M,
                                           BLOCK_E, GROUP_M, num_warps)  # fmt: skip
        if e < n_experts:
            acc_lo = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
            acc_hi = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
            for i in range(n_k):
                s = step % STAGES
                mbarrier.wait(ready.index(s), (step // STAGES) & 1)
                fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads async
                xs = x_bufs.index(s)
                if W_KN:
                    b_lo = lo_bufs.index(s)
                    b_hi = hi_bufs.index(s)
                else:
                    b_lo = lo_bufs.index(s).permute((1, 0))
                    b_hi = hi_bufs.index(s).permute((1, 0))
                acc_lo = warpgroup_mma(xs, b_lo, acc_lo, is_async=True)
                acc_hi = warpgroup_mma(xs, b_hi, acc_hi, is_async=True)
                acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc_lo, acc_hi))
                if num_warps > 4:
                    _partition_barrier()
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=i > 0)
                step += 1
            acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc_lo, acc_hi))
            if num_warps > 4:
                _partition_barrier()
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
            if EPI:
                mbarrier.wait(epi_empty, (done & 1) ^ 1)
                lo_epi.store(acc_lo.to(lo_epi.dtype))
                hi_epi.store(acc_hi.to(hi_epi.dtype))
                _partition_barrier()
                mbarrier.arrive(epi_ready)
                done += 1
            else:
                v = gl.sum(acc_lo + acc_hi, axis=1)
                rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
                gl.store(h_ptr + rows, v.to(h_ptr.dtype.element_ty), mask=v != v)


@gluon.jit
def _tile_storer(lo_epi, hi_epi, epi_ready, epi_empty, offs_ptr, prob_ptr, h_ptr, a_ptr,
                 n_experts, n_cols, n_tiles, n_tiles_n, stride_hp, stride_ap,
                 W_KN: gl.constexpr, SAVE_H: gl.constexpr, SCALE: gl.constexpr,
                 SAVE_A: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_E: gl.constexpr, GROUP_M: gl.constexpr, ROWS: gl.constexpr,
                 WARPS: gl.constexpr):  # fmt: skip
    """Drains each tile from shared memory in ``ROWS``-row slices while the consumer runs the
    next tile: both halves stored into h (16-byte vectors); for the up-projection also
    a = silu(gate) * up (* p) from the stored values. Rows masked at the expert's end."""
    TN: gl.constexpr = BLOCK_N // 8
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TN, TN], [WARPS, 1], [1, 0])
    base = gl.load(offs_ptr)
    done = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        e, row0, row_end, pid_n = _tile_of(t, n_tiles, n_tiles_n, offs_ptr, n_experts, BLOCK_M,
                                           BLOCK_E, GROUP_M, WARPS)  # fmt: skip
        if e < n_experts and (SAVE_H or SAVE_A):
            col0, hi_off, lo_end, hi_end = _halves(pid_n, n_cols, W_KN, BLOCK_N)
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, lay))
            lo_ok = cols < lo_end
            hi_ok = cols + hi_off < hi_end
            mbarrier.wait(epi_ready, done & 1)
            for r in gl.static_range(0, BLOCK_M, ROWS):
                rows = row0 + r + gl.arange(0, ROWS, layout=gl.SliceLayout(1, lay))
                row_ok = rows < row_end
                lrows = gl.where(row_ok, rows - base, 0)
                lo = lo_epi.slice(r, ROWS).load(lay)
                hi = hi_epi.slice(r, ROWS).load(lay)
                if SAVE_H:
                    hp = h_ptr + lrows[:, None] * stride_hp + cols[None, :]
                    gl.store(hp, lo, mask=row_ok[:, None] & lo_ok[None, :])
                    gl.store(hp + hi_off, hi, mask=row_ok[:, None] & hi_ok[None, :])
                if SAVE_A:
                    g32 = lo.to(gl.float32)
                    act = g32 / (1.0 + gl.exp(-g32)) * hi.to(gl.float32)
                    if SCALE:
                        p = gl.load(prob_ptr + lrows, mask=row_ok, other=0.0)
                        act = act * p.to(gl.float32)[:, None]
                    ap = a_ptr + lrows[:, None] * stride_ap + cols[None, :]
                    gl.store(ap, act.to(a_ptr.dtype.element_ty),
                             mask=row_ok[:, None] & lo_ok[None, :])  # fmt: skip
            _partition_barrier()
            mbarrier.arrive(epi_empty)
            done += 1


@gluon.jit
def _gathered_gemm_ws_kernel(
    x_ptr, w_desc, idx_ptr, offs_ptr, prob_ptr, h_ptr, a_ptr,
    n_experts, K, n_cols, n_tiles,
    stride_xt, stride_hp, stride_ap,
    x_layout: gl.constexpr, epi_layout: gl.constexpr,
    W_KN: gl.constexpr, SAVE_H: gl.constexpr, SCALE: gl.constexpr, SAVE_A: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
    STAGES: gl.constexpr, EPI_ROWS: gl.constexpr, GROUP_M: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    STORER_WARPS: gl.constexpr, STORER_REGS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Rows ``x[tok[q]]`` (q of the range, K = H columns, ``K % BLOCK_K == 0``) times expert e's
    weight, persistent over the work items ``pid, pid + nprog, ...`` of ``n_tiles`` (M tiles, an
    upper bound, x N tiles); the three partitions walk the same items.
    - ``W_KN`` False (up-projection): w13 as (El*2I, H) rows through ``w_desc``, ``n_cols`` = I;
      h = [gate, up] stored when ``SAVE_H``, a = silu(gate) * up (* p) when ``SAVE_A``.
    - ``W_KN`` True (plain): w as (El*K, N) rows, ``n_cols`` = N; h = x[tok] @ w[e].
    Neither ``SAVE_H`` nor ``SAVE_A``: nothing is stored and no epilogue buffer is allocated,
    which times the main loop alone (``store_nothing`` of :func:`up_swiglu` / :func:`rows_gemm`)."""
    x_bufs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BLOCK_M, BLOCK_K],
                                       x_layout)  # fmt: skip
    lo_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape,
                                        w_desc.layout)  # fmt: skip
    hi_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape,
                                        w_desc.layout)  # fmt: skip
    EPI: gl.constexpr = SAVE_H or SAVE_A
    EPI_M: gl.constexpr = BLOCK_M if EPI else 8  # no stores (a diagnostic): a token buffer
    lo_epi = gl.allocate_shared_memory(h_ptr.dtype.element_ty, [EPI_M, BLOCK_N], epi_layout)
    hi_epi = gl.allocate_shared_memory(h_ptr.dtype.element_ty, [EPI_M, BLOCK_N], epi_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    epi_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    epi_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=PRODUCER_WARPS * 32 + 1)
        mbarrier.init(empty.index(s), count=1)
    mbarrier.init(epi_ready, count=1)
    mbarrier.init(epi_empty, count=1)
    if W_KN:
        n_tiles_n = gl.cdiv(n_cols, 2 * BLOCK_N)
    else:
        n_tiles_n = gl.cdiv(n_cols, BLOCK_N)
    # fmt: off
    # (argument tuples written in place: a tuple bound to a name first loses its constexprs)
    gl.warp_specialize(
        [(_dual_mma_consumer, (x_bufs, lo_bufs, hi_bufs, ready, empty, lo_epi, hi_epi, epi_ready,
                               epi_empty, offs_ptr, h_ptr, n_experts, K, n_tiles, n_tiles_n,
                               W_KN, EPI, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, GROUP_M,
                               num_warps)),
         (_gather_producer, (x_ptr, idx_ptr, offs_ptr, w_desc, x_bufs, lo_bufs, hi_bufs, ready,
                             empty, n_experts, K, n_cols, n_tiles, n_tiles_n, stride_xt,
                             W_KN, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, GROUP_M,
                             PRODUCER_WARPS)),
         (_tile_storer, (lo_epi, hi_epi, epi_ready, epi_empty, offs_ptr, prob_ptr, h_ptr, a_ptr,
                         n_experts, n_cols, n_tiles, n_tiles_n, stride_hp, stride_ap,
                         W_KN, SAVE_H, SCALE, SAVE_A, BLOCK_M, BLOCK_N, BLOCK_E, GROUP_M,
                         EPI_ROWS, STORER_WARPS))],
        [PRODUCER_WARPS, STORER_WARPS],
        [PRODUCER_REGS, STORER_REGS],
    )
    # fmt: on
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    mbarrier.invalidate(epi_ready)
    mbarrier.invalidate(epi_empty)


def _supports(x_TK, w, outs, cfg) -> bool:
    """bf16/fp16 CUDA tensors on sm90; K a multiple of the K step; a contiguous weight whose 2-D
    row view a tensor descriptor takes; x rows of unit column stride and 16-byte aligned; outputs
    (None: not written) in x's dtype with unit column stride (the epilogue buffer holds them)."""
    if not (x_TK.is_cuda and x_TK.dtype in (torch.bfloat16, torch.float16)):
        return False
    if w.dtype != x_TK.dtype or not w.is_contiguous() or w.data_ptr() % 16:
        return False
    if any(o is not None and (o.dtype != x_TK.dtype or o.stride(1) != 1) for o in outs):
        return False
    if torch.cuda.get_device_capability(x_TK.device)[0] != 9:
        return False
    elt = x_TK.element_size()
    return (
        x_TK.shape[1] % cfg["BLOCK_K"] == 0
        and x_TK.stride(1) == 1
        and (x_TK.stride(0) * elt) % 16 == 0
        and x_TK.data_ptr() % 16 == 0
        and (w.shape[2] * elt) % 16 == 0
    )


def supports_up_swiglu(x_TH, w13_E2IH, h_P2I=None, a_PI=None, config=None) -> bool:
    """Whether :func:`up_swiglu` takes the call (``_supports`` with w13 as (El*2I, H) rows)."""
    return x_TH.shape[1] == w13_E2IH.shape[2] and _supports(
        x_TH, w13_E2IH, (h_P2I, a_PI), config or UP_CONFIG
    )


def supports_rows_gemm(x_TK, w_EKN, c_PN=None, config=None) -> bool:
    """Whether :func:`rows_gemm` takes the call (``_supports`` with w as (El*K, N) rows)."""
    return x_TK.shape[1] == w_EKN.shape[1] and _supports(
        x_TK, w_EKN, (c_PN,), config or ROWS_CONFIG
    )


@functools.cache
def _layouts(bm: int, bn: int, bk: int, dtype: torch.dtype, w_kn: bool):
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    w_block = [bk, bn] if w_kn else [bn, bk]
    return (gl.NVMMASharedLayout.get_default_for([bm, bk], gdt), w_block,
            gl.NVMMASharedLayout.get_default_for(w_block, gdt),
            gl.NVMMASharedLayout.get_default_for([bm, bn], gdt))  # fmt: skip


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch(x_TK, w_rows, idx_P, offs, prob_P, h, a, *, n_experts, n_cols, n_tiles_n, w_kn,
            save_h, save_a, cfg) -> None:  # fmt: skip
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x_layout, w_block, w_layout, epi_layout = _layouts(bm, bn, bk, x_TK.dtype, w_kn)
    w_desc = TensorDescriptor.from_tensor(w_rows, w_block, w_layout)
    n_pairs = h.shape[0]
    n_tiles = (triton.cdiv(n_pairs, bm) + n_experts) * n_tiles_n
    grid = (min(n_tiles, _sm_count(x_TK.device.index or 0)),)
    _gathered_gemm_ws_kernel[grid](
        x_TK, w_desc, idx_P, offs, prob_P if prob_P is not None else a, h, a,
        n_experts, x_TK.shape[1], n_cols, n_tiles,
        x_TK.stride(0), h.stride(0), a.stride(0),
        x_layout, epi_layout,
        W_KN=w_kn, SAVE_H=save_h, SCALE=prob_P is not None, SAVE_A=save_a,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=max(32, triton.next_power_of_2(n_experts)),
        STAGES=cfg["STAGES"], EPI_ROWS=cfg["EPI_ROWS"], GROUP_M=cfg["GROUP_M"],
        PRODUCER_WARPS=cfg["producer_warps"], PRODUCER_REGS=cfg["producer_regs"],
        STORER_WARPS=cfg["storer_warps"], STORER_REGS=cfg["storer_regs"],
        num_warps=cfg["num_warps"],
        maxnreg=cfg["maxnreg"],
    )  # fmt: skip


def up_swiglu(x_TH, w13_E2IH, idx_P, offs, prob_P, h_P2I, a_PI, *, config=None,
              store_nothing=False) -> None:  # fmt: skip
    """``grouped.up_swiglu``'s contract (outputs passed in, ``h_P2I`` or ``a_PI`` may be None);
    call only where :func:`supports_up_swiglu` holds. ``a`` is computed from h rounded to the
    output dtype (the storer's input), not from the fp32 accumulators.

    ``config``: an explicit tile configuration (``UP_CONFIG``'s keys; a sweep's), else
    ``UP_CONFIG`` with the GROUP_M of the shape. ``store_nothing`` (a diagnostic, which no library
    path sets): the outputs stay as they are (the kernel is built without its epilogue and its
    buffer), so that the main loop can be timed alone."""
    n_experts, two_i, hidden = w13_E2IH.shape
    ffn = two_i // 2
    cfg = config or _default_config(UP_CONFIG, triton.cdiv(ffn, UP_CONFIG["BLOCK_N"]))
    h = h_P2I if h_P2I is not None else a_PI
    a = a_PI if a_PI is not None else h_P2I
    if h.shape[0] == 0 or n_experts == 0:
        return
    _launch(x_TH, w13_E2IH.view(n_experts * two_i, hidden), idx_P, offs, prob_P, h, a,
            n_experts=n_experts, n_cols=ffn, n_tiles_n=triton.cdiv(ffn, cfg["BLOCK_N"]),
            w_kn=False, save_h=h_P2I is not None and not store_nothing,
            save_a=a_PI is not None and not store_nothing, cfg=cfg)  # fmt: skip


def rows_gemm(x_TK, w_EKN, idx_P, offs, c_PN, *, config=None, store_nothing=False) -> None:
    """c[q] = x[idx_P[q]] @ w[e] for the range's pairs (``grouped.rows_gemm`` with ``a_idx``);
    call only where :func:`supports_rows_gemm` holds. ``config`` (``ROWS_CONFIG``'s keys) and
    ``store_nothing`` (a diagnostic: ``c_PN`` left as it is) as in :func:`up_swiglu`."""
    n_experts, kdim, ncols = w_EKN.shape
    cfg = config or _default_config(ROWS_CONFIG, triton.cdiv(ncols, 2 * ROWS_CONFIG["BLOCK_N"]))
    if c_PN.shape[0] == 0 or n_experts == 0:
        return
    _launch(x_TK, w_EKN.view(n_experts * kdim, ncols), idx_P, offs, None, c_PN, c_PN,
            n_experts=n_experts, n_cols=ncols,
            n_tiles_n=triton.cdiv(ncols, 2 * cfg["BLOCK_N"]), w_kn=True,
            save_h=not store_nothing, save_a=False, cfg=cfg)  # fmt: skip
