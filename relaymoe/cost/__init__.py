"""The one cost model of an MoE layer step: link bytes, memory and time of every execution mode.

Pure Python (imports nothing from torch or ``relaymoe.ring``): the runtime's ``mode="auto"``
(``relaymoe.ring``), the planner (``relaymoe plan``) and the simulator all take their numbers
from here, so they cannot disagree.

Shape legend (one rank of the expert-parallel group): ``T`` tokens of the largest partition,
``H`` hidden, ``I`` expert FFN width, ``El`` experts per rank, ``E = El*R`` all experts, ``K``
top-k, ``R`` ranks, ``b`` bytes of an activation/weight element, ``pb`` bytes of a router
probability, ``gb`` bytes of a weight-gradient accumulator element (``b``, or 4 with fp32
accumulators: ``relaymoe.options.GRAD_ACCUMS``); expert ids travel as int32, so a token's
routing metadata is ``m = K*(4 + pb)`` bytes; ``J`` fc1 rows per expert (2I for a gated
activation such as SwiGLU: gate and up; I otherwise); ``W = El*(J*H + H*I)`` elements of the
local experts, plus ``El*J`` / ``El*H`` when they carry fc1 / fc2 biases (``Dims.gated``,
``Dims.b13``, ``Dims.b2``: the biases travel and accumulate with their weights).

Modes (``relaymoe.options.MODES``):

* ``expert`` (ring): the weights travel. Per hop, forward ``W*b``; backward the weights and the
  trailing weight gradients ``W*(b + gb)``.
* ``token`` (ring): the tokens travel. Per hop, forward ``T*(H*b + m)`` lead plus the trailing
  output ``T*H*b``; backward ``T*(2*H*b + K*pb)`` lead (x, dy, probabilities: the forward kept
  every partition's routing index, so no ids travel) plus the trailing dx and dprobs
  ``T*(H*b + K*pb)``.
* ``alltoall`` (``relaymoe/ring/token_mode.py``): every rank sends each token once to every rank
  owning at least one of its K experts (x with its ids and probabilities); the owner computes
  all its pairs in one call and returns the partial outputs. The backward sends x and dy again
  (the forward's routing index and probabilities of the received rows are kept, no ids travel)
  and gets dx and dprobs back. Rows sent per rank ``S = T*R*q``, ``q`` the chance that a token
  has an expert on a given rank under uniform routing (``alltoall_rows``); ``1/R`` of them stay
  home, and a rank receives as many rows as it sends (in expectation).

The ring's schedule (``relaymoe/ring/plan.py``): a pass has ``R`` hops; the lead is sent at
hops ``0..R-2``, the trail (when there is one) at hops ``1..R-1`` merged with the lead, and once
more after the last hop to return home.

Files: ``dims`` (the sizes), ``traffic`` (bytes on the links), ``memory``, ``time`` (the time model
and ``choose_mode``), ``order`` (hop orders and per-hop times), ``links`` (link speeds, layout
constants). Option names and choices live in ``relaymoe.options``.
"""

from __future__ import annotations

from relaymoe.cost.dims import (
    SLICE_QUANTUM,
    Dims,
    dims,
    grad_accum_bytes,
    hop_pair_bytes,
    hop_slice_pairs,
)
from relaymoe.cost.links import (
    ALIGN,
    INDEX_BYTES,
    INTER_NODE_BYTES_PER_S,
    NIC_BYTES_PER_S,
    NIC_EFFICIENCY,
    NVLINK_BYTES_PER_S,
    ROUTING_INDEX_BYTES_PER_PAIR,
    SYMM_GRANULE,
)
from relaymoe.cost.memory import (
    MemoryBytes,
    captured_hop_bytes,
    mcore_alltoall_memory_bytes,
    mcore_alltoall_send_bytes,
    memory_bytes,
    node_batched_memory_bytes,
    slot_capacity,
    symmetric_workspace_bytes,
)
from relaymoe.cost.order import (
    RingHopTimes,
    choose_schedule,
    node_batched_hop_times,
    order_partition,
    order_rank,
    ring_hop_times,
    schedule_rank,
)
from relaymoe.cost.time import (
    DEFAULT_TIME_MODEL,
    TimeModel,
    choose_mode,
    choose_mode_for,
    step_seconds,
)
from relaymoe.cost.traffic import HopBytes, StepBytes, alltoall_rows, hop_bytes, step_bytes

__all__ = [
    "ALIGN",
    "DEFAULT_TIME_MODEL",
    "INDEX_BYTES",
    "INTER_NODE_BYTES_PER_S",
    "NIC_BYTES_PER_S",
    "NIC_EFFICIENCY",
    "NVLINK_BYTES_PER_S",
    "ROUTING_INDEX_BYTES_PER_PAIR",
    "SLICE_QUANTUM",
    "SYMM_GRANULE",
    "Dims",
    "HopBytes",
    "MemoryBytes",
    "RingHopTimes",
    "StepBytes",
    "TimeModel",
    "alltoall_rows",
    "captured_hop_bytes",
    "choose_mode",
    "choose_mode_for",
    "choose_schedule",
    "dims",
    "grad_accum_bytes",
    "hop_bytes",
    "hop_pair_bytes",
    "hop_slice_pairs",
    "mcore_alltoall_memory_bytes",
    "mcore_alltoall_send_bytes",
    "memory_bytes",
    "node_batched_hop_times",
    "node_batched_memory_bytes",
    "order_partition",
    "order_rank",
    "ring_hop_times",
    "schedule_rank",
    "slot_capacity",
    "step_bytes",
    "step_seconds",
    "symmetric_workspace_bytes",
]
