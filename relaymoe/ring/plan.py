"""The plan of one ring call: what the ranks agreed to run, the order of its hops, and the bytes
each hop moves.

Shape legend as in ``engine.py``.

**The problem.** :class:`RingRequest` is what the caller of one ``ring_moe`` call asks for: its
``RingConfig``'s options, plus what only the call knows (whether a backward follows, the
backend, the activation); its collective-deciding options (``agree``, ``pair_buffer_mib``) are
written into every agreement's row (``agreement.py``).
:class:`RingProblem` is what every rank agreed on: the sizes of every partition and the resolved
execution. Both are frozen: the layouts and plans below are functions of the problem.

**The nodes.** Every rank's ``host_hash`` travels in the agreement's row; the ranks' hosts give
the GPUs per node (:func:`nodes_from_hosts`), and with them the schedule a ring runs
(:func:`resolve_schedule`), the same on every rank.

**The hop order** (:class:`RingPlan`; RelayMoE §3.1, Fig. 5), flat or two-level. The order itself
is ``relaymoe.cost.order_partition`` / ``order_rank`` (the planner's too). Every rank computes
every partition once, one per step ``s = 0..R-1``, its own at step 0; ``partition(s, r)`` says
which, and ``who(s, p)`` which rank computes ``p`` at step ``s``. Two orders exist
(``options.SCHEDULES``):

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

**The bytes** (:class:`Layout`). A partition and its travelling accumulator hold tensors of
several dtypes (bf16 activations, fp32 probabilities, int32 expert ids). They are packed into one
``uint8`` buffer, each segment starting at an ``ALIGN``-byte boundary so that its typed view is
aligned for vector loads, and moved as one contiguous range: one send and one receive per hop.

**A problem's layouts and pass plans** (:func:`weights_layout`, :func:`expert_plans`,
:func:`token_plans`, ...) are memoised by the (frozen, hashable) problem
(``functools.lru_cache``: a pure function of the problem, no state any call could change): every
pass of every layer asks for them, and building them again (a layout per partition and
direction, a plan's tables) was a tenth of a recorded pass's host time.
"""

from __future__ import annotations

import functools
import hashlib
import socket
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch
from torch import Tensor

from relaymoe import options
from relaymoe.activation import SWIGLU, ExpertActivation, as_activation
from relaymoe.cost import order_partition, order_rank
from relaymoe.cost.links import ALIGN, align_up
from relaymoe.options import NODE_BATCHED

__all__ = [
    "ALIGN",
    "IDX",
    "ByteRange",
    "HopTransfer",
    "Layout",
    "Leg",
    "PassTable",
    "RingPlan",
    "RingProblem",
    "RingRequest",
    "Segment",
    "SlotLayout",
    "capacity",
    "expert_plans",
    "host_hash",
    "nodes_from_hosts",
    "pair_rows",
    "request_activation",
    "resolve_schedule",
    "ring_plan",
    "ring_request",
    "token_layouts",
    "token_lead",
    "token_plans",
    "token_trail",
    "weights_layout",
]


# ---------------------------------------------------------------------------------------------
# the request and the agreed problem
# ---------------------------------------------------------------------------------------------
def request_activation(value) -> ExpertActivation | str:
    """``value`` (``ring_moe``'s ``activation=``) as the request holds it: the
    ``ExpertActivation``, or the message of ``as_activation``'s ``ValueError`` when it is not
    one. Not raised here: the agreement reports it (``agreement.local_check``, code 9) on every
    rank at once, so a rank with a bad activation fails its peers instead of leaving them
    waiting."""
    try:
        return as_activation(value)
    except ValueError as err:
        return str(err)


@dataclass(frozen=True)
class RingRequest:
    """What the caller of one ``ring_moe`` call asks for; every rank must ask the same (the
    agreement checks it). Made by :func:`ring_request` from the call's ``RingConfig`` (whose
    fields of the same names define each option, its choices and its default) and what only the
    call knows; the activation held unchecked, so that the agreement reports a bad one on every
    rank at once. ``needs_grad``: a backward follows."""

    mode: str
    transport: str
    schedule: str
    gpus_per_node: int | None  # None: from the ranks' hosts
    needs_grad: bool
    grad_accum: str  # the weight-gradient accumulators
    # the collective-deciding options (RingConfig.agree, KernelOptions.pair_buffer_mib): agreed
    # in the row, so ranks launched with different values all raise
    agree: str
    pair_buffer_mib: int
    backend: str = "auto"  # the hop primitives' backend on this rank (not compared across ranks)
    # the expert MLP (request_activation: an ExpertActivation, or the message of a bad one)
    activation: ExpertActivation | str = SWIGLU
    # the call is (also) captured in a CUDA graph: "auto" picks among the ring modes, and the
    # all-to-all (host-sized messages) is refused (``hop_graphs.py``)
    capturable: bool = False
    # the hop kernels' options (RingConfig.kernels). This rank's choice: not compared across
    # ranks, nor part of a trusted call's cached signature (agreement.py)
    kernels: options.KernelOptions = field(default_factory=options.KernelOptions, compare=False)
    # how long the agreement's collectives wait for a peer (RingConfig.timeout_s; None: the
    # group's timeout). This rank's, as ``kernels``
    timeout_s: float | None = field(default=None, compare=False)


def ring_request(
    config: options.RingConfig,
    *,
    needs_grad: bool = True,
    backend: str = "auto",
    activation=None,
    capturable: bool = False,
) -> RingRequest:
    """The request of one call: the options of ``config`` (the call's ``RingConfig``, validated
    when it was made) with what only the call knows: whether a backward follows, this rank's hop
    backend, the expert activation (checked by the agreement, on every rank at once) and whether
    the call is captured in a CUDA graph."""
    return RingRequest(
        config.mode, config.transport, config.schedule, config.gpus_per_node, needs_grad,
        config.grad_accum, config.agree, config.kernels.pair_buffer_mib, backend,
        request_activation(activation), bool(capturable), config.kernels, config.timeout_s,
    )  # fmt: skip


@dataclass(frozen=True)
class RingProblem:
    """What every rank agreed on: sizes of every partition and the resolved execution."""

    rank: int
    world_size: int
    num_local_experts: int
    hidden: int
    ffn: int
    topk: int
    dtype: torch.dtype
    prob_dtype: torch.dtype
    tokens: tuple[int, ...]  # T of every rank's token partition
    mode: str  # "expert" | "token"
    transport: str  # "nccl" | "copy_engine" | "local"
    needs_grad: bool
    # pairs[r][q]: pairs of rank r's tokens whose expert rank q owns, read in the same all-reduce
    # as the sizes, so a hop knows its pair count without a host sync of its own. None: the hops
    # size their buffers from the bound ``pair_bound`` (trusted callers, small T).
    pairs: tuple[tuple[int, ...], ...] | None
    # the hop order (RingPlan): "flat", or "two_level" over nodes of gpus_per_node
    # consecutive ranks (None for flat); or "node_batched" (expert mode, expert_mode.py)
    schedule: str = "flat"
    gpus_per_node: int | None = None
    # dtype of the weight-gradient accumulators (expert mode's travelling trail, token mode's
    # local sums): ``dtype`` or fp32 (cost.grad_accum_bytes)
    grad_dtype: torch.dtype | None = None
    # KernelOptions.pair_buffer_mib as agreed by every rank (``_bounded`` decides from it)
    pair_buffer_mib: int = 512
    # the expert MLP every rank computes, and which biases every rank's experts carry (they
    # travel with their weights in expert mode: :func:`weights_layout`)
    activation: ExpertActivation = SWIGLU
    has_b13: bool = False
    has_b2: bool = False

    @property
    def accum_dtype(self) -> torch.dtype:
        return self.grad_dtype or self.dtype

    @property
    def fc1_rows(self) -> int:
        """J: rows of one expert's fc1 weight (``w13[e]``), ``activation.fc1_rows(ffn)``."""
        return self.activation.fc1_rows(self.ffn)

    @property
    def num_experts(self) -> int:
        return self.num_local_experts * self.world_size

    def hop_pairs(self, tokens_rank: int, experts_rank: int) -> int:
        """Rows of the pair buffers of one hop: rank ``tokens_rank``'s tokens against rank
        ``experts_rank``'s experts; exact when the counts were agreed, else the upper bound."""
        if self.pairs is not None:
            return self.pairs[tokens_rank][experts_rank]
        return self.tokens[tokens_rank] * min(self.topk, self.num_local_experts)

    @property
    def expert_range(self) -> tuple[int, int]:
        """This rank's experts ``[rank*E_local, (rank+1)*E_local)``."""
        return self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts


# ---------------------------------------------------------------------------------------------
# the nodes of the ranks' hosts, and the schedule they run
# ---------------------------------------------------------------------------------------------
def host_hash() -> int:
    digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def nodes_from_hosts(hosts: list) -> int | None:
    """GPUs per node when the ranks form equal blocks of consecutive ranks, one host per block
    and a different host for each block (rank ``n*G + g`` on node ``n``); None otherwise."""
    blocks = [1]
    for a, b in zip(hosts, hosts[1:], strict=False):
        if a == b:
            blocks[-1] += 1
        else:
            blocks.append(1)
    starts = [0]
    for n in blocks[:-1]:
        starts.append(starts[-1] + n)
    block_hosts = [hosts[s] for s in starts]
    if len(set(blocks)) != 1 or len(set(block_hosts)) != len(block_hosts):
        return None
    return blocks[0]


def resolve_schedule(
    requested: str, gpus_per_node: int | None, hosts: list
) -> tuple[str, int | None]:
    """``(schedule, gpus_per_node)`` a ring of ``len(hosts)`` ranks runs (the same on every rank:
    the inputs are agreed). ``gpus_per_node`` None: from the ranks' hosts. ``auto`` and
    ``two_level`` run two levels when there are several nodes of several GPUs; one node, or one
    GPU per node, is the flat order anyway."""
    R = len(hosts)
    G = gpus_per_node if gpus_per_node is not None else nodes_from_hosts(hosts)
    if gpus_per_node is not None and gpus_per_node < R and R % gpus_per_node:
        raise ValueError(
            f"ring_moe: gpus_per_node={gpus_per_node} does not divide the EP group's {R} ranks; "
            "the two-level ring needs nodes of equally many consecutive ranks: pass the GPUs "
            "per node of the group (a divisor of its size), or schedule='flat'"
        )
    if requested == "flat":
        return "flat", None
    if G is None:
        if requested in ("two_level", NODE_BATCHED):
            raise ValueError(
                f"ring_moe: schedule={requested!r} needs nodes of equally many consecutive ranks, "
                f"but the EP group's hosts by rank are {_host_runs(hosts)}; pass gpus_per_node "
                "(and order the ranks node by node), or use schedule='flat'"
            )
        return "flat", None  # auto: an irregular placement runs the flat ring
    if requested == NODE_BATCHED:  # any node size: G = 1 is the flat ring, G = R one round
        return NODE_BATCHED, min(G, R)
    if 1 < G < R:
        return "two_level", G
    return "flat", None


def _host_runs(hosts: list) -> str:
    names = {}
    labels = [names.setdefault(h, f"host{len(names)}") for h in hosts]
    return "[" + ", ".join(labels) + "]"


# ---------------------------------------------------------------------------------------------
# the hop order of a pass (pure Python)
# ---------------------------------------------------------------------------------------------
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

    def lead_bytes_sent(self, rank: int | None = None) -> int:
        """Bytes of leads ``rank`` (default this plan's) sends in one pass: the partition it
        holds at each hop ``0..R-2``, forwarded once (expert mode: the experts' weights)."""
        r = self.rank if rank is None else rank
        return sum(self.slot_layout(h, r).lead_bytes for h in range(self.world_size - 1))

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


# ---------------------------------------------------------------------------------------------
# byte layouts of what a hop moves
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# a problem's layouts and pass plans
# ---------------------------------------------------------------------------------------------
IDX = torch.int32  # expert ids travel as int32


@functools.lru_cache(maxsize=256)  # per problem: every pass asks (module doc)
def weights_layout(problem: RingProblem, prefix: str = "", skip: tuple[str, ...] = ()) -> Layout:
    """The experts' weights and biases, or with ``prefix="d"`` their gradient accumulators (in
    ``problem.accum_dtype``: fp32 for a long ring of 16-bit weights, see options.GRAD_ACCUMS):
    ``w13 (El, J, H) | w2 (El, H, I) [| b13 (El, J)] [| b2 (El, H)]``. The biases sit in the
    weights' partition, so the one transfer of a hop carries them (and their gradients trail
    with the weights' gradients); absent biases have no segment, nor the parts named in
    ``skip`` (a world of one adding its weight gradients into a caller's ``main_grad``)."""
    El, H, I, J = problem.num_local_experts, problem.hidden, problem.ffn, problem.fc1_rows
    dt = problem.accum_dtype if prefix == "d" else problem.dtype
    shapes = {"w13": (El, J, H), "w2": (El, H, I), "b13": (El, J), "b2": (El, H)}
    present = ("w13", "w2") + ("b13",) * problem.has_b13 + ("b2",) * problem.has_b2
    return Layout.of(*((prefix + n, dt, shapes[n]) for n in present if n not in skip))


@functools.lru_cache(maxsize=256)  # per problem: every pass asks (module doc)
def token_lead(problem: RingProblem, T: int, backward: bool) -> Layout:
    """A visiting token partition: x, ids and probabilities forward; x, probabilities and dy
    backward (the forward kept each partition's routing index, so no ids travel)."""
    H, K = problem.hidden, problem.topk
    if backward:
        return Layout.of(
            ("x", problem.dtype, (T, H)),
            ("probs", problem.prob_dtype, (T, K)),
            ("dy", problem.dtype, (T, H)),
        )
    return Layout.of(
        ("x", problem.dtype, (T, H)), ("idx", IDX, (T, K)), ("probs", problem.prob_dtype, (T, K))
    )


@functools.lru_cache(maxsize=256)  # per problem: every pass asks (module doc)
def token_trail(problem: RingProblem, T: int, backward: bool) -> Layout:
    H, K = problem.hidden, problem.topk
    if backward:
        return Layout.of(("dx", problem.dtype, (T, H)), ("dprobs", problem.prob_dtype, (T, K)))
    return Layout.of(("out", problem.dtype, (T, H)))


def ring_plan(problem: RingProblem, lead: list[int], trail: list[int] | None) -> RingPlan:
    return RingPlan(
        problem.rank, problem.world_size, lead, trail, gpus_per_node=problem.gpus_per_node
    )


@functools.lru_cache(maxsize=256)  # per problem: every pass asks (module doc)
def expert_plans(problem: RingProblem) -> tuple[RingPlan, RingPlan]:
    R = problem.world_size
    w, dw = weights_layout(problem).nbytes, weights_layout(problem, "d").nbytes
    return ring_plan(problem, [w] * R, None), ring_plan(problem, [w] * R, [dw] * R)


def token_layouts(problem: RingProblem, backward: bool) -> dict:
    """A token-mode pass's ``lead_layout``/``trail_layout`` roles (partition ``p`` holds
    ``problem.tokens[p]`` tokens). Each layout is built once per token count and returned again
    after: the pass asks for them every hop, and the executor keys its views by them."""
    Ts = problem.tokens
    lead = functools.cache(lambda T: token_lead(problem, T, backward))
    trail = functools.cache(lambda T: token_trail(problem, T, backward))
    return {"lead_layout": lambda p: lead(Ts[p]), "trail_layout": lambda p: trail(Ts[p])}


@functools.lru_cache(maxsize=256)  # per problem: every pass asks (module doc)
def token_plans(problem: RingProblem) -> tuple[RingPlan, RingPlan]:
    Ts = problem.tokens
    fwd = ring_plan(
        problem,
        [token_lead(problem, t, False).nbytes for t in Ts],
        [token_trail(problem, t, False).nbytes for t in Ts],
    )
    bwd = ring_plan(
        problem,
        [token_lead(problem, t, True).nbytes for t in Ts],
        [token_trail(problem, t, True).nbytes for t in Ts],
    )
    return fwd, bwd


def capacity(fwd: RingPlan, bwd: RingPlan, problem: RingProblem) -> int:
    """Reserve the backward's slot size at forward when a backward follows (one allocation
    of the persistent copy-engine workspace instead of two)."""
    return max(fwd.capacity(), bwd.capacity()) if problem.needs_grad else fwd.capacity()


def pair_rows(problem: RingProblem, tokens_rank: int, experts_rank: int) -> dict[str, int]:
    """The hop primitives' pair-count keyword for one hop: the agreed count, else its bound."""
    if problem.pairs is not None:
        return {"n_pairs": problem.pairs[tokens_rank][experts_rank]}
    return {"max_pairs": problem.hop_pairs(tokens_rank, experts_rank)}
