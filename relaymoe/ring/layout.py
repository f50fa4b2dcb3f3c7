"""Byte layouts of the flat buffers a ring hop moves: one send and one receive per hop.

A partition (expert weights, or tokens with their routing metadata) and its travelling
accumulator hold tensors of several dtypes (bf16 activations, fp32 probabilities, int32 expert
ids). They are packed into one ``uint8`` buffer, each segment starting at a ``ALIGN``-byte
boundary so that its typed view is aligned for vector loads, and moved as one contiguous range.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from relaymoe.cost.links import ALIGN, align_up

__all__ = ["Layout", "Segment"]


@dataclass(frozen=True)
class Segment:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the layout's base

    @cached_property
    def nbytes(self) -> int:
        """Bytes of the segment (computed once: ``views`` asks for every segment per hop)."""
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """Segments packed back to back (aligned); ``nbytes`` ends at the last segment's end."""

    segments: tuple[Segment, ...]
    nbytes: int

    @staticmethod
    def of(*specs: tuple[str, torch.dtype, tuple[int, ...]]) -> Layout:
        segments, offset, end = [], 0, 0
        for name, dtype, shape in specs:
            seg = Segment(name, dtype, tuple(int(s) for s in shape), offset)
            segments.append(seg)
            end = offset + seg.nbytes
            offset = align_up(end)
        return Layout(tuple(segments), end)

    @property
    def names(self) -> tuple[str, ...]:
        """The segments' names, in layout order."""
        return tuple(seg.name for seg in self.segments)

    def views(self, buf_u8: Tensor, base: int = 0) -> dict[str, Tensor]:
        """Typed views of the segments inside ``buf_u8[base:]`` (no copy)."""
        if base % ALIGN:
            raise ValueError(f"layout base {base} must be a multiple of {ALIGN} bytes")
        if base + self.nbytes > buf_u8.numel():
            raise ValueError(
                f"layout of {self.nbytes} bytes at base {base} overflows a {buf_u8.numel()}-byte "
                "buffer"
            )
        return {
            name: buf_u8[base + start : base + stop].view(dtype).view(shape)
            for name, start, stop, dtype, shape in self._spans
        }

    def __hash__(self) -> int:
        """The dataclass's hash of the fields, computed once (the executor keys its views by
        layout, every hop)."""
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.segments, self.nbytes))

    def __getstate__(self) -> dict:
        """Pickled without the cached hash: it is this process's (string hashes are salted)."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @cached_property
    def _spans(self) -> tuple[tuple[str, int, int, torch.dtype, tuple[int, ...]], ...]:
        """``(name, start, stop, dtype, shape)`` of each segment relative to the base, for
        ``views`` (the ring asks for views every hop; the segments never change)."""
        return tuple(
            (seg.name, seg.offset, seg.offset + seg.nbytes, seg.dtype, seg.shape)
            for seg in self.segments
        )
