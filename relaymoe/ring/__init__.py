"""Ring execution of MoE experts over an expert-parallel group (RelayMoE §3.1-3.3).

Public: :func:`ring_moe` (the autograd op; expert weights as stacked tensors or as lists of
per-expert tensors, ``weights.py``; its per-hop bytes, memory and the time model behind
``mode="auto"`` are :mod:`relaymoe.cost`'s), :func:`record_timeline` / :class:`HopTiming`
(per-hop compute vs transfer, of one runtime's calls, ``executor.py``),
:class:`RingPlan` (the hop order, ``plan.py``), the transports (``executor.py``), and
:class:`RingProblem` / :func:`resolved_problem` (what the ranks agreed on, ``agreement.py``), and
:class:`RingPeerError` (a peer that died or stalled, ``faults.py``), and
:class:`RingRuntime` (what the ring keeps from call to call, held by its owner: ``runtime.py``),
and :class:`MainGrads` (a caller's accumulators of the expert weight gradients, e.g. Megatron's
``main_grad``: ``main_grads.py``).
A call's options are one :class:`relaymoe.options.RingConfig` (``ring_moe(..., config=)``).
See ``engine.py`` for the modes and the memory bound of each.
"""

from relaymoe.ring.engine import resolved_problem, ring_moe
from relaymoe.ring.executor import (
    CopyEngineTransport,
    HopTiming,
    P2PTransport,
    copy_engine_available,
    record_timeline,
)
from relaymoe.ring.faults import RingPeerError
from relaymoe.ring.main_grads import MainGrads
from relaymoe.ring.plan import RingPlan, RingProblem
from relaymoe.ring.runtime import RingRuntime

__all__ = [
    "CopyEngineTransport",
    "HopTiming",
    "MainGrads",
    "P2PTransport",
    "RingPlan",
    "RingPeerError",
    "RingProblem",
    "RingRuntime",
    "copy_engine_available",
    "record_timeline",
    "resolved_problem",
    "ring_moe",
]
