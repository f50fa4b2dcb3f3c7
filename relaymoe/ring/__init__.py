"""Ring execution of MoE experts over an expert-parallel group (RelayMoE §3.1-3.3).

Public: :func:`ring_moe` (the autograd op; expert weights as stacked tensors or as lists of
per-expert tensors, ``weights.py``), :func:`comm_volume` / :class:`CommVolume` (the per-hop
volume, from :mod:`relaymoe.costmodel`, which also holds the time model behind
``mode="auto"``), :func:`record_timeline` / :class:`HopTiming` (per-hop compute vs transfer),
:class:`RingPlan` (the schedule), the transports, and
:class:`RingProblem` / :func:`resolved_problem` (what the ranks agreed on), and
:class:`RingPeerError` (a peer that died or stalled, ``faults.py``).
See ``engine.py`` for the modes and the memory bound of each.
"""

from relaymoe.costmodel import CommVolume, comm_volume
from relaymoe.ring.agree import RingProblem
from relaymoe.ring.engine import resolved_problem, ring_moe
from relaymoe.ring.executor import HopTiming, record_timeline
from relaymoe.ring.faults import RingPeerError
from relaymoe.ring.schedule import RingPlan
from relaymoe.ring.transport import (
    CopyEngineTransport,
    P2PTransport,
    copy_engine_available,
    symmetric_workspace_bytes,
)

__all__ = [
    "CommVolume",
    "CopyEngineTransport",
    "HopTiming",
    "P2PTransport",
    "RingPlan",
    "RingPeerError",
    "RingProblem",
    "comm_volume",
    "copy_engine_available",
    "record_timeline",
    "resolved_problem",
    "ring_moe",
    "symmetric_workspace_bytes",
]
