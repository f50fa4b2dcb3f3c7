"""The ring schedule: pure Python, no torch (RelayMoE §3.1, Fig. 5).

Ranks ``0..R-1`` form a ring; every hop each rank sends to ``r+1`` and receives from ``r-1``.
At hop ``h`` rank ``r`` computes with partition ``(r - h) mod R`` (its own at hop 0). Two kinds
of data travel:

* the **lead**: the partition itself (expert weights, or tokens with their routing metadata),
  sent at hops ``0..R-2`` so that it is already in place when the receiver's next hop starts;
* the **trail** (optional): the accumulator every rank adds into (expert-weight gradients in
  expert mode, outputs or token gradients in token mode). It travels one hop behind its
  partition: a rank computes its local share into a scratch without waiting, then waits for the
  incoming partial accumulator, adds into it and sends it with its next transfer. The trail is
  sent at hops ``1..R-1`` merged with the lead into one contiguous range, and after the last
  hop it makes one trail-only hop home ("hop R").

Two slots (double buffer) hold this data; step ``h`` (``0..R``) of rank ``r`` lives in slot
``h % 2`` laid out as ``[lead of partition (r-h) | trail of partition (r-h+1)]``. Every size
comes from the per-partition byte counts known to all ranks, so every rank can compute every
other rank's layout: a receiver knows exactly how many bytes arrive and where a pulling
transport finds them on the sender.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ByteRange", "HopTransfer", "RingPlan", "SlotLayout"]

_ALIGN = 256


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class ByteRange:
    slot: int  # 0 or 1 (the double buffer); -1 for the fresh buffer of the final return
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class SlotLayout:
    """Content of one rank's slot at step ``h``: lead at byte 0, trail after it (aligned)."""

    lead_partition: int | None
    lead_bytes: int
    trail_partition: int | None
    trail_offset: int
    trail_bytes: int

    @property
    def end(self) -> int:
        return (
            self.trail_offset + self.trail_bytes
            if self.trail_partition is not None
            else (self.lead_bytes)
        )


@dataclass(frozen=True)
class HopTransfer:
    """One rank's transfer of hop ``h``: what it sends to ``send_peer`` and receives from
    ``recv_peer`` (``None`` when nothing), and where the receive's bytes sit on the sender."""

    hop: int
    send_peer: int
    recv_peer: int
    send: ByteRange | None
    recv: ByteRange | None
    recv_src: ByteRange | None  # the sender's ``send`` range (pulling transports read it)
    sends_lead: bool
    sends_trail: bool


class RingPlan:
    """Schedule of one ring pass for every rank.

    ``lead_bytes[p]`` / ``trail_bytes[p]``: bytes of partition ``p``'s lead / trail (``trail_bytes``
    None when nothing trails, e.g. the expert-mode forward whose output stays home).
    """

    def __init__(
        self, rank: int, world_size: int, lead_bytes: list[int], trail_bytes: list[int] | None
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must lie in [0, world_size={world_size})")
        if len(lead_bytes) != world_size or (
            trail_bytes is not None and len(trail_bytes) != world_size
        ):
            raise ValueError("lead_bytes/trail_bytes need one entry per rank")
        self.rank = rank
        self.world_size = world_size
        self.lead_bytes = tuple(int(b) for b in lead_bytes)
        self.trail_bytes = None if trail_bytes is None else tuple(int(b) for b in trail_bytes)

    @property
    def has_trail(self) -> bool:
        return self.trail_bytes is not None

    @property
    def num_hops(self) -> int:
        return self.world_size

    def partition(self, hop: int, rank: int | None = None) -> int:
        """Partition computed at ``hop`` by ``rank`` (default: this rank)."""
        r = self.rank if rank is None else rank
        return (r - hop) % self.world_size

    def slot_layout(self, step: int, rank: int | None = None) -> SlotLayout:
        """Layout of ``rank``'s slot ``step % 2`` during step ``step`` in ``0..R``."""
        r = self.rank if rank is None else rank
        R = self.world_size
        if not 0 <= step <= R:
            raise ValueError(f"step {step} outside [0, {R}]")
        lead_p = (r - step) % R if step <= R - 1 else None
        lead = self.lead_bytes[lead_p] if lead_p is not None else 0
        trail_p = (r - step + 1) % R if (step >= 1 and self.has_trail) else None
        trail = self.trail_bytes[trail_p] if trail_p is not None else 0
        return SlotLayout(lead_p, lead, trail_p, _align(lead) if lead else 0, trail)

    def _send_range(self, hop: int, rank: int) -> ByteRange | None:
        R = self.world_size
        lay = self.slot_layout(hop, rank)
        lead = hop <= R - 2
        trail = hop >= 1 and self.has_trail
        if hop == R:  # final trail-only return
            lead = False
        if lead and trail:
            start, stop = 0, lay.trail_offset + lay.trail_bytes
        elif lead:
            start, stop = 0, lay.lead_bytes
        elif trail:
            start, stop = lay.trail_offset, lay.trail_offset + lay.trail_bytes
        else:
            return None
        if stop == start:
            return None
        return ByteRange(hop % 2, start, stop)

    def transfer(self, hop: int, rank: int | None = None) -> HopTransfer:
        """Transfer of ``hop`` in ``0..R`` (hop ``R``: the trail's return home, if any)."""
        r = self.rank if rank is None else rank
        R = self.world_size
        if not 0 <= hop <= R:
            raise ValueError(f"hop {hop} outside [0, {R}]")
        send_peer, recv_peer = (r + 1) % R, (r - 1) % R
        if R == 1 or (hop == R and not self.has_trail):
            return HopTransfer(hop, send_peer, recv_peer, None, None, None, False, False)
        send = self._send_range(hop, r)
        src = self._send_range(hop, recv_peer)
        recv = None
        if src is not None:
            if hop == R:
                recv = ByteRange(-1, 0, src.nbytes)  # into a fresh buffer of the owner
            else:
                # A range that starts at byte 0 holds the lead (same partition, same size on
                # both sides); a trail-only range lands in the receiver's trail region.
                start = 0 if src.start == 0 else self.slot_layout(hop + 1, r).trail_offset
                recv = ByteRange((hop + 1) % 2, start, start + src.nbytes)
        return HopTransfer(
            hop,
            send_peer,
            recv_peer,
            send,
            recv,
            src,
            sends_lead=hop <= R - 2,
            sends_trail=self.has_trail and 1 <= hop,
        )

    def capacity(self) -> int:
        """Bytes one slot needs on any rank at any step (identical on every rank)."""
        R = self.world_size
        return max(self.slot_layout(s, q).end for q in range(R) for s in range(R + 1))
