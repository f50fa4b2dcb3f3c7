"""The ring's hop order (flat or two-level across nodes) and its per-hop times."""

from __future__ import annotations

import math
from dataclasses import dataclass

from relaymoe.cost.dims import Dims, check_mode, check_transport
from relaymoe.cost.links import INTER_NODE_BYTES_PER_S
from relaymoe.cost.time import DEFAULT_TIME_MODEL, TimeModel, compute_seconds, exposed_seconds
from relaymoe.cost.traffic import hop_bytes
from relaymoe.options import AUTO, NODE_BATCHED, RING_MODES, SCHEDULE_CHOICES, SCHEDULES


def check_nodes(world: int, gpus_per_node: int | None) -> int:
    """Ranks of the group per node (``world`` when ``None``: one node)."""
    if gpus_per_node is None:
        return world
    G = gpus_per_node
    if isinstance(G, bool) or not isinstance(G, int) or G < 1:
        raise ValueError(f"cost model: gpus_per_node={G!r} must be an int >= 1 (or None: one node)")
    if world > G and world % G:
        raise ValueError(
            f"cost model: the group's {world} ranks span nodes of gpus_per_node={G} but are "
            f"not a whole number of nodes; use a group of a multiple of {G} ranks, or one node"
        )
    return min(G, world)


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"cost model: schedule {schedule!r} is not one of {SCHEDULES}")


def _order_width(schedule: str, world: int, G: int) -> int:
    """Ranks per level-one ring of the schedule's order: the whole group for flat."""
    return G if schedule == "two_level" else world


def order_partition(step: int, rank: int, world: int, width: int) -> int:
    """The partition ``rank`` computes at ``step`` in the ring order whose level-one rings have
    ``width`` ranks (``world``: flat; ``G``: two-level over ``world/G`` nodes): round
    ``j = step // width`` brings node ``n - j``'s partitions, step ``i = step % width`` of it the
    one of local rank ``g - i + j``. The one definition of the order (``relaymoe/ring/plan.py``
    runs it; no checks here: it is on the ring's per-hop path)."""
    n, g = divmod(rank, width)
    j, i = divmod(step, width)
    return (n - j) % (world // width) * width + (g - i + j) % width


def order_rank(step: int, partition: int, world: int, width: int) -> int:
    """The rank that computes ``partition`` at ``step``: the inverse of ``order_partition``."""
    pn, pg = divmod(partition, width)
    j, i = divmod(step, width)
    return (pn + j) % (world // width) * width + (pg + i - j) % width


def schedule_rank(
    schedule: str, step: int, partition: int, world: int, gpus_per_node: int | None = None
) -> int:
    """The rank that computes ``partition`` at ``step`` (``0..world-1``); the order of
    ``relaymoe/ring/plan.py`` (``RingPlan.who``). Flat: ``(partition + step) mod R``.
    Two-level, ``G`` ranks per node, ``N = R/G`` nodes: round ``j = step // G`` runs on node
    ``partition's node + j``, step ``i = step % G`` of it on local rank ``g + i - j`` (mod G), so
    a partition moves ``g -> g+1`` inside a round and to the same local rank of the next node
    between rounds."""
    _check_schedule(schedule)
    G = _order_width(schedule, world, check_nodes(world, gpus_per_node))
    return order_rank(step, partition, world, G)


def choose_schedule(*, world: int, gpus_per_node: int | None = None, requested: str = AUTO) -> str:
    """The schedule a ring of ``world`` ranks runs: ``requested`` unless ``auto``, else
    ``two_level`` when the group spans nodes of more than one GPU, ``flat`` otherwise (one node,
    or one GPU per node, where both orders are the same). ``ring_hop_times`` never finds the
    two-level order slower: it runs the same hops with the same compute, and only the hops
    around a node crossing send over the slow links, each over its own GPU's NIC."""
    if requested not in SCHEDULE_CHOICES:
        raise ValueError(f"cost model: schedule {requested!r} is not one of {SCHEDULE_CHOICES}")
    G = check_nodes(world, gpus_per_node)
    if requested != AUTO:
        return requested
    return "two_level" if 1 < G < world else "flat"


def _hop_sends(schedule: str, R: int, G: int, hop: int, r: int, trail: bool) -> dict:
    """``{peer: (lead?, trail?)}`` of rank ``r`` at ``hop`` in ``0..R`` (``R``: the trail home):
    the lead goes to whoever computes its partition at the next step, the trail one hop behind
    along the same path, then home to the partition's owner; a lead and a trail for the same
    peer travel as one message."""
    W = _order_width(schedule, R, G)

    def partition(step: int) -> int:  # what r computes at ``step``
        return order_partition(step, r, R, W)

    out: dict[int, tuple[bool, bool]] = {}
    if hop <= R - 2:
        out[schedule_rank(schedule, hop + 1, partition(hop), R, G)] = (True, False)
    if trail and hop >= 1:
        p = partition(hop - 1)
        peer = schedule_rank(schedule, hop, p, R, G) if hop < R else p
        out[peer] = (peer in out, True)
    return out


@dataclass(frozen=True)
class RingHopTimes:
    """Per-hop times of one schedule for one layer step (``ring_hop_times``), seconds.

    A hop is ``inter`` when some rank's send of it crosses nodes, ``intra`` otherwise; counts
    are over the passes that run, the trail's return home included. ``intra_hop_s`` /
    ``inter_hop_s``: the slowest hop of that kind (its compute plus the exposed part of its
    transfers; 0 when there is none); ``transfer_s``: the slowest transfer of a hop of that kind
    alone. ``step_s``: the layer step, ``sqrt(host**2 + device**2)`` as ``step_seconds``.
    """

    schedule: str
    world: int
    gpus_per_node: int
    intra_hops: int
    inter_hops: int
    hop_compute_s: float  # the slowest pass's per-hop compute (backward when training)
    intra_hop_s: float
    inter_hop_s: float
    intra_transfer_s: float
    inter_transfer_s: float
    host_s: float
    device_s: float

    @property
    def nodes(self) -> int:
        return self.world // self.gpus_per_node

    @property
    def step_s(self) -> float:
        return math.hypot(self.host_s, self.device_s)


def ring_hop_times(
    mode: str,
    d: Dims,
    *,
    schedule: str,
    gpus_per_node: int | None = None,
    training: bool = True,
    transport: str = "copy_engine",
    model: TimeModel = DEFAULT_TIME_MODEL,
    inter_bytes_per_s: float = INTER_NODE_BYTES_PER_S,
) -> RingHopTimes:
    """Hop by hop times of a ring mode under ``schedule`` with ``gpus_per_node`` ranks of the
    group per node (``None``: one node). Every hop computes ``1/R`` of the rank's pairs and
    hides its sends under that compute as ``step_seconds`` does; a hop is as slow as its slowest
    rank, and a rank's messages to different peers run at once on their own links. Inside a
    node the links run at ``model.link_bytes_per_s`` over ``transport``; a flat ring that spans
    nodes runs all of them over NCCL (the copy engine needs the whole group on one node), the
    two-level ring keeps ``transport`` inside its nodes. Between nodes, one NIC per GPU at
    ``inter_bytes_per_s`` over NCCL. In one node both schedules give ``step_seconds``."""
    check_mode(mode, RING_MODES)
    _check_schedule(schedule)
    check_transport(transport)
    R = d.R
    G = check_nodes(R, gpus_per_node)
    if not inter_bytes_per_s > 0:
        raise ValueError(f"cost model: inter_bytes_per_s={inter_bytes_per_s!r} must be > 0")
    passes = (False, True) if training else (False,)
    host = model.call_fixed_s + len(passes) * R * model.hop_fixed_s
    device = sum(compute_seconds(d, model, bwd) for bwd in passes)
    spans = G < R
    intra_transport = "nccl" if spans and schedule == "flat" else transport
    hide_intra = model.nccl_hide if intra_transport == "nccl" else model.hide
    counts = {"intra": 0, "inter": 0}
    hop_s = {"intra": 0.0, "inter": 0.0}
    x_s = {"intra": 0.0, "inter": 0.0}
    c_max = 0.0
    h = hop_bytes(mode, d)
    for bwd in passes:
        lead, trail = (h.bwd_lead, h.bwd_trail) if bwd else (h.fwd_lead, h.fwd_trail)
        c_hop = compute_seconds(d, model, bwd) / R
        c_max = max(c_max, c_hop)
        if R == 1:
            continue  # nothing travels
        for hop in range(R + 1):
            home = hop == R
            c = 0.0 if home else c_hop
            worst_exposed, worst_x, inter = 0.0, 0.0, False
            for r in range(R):
                for peer, (has_lead, has_trail) in _hop_sends(
                    schedule, R, G, hop, r, trail > 0
                ).items():
                    nbytes = (lead if has_lead else 0) + (trail if has_trail else 0)
                    if nbytes <= 0:
                        continue
                    crosses = r // G != peer // G
                    inter |= crosses
                    x = nbytes / (inter_bytes_per_s if crosses else model.link_bytes_per_s)
                    hide = model.nccl_hide if crosses else hide_intra
                    e = x if home else exposed_seconds(x, c, hide)
                    worst_exposed, worst_x = max(worst_exposed, e), max(worst_x, x)
            if home and worst_x == 0.0:
                continue  # nothing trails: no hop home
            kind = "inter" if inter else "intra"
            counts[kind] += 1
            hop_s[kind] = max(hop_s[kind], c + worst_exposed)
            x_s[kind] = max(x_s[kind], worst_x)
            device += worst_exposed
    return RingHopTimes(
        schedule=schedule, world=R, gpus_per_node=G, intra_hops=counts["intra"],
        inter_hops=counts["inter"], hop_compute_s=c_max, intra_hop_s=hop_s["intra"],
        inter_hop_s=hop_s["inter"], intra_transfer_s=x_s["intra"],
        inter_transfer_s=x_s["inter"], host_s=host, device_s=device,
    )  # fmt: skip


def node_batched_hop_times(
    d: Dims,
    *,
    gpus_per_node: int | None = None,
    training: bool = True,
    model: TimeModel = DEFAULT_TIME_MODEL,
    inter_bytes_per_s: float = INTER_NODE_BYTES_PER_S,
) -> RingHopTimes:
    """Hop times of the expert ring's node-batched rounds (``NODE_BATCHED``,
    ``relaymoe/ring/expert_mode.py``): ``N = R/G`` hops a pass, each over ``G/R`` of the rank's
    pairs, after an all-gather of the node's ``G-1`` other partitions over NVLink (not hidden);
    the next partition (backward with the travelling gradients) crosses to the next node on
    this GPU's NIC under the compute; backward, the round's gradients are reduce-scattered in
    the node after it (not hidden). Every hop is ``inter`` when there are several nodes."""
    R = d.R
    G = check_nodes(R, gpus_per_node)
    N = R // G
    passes = (False, True) if training else (False,)
    host = model.call_fixed_s + len(passes) * N * model.hop_fixed_s
    h = hop_bytes("expert", d)
    device, c_max, hop_max, row_max, x_max = 0.0, 0.0, 0.0, 0.0, 0.0
    for bwd in passes:
        c = compute_seconds(d, model, bwd) * G / R
        lead, trail = (h.bwd_lead, h.bwd_trail) if bwd else (h.fwd_lead, 0)
        row = (G - 1) * (lead + trail) / model.link_bytes_per_s  # gather (+ reduce-scatter)
        for j in range(N + (1 if bwd and N > 1 else 0)):  # backward: the gradients home
            nbytes = (lead if j < N - 1 else 0) + (trail if 0 < j else 0)
            x = nbytes / inter_bytes_per_s if N > 1 else 0.0
            comp = c if j < N else 0.0
            e = exposed_seconds(x, comp, model.nccl_hide) if comp else x
            hop = (row if j < N else 0.0) + comp + e
            device += hop
            hop_max, x_max = max(hop_max, hop), max(x_max, x)
        c_max, row_max = max(c_max, c), max(row_max, row)
    inter = N > 1
    hops = len(passes) * N + (1 if training and inter else 0)
    return RingHopTimes(
        schedule=NODE_BATCHED, world=R, gpus_per_node=G, intra_hops=0 if inter else hops,
        inter_hops=hops if inter else 0, hop_compute_s=c_max,
        intra_hop_s=0.0 if inter else hop_max, inter_hop_s=hop_max if inter else 0.0,
        intra_transfer_s=row_max, inter_transfer_s=x_max, host_s=host, device_s=device,
    )  # fmt: skip
