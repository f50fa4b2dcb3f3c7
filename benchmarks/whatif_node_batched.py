"""What-if (issue #18): node-batched rounds of the expert ring, a schedule that is NOT built.

    python benchmarks/whatif_node_batched.py [--eps 8 16 32 64] [--gpus-per-node 8] [--out PATH]

The calibrated simulator puts a fixed host cost on every ring hop (``ComputeModel.launch_us``,
fitted on the measured EP <= 2 rows: ~2 ms). The flat and two-level rings both make EP - 1 hops a
pass, so at EP 64 that cost dominates either schedule. Node-batched rounds pay it once per node:

* a round starts with the node's G GPUs holding the G expert partitions of one node, gathered
  over NVLink (each GPU receives the other G - 1 partitions: an intra-node all-gather);
* each GPU computes its own tokens against all G * El experts of the round in one hop (one set
  of launches: G times the pairs of a flat hop);
* meanwhile every GPU receives, over its own NIC, the partition its local rank of the previous
  node held (the two-level ring's inter-node step), and the next all-gather follows;
* backward: the same rounds; the weight gradients of a round are reduce-scattered inside the
  node (each GPU sums the G contributions for one partition) and then travel with their
  weights, one inter-node step behind, as the ring's trail does. N rounds a pass, N = EP / G.

Costs (uniform routing, the simulator's calibrated compute model and links):
round compute = ``cm.seconds`` of G * T*K/EP pairs over G * El experts (the fixed host cost once),
plus the (G - 1) copy launches of the gather at the intra-node latency; round transfer = the
inter-node step (El experts; backward also their gradients) + the intra-node gather (backward
also the reduce-scatter); a round takes max(compute, transfer) with the transfer of the next
round under the compute of this one; the first round's gather is not hidden. Memory: two
buffers of G * El experts (flat: two of El).

Rows ``bench: whatif_node_batched``: ``shape``, ``ep``, ``gpus_per_node``, ``ms_fwd_bwd`` of
node-batched / two-level / flat (expert mode) / all-to-all, the ratios, and the weight buffer
bytes. A prediction from the model, not a measurement; nothing in ``relaymoe/`` implements it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.scaling_sim import BASE, TOKENS_PER_GPU  # noqa: E402
from benchmarks.sim import Cluster, ComputeModel, MoEShape  # noqa: E402


def node_batched_ms(shape: MoEShape, cl: Cluster, cm: ComputeModel) -> tuple[float, float]:
    """(forward, backward) ms of one layer with node-batched rounds, expert mode."""
    G, N = cl.gpus_per_node, cl.nodes
    El = shape.E // cl.ep
    w = El * shape.expert_weight_bytes  # one partition's weights (its gradients: the same)
    pairs = G * shape.pairs / cl.ep
    gather_launch_s = (G - 1) * cl.intra_latency_us * 1e-6
    fwd_c = cm.seconds(shape.flops_fwd(pairs), pairs, G * El, bwd=False, width=shape.I)
    bwd_c = cm.seconds(shape.flops_bwd(pairs, recompute=True), pairs, G * El, bwd=True,
                       width=shape.I)  # fmt: skip
    bwd_c += cm.copy_seconds(G * w)  # add the round's gradients into the travelling sums
    gather_s = (G - 1) * w / (cl.intra_GBps * 1e9) if G > 1 else 0.0
    inter_s = cl.transfer_seconds(0, G % cl.ep, w) if N > 1 else 0.0

    def one_pass(compute_s: float, transfer_s: float) -> float:
        t = gather_s  # the first round's partitions are gathered before it starts
        for r in range(N):
            nxt = transfer_s if r < N - 1 else 0.0
            t += max(compute_s + gather_launch_s, nxt)
        return t

    fwd = one_pass(fwd_c, inter_s + gather_s)
    # backward: weights again, plus the gradients (reduce-scatter in the node, then one step)
    bwd = one_pass(bwd_c, 2 * (inter_s + gather_s)) + inter_s + gather_s  # the trail home
    return fwd * 1e3, bwd * 1e3


def main(argv=None) -> int:
    from benchmarks.common import JsonlWriter, print_table
    from benchmarks.runs import current_rows
    from benchmarks.sim import simulate_alltoall, simulate_ring
    from benchmarks.sim.calibrate import calibrate, latest_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eps", type=int, nargs="*", default=[8, 16, 32, 64])
    ap.add_argument("--gpus-per-node", type=int, nargs="*", default=[8])
    ap.add_argument("--out", default=None, help="rows file (default: print only)")
    a = ap.parse_args(argv)
    rows = latest_rows([{**r.data, "_file": str(r.run.path / r.file)} for r in current_rows()
                        if r.data.get("bench") != "scaling_sim"])  # fmt: skip
    cm, notes = calibrate(rows)
    shape = MoEShape(name="E128_K8", T=TOKENS_PER_GPU, **BASE)
    out = []
    for g in a.gpus_per_node:
        for ep in a.eps:
            cl = Cluster(ep=ep, gpus_per_node=g, intra_GBps=notes["intra_GBps"])
            flat = simulate_ring(shape, cl, cm, "expert", schedule="flat").ms_fwd_bwd
            two = simulate_ring(shape, cl, cm, "expert", schedule="two_level").ms_fwd_bwd
            a2a = simulate_alltoall(shape, cl, cm).ms_fwd_bwd
            f, b = node_batched_ms(shape, cl, cm)
            nb = f + b
            out.append({
                "bench": "whatif_node_batched", "shape": shape.name, "T": shape.T, "ep": ep,
                "gpus_per_node": g, "hop_fixed_us": round(cm.launch_us, 1),
                "ms_node_batched": round(nb, 2), "ms_two_level": round(two, 2),
                "ms_flat": round(flat, 2), "ms_alltoall": round(a2a, 2),
                "node_batched_vs_flat": round(flat / nb, 2),
                "node_batched_vs_alltoall": round(a2a / nb, 2),
                "two_level_vs_flat": round(flat / two, 2),
                "weight_buffer_MiB": round(2 * g * (shape.E // ep) * shape.expert_weight_bytes
                                           / 2**20, 1),
            })  # fmt: skip
    print_table(out, [k for k in out[0] if k not in ("bench", "shape", "T")])
    if a.out:
        writer = JsonlWriter(Path(a.out))
        for r in out:
            writer.write(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
