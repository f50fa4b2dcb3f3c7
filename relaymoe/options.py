"""The names of relaymoe's options and their choices, in one place; torch-free.

The runtime (``ring_moe``), the Megatron flags, the YAML configs, the planner and the simulator
all import these spellings from here, so an option cannot be spelled two ways.
"""

from __future__ import annotations

__all__ = [
    "AUTO",
    "FP32_GRAD_ACCUM_MIN_EP",
    "GRAD_ACCUMS",
    "GRAD_ACCUM_CHOICES",
    "HOST_WAIT_CHOICES",
    "LINK_TRANSPORTS",
    "MODES",
    "MODE_CHOICES",
    "NODE_BATCHED",
    "RING_MODES",
    "SCHEDULES",
    "SCHEDULE_CHOICES",
    "TRANSPORTS",
    "TRANSPORT_CHOICES",
]

AUTO = "auto"  # a request resolved by the runtime: choose_mode / the copy engine when it works
MODES = ("expert", "token", "alltoall")  # the order breaks ties in choose_mode
RING_MODES = ("expert", "token")
LINK_TRANSPORTS = ("nccl", "copy_engine")  # what a world of more than one rank may run over
TRANSPORTS = ("local", *LINK_TRANSPORTS)  # as resolved by the runtime (local: a world of 1)
MODE_CHOICES = (AUTO, *MODES)  # what a caller may ask for (ring_moe, flags, configs)
TRANSPORT_CHOICES = (AUTO, *LINK_TRANSPORTS)
# How the ring's ranks are ordered into hops (relaymoe/ring/schedule.py): one ring over the
# group ("flat"), or rings inside each node joined by one hop to the next node that every GPU
# of the node makes at once ("two_level"); "auto": two_level when the group spans nodes.
SCHEDULES = ("flat", "two_level")
# Expert mode only, asked for by name (not yet measured, so "auto" never picks it): rounds of a
# whole node's experts, all-gathered inside the node, the column of each local rank a ring
# across nodes (relaymoe/ring/nodebatch.py): one hop per node instead of per rank.
NODE_BATCHED = "node_batched"
SCHEDULE_CHOICES = (AUTO, *SCHEDULES, NODE_BATCHED)
# The dtype of the ring's weight-gradient accumulators (expert mode: the gradients that travel
# with their weights; token mode: the local ones every hop adds to): "param" (the weights' own,
# bf16), "fp32", or "auto": fp32 from FP32_GRAD_ACCUM_MIN_EP ranks. Each hop adds one rounding
# in a 16-bit accumulator, so the ring's weight-gradient error grows with EP while an all-to-all's
# single GEMM does not: measured over gloo (docs/lab-notes/numerics_2026-11-30.md) the ring's
# dw2 error was 1.55x the all-to-all's at EP 8 and 1.90x at EP 16, extrapolated 2.5x at EP 32.
GRAD_ACCUMS = ("param", "fp32")
GRAD_ACCUM_CHOICES = (AUTO, *GRAD_ACCUMS)
FP32_GRAD_ACCUM_MIN_EP = 16

# whether the host waits for a ring pass's transfers on CUDA (RELAYMOE_RING_HOST_WAIT): at the
# end of each pass for the one before it, and at a backward's end for its last (the default,
# first: a dead peer named a pass later, measured free), never, or at the end of each pass for
# the pass itself (a dead peer named at once, at a measured cost; ring/faults.py)
HOST_WAIT_CHOICES = ("lag", "off", "pass")
