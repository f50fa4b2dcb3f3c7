"""Routing index (MoEBlaze §3-4): integer arrays that replace the (T*K, H) dispatch buffer.

Shape legend: T tokens, K experts per token (top-k), E experts, P = T*K token-expert pairs.

Every later piece (fused expert kernels, ring hops) reads tokens in place through these indices.
The pairs of any contiguous expert range ``[e0, e1)`` are the contiguous positions
``offsets[e0]:offsets[e1]`` of ``expert_token_indices``; a ring hop uses exactly such a slice.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

__all__ = ["RoutingIndex", "build_routing_index", "validate_topk_idx"]

Impl = Literal["auto", "torch", "triton"]


@dataclass(frozen=True)
class RoutingIndex:
    """The four MoEBlaze arrays plus the sizes they were built for.

    expert_token_indices_P: token ids grouped by expert (ascending expert, then ascending token).
    expert_token_offsets_E1: exclusive prefix sum of pairs per expert; ``[E] == P``.
    token_expert_indices_P: expert ids in token-major order (``topk_idx.flatten()``).
    token_index_map_P: position of pair ``(t, k)`` (flat ``t*K + k``) inside
        ``expert_token_indices``; int64 once ``P >= 2**31``.
    """

    expert_token_indices: Tensor  # (P,) int32
    expert_token_offsets: Tensor  # (E+1,) int64
    token_expert_indices: Tensor  # (P,) int32
    token_index_map: Tensor  # (P,) int32 or int64
    num_tokens: int  # T
    topk: int  # K
    num_experts: int  # E
    # the topk_idx tensor it was built from and that tensor's version counter then (see
    # ``built_from``); None for an index built another way
    source: _Source | None = field(default=None, compare=False, repr=False)
    # the one uint8 buffer whose views the four arrays are, when they were built into one (a
    # recorded ring hop's: it is copied in and out in one piece); None otherwise
    packed: Tensor | None = field(default=None, compare=False, repr=False)

    def built_from(self, topk_idx: Tensor) -> bool:
        """Whether this index was built from the tensor object ``topk_idx`` and that tensor has
        not been modified in place since (its version counter is unchanged). Host metadata only:
        no device work, no host sync. False for a copy, a view or another routing (the caller
        then compares the ids themselves)."""
        return self.source is not None and self.source.matches(topk_idx)

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.topk

    def offsets_for(self, e0: int, e1: int) -> Tensor:
        """(e1-e0+1,) view of the offsets of experts ``[e0, e1)``; positions stay global.

        No host sync: a kernel handed this view and the full ``expert_token_indices`` computes
        exactly the pairs of experts ``[e0, e1)`` (local expert ``j`` is global ``e0 + j``).
        """
        _check_range(e0, e1, self.num_experts)
        return self.expert_token_offsets[e0 : e1 + 1]

    def pair_range(self, e0: int, e1: int) -> tuple[int, int]:
        """Host ``(start, stop)`` of the pairs of experts ``[e0, e1)``. Host sync."""
        _check_range(e0, e1, self.num_experts)
        bounds = self.expert_token_offsets[[e0, e1]].tolist()  # host sync
        return int(bounds[0]), int(bounds[1])

    def tokens_for(self, e0: int, e1: int) -> Tensor:
        """Token ids of the pairs of experts ``[e0, e1)``, in index order. Host sync."""
        start, stop = self.pair_range(e0, e1)
        return self.expert_token_indices[start:stop]

    def tokens_per_expert(self) -> Tensor:
        """(E,) int64 pair counts per expert (device tensor, no sync)."""
        return self.expert_token_offsets[1:] - self.expert_token_offsets[:-1]


class _Source:
    """A weak reference to the ``topk_idx`` an index was built from, with its version counter
    at build time: the same object, unmodified, is the same routing. Weak, so the index keeps
    no routing alive; a freed tensor never matches (a new tensor at the same address cannot
    pass for it)."""

    __slots__ = ("ref", "version")

    def __init__(self, topk_idx: Tensor):
        self.ref = weakref.ref(topk_idx)
        self.version = topk_idx._version

    @staticmethod
    def of(topk_idx: Tensor) -> _Source | None:
        try:
            return _Source(topk_idx)
        except (RuntimeError, TypeError):  # inference tensors keep no version counter
            return None

    def matches(self, topk_idx: Tensor) -> bool:
        if self.ref() is not topk_idx:
            return False
        try:
            return topk_idx._version == self.version
        except RuntimeError:
            return False


def _check_range(e0: int, e1: int, num_experts: int) -> None:
    if not (0 <= e0 <= e1 <= num_experts):
        raise ValueError(
            f"expert range [{e0}, {e1}) must satisfy 0 <= e0 <= e1 <= num_experts={num_experts}"
        )


# integer dtypes torch compares and reduces natively (others are widened to int64 to validate)
_COMPARABLE_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def validate_topk_idx(topk_idx: Tensor, num_experts: int) -> None:
    """Raise ``ValueError`` naming the bad value and its limit. One host sync when T > 0."""
    if not isinstance(topk_idx, Tensor):
        raise ValueError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
    if topk_idx.dim() != 2:
        raise ValueError(
            f"topk_idx must be 2-D (T, K), got shape {tuple(topk_idx.shape)}; "
            "reshape it to (num_tokens, topk)"
        )
    if (
        topk_idx.dtype.is_floating_point
        or topk_idx.dtype.is_complex
        or topk_idx.dtype == (torch.bool)
    ):
        raise ValueError(f"topk_idx must hold integer expert ids, got dtype {topk_idx.dtype}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    num_tokens, topk = topk_idx.shape
    if topk < 1:
        raise ValueError(f"topk (K = topk_idx.shape[1]) must be >= 1, got {topk}")
    if topk > num_experts:
        raise ValueError(
            f"topk K={topk} exceeds num_experts E={num_experts}: a token picks K distinct experts"
        )
    if num_tokens == 0:
        return
    if topk_idx.dtype not in _COMPARABLE_INTS:  # uint16/32/64: no min/max kernels in torch
        topk_idx = topk_idx.long()
    lo, hi = torch.aminmax(topk_idx)
    dup = torch.zeros((), dtype=torch.bool, device=topk_idx.device)
    if topk > 1:
        s = torch.sort(topk_idx, dim=1).values
        dup = (s[:, 1:] == s[:, :-1]).any()
    lo, hi, dup = (v.item() for v in torch.stack([lo.long(), hi.long(), dup.long()]).cpu())
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"topk_idx holds expert id {bad}, outside [0, {num_experts}); "
            "pass global expert ids below num_experts"
        )
    if dup:
        raise ValueError(
            "topk_idx has a row that repeats an expert id; each token must pick K distinct experts"
        )


def _build_torch(topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Plain-torch build: a stable sort by expert id of the token-major pairs."""
    num_tokens, topk = topk_idx.shape
    num_pairs = num_tokens * topk
    device = topk_idx.device
    from relaymoe.kernels.index_arrays import index_arrays_like

    map_dtype = index_arrays_like(num_pairs, num_experts)[3][1]
    flat = topk_idx.reshape(-1).to(torch.int64)
    # index_add_, not bincount: bincount reads the largest id on the host to size its output
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=offsets[1:])
    # Stable: pairs of one expert keep token-major order, so token ids ascend (no repeats per row).
    order = torch.sort(flat, stable=True).indices
    expert_token_indices = (order // topk).to(torch.int32)
    token_index_map = torch.empty(num_pairs, dtype=map_dtype, device=device)
    token_index_map[order] = torch.arange(num_pairs, dtype=map_dtype, device=device)
    return expert_token_indices, offsets, flat.to(torch.int32), token_index_map


def build_routing_index(
    topk_idx: Tensor,
    num_experts: int,
    *,
    impl: Impl = "auto",
    validate: bool = True,
    out: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> RoutingIndex:
    """Build the routing index of ``topk_idx (T, K)`` over ``num_experts`` experts.

    ``impl="auto"`` uses the atomic-free Triton build on CUDA and plain torch elsewhere;
    ``"triton"`` forces Triton (on CPU only under ``TRITON_INTERPRET=1``). Both give identical
    arrays. ``validate=False`` skips the input checks (and their host sync) for callers that
    already validated the routing. The index keeps a weak reference to ``topk_idx`` and its
    version counter (:meth:`RoutingIndex.built_from`), so that ``moe_experts(index=...)`` can
    tell, without device work, that it is handed the routing it was built from. ``out``: the
    four arrays to write in place, in field order (``kernels.index_arrays.index_arrays_like``; e.g.
    views of one buffer, which a recorded ring hop copies out in one piece); default fresh ones.
    """
    if validate:
        validate_topk_idx(topk_idx, num_experts)
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    num_tokens, topk = topk_idx.shape
    from relaymoe.kernels import check_int32

    # expert_token_indices and token_expert_indices are int32 (the kernels' gather operands)
    check_int32(
        "tokens T",
        num_tokens,
        where="build_routing_index",
        fix="split the micro-batch (or the sequence) so one call holds fewer tokens",
    )
    if impl == "auto":
        from relaymoe.kernels import triton_available

        impl = "triton" if topk_idx.is_cuda and triton_available() else "torch"
    if out is not None:
        from relaymoe.kernels.index_arrays import check_index_out

        check_index_out(out, num_tokens * topk, num_experts, topk_idx.device)
    if impl == "triton" and num_tokens > 0:
        from relaymoe.kernels.routing import build_routing_index_triton

        arrays = build_routing_index_triton(topk_idx, num_experts, out=out)
    else:
        arrays = _build_torch(topk_idx, num_experts)
        if out is not None:
            for dst, src in zip(out, arrays, strict=True):
                dst.copy_(src)
            arrays = out
    return RoutingIndex(*arrays, num_tokens=num_tokens, topk=topk, num_experts=num_experts,
                        source=_Source.of(topk_idx))  # fmt: skip
