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

    def views(self, buf_u8: Tensor, base: int = 0, flats: dict | None = None) -> dict[str, Tensor]:
        """Typed views of the segments inside ``buf_u8[base:]`` (no copy).

        ``flats``: a dict the caller keeps for ``buf_u8`` (and only for it), which holds the
        buffer's typed flat views by dtype; layouts viewed in the same buffer share them instead
        of making them again (the ring views the same slots with several layouts per pass).
        """
        self._check(buf_u8, base)
        if flats is None:
            flats = {}
        out = {}
        for name, start, dtype, shape, stride in self._spans:
            flat, first = flats.get(dtype) or _flat(flats, buf_u8, dtype)
            out[name] = flat.as_strided(shape, stride, first + (base + start) // dtype.itemsize)
        return out

    def runs(self, buf_u8: Tensor, base: int = 0, flats: dict | None = None) -> list[Tensor]:
        """The segments inside ``buf_u8[base:]`` as few 1-D typed views as cover exactly their
        elements: adjacent segments of one dtype with no alignment gap between them share one.
        For elementwise work over a whole layout (zeroing it, adding one copy into another),
        which then takes one operation per run instead of one per segment. ``flats`` as in
        :meth:`views`."""
        self._check(buf_u8, base)
        if flats is None:
            flats = {}
        out = []
        for start, numel, dtype in self._runs:
            flat, first = flats.get(dtype) or _flat(flats, buf_u8, dtype)
            out.append(flat.as_strided((numel,), (1,), first + (base + start) // dtype.itemsize))
        return out

    def _check(self, buf_u8: Tensor, base: int) -> None:
        if base % ALIGN:
            raise ValueError(f"layout base {base} must be a multiple of {ALIGN} bytes")
        if base + self.nbytes > (size := buf_u8.numel()):
            raise ValueError(
                f"layout of {self.nbytes} bytes at base {base} overflows a {size}-byte buffer"
            )

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
    def _spans(self) -> tuple[tuple[str, int, torch.dtype, tuple[int, ...], tuple[int, ...]], ...]:
        """``(name, start, dtype, shape, contiguous strides)`` of each segment, ``start`` in bytes
        from the base, for ``views`` (the ring asks for views every pass; the segments never
        change)."""
        return tuple(
            (seg.name, seg.offset, seg.dtype, seg.shape, _strides(seg.shape))
            for seg in self.segments
        )

    @cached_property
    def _runs(self) -> tuple[tuple[int, int, torch.dtype], ...]:
        """``(start byte, elements, dtype)`` of each run of :meth:`runs`."""
        runs: list[list] = []
        for seg in self.segments:
            last = runs[-1] if runs else None
            if (
                last
                and last[2] == seg.dtype
                and last[0] + last[1] * seg.dtype.itemsize == seg.offset
            ):
                last[1] += seg.nbytes // seg.dtype.itemsize
            else:
                runs.append([seg.offset, seg.nbytes // seg.dtype.itemsize, seg.dtype])
        return tuple((start, numel, dtype) for start, numel, dtype in runs if numel)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``, in elements."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _flat(flats: dict, buf_u8: Tensor, dtype: torch.dtype) -> tuple[Tensor, int]:
    """``buf_u8`` viewed as ``dtype`` (its whole elements) and that view's storage offset in
    elements, stored in ``flats``: what the segments' views are cut from."""
    numel = buf_u8.numel()
    whole = numel - numel % dtype.itemsize
    flat = (buf_u8 if whole == numel else buf_u8[:whole]).view(dtype)
    flats[dtype] = entry = (flat, flat.storage_offset())
    return entry
