"""MoE-block peak memory per GPU (bytes over the inputs, weight gradients included).

The same accounting as the benchmarks' ``peak_over_inputs_MiB``: what a forward+backward of one
layer allocates beyond its inputs and weights, from ``relaymoe.cost`` (the planner's and
the runtime's numbers):

* all-to-all (Megatron dispatcher): ``cost.mcore_alltoall_memory_bytes``;
* ring: the resident output and dx accumulators (activations' dtype) plus the mode's memory
  bound (``cost.memory_bytes``: saved and transient bytes, and with the copy engine the
  symmetric workspace, which a single layer does not share with others); node-batched rounds:
  ``cost.node_batched_memory_bytes`` instead.
"""

from __future__ import annotations

from benchmarks.sim.model import MoEShape
from relaymoe import cost


def alltoall_peak_bytes(shape: MoEShape, ep: int) -> float:
    return float(cost.mcore_alltoall_memory_bytes(shape.dims(ep)))


def ring_peak_bytes(
    shape: MoEShape, ep: int, mode: str = "expert", transport: str = "nccl"
) -> float:
    d = shape.dims(ep)
    mem = cost.memory_bytes(mode, d, transport=transport)
    resident = 2 * d.T * d.H * d.b  # output + dx accumulator
    return float(resident + mem.peak + mem.workspace)


def node_batched_peak_bytes(shape: MoEShape, ep: int, gpus_per_node: int) -> float:
    d = shape.dims(ep)
    mem = cost.node_batched_memory_bytes(d, gpus_per_node=gpus_per_node)
    resident = 2 * d.T * d.H * d.b  # output + dx accumulator
    return float(resident + mem.peak)
