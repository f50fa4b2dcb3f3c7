"""The ring schedule: pure Python, no torch (RelayMoE §3.1, Fig. 5), flat or two-level. The
order itself is ``relaymoe.cost.order_partition`` / ``order_rank`` (the planner's too).

Every rank computes every partition once, one per step ``s = 0..R-1``, its own at step 0;
``partition(s, r)`` says which, and ``who(s, p)`` which rank computes ``p`` at step ``s``. Two
orders exist (``options.SCHEDULES``):

* **flat**: one ring over the group: rank ``r`` computes ``(r - s) mod R``, so every hop each rank
  sends to ``r+1``. Across nodes every hop then crosses the slow link at one rank per node.
* **two_level** (``gpus_per_node = G``, ``N = R/G`` nodes, rank ``r = n*G + g``): ``N`` rounds of
  ``G`` steps. Inside a round the partitions circulate around the node's ring (``g -> g+1``, G-1
  hops over NVLink); between rounds every GPU of the node hands its partition to the same local
  rank of the next node (``n -> n+1``), all ``G`` links at once. At step ``s = j*G + i`` rank
  ``(n, g)`` computes the partition of rank ``(n - j mod N, g - i + j mod G)``: for each round ``j``
  one node's partitions, every local index once, so every (rank, partition) pair occurs exactly
  once. ``G = R`` (one node) and ``G = 1`` give the flat order.

Two kinds of data travel:

* the **lead**: the partition itself (expert weights, or tokens with their routing metadata),
  sent at hops ``0..R-2`` to the rank that computes it at the next step, so that it is already in
  place when that rank's next step starts;
* the **trail** (optional): the accumulator every rank adds into (expert-weight gradients in
  expert mode, outputs or token gradients in token mode). It follows its partition's path one hop
  behind: a rank computes its local share into a scratch without waiting, then waits for the
  incoming partial accumulator, adds into it and sends it at the next hop to where the lead went.
  After the last step it makes one trail-only hop home to the partition's owner ("hop R").

Two slots (double buffer) hold this data; step ``s`` (``0..R``) of rank ``r`` lives in slot
``s % 2`` laid out as ``[lead of partition(s) | trail of partition(s-1)]``. A hop's lead and
trail go to the same peer in a flat ring (one contiguous range); in the two-level ring they part
at the hops around a node crossing (the lead goes to the next node, the trail still to the node
neighbour, or the reverse), so a hop has up to two sends and two receives (``Leg``s). Every size
comes from the per-partition byte counts known to all ranks, so every rank can compute every
other rank's layout: a receiver knows exactly how many bytes arrive and where a pulling transport
finds them on the sender.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from relaymoe.cost import order_partition, order_rank
from relaymoe.cost.links import align_up

__all__ = ["ByteRange", "HopTransfer", "Leg", "PassTable", "RingPlan", "SlotLayout"]


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
class Leg:
    """One message of a hop: the ``peer`` (a group rank) and the byte ``range`` in this rank's
    buffers; for a receive, ``src`` is the sender's range (pulling transports read it)."""

    peer: int
    range: ByteRange
    src: ByteRange | None = None

    @property
    def nbytes(self) -> int:
        return self.range.nbytes


@dataclass(frozen=True)
class HopTransfer:
    """One rank's transfers of hop ``h``: at most two sends and two receives, each with a distinct
    peer (a lead and a trail for the same peer travel as one range)."""

    hop: int
    sends: tuple[Leg, ...]
    recvs: tuple[Leg, ...]
    sends_lead: bool
    sends_trail: bool

    @cached_property
    def peers(self) -> frozenset[int]:
        return frozenset(leg.peer for leg in (*self.sends, *self.recvs))

    @property
    def send_bytes(self) -> int:
        return sum(leg.nbytes for leg in self.sends)


class RingPlan:
    """Schedule of one ring pass for every rank.

    ``lead_bytes[p]`` / ``trail_bytes[p]``: bytes of partition ``p``'s lead / trail (``trail_bytes``
    None when nothing trails, e.g. the expert-mode forward whose output stays home).
    ``gpus_per_node``: ``None`` for the flat order, else ``G`` for the two-level order over
    ``R/G`` nodes of ``G`` consecutive ranks (``G`` must divide ``R``).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        lead_bytes: list[int],
        trail_bytes: list[int] | None,
        *,
        gpus_per_node: int | None = None,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must lie in [0, world_size={world_size})")
        if len(lead_bytes) != world_size or (
            trail_bytes is not None and len(trail_bytes) != world_size
        ):
            raise ValueError("lead_bytes/trail_bytes need one entry per rank")
        G = world_size if gpus_per_node is None else gpus_per_node
        if isinstance(G, bool) or not isinstance(G, int) or G < 1 or world_size % G:
            raise ValueError(
                f"gpus_per_node={gpus_per_node!r} must be a positive divisor of the group's "
                f"{world_size} ranks (nodes of equally many consecutive ranks); fix: pass the "
                "GPUs per node of the EP group, or None for a flat ring"
            )
        self.rank = rank
        self.world_size = world_size
        self.gpus_per_node = G
        self.nodes = world_size // G
        self.lead_bytes = tuple(int(b) for b in lead_bytes)
        self.trail_bytes = None if trail_bytes is None else tuple(int(b) for b in trail_bytes)

    @property
    def schedule(self) -> str:
        """``two_level`` when both levels have more than one member, else ``flat`` (the same
        order as the flat ring)."""
        return "two_level" if 1 < self.gpus_per_node < self.world_size else "flat"

    @property
    def has_trail(self) -> bool:
        return self.trail_bytes is not None

    def partition(self, step: int, rank: int | None = None) -> int:
        """Partition computed at ``step`` by ``rank`` (default: this rank)."""
        r = self.rank if rank is None else rank
        return order_partition(step, r, self.world_size, self.gpus_per_node)

    def who(self, step: int, partition: int) -> int:
        """The rank that computes ``partition`` at ``step`` (the inverse of ``partition``)."""
        return order_rank(step, partition, self.world_size, self.gpus_per_node)

    def slot_layout(self, step: int, rank: int | None = None) -> SlotLayout:
        """Layout of ``rank``'s slot ``step % 2`` during step ``step`` in ``0..R``."""
        r = self.rank if rank is None else rank
        R = self.world_size
        if not 0 <= step <= R:
            raise ValueError(f"step {step} outside [0, {R}]")
        lead_p = self.partition(step, r) if step <= R - 1 else None
        lead = self.lead_bytes[lead_p] if lead_p is not None else 0
        trail_p = self.partition(step - 1, r) if (step >= 1 and self.has_trail) else None
        trail = self.trail_bytes[trail_p] if trail_p is not None else 0
        return SlotLayout(lead_p, lead, trail_p, align_up(lead) if lead else 0, trail)

    def _sends(self, hop: int, rank: int) -> list[tuple[str, Leg]]:
        """``rank``'s non-empty sends of ``hop`` as ``(kind, leg)``, kind lead/trail/both."""
        R = self.world_size
        lay = self.slot_layout(hop, rank)
        lead_to = trail_to = None
        if hop <= R - 2 and lay.lead_bytes:
            lead_to = self.who(hop + 1, lay.lead_partition)
        if self.has_trail and hop >= 1 and lay.trail_bytes:
            p = lay.trail_partition
            trail_to = self.who(hop, p) if hop < R else p  # hop R: home to the owner
        slot, t0, t1 = hop % 2, lay.trail_offset, lay.trail_offset + lay.trail_bytes
        if lead_to is not None and lead_to == trail_to:
            return [("both", Leg(lead_to, ByteRange(slot, 0, t1)))]
        out = []
        if lead_to is not None:
            out.append(("lead", Leg(lead_to, ByteRange(slot, 0, lay.lead_bytes))))
        if trail_to is not None:
            out.append(("trail", Leg(trail_to, ByteRange(slot, t0, t1))))
        return out

    def transfer(self, hop: int, rank: int | None = None) -> HopTransfer:
        """Transfers of ``hop`` in ``0..R`` (hop ``R``: the trail's return home, if any)."""
        r = self.rank if rank is None else rank
        R = self.world_size
        if not 0 <= hop <= R:
            raise ValueError(f"hop {hop} outside [0, {R}]")
        lead = hop <= R - 2
        trail = self.has_trail and hop >= 1
        if R == 1 or (hop == R and not self.has_trail):
            return HopTransfer(hop, (), (), False, False)
        sends = tuple(leg for _, leg in self._sends(hop, r))
        # who sends to r: the lead of its next partition, the trail of the partition it computes
        sources = set()
        if lead:
            sources.add(self.who(hop, self.partition(hop + 1, r)))
        if trail and hop < R:
            sources.add(self.who(hop - 1, self.partition(hop, r)))
        elif trail:  # hop R: whoever computed this rank's own partition last
            sources.add(self.who(R - 1, r))
        recvs = []
        for src in sorted(sources):
            for kind, leg in self._sends(hop, src):
                if leg.peer != r:
                    continue
                n = leg.nbytes
                if hop == R:
                    rng = ByteRange(-1, 0, n)  # into a fresh buffer of the owner
                elif kind == "trail":
                    start = self.slot_layout(hop + 1, r).trail_offset
                    rng = ByteRange((hop + 1) % 2, start, start + n)
                else:  # the lead (and a merged trail: the same lead partition, the same offset)
                    rng = ByteRange((hop + 1) % 2, 0, n)
                recvs.append(Leg(src, rng, leg.range))
        return HopTransfer(hop, sends, tuple(recvs), sends_lead=lead, sends_trail=trail)

    def transfers(self) -> tuple[HopTransfer, ...]:
        """This rank's transfers of every hop, ``transfers()[h] == transfer(h)`` for ``h`` in
        ``0..R``. The executor asks once per pass instead of planning each hop on the host: cached
        by sizes, order and rank (a steady-state training step repeats them)."""
        return self.pass_table().transfers

    def trail_offsets(self) -> tuple[int, ...]:
        """``trail_offsets()[s] == slot_layout(s).trail_offset`` for ``s`` in ``0..R`` (where
        the trail sits in this rank's slot at step ``s``); cached with :meth:`transfers`."""
        return self.pass_table().trail_offsets

    def pass_table(self) -> PassTable:
        """Everything this rank's pass asks of the plan per hop (:class:`PassTable`), computed
        once for the plan's sizes, order and rank, and kept by the plan (a pass asks more than
        once; looking it up by the sizes hashes them)."""
        table = self.__dict__.get("_table")
        if table is None:
            table = self.__dict__["_table"] = _pass_hops(
                self.world_size, self.gpus_per_node, self.lead_bytes, self.trail_bytes, self.rank
            )
        return table

    def capacity(self) -> int:
        """Bytes one slot needs on any rank at any step (identical on every rank). Every ring
        call asks for it: cached by sizes and order (``O(R^2)`` slot layouts otherwise, host time
        that grows with R)."""
        return _capacity(self.world_size, self.gpus_per_node, self.lead_bytes, self.trail_bytes)


@functools.lru_cache(maxsize=256)
def _capacity(R: int, G: int, lead: tuple, trail: tuple | None) -> int:
    plan = RingPlan(0, R, list(lead), None if trail is None else list(trail), gpus_per_node=G)
    return max(plan.slot_layout(s, q).end for q in range(R) for s in range(R + 1))


class PassTable(NamedTuple):
    """One rank's per-hop answers of a pass, as plain tuples for the executor's hop loop.

    ``transfers[h]`` / ``trail_offsets[s]``: as :meth:`RingPlan.transfers` /
    :meth:`RingPlan.trail_offsets`; ``partitions[s]``: ``partition(s)`` for ``s`` in
    ``0..R-1``; ``ranges``: the distinct byte ranges of every hop's legs; ``legs[h]``: hop
    ``h``'s ``(sends, recvs)`` as indices into ``ranges``, in ``transfers[h]``'s order (a range
    that recurs in a pass has one index, so its view is cut once per pass).
    """

    transfers: tuple[HopTransfer, ...]
    trail_offsets: tuple[int, ...]
    partitions: tuple[int, ...]
    ranges: tuple[ByteRange, ...]
    legs: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


@functools.lru_cache(maxsize=256)
def _pass_hops(R: int, G: int, lead: tuple, trail: tuple | None, rank: int) -> PassTable:
    """One rank's :class:`PassTable` (immutable, so shared by every plan of the same sizes)."""
    plan = RingPlan(rank, R, list(lead), None if trail is None else list(trail), gpus_per_node=G)
    steps = range(R + 1)
    transfers = tuple(plan.transfer(h) for h in steps)
    index: dict[ByteRange, int] = {}

    def at(legs: tuple[Leg, ...]) -> tuple[int, ...]:
        return tuple(index.setdefault(leg.range, len(index)) for leg in legs)

    legs = tuple((at(x.sends), at(x.recvs)) for x in transfers)
    return PassTable(
        transfers=transfers,
        trail_offsets=tuple(plan.slot_layout(s).trail_offset for s in steps),
        partitions=tuple(plan.partition(s) for s in range(R)),
        ranges=tuple(index),
        legs=legs,
    )
