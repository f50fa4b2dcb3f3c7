"""MoE-block peak memory per GPU (bytes over the inputs, weight gradients included).

The same accounting as the benchmarks' ``peak_over_inputs_MiB``: what a forward+backward of one
layer allocates beyond its inputs and weights. Closed forms, not a trace:

* all-to-all (Megatron dispatcher): local weight gradients, ``a`` coexisting top-k-expanded
  (T*K, H) buffers (permuted tokens, dispatch output, expert output, combine input; the send and
  the receive side coexist once EP > 1) and three (T*K, I) expert intermediates.
  ``a = 4`` at EP = 1 and ``5.5`` beyond, fit to the two megatron-core anchors (qwen3 T32k:
  6464 MiB at EP=1, 7486 MiB at EP=2; this model gives 6400 and 7360).
* ring: local weight gradients, two in-flight partitions (double buffer), two travelling
  accumulators (expert mode: weight-gradient buffers; token mode: output / dx), the output and
  the dx accumulator, the routing index, and one hop's intermediates (the hop's ``T*K/R`` pairs:
  recomputed h (2I), dh (2I), a (I) and the down-projection rows (H)). Accumulators are in the
  activations' dtype, as the ring's layouts (``relaymoe/ring/engine.py``); probabilities fp32.
"""

from __future__ import annotations

from relaymoe.sim.model import MoEShape


def _local_wgrad(shape: MoEShape, ep: int) -> float:
    return (shape.E // ep) * 3 * shape.H * shape.I * shape.dtype_bytes


def alltoall_peak_bytes(shape: MoEShape, ep: int) -> float:
    b = shape.dtype_bytes
    a = 4.0 if ep == 1 else 5.5
    return _local_wgrad(shape, ep) + a * shape.pairs * shape.H * b + 3 * shape.pairs * shape.I * b


def ring_peak_bytes(shape: MoEShape, ep: int, mode: str = "expert") -> float:
    b = shape.dtype_bytes
    El = shape.E // ep
    T, H, I = shape.T, shape.H, shape.I
    pairs_hop = shape.pairs / ep
    index = 3 * 4 * shape.pairs
    resident = 2 * T * H * b  # output + dx accumulator
    hop = pairs_hop * (5 * I + H) * b
    buffers = 0.0
    if ep > 1:
        if mode == "expert":
            buffers = 2 * El * shape.expert_weight_bytes + 2 * El * 3 * H * I * shape.grad_bytes
        else:
            lead = 2 * T * H * b + T * shape.K * shape.meta_bytes_per_pair
            trail = T * H * b + T * shape.K * 4  # dx in the activations' dtype, fp32 dprobs
            buffers = 2 * lead + 2 * trail
    return _local_wgrad(shape, ep) + index + resident + hop + buffers
