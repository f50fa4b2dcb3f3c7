"""The gathered-row GEMMs as warp-specialised, persistent Gluon kernels for sm90 (Triton >= 3.6):
the up-projection ``x[tok] @ w13[e]^T`` with its SwiGLU, and the down projection's backward
``dy[tok] @ w2[e]``.

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
The plain GEMM is the same kernel with its (K, N) weight tiles taken as two adjacent column
blocks in place of gate and up (``W_KN``), and no SwiGLU.

Shape legend as in ``grouped``: T tokens, H hidden, I expert FFN width, El local experts, P pairs
of the range (rows ``offs[0]:offs[El]`` of the routing index).

Barriers: ``ready[s]`` / ``empty[s]`` per slot (step ``c`` of the program uses slot
``c % STAGES`` with parity ``(c // STAGES) & 1``; ``ready`` expects the producer's threads plus
the TMA's ``expect``); ``epi_ready`` / ``epi_empty`` for the one epilogue buffer. An arrive is one
thread's, so a partition of two warp groups meets at a partition barrier first.

Tried and removed: the weight gradients in the same form (both operands by masked ``cp.async``,
A read transposed, two 128-column accumulators, storer partition) ran dw2 in 3.8 ms and dw13 in
3.6 against the Triton kernel's 1.66 and 3.45 (H200, qwen3 T32k, sweep_kernels.py --kernels
wgrad, d276ef7). The Triton kernel keeps them.

Only this module imports ``triton.experimental.gluon``; ``grouped.up_swiglu`` and
``grouped.rows_gemm`` import it lazily on sm90 (``RELAYMOE_GATHER_WS``), so CPU runs never touch
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

# a barrier among the warps of one partition: ``thread_barrier`` in Triton 3.6, ``barrier`` later
_partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

__all__ = ["DOWN_BWD_CONFIG", "ROWS_CONFIG", "UP_CONFIG", "down_bwd_swiglu", "rows_gemm",
           "supports_down_bwd_swiglu", "supports_rows_gemm", "supports_up_swiglu",
           "up_swiglu"]  # fmt: skip

PRODUCER_WARPS = 4
STORER_WARPS = 4
# tiles, slots, consumer warps, the storer's row slice, the workers' registers and the cap
# H200, qwen3 T32k (benchmarks/sweep_kernels.py --kernels up_swiglu, c91189d): 2.91 ms against
# 3.18 for the Triton kernel's best; 2 slots 4.54 ms, a 32-column K step with 6 slots 3.11,
# producer/storer registers 56/80 3.03 (the cap 128 is 16 warps' share of the register file)
UP_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 3, "EPI_ROWS": 32,
             "num_warps": 8, "producer_regs": 72, "storer_regs": 72, "maxnreg": 128}  # fmt: skip
# the plain gathered GEMM (down projection's backward, dy[tok] @ w2[e]): a tile is two adjacent
# 128-column blocks
ROWS_CONFIG = dict(UP_CONFIG)
# the same GEMM with the SwiGLU backward as its epilogue: the storer reads h (8-row slices by TMA,
# H_SLOTS of them in flight) and writes dh, p * a and dprob partials
DOWN_BWD_CONFIG = dict(ROWS_CONFIG, BLOCK_K=32, STAGES=5, EPI_ROWS=8, H_SLOTS=2, producer_regs=56,
                       storer_regs=104)  # fmt: skip


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
                     BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """Fills slot after slot, across tiles: the two weight tiles by TMA, the x rows of the
    tile's tokens by ``cp.async`` (16-byte vectors, 8 columns a thread)."""
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    TK: gl.constexpr = BLOCK_K // 8
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TK, TK], [WARPS, 1], [1, 0])
    ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, lay))
    n_k = K // BLOCK_K
    step = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        e, row0, row_end, pid_n = _tile_of(t, n_tiles_n, offs_ptr, n_experts, BLOCK_M, BLOCK_E,
                                           WARPS)  # fmt: skip
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
                       epi_empty, offs_ptr, n_experts, K, n_tiles, n_tiles_n,
                       W_KN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
                       num_warps: gl.constexpr):  # fmt: skip
    """The lo and hi accumulators of each tile (one step's two MMAs stay in flight), handed to
    the storer through shared memory in the output dtype."""
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    n_k = K // BLOCK_K
    step = 0
    done = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        e, row0, row_end, pid_n = _tile_of(t, n_tiles_n, offs_ptr, n_experts, BLOCK_M, BLOCK_E,
                                           num_warps)  # fmt: skip
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
            mbarrier.wait(epi_empty, (done & 1) ^ 1)
            lo_epi.store(acc_lo.to(lo_epi.dtype))
            hi_epi.store(acc_hi.to(hi_epi.dtype))
            _partition_barrier()
            mbarrier.arrive(epi_ready)
            done += 1


@gluon.jit
def _swiglu_bwd_math(g, gate, up, p):
    """(dgate, dup, p * a, rowsum(g * a)) in fp32 from g, h = [gate, up] and p (fp32, (ROWS, 1))."""
    g32 = g.to(gl.float32)
    gate32 = gate.to(gl.float32)
    up32 = up.to(gl.float32)
    sig = 1.0 / (1.0 + gl.exp(-gate32))
    silu = gate32 * sig
    act = silu * up32
    da = g32 * p
    dgate = da * up32 * sig * (1.0 + gate32 * (1.0 - sig))
    return dgate, da * silu, act * p, gl.sum(g32 * act, 1)


@gluon.jit
def _load_h_slice(h_desc, h_bufs, h_bars, slot, lrow, col0, n_cols, BLOCK_N: gl.constexpr):
    """TMA of one row slice of h into ``slot``: gate and up of the tile's lo and hi columns
    (buffers ``4 * slot + 0..3``), onto ``h_bars[slot]``. Rows past h's end read as zeros."""
    bar = h_bars.index(slot)
    mbarrier.expect(bar, 4 * h_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(h_desc, [lrow, col0], bar, h_bufs.index(4 * slot))
    tma.async_copy_global_to_shared(h_desc, [lrow, col0 + n_cols], bar, h_bufs.index(4 * slot + 1))
    tma.async_copy_global_to_shared(h_desc, [lrow, col0 + BLOCK_N], bar,
                                    h_bufs.index(4 * slot + 2))  # fmt: skip
    tma.async_copy_global_to_shared(h_desc, [lrow, col0 + BLOCK_N + n_cols], bar,
                                    h_bufs.index(4 * slot + 3))  # fmt: skip


@gluon.jit
def _swiglu_bwd_tile(lo_epi, hi_epi, epi_ready, h_desc, h_bufs, h_bars, p_smem, dh_desc, a_desc,
                     o_bufs, done, row0, row_end, base, col0, cols, lo_ok, hi_ok, pid_n, prob_ptr,
                     a_ptr, dh_ptr, part_ptr, n_cols, n_tiles_n, stride_ap, stride_dhp,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ROWS: gl.constexpr,
                     lay: gl.constexpr):  # fmt: skip
    """The storer's SwiGLU backward of one tile of g = dy[tok] @ w2[e] (``lo_epi``, ``hi_epi``:
    its two column blocks, g rounded to the output dtype as the split path stores it). SiLU is
    recomputed from the saved h = [gate, up]; dh = [p*g * up * silu'(gate), p*g * silu(gate)]
    goes into ``dh_ptr`` (which may be h itself: each element is read, then written, and
    belongs to one tile); p * a into ``a_ptr`` (for dw2); the tile's share of dprob =
    rowsum(g * a) into column ``pid_n`` of the fp32 ``(P, n_tiles_n)`` partials (summed after
    the kernel in a fixed order).

    h comes by TMA in ``ROWS``-row slices through a ring of ``H_SLOTS`` slots: four storer warps
    hold too few registers to keep enough loads in flight while the GEMM keeps L2 busy (8-row
    slices loaded into registers, the next one ahead: 3.39 ms against the split path's 2.08,
    H200, qwen3 T32k, b229c62). The first slots are requested before the tile's accumulators
    are waited for."""
    H_SLOTS: gl.constexpr = h_bars.type.shape[0]
    N_SLICES: gl.constexpr = BLOCK_M // ROWS
    first = done * N_SLICES  # slices this partition consumed before this tile
    lrow0 = (row0 - base).to(gl.int32)  # h's row count is checked against int32 at launch
    col0 = col0.to(gl.int32)
    for j in gl.static_range(H_SLOTS):
        _load_h_slice(h_desc, h_bufs, h_bars, (first + j) % H_SLOTS, lrow0 + j * ROWS, col0,
                      n_cols, BLOCK_N)  # fmt: skip
    # the tile's router probabilities in one load, kept in shared memory: one global load a
    # slice, waited for at once, cost a memory latency a slice (3.73 ms against 2.05 split)
    p_lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    p_rows = row0 + gl.arange(0, BLOCK_M, layout=p_lay)
    p_ok = p_rows < row_end
    p_all = gl.load(prob_ptr + gl.where(p_ok, p_rows - base, 0), mask=p_ok, other=0.0)
    p_smem.store(p_all.to(gl.float32))
    _partition_barrier()
    mbarrier.wait(epi_ready, done & 1)
    for r in gl.static_range(N_SLICES):
        c = first + r
        slot = c % H_SLOTS
        rows = row0 + r * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, lay))
        row_ok = rows < row_end
        lrows = gl.where(row_ok, rows - base, 0)
        p = p_smem.slice(r * ROWS, ROWS).load(gl.SliceLayout(1, lay))[:, None]
        m_lo = row_ok[:, None] & lo_ok[None, :]
        m_hi = row_ok[:, None] & hi_ok[None, :]
        mbarrier.wait(h_bars.index(slot), (c // H_SLOTS) & 1)
        gate_lo = h_bufs.index(4 * slot).load(lay)
        up_lo = h_bufs.index(4 * slot + 1).load(lay)
        gate_hi = h_bufs.index(4 * slot + 2).load(lay)
        up_hi = h_bufs.index(4 * slot + 3).load(lay)
        if r + H_SLOTS < N_SLICES:  # the slot is read: every thread, then the next request
            _partition_barrier()
            _load_h_slice(h_desc, h_bufs, h_bars, slot, lrow0 + (r + H_SLOTS) * ROWS, col0,
                          n_cols, BLOCK_N)  # fmt: skip
        lo = lo_epi.slice(r * ROWS, ROWS).load(lay)
        dg_lo, du_lo, pa_lo, dprob = _swiglu_bwd_math(lo, gate_lo, up_lo, p)
        hi = hi_epi.slice(r * ROWS, ROWS).load(lay)
        dg_hi, du_hi, pa_hi, dprob_hi = _swiglu_bwd_math(hi, gate_hi, up_hi, p)
        gl.store(part_ptr + lrows * n_tiles_n + pid_n, dprob + dprob_hi, mask=row_ok)
        if row0 + (r + 1) * ROWS <= row_end:  # a whole slice of this expert: TMA stores
            _store_slice_tma(dh_desc, a_desc, o_bufs, (r % 2) * 6, lrow0 + r * ROWS, col0, n_cols,
                             dg_lo, du_lo, pa_lo, dg_hi, du_hi, pa_hi, BLOCK_N)  # fmt: skip
        else:  # the expert's last rows: the next expert's rows must not be written
            dty: gl.constexpr = dh_ptr.dtype.element_ty
            aty: gl.constexpr = a_ptr.dtype.element_ty
            dhp = dh_ptr + lrows[:, None] * stride_dhp + cols[None, :]
            ap = a_ptr + lrows[:, None] * stride_ap + cols[None, :]
            gl.store(dhp, dg_lo.to(dty), mask=m_lo)
            gl.store(dhp + n_cols, du_lo.to(dty), mask=m_lo)
            gl.store(ap, pa_lo.to(aty), mask=m_lo)
            gl.store(dhp + BLOCK_N, dg_hi.to(dty), mask=m_hi)
            gl.store(dhp + BLOCK_N + n_cols, du_hi.to(dty), mask=m_hi)
            gl.store(ap + BLOCK_N, pa_hi.to(aty), mask=m_hi)


@gluon.jit
def _store_slice_tma(dh_desc, a_desc, o_bufs, b0, lrow, col0, n_cols, dg_lo, du_lo, pa_lo, dg_hi,
                     du_hi, pa_hi, BLOCK_N: gl.constexpr):  # fmt: skip
    """One slice's six (ROWS, BLOCK_N) results through staging buffers ``b0 .. b0 + 5`` and TMA
    stores (dh's gate and up columns, p * a; lo then hi). The buffers were last handed to TMA two
    slices ago: at most that slice's six stores may still be reading shared memory."""
    tma.store_wait(6)
    _partition_barrier()
    dty: gl.constexpr = o_bufs.dtype
    o_bufs.index(b0).store(dg_lo.to(dty))
    o_bufs.index(b0 + 1).store(du_lo.to(dty))
    o_bufs.index(b0 + 2).store(pa_lo.to(dty))
    o_bufs.index(b0 + 3).store(dg_hi.to(dty))
    o_bufs.index(b0 + 4).store(du_hi.to(dty))
    o_bufs.index(b0 + 5).store(pa_hi.to(dty))
    fence_async_shared()
    _partition_barrier()
    tma.async_copy_shared_to_global(dh_desc, [lrow, col0], o_bufs.index(b0))
    tma.async_copy_shared_to_global(dh_desc, [lrow, col0 + n_cols], o_bufs.index(b0 + 1))
    tma.async_copy_shared_to_global(a_desc, [lrow, col0], o_bufs.index(b0 + 2))
    tma.async_copy_shared_to_global(dh_desc, [lrow, col0 + BLOCK_N], o_bufs.index(b0 + 3))
    tma.async_copy_shared_to_global(dh_desc, [lrow, col0 + BLOCK_N + n_cols], o_bufs.index(b0 + 4))
    tma.async_copy_shared_to_global(a_desc, [lrow, col0 + BLOCK_N], o_bufs.index(b0 + 5))


@gluon.jit
def _tile_storer(lo_epi, hi_epi, epi_ready, epi_empty, h_desc, h_bufs, h_bars, p_smem, dh_desc,
                 a_desc, o_bufs, offs_ptr, prob_ptr,
                 h_ptr, a_ptr, dh_ptr, part_ptr, n_experts, n_cols, n_tiles, n_tiles_n, stride_hp,
                 stride_ap, stride_dhp,
                 W_KN: gl.constexpr, SAVE_H: gl.constexpr, SCALE: gl.constexpr,
                 SAVE_A: gl.constexpr, SWIGLU_BWD: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCK_E: gl.constexpr, ROWS: gl.constexpr,
                 WARPS: gl.constexpr):  # fmt: skip
    """Drains each tile from shared memory in ``ROWS``-row slices while the consumer runs the
    next tile: both halves stored into h (16-byte vectors); for the up-projection also
    a = silu(gate) * up (* p) from the stored values. Rows masked at the expert's end.
    ``SWIGLU_BWD`` (plain GEMM g = dy[tok] @ w2[e]): the SwiGLU backward instead
    (:func:`_swiglu_bwd_tile`)."""
    TN: gl.constexpr = BLOCK_N // 8
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TN, TN], [WARPS, 1], [1, 0])
    base = gl.load(offs_ptr)
    done = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        e, row0, row_end, pid_n = _tile_of(t, n_tiles_n, offs_ptr, n_experts, BLOCK_M, BLOCK_E,
                                           WARPS)  # fmt: skip
        if e < n_experts:
            col0, hi_off, lo_end, hi_end = _halves(pid_n, n_cols, W_KN, BLOCK_N)
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, lay))
            lo_ok = cols < lo_end
            hi_ok = cols + hi_off < hi_end
            if SWIGLU_BWD:
                _swiglu_bwd_tile(lo_epi, hi_epi, epi_ready, h_desc, h_bufs, h_bars, p_smem, dh_desc,
                                 a_desc, o_bufs, done, row0,
                                 row_end, base, col0, cols, lo_ok, hi_ok, pid_n, prob_ptr, a_ptr,
                                 dh_ptr, part_ptr, n_cols, n_tiles_n, stride_ap, stride_dhp,
                                 BLOCK_M, BLOCK_N, ROWS, lay)  # fmt: skip
            else:
                mbarrier.wait(epi_ready, done & 1)
            for r in gl.static_range(0, BLOCK_M if not SWIGLU_BWD else 0, ROWS):
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
    if SWIGLU_BWD:
        tma.store_wait(0)  # the staging buffers are read before the kernel ends


@gluon.jit
def _gathered_gemm_ws_kernel(
    x_ptr, w_desc, h_desc, dh_desc, a_desc, idx_ptr, offs_ptr, prob_ptr, h_ptr, a_ptr, dh_ptr, part_ptr,
    n_experts, K, n_cols, n_tiles,
    stride_xt, stride_hp, stride_ap, stride_dhp,
    x_layout: gl.constexpr, epi_layout: gl.constexpr,
    W_KN: gl.constexpr, SAVE_H: gl.constexpr, SCALE: gl.constexpr, SAVE_A: gl.constexpr,
    SWIGLU_BWD: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
    STAGES: gl.constexpr, EPI_ROWS: gl.constexpr, H_SLOTS: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    STORER_WARPS: gl.constexpr, STORER_REGS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Rows ``x[tok[q]]`` (q of the range, K = H columns, ``K % BLOCK_K == 0``) times expert e's
    weight, persistent over the work items ``pid, pid + nprog, ...`` of ``n_tiles`` (M tiles, an
    upper bound, x N tiles); the three partitions walk the same items.
    - ``W_KN`` False (up-projection): w13 as (El*2I, H) rows through ``w_desc``, ``n_cols`` = I;
      h = [gate, up] stored when ``SAVE_H``, a = silu(gate) * up (* p) when ``SAVE_A``.
    - ``W_KN`` True (plain): w as (El*K, N) rows, ``n_cols`` = N; h = x[tok] @ w[e].
    - ``W_KN`` and ``SWIGLU_BWD`` (down backward, w = w2 as (El*H, I) rows): g = dy[tok] @ w2[e]
      never stored; h is the saved pre-activation (read through ``h_desc``, ``EPI_ROWS`` x
      ``BLOCK_N`` boxes, ``H_SLOTS`` slices in flight), dh, p * a and dprob partials written
      (``_swiglu_bwd_tile``). Other kinds pass any descriptor as ``h_desc`` (unused)."""
    x_bufs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BLOCK_M, BLOCK_K],
                                       x_layout)  # fmt: skip
    lo_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape,
                                        w_desc.layout)  # fmt: skip
    hi_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape,
                                        w_desc.layout)  # fmt: skip
    lo_epi = gl.allocate_shared_memory(h_ptr.dtype.element_ty, [BLOCK_M, BLOCK_N], epi_layout)
    hi_epi = gl.allocate_shared_memory(h_ptr.dtype.element_ty, [BLOCK_M, BLOCK_N], epi_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    epi_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    epi_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # the SwiGLU backward's h slices (a token allocation for the other kinds)
    HB: gl.constexpr = 4 * H_SLOTS if SWIGLU_BWD else 1
    HR: gl.constexpr = EPI_ROWS if SWIGLU_BWD else 8
    h_bufs = gl.allocate_shared_memory(h_ptr.dtype.element_ty, [HB, HR, BLOCK_N], h_desc.layout)
    h_bars = gl.allocate_shared_memory(gl.int64, [H_SLOTS, 1], mbarrier.MBarrierLayout())
    p_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M if SWIGLU_BWD else 32],
                                       gl.SwizzledSharedLayout(1, 1, 1, [0]))  # fmt: skip
    o_bufs = gl.allocate_shared_memory(h_ptr.dtype.element_ty, [12 if SWIGLU_BWD else 1, HR,
                                       BLOCK_N], h_desc.layout)  # fmt: skip
    for s in gl.static_range(H_SLOTS):
        mbarrier.init(h_bars.index(s), count=1)
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
                               epi_empty, offs_ptr, n_experts, K, n_tiles, n_tiles_n,
                               W_KN, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, num_warps)),
         (_gather_producer, (x_ptr, idx_ptr, offs_ptr, w_desc, x_bufs, lo_bufs, hi_bufs, ready,
                             empty, n_experts, K, n_cols, n_tiles, n_tiles_n, stride_xt,
                             W_KN, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, PRODUCER_WARPS)),
         (_tile_storer, (lo_epi, hi_epi, epi_ready, epi_empty, h_desc, h_bufs, h_bars, p_smem,
                         dh_desc, a_desc, o_bufs, offs_ptr,
                         prob_ptr, h_ptr, a_ptr, dh_ptr, part_ptr, n_experts, n_cols, n_tiles,
                         n_tiles_n, stride_hp, stride_ap, stride_dhp, W_KN, SAVE_H, SCALE, SAVE_A,
                         SWIGLU_BWD, BLOCK_M, BLOCK_N, BLOCK_E, EPI_ROWS, STORER_WARPS))],
        [PRODUCER_WARPS, STORER_WARPS],
        [PRODUCER_REGS, STORER_REGS],
    )
    # fmt: on
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    mbarrier.invalidate(epi_ready)
    mbarrier.invalidate(epi_empty)
    for s in gl.static_range(H_SLOTS):
        mbarrier.invalidate(h_bars.index(s))


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


def supports_down_bwd_swiglu(dy_TH, w2_EHI, g_PI, h_P2I, dh_P2I, config=None) -> bool:
    """Whether :func:`down_bwd_swiglu` takes the call: :func:`supports_rows_gemm`'s rules, with
    h and dh as (P, 2I) in dy's dtype, unit column stride, I a multiple of the 256-column tile,
    and the rows of h, dh and g 16-byte aligned (tensor descriptors)."""
    ffn = w2_EHI.shape[2]
    cfg = config or DOWN_BWD_CONFIG
    return (
        all(t.shape[1] == 2 * ffn for t in (h_P2I, dh_P2I))
        and ffn % (2 * cfg["BLOCK_N"]) == 0  # a tile's TMA boxes stay inside gate, up and p*a
        and all(  # h, dh and p*a through tensor descriptors
            (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
            for t in (h_P2I, dh_P2I, g_PI)
        )
        and _supports(dy_TH, w2_EHI, (g_PI, h_P2I, dh_P2I), config or DOWN_BWD_CONFIG)
        and dy_TH.shape[1] == w2_EHI.shape[1]
    )


@functools.cache
def _layouts(bm: int, bn: int, bk: int, dtype: torch.dtype, w_kn: bool):
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    w_block = [bk, bn] if w_kn else [bn, bk]
    return (gl.NVMMASharedLayout.get_default_for([bm, bk], gdt), w_block,
            gl.NVMMASharedLayout.get_default_for(w_block, gdt),
            gl.NVMMASharedLayout.get_default_for([bm, bn], gdt))  # fmt: skip


@functools.cache
def _h_layout(rows: int, cols: int, dtype: torch.dtype):
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gdt)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch(x_TK, w_rows, idx_P, offs, prob_P, h, a, *, n_experts, n_cols, n_tiles_n, w_kn,
            save_h, save_a, cfg, dh=None, part=None) -> None:  # fmt: skip
    """One launch; ``dh`` and ``part`` (the SwiGLU backward's outputs) select that epilogue."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x_layout, w_block, w_layout, epi_layout = _layouts(bm, bn, bk, x_TK.dtype, w_kn)
    w_desc = TensorDescriptor.from_tensor(w_rows, w_block, w_layout)
    n_pairs = h.shape[0]
    n_tiles = (triton.cdiv(n_pairs, bm) + n_experts) * n_tiles_n
    grid = (min(n_tiles, _sm_count(x_TK.device.index or 0)),)
    swiglu_bwd = dh is not None
    h_desc = dh_desc = a_desc = w_desc  # unused but for the SwiGLU backward
    if swiglu_bwd:
        block = [cfg["EPI_ROWS"], bn]
        layout = _h_layout(*block, h.dtype)
        h_desc, dh_desc, a_desc = (
            TensorDescriptor.from_tensor(t, block, layout) for t in (h, dh, a)
        )
    _gathered_gemm_ws_kernel[grid](
        x_TK, w_desc, h_desc, dh_desc, a_desc, idx_P, offs, prob_P if prob_P is not None else a, h, a,
        dh if swiglu_bwd else h, part if swiglu_bwd else a,
        n_experts, x_TK.shape[1], n_cols, n_tiles,
        x_TK.stride(0), h.stride(0), a.stride(0), dh.stride(0) if swiglu_bwd else 0,
        x_layout, epi_layout,
        W_KN=w_kn, SAVE_H=save_h, SCALE=prob_P is not None, SAVE_A=save_a, SWIGLU_BWD=swiglu_bwd,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=max(32, triton.next_power_of_2(n_experts)),
        STAGES=cfg["STAGES"], EPI_ROWS=cfg["EPI_ROWS"], H_SLOTS=cfg.get("H_SLOTS", 1),
        PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=cfg["producer_regs"],
        STORER_WARPS=STORER_WARPS, STORER_REGS=cfg["storer_regs"], num_warps=cfg["num_warps"],
        maxnreg=cfg["maxnreg"],
    )  # fmt: skip


def up_swiglu(x_TH, w13_E2IH, idx_P, offs, prob_P, h_P2I, a_PI, *, config=None) -> None:
    """``grouped.up_swiglu``'s contract (outputs passed in, ``h_P2I`` or ``a_PI`` may be None);
    call only where :func:`supports_up_swiglu` holds. ``a`` is computed from h rounded to the
    output dtype (the storer's input), not from the fp32 accumulators."""
    cfg = config or UP_CONFIG
    n_experts, two_i, hidden = w13_E2IH.shape
    ffn = two_i // 2
    h = h_P2I if h_P2I is not None else a_PI
    a = a_PI if a_PI is not None else h_P2I
    if h.shape[0] == 0 or n_experts == 0:
        return
    _launch(x_TH, w13_E2IH.view(n_experts * two_i, hidden), idx_P, offs, prob_P, h, a,
            n_experts=n_experts, n_cols=ffn, n_tiles_n=triton.cdiv(ffn, cfg["BLOCK_N"]),
            w_kn=False, save_h=h_P2I is not None, save_a=a_PI is not None, cfg=cfg)  # fmt: skip


def rows_gemm(x_TK, w_EKN, idx_P, offs, c_PN, *, config=None) -> None:
    """c[q] = x[idx_P[q]] @ w[e] for the range's pairs (``grouped.rows_gemm`` with ``a_idx``);
    call only where :func:`supports_rows_gemm` holds."""
    cfg = config or ROWS_CONFIG
    n_experts, kdim, ncols = w_EKN.shape
    if c_PN.shape[0] == 0 or n_experts == 0:
        return
    _launch(x_TK, w_EKN.view(n_experts * kdim, ncols), idx_P, offs, None, c_PN, c_PN,
            n_experts=n_experts, n_cols=ncols,
            n_tiles_n=triton.cdiv(ncols, 2 * cfg["BLOCK_N"]), w_kn=True, save_h=True,
            save_a=False, cfg=cfg)  # fmt: skip


def down_bwd_swiglu(dy_TH, w2_EHI, idx_P, offs, h_P2I, prob_P, g_PI, dh_P2I, dprob_P, *,
                    config=None) -> None:  # fmt: skip
    """``grouped.down_backward_swiglu``'s contract: g = dy[tok] @ w2[e] is never stored; ``g_PI``
    receives p * a, ``dh_P2I`` (may be ``h_P2I``) the pre-activation's gradient, ``dprob_P``
    (fp32) rowsum(g * a). Call only where :func:`supports_down_bwd_swiglu` holds."""
    cfg = config or DOWN_BWD_CONFIG
    n_experts, hidden, ffn = w2_EHI.shape
    n_pairs = g_PI.shape[0]
    if n_pairs == 0 or n_experts == 0:
        return
    n_tiles_n = triton.cdiv(ffn, 2 * cfg["BLOCK_N"])
    part_PN = torch.empty(n_pairs, n_tiles_n, dtype=torch.float32, device=g_PI.device)
    _launch(dy_TH, w2_EHI.view(n_experts * hidden, ffn), idx_P, offs, prob_P, h_P2I, g_PI,
            n_experts=n_experts, n_cols=ffn, n_tiles_n=n_tiles_n, w_kn=True, save_h=False,
            save_a=False, cfg=cfg, dh=dh_P2I, part=part_PN)  # fmt: skip
    torch.sum(part_PN, dim=1, out=dprob_P)
