"""Node-batched rounds of the expert ring (``schedule="node_batched"``, ``relaymoe/ring/
expert_mode.py``) in the simulator: ``N = EP/G`` hops a pass instead of ``EP - 1``.

A round on GPU ``(n, g)``, as the runtime runs it: the node all-gathers its G partitions over
NVLink (each GPU receives ``G - 1`` partitions; before the round's compute, not hidden), then the
round's column transfer (the next partition over this GPU's NIC; backward also the travelling
gradients) starts and overlaps the compute of ``G*T*K/EP`` pairs over ``G*El`` experts (one hop:
the fixed host cost once). Backward, after the compute, the round's gradients are
reduce-scattered inside the node (``G - 1`` partitions out and in, not hidden) and added (at
``G = 1`` the hop adds into the travelling gradients itself, as the flat ring does). After
the last round the gradients make one column hop home. Uniform routing, every rank alike.
"""

from __future__ import annotations

from benchmarks.sim.memory import node_batched_peak_bytes
from benchmarks.sim.model import Cluster, ComputeModel, MoEShape, SimResult


def simulate_node_batched(shape: MoEShape, cluster: Cluster, compute: ComputeModel) -> SimResult:
    """Forward and backward of the node-batched expert ring; ``SimResult`` with
    ``extra["schedule"] = "node_batched"``."""
    G, N, ep = min(cluster.gpus_per_node, cluster.ep), cluster.nodes, cluster.ep
    d = shape.dims(ep)
    w = d.El * shape.expert_weight_bytes  # one partition's weights
    dw = w * d.gb // d.b  # its gradients in the accumulator dtype
    pairs = G * shape.pairs / ep
    fwd_c = compute.seconds(shape.flops_fwd(pairs), pairs, G * d.El, bwd=False, width=shape.I)
    bwd_c = compute.seconds(shape.flops_bwd(pairs, recompute=True), pairs, G * d.El, bwd=True,
                            width=shape.I)  # fmt: skip
    if G > 1:  # the round's shares added into the travelling sums (G = 1: written there)
        bwd_c += compute.copy_seconds(G * dw)
    row_latency = (G - 1) * cluster.intra_latency_us * 1e-6 if G > 1 else 0.0
    gather = row_latency + (G - 1) * w / (cluster.intra_GBps * 1e9) if G > 1 else 0.0
    scatter = row_latency + (G - 1) * dw / (cluster.intra_GBps * 1e9) if G > 1 else 0.0
    nxt = G % ep  # the same local rank of the next node

    def column(nbytes: float) -> float:
        return cluster.transfer_seconds(0, nxt, nbytes) if N > 1 else 0.0

    fwd = sum(gather + max(fwd_c, column(w) if j < N - 1 else 0.0) for j in range(N))
    bwd = 0.0
    for j in range(N):  # lead of the next round, trail of the previous one, at once
        xfer = column((w if j < N - 1 else 0) + (dw if j > 0 else 0))
        bwd += gather + max(bwd_c, xfer) + scatter
    bwd += column(dw) + compute.copy_seconds(dw)  # the gradients home, added there
    sent = (N - 1) * w + N * dw + 2 * (G - 1) * w + (G - 1) * dw
    return SimResult(
        scheme="ring_expert",
        shape=shape.name,
        ep=ep,
        gpus_per_node=cluster.gpus_per_node,
        ms_fwd=fwd * 1e3,
        ms_bwd=bwd * 1e3,
        bytes_per_rank=sent,
        peak_MiB=node_batched_peak_bytes(shape, ep, G) / 2**20,
        compute_ms=N * (fwd_c + bwd_c) * 1e3,
        extra={
            "schedule": "node_batched",
            "rounds": N,
            "round_compute_ms_fwd": fwd_c * 1e3,
            "row_gather_ms": gather * 1e3,
        },  # fmt: skip
    )
