"""A hop's routing index as the input of a recorded hop: its four arrays packed into one buffer
(one copy a hop, not four; one tensor a recorded token forward builds and returns), and one
body for every expert range of an expert-mode ring (the range's offsets an input).

Used by ``hop_graphs.py``'s callers, ``expert_mode`` and ``token_mode``.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import NamedTuple

from torch import Tensor

from relaymoe.kernels.index_arrays import index_arrays_like
from relaymoe.ring.plan import Layout
from relaymoe.routing import RoutingIndex

__all__ = [
    "INDEX_FIELDS",
    "PackedIndex",
    "index_from",
    "index_inputs",
    "index_layout",
    "index_sizes",
    "packed_index",
    "range_window",
    "window_fits",
]

INDEX_FIELDS = ("expert_token_indices", "expert_token_offsets", "token_expert_indices",
                "token_index_map")  # fmt: skip


def index_inputs(index: RoutingIndex | PackedIndex, prefix: str = "index.") -> dict[str, Tensor]:
    """The routing index's arrays as inputs of :meth:`HopGraphs.run`: its one packed buffer
    when it has one (:func:`packed_index`: one copy a hop, not four), else the four arrays."""
    if index.packed is not None:
        return {prefix + "packed": index.packed}
    return {prefix + f: getattr(index, f) for f in INDEX_FIELDS}


@functools.cache
def index_layout(sizes: tuple[int, int, int]) -> Layout:
    """The four arrays of a routing index of ``sizes`` (:func:`index_sizes`) in one buffer."""
    T, K, E = sizes
    arrays = index_arrays_like(T * K, E)
    return Layout.of(*((f, dt, shape) for f, (shape, dt) in zip(INDEX_FIELDS, arrays, strict=True)))


def packed_index(buf: Tensor, sizes: tuple[int, int, int]) -> RoutingIndex:
    """The routing index whose arrays are views of ``buf`` (uint8, :func:`index_layout`):
    what a recorded token forward builds into one buffer, so that the hop returns it as one
    tensor (one clone after the replay) and the backward copies it in as one."""
    views = index_layout(sizes).views(buf)
    return RoutingIndex(*(views[f] for f in INDEX_FIELDS), *sizes, packed=buf)


class PackedIndex(NamedTuple):
    """A routing index kept as its packed buffer (:func:`index_layout`) and sizes: what a
    recorded token forward returns for each visiting partition. The backward copies the buffer
    into its hop as one tensor and never needs the arrays on the host, so their views are made
    only where read (:attr:`index`), not every hop."""

    packed: Tensor
    sizes: tuple[int, int, int]

    @property
    def index(self) -> RoutingIndex:
        """The :class:`RoutingIndex` whose arrays are views of :attr:`packed`."""
        return packed_index(self.packed, self.sizes)

    num_tokens = property(lambda self: self.sizes[0])
    topk = property(lambda self: self.sizes[1])
    num_experts = property(lambda self: self.sizes[2])


def index_sizes(index: RoutingIndex | PackedIndex) -> tuple[int, int, int]:
    """``(num_tokens, topk, num_experts)`` of ``index``: what :func:`index_from` rebuilds it of
    (a body keeps these host sizes, never the index of the call that recorded it)."""
    return index.num_tokens, index.topk, index.num_experts


def index_from(tensors: dict[str, Tensor], sizes: tuple[int, int, int],
               prefix: str = "index.") -> RoutingIndex:  # fmt: skip
    """A routing index over the arrays ``tensors[prefix + field]`` of ``sizes``
    (:func:`index_sizes`), or over the packed buffer ``tensors[prefix + "packed"]``."""
    buf = tensors.get(prefix + "packed")
    if buf is not None:
        return packed_index(buf, sizes)
    return RoutingIndex(*(tensors[prefix + f] for f in INDEX_FIELDS), *sizes)


def window_fits(prob) -> bool:
    """Whether one recorded expert-mode hop (forward or backward) can serve every expert range
    through :func:`range_window`: a ring of more than one, and no fc2 bias (the forward's
    combine and the backward's router gradient read ``b2`` at ``e - e0``, ``e0`` a host value
    of the range)."""
    return prob.world_size > 1 and not prob.has_b2


def range_window(index: RoutingIndex, offsets: Tensor) -> tuple[RoutingIndex, tuple[int, int]]:
    """``(index, range)`` for a hop body recorded once for every expert range of one size:
    ``offsets (El+1,)`` are experts ``[e0, e0+El)``'s entries of ``index``'s offsets (global
    positions, an input of the hop copied into its static buffer each replay), and the result's
    range ``(0, El)`` reads them where the kernels read a range's offsets
    (``offsets_for(0, El)``). The kernels then depend on ``e0`` only through that device data;
    the pair count comes from the caller's bound (``max_pairs``), never from the range. The
    expert ids (``token_expert_indices``) stay global: only a hop without fc2 bias reads no
    expert id by range (:func:`window_fits`), forward or backward."""
    El = offsets.shape[0] - 1
    return replace(index, expert_token_offsets=offsets, packed=None), (0, El)
