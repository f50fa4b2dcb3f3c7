"""What every grouped kernel shares: the device-side tile schedule over the routing index (an
M tile found from the expert offsets, no host sync), the K loop of a gathered-row tile, the launch
grid and the int32 checks of the launchers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from relaymoe.kernels import check_int32, tile_group_m


@triton.jit
def _expert_tile(pid_m, offs_ptr, n_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(local expert, first global row, end global row) of M tile ``pid_m``; expert == n_experts
    when the program has no tile."""
    j = tl.arange(0, BLOCK_E)
    live = j < n_experts
    lo = tl.load(offs_ptr + j, mask=live, other=0)
    hi = tl.load(offs_ptr + j + 1, mask=live, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    last = tl.cumsum(tiles, 0)  # inclusive: tiles of experts <= j
    e = tl.sum((last <= pid_m).to(tl.int32), 0)
    pick = j == e
    first_tile = tl.sum(tl.where(pick, last - tiles, 0), 0)
    row0 = tl.sum(tl.where(pick, lo, 0), 0) + (pid_m - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(pick, hi, 0), 0)
    return e, row0, row_end


@triton.jit
def row_expert(grows, offs_ptr, n_experts, BLOCK_E: tl.constexpr):
    """Local expert of each global pair row ``grows`` (the number of expert ends ``offs[j+1]``
    not above it): ``n_experts`` for a row past the range (a bound-sized buffer's tail)."""
    j = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + 1 + j, mask=j < n_experts, other=0)
    live = (j < n_experts)[None, :]
    return tl.sum((live & (ends[None, :] <= grows[:, None])).to(tl.int32), 1)


@triton.jit
def row_col_tile(
    n_cols, offs_ptr, n_experts, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``_expert_tile`` of this program plus its N tile, on a grid of (M tiles) x
    ``cdiv(n_cols, BLOCK_N)`` programs (``row_grid``) taken in groups of ``GROUP_M`` M tiles,
    M fastest inside a group (``relaymoe.kernels.tile_group_m``; 1: N tiles fastest)."""
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(n_cols, BLOCK_N)
    n_m = tl.num_programs(0) // n_tiles_n
    per_group = GROUP_M * n_tiles_n
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(n_m - first_m, GROUP_M)
    rem = pid % per_group
    e, row0, row_end = _expert_tile(first_m + rem % size, offs_ptr, n_experts, BLOCK_M, BLOCK_E)
    return e, row0, row_end, rem // size


@triton.jit
def row_tile(
    n_cols, offs_ptr, idx_ptr, n_experts, GATHER: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """This program's tile of a gathered-row GEMM (``row_col_tile``): ``(e, pid_n, row_ok,
    lrows, a_rows, cols, col_ok)``: its expert (``n_experts``: no tile, the caller returns),
    which rows are the expert's, their rows in the range's pair buffers (int64, 0 past the
    end), the operand row each reads (the pair's token with ``GATHER``, through the routing
    index ``idx_ptr``, else its pair row), and the N tile's columns."""
    e, row0, row_end, pid_n = row_col_tile(n_cols, offs_ptr, n_experts, BLOCK_M, BLOCK_N, BLOCK_E,
                                            GROUP_M)  # fmt: skip
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    lrows = tl.where(row_ok, rows - tl.load(offs_ptr), 0).to(tl.int64)
    if GATHER:
        a_rows = tl.load(idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        a_rows = lrows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, pid_n, row_ok, lrows, a_rows, cols, cols < n_cols


@triton.jit
def load_k_step(a_ptrs, b_ptrs, ks, k0, K, col_ok, EVEN_K: tl.constexpr):
    """One K step's A (BLOCK_M, BLOCK_K) and B (BLOCK_K, BLOCK_N) tiles at ``k0`` (the K tail
    masked unless ``EVEN_K``; B's columns past the end masked)."""
    if EVEN_K:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
    else:
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
    return a, b


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def row_gemm_loop(
    a_rows,  # (BLOCK_M,) int64 row ids into a_ptr (already valid addresses)
    a_ptr,
    stride_a,
    b_ptr,  # base of this expert's (K, N) operand
    stride_bk,
    stride_bn,
    cols,  # (BLOCK_N,) column ids, unclamped: a clamp hides contiguity (scalar loads)
    col_ok,
    K,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + ks[None, :]
    b_ptrs = b_ptr + cols[None, :] * stride_bn + ks[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a, b = load_k_step(a_ptrs, b_ptrs, ks, k0, K, col_ok, EVEN_K)
        acc = mma(a, b, acc, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc


def even_k(kdim):
    return lambda meta: meta[kdim] % meta["BLOCK_K"] == 0


# the gathered-row kernels' tile order: groups of ROW_GROUP_M M tiles (taller for wide experts,
# ``tile_group_m``)
ROW_GROUP_M = 8


def row_group_m(ncols: int, block_n: int) -> int:
    return tile_group_m(triton.cdiv(ncols, block_n), ROW_GROUP_M)


def group_m(ncols):
    return lambda meta: row_group_m(meta[ncols], meta["BLOCK_N"])


def expert_block_size(n_experts: int) -> int:
    return max(16, triton.next_power_of_2(n_experts))


def row_grid(n_pairs: int, n_experts: int, ncols: int):
    def grid(meta):
        tiles_m = triton.cdiv(n_pairs, meta["BLOCK_M"]) + n_experts
        n = tiles_m * triton.cdiv(ncols, meta["BLOCK_N"])
        check_int32(
            f"the launch grid ({n_pairs} pairs x {ncols} columns in "
            f"{meta['BLOCK_M']}x{meta['BLOCK_N']} tiles)", n, where="relaymoe row kernels",
            fix="use fewer tokens per call",
        )  # fmt: skip
        return (n,)

    return grid


_FIX_WEIGHT = "shard the expert FFN (tensor parallelism on the experts) to shrink each expert"


def check_expert_span(t: torch.Tensor, name: str, where: str) -> None:
    """The largest element offset inside one expert of an (E, M, N) operand is computed in
    int32 by the kernels (index times stride)."""
    span = sum((d - 1) * abs(st) for d, st in zip(t.shape[1:], t.stride()[1:], strict=True))
    check_int32(f"the largest offset inside one expert of {name} {tuple(t.shape)}", span + 1,
                where=where, fix=_FIX_WEIGHT)  # fmt: skip


def check_rows(n_rows: int, where: str) -> None:
    check_int32(f"the pair rows of the expert range ({n_rows})", n_rows, where=where,
                fix="use fewer tokens per call, or fewer experts per rank")  # fmt: skip


def exact_fp32(t: torch.Tensor) -> bool:
    """fp32 inputs use exact fp32 products (no TF32), so fp32 results meet fp32 bounds."""
    return t.dtype == torch.float32
