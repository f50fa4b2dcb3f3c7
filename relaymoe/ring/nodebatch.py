"""Node-batched rounds of the expert ring (``schedule="node_batched"``, issue #18).

The flat and two-level orders make ``R - 1`` hops a pass, and every hop pays the ring's fixed
host cost once (launches, index slices, Python: about 2 ms fitted on H200 at EP 2). Across
nodes this schedule pays it once per node instead. With ``G`` GPUs a node and ``N = R/G`` nodes,
rank ``r = n*G + g``:

* **column**: the ranks ``(0, g), (1, g), ..., (N-1, g)`` of one local index form a ring of
  ``N`` (the two-level ring's inter-node step, every GPU on its own NIC). ``relay`` runs over it
  unchanged: at round ``j`` rank ``(n, g)`` holds partition ``(n - j, g)`` (the lead), and in
  the backward its weight gradient (the trail) follows one round behind, home after ``N``.
* **row**: inside a round the node's ``G`` GPUs hold the ``G`` partitions of one node
  ``m = n - j``, i.e. its contiguous experts ``[m*G*El, (m+1)*G*El)``. The hop's compute
  all-gathers them over the row (P2P to each node peer) and runs one hop primitive over all
  ``G*El`` experts. Backward: the ``G*El`` experts' weight gradients of this rank's tokens are
  reduce-scattered over the row (partition ``(m, q)``'s share goes to local rank ``q``) and
  added into the trail.

So a pass has ``N`` hops of ``G`` times the pairs of a flat hop. Every exchange is a
``batch_isend_irecv`` on the EP group (gloo on CPU, NCCL on CUDA): no sub-group is created.
Extra memory against the flat expert ring: the gathered ``G*El`` experts (and, backward, their
gradients in the accumulator dtype, written by the hop, not zero-filled) for one hop; none at
``G = 1``, where the hop runs on the visiting partition in place and adds into the travelling
gradients as the flat ring does. No token buffer grows. A rank with no tokens
still exchanges (its peers wait for its partition and its zero gradient share). Expert mode only:
token partitions batched ``G`` at a time would multiply the token slots by ``G``.

Waits: on CPU each exchange is waited for, bounded by the group's timeout (``RingPeerError``
names the peers); on CUDA the works are stream-ordered and handed to the pass's host wait
(``faults.PeerWatch.finish``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from relaymoe.ring.faults import PeerWatch
from relaymoe.ring.schedule import HopTransfer, Leg, RingPlan
from relaymoe.ring.transport import P2PTransport

__all__ = ["ColumnTransport", "column_plan", "row_exchange", "row_ranks"]


def row_ranks(rank: int, gpus_per_node: int) -> list[int]:
    """The group ranks of ``rank``'s node, by local index."""
    n = rank // gpus_per_node
    return [n * gpus_per_node + q for q in range(gpus_per_node)]


def column_plan(
    rank: int, world: int, gpus_per_node: int, lead_bytes: int, trail_bytes: int | None
) -> RingPlan:
    """The flat ring over ``rank``'s column (its local index on every node): ``N`` ranks."""
    N = world // gpus_per_node
    trail = None if trail_bytes is None else [trail_bytes] * N
    return RingPlan(rank // gpus_per_node, N, [lead_bytes] * N, trail)


class ColumnTransport(P2PTransport):
    """``P2PTransport`` for a column plan: its peers are node indices; the group's ranks are
    ``node * gpus_per_node + g``."""

    def __init__(self, group: dist.ProcessGroup, rank: int, gpus_per_node: int):
        super().__init__(group)
        self.g, self.G = rank % gpus_per_node, gpus_per_node
        self.node = rank // gpus_per_node

    def watch_view(self) -> dict:
        """A hop's neighbours are the column's (errors still name the whole EP group)."""
        N = dist.get_world_size(self.group) // self.G
        return {"ring": [m * self.G + self.g for m in range(N)]}

    def group_peers(self, peers) -> set[int]:
        return {p * self.G + self.g for p in peers}

    def issue(self, xfer: HopTransfer, sends: list[Tensor], recvs: list[Tensor]) -> list:
        def leg(lg: Leg) -> Leg:
            return Leg(lg.peer * self.G + self.g, lg.range, lg.src)

        mapped = HopTransfer(
            xfer.hop, tuple(map(leg, xfer.sends)), tuple(map(leg, xfer.recvs)),
            xfer.sends_lead, xfer.sends_trail,
        )  # fmt: skip
        return super().issue(mapped, sends, recvs)


def row_exchange(
    group: dist.ProcessGroup | None,
    rank: int,
    gpus_per_node: int,
    sends: Callable[[int], list[Tensor]],
    recvs: Callable[[int], list[Tensor]],
    *,
    mode: str,
    phase: str,
    device: torch.device,
) -> None:
    """Send ``sends(q)`` to and receive ``recvs(q)`` from every other rank ``q`` of the node
    (local indices), all at once; returns when the data may be read (CPU: waited, bounded; CUDA:
    ordered on the current stream, the host wait deferred to the pass's policy)."""
    G, g = gpus_per_node, rank % gpus_per_node
    if G == 1:
        return
    row = row_ranks(rank, G)
    ops, peers = [], []
    for q in range(G):  # the sends first, then the receives, in the same order on every rank
        if q != g:
            for t in sends(q):
                ops.append(dist.P2POp(dist.isend, t, group=group, group_peer=row[q]))
                peers.append(row[q])
    for q in range(G):
        if q != g:
            for t in recvs(q):
                ops.append(dist.P2POp(dist.irecv, t, group=group, group_peer=row[q]))
                peers.append(row[q])
    watch = PeerWatch(group, mode=mode, phase=phase)
    with watch.issuing(op="row exchange", peers=sorted(set(peers))):
        works = dist.batch_isend_irecv(ops)
    if device.type == "cuda":
        for w in works:
            w.wait()  # the current stream waits for NCCL's; the host does not
        watch.defer(works, op="row exchange")
        watch.finish(device)
        return
    if len(works) == len(ops):
        watch.wait([(w, (p,)) for w, p in zip(works, peers, strict=True)], op="row exchange")
    else:
        watch.wait([(w, tuple(sorted(set(peers)))) for w in works], op="row exchange")
