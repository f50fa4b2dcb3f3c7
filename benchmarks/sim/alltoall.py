"""All-to-all dispatch model (Megatron's alltoall dispatcher; paper §2.1, Fig. 2).

Per GPU and pass: permute (an HBM copy of the top-k-expanded rows), dispatch all-to-all, expert
compute on the pairs that arrive (``T*K`` of them under uniform routing, over ``E/R`` local
experts), combine all-to-all, unpermute. Backward repeats the two all-to-alls on gradients.
Nothing overlaps (Megatron's default). Each rank sends ``(R-1)/R`` of its expanded rows away:
``(G-1)/R`` to the GPUs of its node over NVLink and ``(R-G)/R`` over its NIC, both at once, so
an all-to-all takes the longer of the two plus a per-peer message cost. Bandwidths are the full
link rates: an optimistic baseline, so predicted ring speedups are not inflated by it.
"""

from __future__ import annotations

from benchmarks.sim.model import GB, Cluster, ComputeModel, MoEShape, SimResult
from relaymoe.cost import mcore_alltoall_send_bytes

PEER_MESSAGE_US = 2.0


def alltoall_seconds(shape: MoEShape, cluster: Cluster, row_bytes: float) -> float:
    R = cluster.ep
    if R == 1:
        return 0.0
    G = min(cluster.gpus_per_node, R)
    intra = shape.pairs * (G - 1) / R * row_bytes
    inter = shape.pairs * (R - G) / R * row_bytes
    t = intra / (cluster.intra_GBps * GB)
    lat = cluster.intra_latency_us
    if inter > 0:
        t = max(t, inter / (cluster.inter_GBps * GB))
        lat = cluster.inter_latency_us
    return t + (lat + (R - 1) * PEER_MESSAGE_US) * 1e-6


def alltoall_bytes(shape: MoEShape, ep: int) -> float:
    """Bytes one rank sends in one all-to-all of (T*K, H) rows."""
    return mcore_alltoall_send_bytes(shape.dims(ep))


def simulate_alltoall(
    shape: MoEShape,
    cluster: Cluster,
    compute: ComputeModel,
    *,
    experts: str = "fused",
    recompute: bool = False,
) -> SimResult:
    """``experts="fused"``: the same grouped kernels as the ring; ``"sequential_mlp"``: Megatron's
    SequentialMLP (per-expert cost ``compute.seq_mlp_ms_per_expert``, fit by ``calibrate``)."""
    from benchmarks.sim.memory import alltoall_peak_bytes

    if shape.E % cluster.ep:
        raise ValueError(f"E={shape.E} experts do not split over ep={cluster.ep}")
    if experts not in ("fused", "sequential_mlp"):
        raise ValueError(f"experts={experts!r}: use 'fused' or 'sequential_mlp'")
    El = shape.E // cluster.ep
    P = shape.pairs
    row = shape.H * shape.dtype_bytes
    a2a = alltoall_seconds(shape, cluster, row)
    perm = compute.copy_seconds(P * row)
    if experts == "fused":
        c_f = compute.seconds(shape.flops_fwd(P), P, El, bwd=False, width=shape.I)
        c_b = compute.seconds(
            shape.flops_bwd(P, recompute=recompute), P, El, bwd=True, width=shape.I
        )
    else:
        thr = (compute.seq_mlp_tflops or compute.peak_tflops_fwd) * 1e12
        per_expert = compute.seq_mlp_ms_per_expert * 1e-3 * El
        total = per_expert + (shape.flops_fwd(P) + shape.flops_bwd(P, recompute=False)) / thr
        c_f, c_b = total / 3.0, 2.0 * total / 3.0
    fwd = 2 * perm + 2 * a2a + c_f
    bwd = 2 * perm + 2 * a2a + c_b
    return SimResult(
        scheme="alltoall" if experts == "fused" else "mcore_alltoall",
        shape=shape.name,
        ep=cluster.ep,
        gpus_per_node=cluster.gpus_per_node,
        ms_fwd=fwd * 1e3,
        ms_bwd=bwd * 1e3,
        bytes_per_rank=4 * alltoall_bytes(shape, cluster.ep),
        peak_MiB=alltoall_peak_bytes(shape, cluster.ep) / 2**20,
        compute_ms=(c_f + c_b) * 1e3,
        extra={"a2a_ms": a2a * 1e3, "permute_ms": perm * 1e3},
    )
