"""Discrete-event model of the ring (RelayMoE §3.1-3.3): hops, P2P links, overlap, hop-behind.

Every rank runs the same schedule. At hop ``h`` rank ``r`` computes its share of the pairs
against the partition that visits it (``T*K/R`` pairs under uniform routing) and, with overlap,
forwards that partition ("lead" bytes) to ``r+1`` while computing. An accumulator that must be
updated by every rank (expert-weight gradients in expert mode, outputs / token gradients in
token mode: "trail" bytes) travels one hop behind its partition, merged into the same transfer:
a rank computes its local part without waiting, then waits for the incoming accumulator, adds
into it (an HBM read+write) and sends it with its next transfer. After the last hop the
accumulators make one trail-only hop home.

Constraints of one transfer ``r -> r+1`` at hop ``h``:
  * the sender has the data (the lead arrived; the trail was accumulated at hop ``h-1``);
  * the receiver's double buffer is free (it finished computing hop ``h-1``);
  * the link is free (the sender's previous transfer ended).
Without overlap a rank computes, then sends, then the receiver computes: hop time = compute +
transfer. Transfer contention: while a transfer into ``r`` runs during its compute, the compute
is slowed by ``(1 - hide) * min(compute, transfer)`` (``Cluster.hide_*``: the measured hidden
share of the copy-engine and NCCL transports).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.sim.model import Cluster, ComputeModel, MoEShape
from relaymoe.costmodel import RING_MODES, hop_bytes


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
    ``relaymoe.costmodel.hop_bytes`` (paper Table 2 volumes)."""
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


def simulate_pass(cluster: Cluster, hop: HopPayload, *, overlap: bool = True) -> RingPass:
    """Event times of one ring pass over ``cluster.ep`` ranks; returns the slowest rank's end."""
    R = cluster.ep
    if R == 1:
        return RingPass(hop.compute_s, [hop.compute_s], [0.0], 0.0)
    lead, trail = hop.lead_bytes, hop.trail_bytes
    prev = [(r - 1) % R for r in range(R)]
    nxt = [(r + 1) % R for r in range(R)]
    end = [0.0] * R  # end of each rank's previous hop (compute + accumulation)
    compute_end = [0.0] * R  # end of each rank's previous compute (frees its lead buffer)
    link_free = [0.0] * R  # link r -> r+1
    lead_at = [0.0] * R  # when this hop's lead is available on r (own partition at hop 0)
    trail_at = [None] * R  # when the accumulator for this hop's partition arrives on r
    sent = 0.0
    hop_c, hop_x = [], []
    for h in range(R):
        last = h == R - 1
        # transfer durations into each rank during this hop (for contention)
        in_bytes = (0.0 if last else lead) + (trail if h > 0 else 0.0)
        x_in = [cluster.link_seconds(prev[r], in_bytes) for r in range(R)]
        new_end, new_compute_end = [0.0] * R, [0.0] * R
        c_max = 0.0
        for r in range(R):
            start = max(end[r], lead_at[r])
            c = hop.compute_s
            if overlap:
                c += (1.0 - cluster.hide(prev[r])) * min(hop.compute_s, x_in[r])
            c_max = max(c_max, c)
            ce = start + c
            new_compute_end[r] = ce
            if h > 0 and trail > 0 and not overlap:
                # sequential: the accumulator came with this hop's lead; add the local part
                ce = max(ce, trail_at[r]) + hop.acc_s
            new_end[r] = ce
        # transfers of hop h. With overlap: the lead for the receiver's hop h+1 (sent while
        # computing) merged with the trail of this rank's hop h-1 (the receiver's hop h
        # accumulator); on the last hop only that trail. Without overlap: after the hop, the
        # lead for hop h+1 and the trail of hop h.
        new_lead_at, new_trail_at = [0.0] * R, [None] * R
        x_max = 0.0
        for r in range(R):
            d = nxt[r]
            buffer_free = compute_end[d] if h > 0 else 0.0
            if overlap:
                nbytes = (0.0 if last else lead) + (trail if h > 0 else 0.0)
                ready = lead_at[r] if (h == 0 or trail == 0) else max(lead_at[r], end[r])
            else:
                nbytes = 0.0 if last else lead + trail
                ready = new_end[r]
            if nbytes <= 0:
                continue
            ready = max(ready, buffer_free, link_free[r])
            dur = cluster.link_seconds(r, nbytes)
            x_max = max(x_max, dur)
            link_free[r] = ready + dur
            sent += nbytes
            new_lead_at[d] = ready + dur
            if trail > 0:
                if overlap and h > 0:
                    trail_at[d] = ready + dur  # needed by d during this very hop
                new_trail_at[d] = ready + dur
        if overlap and trail > 0:
            # the accumulation waits for the trail that arrives during this hop
            for r in range(R):
                if h > 0:
                    new_end[r] = max(new_compute_end[r], trail_at[r]) + hop.acc_s
        hop_c.append(c_max)
        hop_x.append(x_max)
        end, compute_end = new_end, new_compute_end
        lead_at, trail_at = new_lead_at, new_trail_at
    finish = list(end)
    if trail > 0:
        # the accumulators of the last hop make one trail-only hop home, then are added there
        for r in range(R):
            d = nxt[r]
            ready = max(end[r], link_free[r])
            dur = cluster.link_seconds(r, trail)
            sent += trail
            finish[d] = max(finish[d], ready + dur + hop.acc_s)
    return RingPass(max(finish), hop_c, hop_x, sent / R)


def _transport(cluster: Cluster) -> str:
    """Symmetric memory (the copy engine) needs the whole ring on one node."""
    if cluster.ep == 1:
        return "local"
    return "copy_engine" if cluster.ep <= cluster.gpus_per_node else "nccl"


def simulate_ring(
    shape: MoEShape,
    cluster: Cluster,
    compute: ComputeModel,
    mode: str = "expert",
    *,
    overlap: bool = True,
    recompute: bool = True,
):
    """Forward and backward passes of the ring; returns ``benchmarks.sim.model.SimResult``."""
    from benchmarks.sim.memory import ring_peak_bytes
    from benchmarks.sim.model import SimResult

    fwd, bwd = hop_payloads(shape, cluster.ep, compute, mode, recompute=recompute)
    pf = simulate_pass(cluster, fwd, overlap=overlap)
    pb = simulate_pass(cluster, bwd, overlap=overlap)
    compute_s = cluster.ep * (fwd.compute_s + bwd.compute_s)
    return SimResult(
        scheme=f"ring_{mode}" + ("" if overlap else "_sequential"),
        shape=shape.name,
        ep=cluster.ep,
        gpus_per_node=cluster.gpus_per_node,
        ms_fwd=pf.seconds * 1e3,
        ms_bwd=pb.seconds * 1e3,
        bytes_per_rank=pf.bytes_sent_per_rank + pb.bytes_sent_per_rank,
        peak_MiB=ring_peak_bytes(shape, cluster.ep, mode, _transport(cluster)) / 2**20,
        compute_ms=compute_s * 1e3,
        extra={
            "hop_lead_MB_fwd": fwd.lead_bytes / 1e6,
            "hop_lead_MB_bwd": bwd.lead_bytes / 1e6,
            "hop_trail_MB_bwd": bwd.trail_bytes / 1e6,
            "hop_compute_ms_fwd": fwd.compute_s * 1e3,
            "hop_compute_ms_bwd": bwd.compute_s * 1e3,
            "hop_transfer_ms_max_fwd": max(pf.hop_transfer_s) * 1e3,
            "hop_transfer_ms_max_bwd": max(pb.hop_transfer_s) * 1e3,
        },
    )
