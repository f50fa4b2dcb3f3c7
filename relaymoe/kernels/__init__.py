"""Triton kernels and their launchers. Imports only torch and triton.

This module itself imports neither (the plain-torch paths and the ring's agreement use it): it
also holds the int32 limits of the kernels and of the routing index (:func:`check_int32`,
:func:`check_problem_limits`), checked on sizes alone, before anything is allocated or launched,
and the gathered-row GEMMs' tile order (:func:`tile_group_m`), which the Triton and the Gluon
kernels share.
"""

from __future__ import annotations

import functools

__all__ = [
    "INT32_LIMIT",
    "check_int32",
    "check_problem_limits",
    "interpret_mode",
    "tile_group_m",
    "triton_available",
    "unit_cols",
]

# Values at or above this overflow an int32 offset. What stays int32 (everything else is int64):
# token ids in the routing index (expert_token_indices), the row ids of the SwiGLU backward
# kernel and torch._grouped_mm's group ends (pairs of one expert range), and offsets inside one
# expert's weight (a row or column index times the weight's stride).
INT32_LIMIT = 2**31


@functools.cache
def _import_triton() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # triton missing or broken: the plain-torch paths still work
        return False
    return True


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (Triton's own ``interpret`` knob,
    which ``TRITON_INTERPRET=1`` sets); False without Triton."""
    if not _import_triton():
        return False
    import triton.knobs

    return bool(triton.knobs.runtime.interpret)


def triton_available() -> bool:
    """Triton is importable (kernels run on CUDA, or on CPU under the interpreter)."""
    return _import_triton()


def unit_cols(t):
    """A 2-D tensor ``t`` itself when its columns are at unit stride (what the kernels' row loads
    and stores assume) and its rows do not alias, else a row-major copy. Row strides are free: a
    contiguous tensor, a row slice or a block of a wider tensor (``big[:, :H]``) pass through
    without a copy; a transposed, column-strided or expanded one is copied."""
    rows_apart = t.shape[0] <= 1 or t.stride(0) != 0  # tensor descriptors need a row stride
    if t.dim() != 2 or (rows_apart and (t.shape[1] <= 1 or t.stride(1) == 1)):
        return t
    return t.contiguous()


# The gathered-row GEMMs (Triton and Gluon) walk their tiles in groups of GROUP_M M tiles, M
# fastest inside a group, so the tiles in flight share a few row blocks and weight column blocks
# in L2. Wide experts (at least WIDE_N_TILES N tiles a row of tiles) take taller groups: 16
# was faster than 8 there and no slower for narrow experts, and both beat N tiles fastest.
WIDE_N_TILES = 16
WIDE_GROUP_M = 16


def tile_group_m(n_tiles_n: int, narrow: int) -> int:
    """GROUP_M for a row of ``n_tiles_n`` N tiles: ``WIDE_GROUP_M`` for wide experts, else
    ``narrow`` (the kernel's own default)."""
    return WIDE_GROUP_M if n_tiles_n >= WIDE_N_TILES else narrow


def check_int32(what: str, value: int, *, where: str, fix: str) -> None:
    """Raise ``ValueError`` when ``value`` (described by ``what``) reaches 2^31."""
    if value >= INT32_LIMIT:
        raise ValueError(
            f"{where}: {what} = {value:,} reaches the int32 limit 2^31 = {INT32_LIMIT:,}; {fix}"
        )


_FIX_TOKENS = "split the micro-batch (or the sequence) so one call holds fewer tokens"
_FIX_PAIRS = "use fewer tokens per call, or fewer experts per rank (a larger expert-parallel group)"
_FIX_WEIGHT = "shard the expert FFN (tensor parallelism on the experts) so 2*I*H stays below it"


def check_problem_limits(
    *, tokens: int, topk: int, hidden: int, ffn: int, num_local_experts: int, where: str
) -> None:
    """The int32 limits of a MoE call whose largest token partition is ``tokens``, on sizes only
    (nothing allocated): token ids, the pairs of one expert range (``T * min(K, E_local)``) and
    one expert's weight (``2*I*H`` elements). Raises ``ValueError`` naming the first one hit."""
    check_int32("T (tokens of one partition)", tokens, where=where, fix=_FIX_TOKENS)
    pairs = tokens * min(topk, num_local_experts)
    check_int32(
        f"T*min(K, E_local) = {tokens}*{min(topk, num_local_experts)} (token-expert pairs of "
        "one expert range)",
        pairs,
        where=where,
        fix=_FIX_PAIRS,
    )
    check_int32(
        f"2*I*H = 2*{ffn}*{hidden} (elements of one expert's fc1 weight)",
        2 * ffn * hidden,
        where=where,
        fix=_FIX_WEIGHT,
    )
