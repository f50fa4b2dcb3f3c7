"""Discrete-event model of the ring (RelayMoE §3.1-3.3): hops, P2P links, overlap, hop-behind.

Every rank runs the same schedule. At hop ``h`` rank ``r`` computes its share of the pairs
against the partition that visits it (``T*K/R`` pairs under uniform routing) and, with overlap,
forwards that partition ("lead" bytes) to the rank that computes it next while computing. An
accumulator that must be updated by every rank (expert-weight gradients in expert mode, outputs
/ token gradients in token mode: "trail" bytes) travels one hop behind its partition along the
same path: a rank computes its local part without waiting, then waits for the incoming
accumulator, adds into it (an HBM read+write) and sends it at its next hop. After the last hop
the accumulators make one trail-only hop home to their owners.

Orders (``relaymoe.options.SCHEDULES``, ``schedule_rank``): ``flat`` sends every hop to
``r+1``, so lead and trail share one message; ``two_level`` circulates inside each node for
``G-1`` hops, then every GPU hands its partition to the same local rank of the next node, so at
the hops around a node crossing the lead and the trail go to different peers over different
links (one of them a NIC), at once.

Constraints of one transfer ``src -> dst`` at hop ``h``:
  * the sender has the data (the lead arrived; the trail was accumulated at hop ``h-1``);
  * the receiver's double buffer is free (it finished computing hop ``h-1``);
  * the link is free (the sender's previous transfer to ``dst`` ended).
Without overlap a rank computes, then sends, then the receiver computes: hop time = compute +
transfer. Transfer contention: while transfers into ``r`` run during its compute, the compute
is slowed by ``(1 - hide) * min(compute, transfer)`` for each of them (``Cluster.hide_*``: the
measured hidden share of the copy-engine and NCCL transports; a flat ring across nodes runs
NCCL on every link, since the copy engine needs the whole group on one node).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.sim.model import Cluster, ComputeModel, MoEShape
from relaymoe.cost import hop_bytes, schedule_rank
from relaymoe.options import RING_MODES, SCHEDULES


@dataclass(frozen=True)
class HopPayload:
    """Bytes of one hop and seconds of one hop's work on one rank."""

    lead_bytes: float  # the visiting partition, needed by the receiver's next hop
    trail_bytes: float  # the accumulator travelling one hop behind its partition
    compute_s: float  # the hop's GEMMs on this rank
    acc_s: float  # adding the local part into the incoming accumulator


@dataclass(frozen=True)
class RingPass:
    """Timeline of one pass (forward or backward) of the ring."""

    seconds: float
    hop_compute_s: list  # per hop, max over ranks
    hop_transfer_s: list  # per hop, max over links
    bytes_sent_per_rank: float


def hop_payloads(
    shape: MoEShape, ep: int, compute: ComputeModel, mode: str, *, recompute: bool = True
) -> tuple[HopPayload, HopPayload]:
    """(forward, backward) payloads of one hop of ``mode``; bytes from
    ``relaymoe.cost.hop_bytes`` (paper Table 2 volumes)."""
    if mode not in RING_MODES:
        raise ValueError(f"mode={mode!r} is not a ring mode; use one of {RING_MODES}")
    d = shape.dims(ep)
    pairs_hop = shape.pairs / ep  # uniform routing: each visiting partition matches 1/R
    experts_hop = d.El
    c_fwd = compute.seconds(
        shape.flops_fwd(pairs_hop), pairs_hop, experts_hop, bwd=False, width=shape.I
    )
    c_bwd = compute.seconds(
        shape.flops_bwd(pairs_hop, recompute=recompute),
        pairs_hop,
        experts_hop,
        bwd=True,
        width=shape.I,
    )
    if ep == 1:  # nothing travels
        return HopPayload(0, 0, c_fwd, 0.0), HopPayload(0, 0, c_bwd, 0.0)
    h = hop_bytes(mode, d)
    # a rank adds its local part into the incoming accumulator: one HBM read+write of it
    fwd = HopPayload(h.fwd_lead, h.fwd_trail, c_fwd, compute.copy_seconds(h.fwd_trail))
    bwd = HopPayload(h.bwd_lead, h.bwd_trail, c_bwd, compute.copy_seconds(h.bwd_trail))
    return fwd, bwd


def _routes(cluster: Cluster, schedule: str) -> list[list[int]]:
    """``part[s][r]``: the partition rank ``r`` computes at step ``s`` (``cost.schedule_rank``
    inverted; the order of ``relaymoe/ring/plan.py``)."""
    R, G = cluster.ep, cluster.gpus_per_node
    part = [[0] * R for _ in range(R)]
    for s in range(R):
        for p in range(R):
            part[s][schedule_rank(schedule, s, p, R, G)] = p
    return part


def _messages(
    part: list[list[int]], schedule: str, cluster: Cluster, h: int, r: int, lead: float,
    trail: float, overlap: bool,
) -> dict[int, tuple[float, bool, bool]]:  # fmt: skip
    """``{dst: (bytes, has_lead, has_trail)}`` rank ``r`` sends at hop ``h`` in ``0..R-1``.
    With overlap: the lead for the receiver's next step and the trail of this rank's step
    ``h-1``, which follows its partition's path one hop behind (the two part around node
    crossings in the two-level order). Without: after the hop, the lead and the trail of step
    ``h`` together to where the partition goes next. A lead and a trail for one peer travel as
    one message."""
    R, G = cluster.ep, cluster.gpus_per_node
    out: dict[int, list] = {}
    last = h == R - 1
    if not last:
        dst = schedule_rank(schedule, h + 1, part[h][r], R, G)
        out[dst] = [lead, True, False]
        if not overlap and trail > 0:
            out[dst] = [lead + trail, True, True]
    if overlap and trail > 0 and h > 0:
        dst = schedule_rank(schedule, h, part[h - 1][r], R, G)
        m = out.setdefault(dst, [0.0, False, False])
        m[0] += trail
        m[2] = True
    return {d: (b, has_lead, has_trail) for d, (b, has_lead, has_trail) in out.items() if b > 0}


def simulate_pass(
    cluster: Cluster, hop: HopPayload, *, overlap: bool = True, schedule: str = "flat"
) -> RingPass:
    """Event times of one ring pass over ``cluster.ep`` ranks in the ``schedule``'s order
    (``options.SCHEDULES``); returns the slowest rank's end. Links are ``(src, dst)`` pairs,
    each busy with one message at a time."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; use one of {SCHEDULES}")
    R = cluster.ep
    if R == 1:
        return RingPass(hop.compute_s, [hop.compute_s], [0.0], 0.0)
    lead, trail = hop.lead_bytes, hop.trail_bytes
    part = _routes(cluster, schedule)
    # the copy engine needs the whole group on one node: a flat ring across nodes runs NCCL
    copy_engine = not cluster.spans_nodes or schedule == "two_level"
    end = [0.0] * R  # end of each rank's previous hop (compute + accumulation)
    compute_end = [0.0] * R  # end of each rank's previous compute (frees its lead buffer)
    link_free: dict[tuple[int, int], float] = {}
    lead_at = [0.0] * R  # when this hop's lead is available on r (own partition at hop 0)
    trail_at = [None] * R  # when the accumulator for this hop's partition arrives on r
    sent = 0.0
    hop_c, hop_x = [], []
    for h in range(R):
        msgs = [_messages(part, schedule, cluster, h, r, lead, trail, overlap) for r in range(R)]
        # the transfers into each rank during this hop slow its compute (contention)
        penalty = [0.0] * R
        if overlap:
            for src in range(R):
                for dst, (nbytes, _, _) in msgs[src].items():
                    x = cluster.transfer_seconds(src, dst, nbytes)
                    hide = cluster.link_hide(src, dst, copy_engine=copy_engine)
                    penalty[dst] += (1.0 - hide) * min(hop.compute_s, x)
        new_end, new_compute_end = [0.0] * R, [0.0] * R
        c_max = 0.0
        for r in range(R):
            start = max(end[r], lead_at[r])
            c = hop.compute_s + penalty[r]
            c_max = max(c_max, c)
            ce = start + c
            new_compute_end[r] = ce
            if h > 0 and trail > 0 and not overlap:
                # sequential: the accumulator came with this hop's lead; add the local part
                ce = max(ce, trail_at[r]) + hop.acc_s
            new_end[r] = ce
        # With overlap a rank issues its sends when it holds this hop's lead and (when a trail
        # travels) has accumulated its previous hop; without, after the hop.
        new_lead_at, new_trail_at = [0.0] * R, [None] * R
        x_max = 0.0
        for r in range(R):
            if overlap:
                ready0 = lead_at[r] if (h == 0 or trail == 0) else max(lead_at[r], end[r])
            else:
                ready0 = new_end[r]
            for d, (nbytes, has_lead, has_trail) in msgs[r].items():
                buffer_free = compute_end[d] if h > 0 else 0.0
                ready = max(ready0, buffer_free, link_free.get((r, d), 0.0))
                dur = cluster.transfer_seconds(r, d, nbytes)
                x_max = max(x_max, dur)
                link_free[(r, d)] = ready + dur
                sent += nbytes
                if has_lead:
                    new_lead_at[d] = ready + dur
                if has_trail:
                    if overlap:
                        trail_at[d] = ready + dur  # needed by d during this very hop
                    new_trail_at[d] = ready + dur
        if overlap and trail > 0 and h > 0:
            # the accumulation waits for the trail that arrives during this hop
            for r in range(R):
                new_end[r] = max(new_compute_end[r], trail_at[r]) + hop.acc_s
        hop_c.append(c_max)
        hop_x.append(x_max)
        end, compute_end = new_end, new_compute_end
        lead_at, trail_at = new_lead_at, new_trail_at
    finish = list(end)
    if trail > 0:
        # the accumulators of the last hop make one trail-only hop home, then are added there
        for r in range(R):
            d = part[R - 1][r]  # the owner of the partition r computed last
            ready = max(end[r], link_free.get((r, d), 0.0))
            dur = cluster.transfer_seconds(r, d, trail)
            sent += trail
            finish[d] = max(finish[d], ready + dur + hop.acc_s)
    return RingPass(max(finish), hop_c, hop_x, sent / R)


def _transport(cluster: Cluster, schedule: str = "flat") -> str:
    """Symmetric memory (the copy engine) needs the whole ring on one node; the two-level ring
    keeps it inside each node (its slots live there, so its workspace counts)."""
    if cluster.ep == 1:
        return "local"
    if not cluster.spans_nodes or schedule == "two_level":
        return "copy_engine"
    return "nccl"


def simulate_ring(
    shape: MoEShape,
    cluster: Cluster,
    compute: ComputeModel,
    mode: str = "expert",
    *,
    overlap: bool = True,
    recompute: bool = True,
    schedule: str = "flat",
):
    """Forward and backward passes of the ring in the ``schedule``'s order; returns
    ``benchmarks.sim.model.SimResult``."""
    from benchmarks.sim.memory import ring_peak_bytes
    from benchmarks.sim.model import SimResult

    fwd, bwd = hop_payloads(shape, cluster.ep, compute, mode, recompute=recompute)
    pf = simulate_pass(cluster, fwd, overlap=overlap, schedule=schedule)
    pb = simulate_pass(cluster, bwd, overlap=overlap, schedule=schedule)
    compute_s = cluster.ep * (fwd.compute_s + bwd.compute_s)
    return SimResult(
        scheme=f"ring_{mode}" + ("" if overlap else "_sequential"),
        shape=shape.name,
        ep=cluster.ep,
        gpus_per_node=cluster.gpus_per_node,
        ms_fwd=pf.seconds * 1e3,
        ms_bwd=pb.seconds * 1e3,
        bytes_per_rank=pf.bytes_sent_per_rank + pb.bytes_sent_per_rank,
        peak_MiB=ring_peak_bytes(shape, cluster.ep, mode, _transport(cluster, schedule)) / 2**20,
        compute_ms=compute_s * 1e3,
        extra={
            "schedule": schedule,
            "hop_lead_MB_fwd": fwd.lead_bytes / 1e6,
            "hop_lead_MB_bwd": bwd.lead_bytes / 1e6,
            "hop_trail_MB_bwd": bwd.trail_bytes / 1e6,
            "hop_compute_ms_fwd": fwd.compute_s * 1e3,
            "hop_compute_ms_bwd": bwd.compute_s * 1e3,
            "hop_transfer_ms_max_fwd": max(pf.hop_transfer_s) * 1e3,
            "hop_transfer_ms_max_bwd": max(pb.hop_transfer_s) * 1e3,
        },
    )
