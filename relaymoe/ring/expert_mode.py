"""Expert mode: the weights travel, the tokens stay; the forward and backward passes of the ring,
in the flat or two-level hop order or in node-batched rounds.

The experts' biases travel in their weights' partition (``plan.weights_layout``) and their
gradients trail home with the weight gradients, in the same accumulators' dtype. A hop's compute
is a body over named tensors (``run_hop``): called on the live ones, or replayed from
``hop_graphs.py``'s cache with ``RingConfig.capture_hops``.

**Node-batched rounds** (``schedule="node_batched"``, :func:`batched_expert_forward`,
:func:`batched_expert_backward`) are experimental: ``schedule="auto"`` never picks them (``auto``
resolves to ``flat`` or ``two_level``, ``plan.resolve_schedule``), so they run only when asked for
by name, in expert mode: ``ring_moe(..., config=RingConfig(schedule="node_batched"))`` (with
``gpus_per_node=G`` or the hosts' nodes) or Megatron's ``--relaymoe-schedule node_batched``.
They are tested over gloo on CPU and have run on GPUs only inside one node (two GPUs, ``G = 1``
and ``2``); they have never run across nodes, where their gain is simulated only (the cost
model's multi-node clusters).

The flat and two-level orders make ``R - 1`` hops a pass, and every hop pays the ring's fixed
host cost once (launches, index slices, Python). Across nodes the node-batched schedule pays it
once per node instead. With ``G`` GPUs a node and ``N = R/G`` nodes, rank ``r = n*G + g``:

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

Every activation and the experts' biases: the biases travel in their weights' partition, are
all-gathered with them and their gradients reduce-scattered with the weights' (the bias
gradients added into zeros, as the hop primitives add them).

Waits: on CPU each exchange is waited for, bounded by the group's timeout (``RingPeerError``
names the peers); on CUDA the works are stream-ordered and handed to the pass's host wait
(``faults.PeerWatch.finish``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from relaymoe.experts import expert_hop_backward, expert_hop_forward
from relaymoe.ring.executor import P2PTransport, PassWork, relay, ring_pass
from relaymoe.ring.hop_graphs import (
    hop_graphs_of,
    hop_head,
    hop_key,
    index_from,
    index_inputs,
    index_sizes,
    range_window,
    run_hop,
    stage_pass,
    window_fits,
)
from relaymoe.ring.main_grads import WEIGHTS, add_home, direct_targets
from relaymoe.ring.plan import (
    HopTransfer,
    Leg,
    RingPlan,
    RingProblem,
    capacity,
    expert_plans,
    pair_rows,
    weights_layout,
)
from relaymoe.ring.weights import (
    FORWARD,
    biases,
    home_grads,
    hop_grads,
    hop_options,
    local_parts,
    pack_own,
    present,
)

__all__ = [
    "ColumnTransport",
    "batched_expert_backward",
    "batched_expert_forward",
    "column_plan",
    "expert_backward",
    "expert_forward",
    "range_offsets",
    "row_exchange",
    "row_ranks",
]


def range_offsets(index, El: int) -> tuple:
    """Every expert range's ``El+1`` pair offsets (``index.offsets_for(p*El, (p+1)*El)`` for
    each partition ``p``) as views made in one call a pass, not one a hop: what a recorded hop
    copies in when one body serves every range (``hop_graphs.range_window``)."""
    return index.expert_token_offsets.unfold(0, El + 1, El).unbind(0)


def expert_forward(problem, call, x, experts, probs, index, order):
    kernel_choice = call.kernel_choice
    El = problem.num_local_experts
    out = torch.zeros_like(x)
    T = x.shape[0]
    local = local_parts(experts, order) if problem.world_size == 1 else None

    graphs = hop_graphs_of(problem, call, x.device)
    own, sizes = {"x": x, "probs": probs, **index_inputs(index)}, index_sizes(index)
    # Recorded hops share one graph for every expert range (range_window): a GPU given many
    # distinct graphs back to back idles between them, one graph per range would be R of them
    any_range = graphs is not None and window_fits(problem)
    head = graphs and hop_head(problem, call, "fwd")
    offsets = range_offsets(index, El) if any_range else None

    def compute(hop, part, lead, trail):
        if T == 0:
            return
        w = local if lead is None else lead
        rng, rows = (part * El, (part + 1) * El), pair_rows(problem, problem.rank, part)
        inputs = {**own, **present(w)}
        if any_range:  # the range's pair offsets reach the graph as an input, copied each hop
            inputs["range_offsets"] = offsets[part]

        def body(t):
            full = index_from(t, sizes)
            hop_index, hop_range = range_window(full, t["range_offsets"]) if any_range else (
                full, rng)  # fmt: skip
            expert_hop_forward(
                t["x"], t["w13"], t["w2"], t["probs"], hop_index, expert_range=hop_range,
                **biases(t), out_TH=t["out"], save="none",
                options=hop_options(problem, kernel_choice, rows),
            )  # fmt: skip

        # only a cache reads the key; shared by every range when the window serves them
        key = graphs and hop_key(head, (0, El) if any_range else rng, rows) + (any_range,)
        run_hop(graphs, key, body, inputs, {"out": out})

    fwd, bwd = expert_plans(problem)
    w = weights_layout(problem)  # every partition's, built once: the executor's views recur
    with stage_pass(graphs, own, {"out": out}):  # recorded hops: copied once a pass, not a hop
        work = PassWork(lead_layout=lambda p: w, own_lead=partial(pack_own, experts),
                        compute=compute, capacity=capacity(fwd, bwd, problem))  # fmt: skip
        ring_pass(problem, call, x.device, "fwd", fwd, work)
    return out


def expert_backward(problem, call, dy, x, experts, probs, index, order, into=None):
    """Returns ``(dx, dprobs, grads)``, ``grads`` this rank's experts' gradients by part name
    (``w13``, ``w2``, and the biases'); their rows are in the row order the compute used:
    expert order for ``R > 1`` (slot 0 is packed in expert order), ``order`` in a world of
    one. ``into``: the call's ``MainGrads`` (None: none): the weight gradients are added there
    and left out of ``grads`` (``main_grads.py``: a world of one adds them inside its hop where
    the accumulators allow, a ring when they arrive home)."""
    kernel_choice = call.kernel_choice
    El = problem.num_local_experts
    dx = torch.zeros_like(x)
    dprobs = torch.zeros_like(probs)
    T = x.shape[0]
    local = local_parts(experts, order) if problem.world_size == 1 else None
    # a world of one computes this rank's experts only: its hop adds into the targets in place
    alone = problem.world_size == 1
    direct = direct_targets(into, order, problem.accum_dtype) if alone and into else None
    targets, reverse = direct or ({}, False)

    graphs = hop_graphs_of(problem, call, x.device)
    own, sizes = {"dy": dy, "x": x, "probs": probs, **index_inputs(index)}, index_sizes(index)
    any_range = graphs is not None and window_fits(problem)  # one body for every range, as forward
    head = graphs and hop_head(problem, call, "bwd")
    offsets = range_offsets(index, El) if any_range else None

    # The trail reaches compute as it is (relay's zero_trail=False): each hop writes its weight
    # gradients over it (dw_accumulate=False: no zero fill, no read of the old values, bitwise
    # what zeros added into get) and zeroes the bias gradients it adds into, inside a recorded
    # hop's graph.
    def compute(hop, part, lead, trail):
        if T == 0:  # no pairs: this rank's share of the weight gradient is exactly zero
            for v in trail.values():
                v.zero_()
            return
        w = local if lead is None else lead
        rng, rows = (part * El, (part + 1) * El), pair_rows(problem, problem.rank, part)
        inputs = {**own, **present(w)}
        if any_range:
            inputs["range_offsets"] = offsets[part]

        def body(t):
            for name in ("db13", "db2"):
                if name in t:
                    t[name].zero_()
            full = index_from(t, sizes)
            hop_index, hop_range = range_window(full, t["range_offsets"]) if any_range else (
                full, rng)  # fmt: skip
            grads = hop_grads(t, dw_accumulate=direct is not None, dw_reversed=reverse)
            expert_hop_backward(
                t["dy"], t["x"], t["w13"], t["w2"], t["probs"], hop_index,
                expert_range=hop_range, **biases(t), grads=grads,
                options=hop_options(problem, kernel_choice, rows),
            )  # fmt: skip

        key = graphs and hop_key(head, (0, El) if any_range else rng, rows) + (
            any_range, direct is not None, reverse)  # fmt: skip
        run_hop(graphs, key, body, inputs, {"dx": dx, "dprobs": dprobs, **trail, **targets})

    _, bwd = expert_plans(problem)
    # built once, as forward; no accumulators for what goes into the targets in place
    w, dw = weights_layout(problem), weights_layout(problem, "d", WEIGHTS if targets else ())
    with stage_pass(graphs, own, {"dx": dx, "dprobs": dprobs}):
        work = PassWork(lead_layout=lambda p: w, own_lead=partial(pack_own, experts),
                        compute=compute, trail_layout=lambda p: dw, zero_trail=False)  # fmt: skip
        grads = ring_pass(problem, call, x.device, "bwd", bwd, work)
    add_home(into, grads, order if alone else FORWARD)
    return dx, dprobs, home_grads(problem, grads)


# ---------------------------------------------------------------------------------------------
# node-batched rounds: a column ring of nodes, the node's experts gathered over its row
# ---------------------------------------------------------------------------------------------
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
    call,
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
    (local indices) of the call's group (``call``: a ``RingCall``), all at once; returns when
    the data may be read (CPU: waited, bounded; CUDA: ordered on the current stream, the host
    wait deferred to the call's policy)."""
    group = call.group
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
    watch = call.watch(mode=mode, phase=phase)
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


# ---------------------------------------------------------------------------------------------
# the expert passes in node-batched rounds
# ---------------------------------------------------------------------------------------------
def _node_pairs(problem: RingProblem, node: int) -> dict[str, int]:
    """The pair-count keyword of one round: this rank's tokens against node ``node``'s experts."""
    G, T = problem.gpus_per_node, problem.tokens[problem.rank]
    if problem.pairs is not None:
        return {"n_pairs": sum(problem.pairs[problem.rank][node * G : (node + 1) * G])}
    return {"max_pairs": T * min(problem.topk, G * problem.num_local_experts)}


def _node_experts(problem: RingProblem, call, lead, local, device, phase) -> dict[str, Tensor]:
    """The round's ``G*El`` experts by part name (``w13``, ``w2`` and the biases): this rank's
    visiting partition (``lead``, or ``local`` in a column of one) and its node peers',
    all-gathered over the row (the biases in the same exchange as their weights)."""
    G, El, g = (
        problem.gpus_per_node,
        problem.num_local_experts,
        problem.rank % problem.gpus_per_node,
    )
    src = local if lead is None else lead
    mine = {n: src[n] for n in weights_layout(problem).names}
    if G == 1:  # the node is this rank: its partition as it is, no copy
        return mine
    node = {n: t.new_empty((G * El, *t.shape[1:])) for n, t in mine.items()}
    for n, t in mine.items():
        node[n][g * El : (g + 1) * El].copy_(t)
    row_exchange(
        call, problem.rank, G, lambda q: list(mine.values()),
        lambda q: [t[q * El : (q + 1) * El] for t in node.values()],
        mode=problem.mode, phase=phase, device=device,
    )  # fmt: skip
    return node


def _batched_pass(problem, call, device, phase, compute, experts, backward):
    """One column pass; the hop's experts are all-gathered over the row before the hop's column
    transfer is issued (``relay``'s ``prepare``) and handed to ``compute(node, parts,
    trail)`` (``parts``: the round's experts by part name)."""
    G = problem.gpus_per_node
    w, dw = weights_layout(problem), weights_layout(problem, "d")
    plan = column_plan(
        problem.rank, problem.world_size, G, w.nbytes, dw.nbytes if backward else None
    )
    local = local_parts(experts, FORWARD) if plan.world_size == 1 else None  # a column of one
    gathered = {}

    def prepare(hop, node, lead):
        gathered["w"] = _node_experts(problem, call, lead, local, device, phase)

    def run(hop, node, lead, trail):
        compute(node, gathered.pop("w"), trail)

    work = PassWork(lead_layout=lambda p: w, own_lead=partial(pack_own, experts), compute=run,
                    trail_layout=(lambda p: dw) if backward else None, prepare=prepare)  # fmt: skip
    return relay(plan, work, transport=ColumnTransport(call.group, problem.rank, G),
                 device=device, call=call, mode=problem.mode, phase=phase)  # fmt: skip


def batched_expert_forward(problem, call, x, experts, probs, index, order):
    kernel_choice = call.kernel_choice
    G, El = problem.gpus_per_node, problem.num_local_experts
    out = torch.zeros_like(x)

    def compute(node, parts, trail):
        if x.shape[0] == 0:
            return
        expert_hop_forward(
            x, parts["w13"], parts["w2"], probs, index,
            expert_range=(node * G * El, (node + 1) * G * El), **biases(parts), out_TH=out,
            save="none", options=hop_options(problem, kernel_choice, _node_pairs(problem, node)),
        )  # fmt: skip

    _batched_pass(problem, call, x.device, "fwd", compute, experts, False)
    return out


def batched_expert_backward(problem, call, dy, x, experts, probs, index, order, into=None):
    """As ``expert_backward``; the gradients' rows in expert order (``into``'s added when
    they arrive home)."""
    kernel_choice = call.kernel_choice
    G, El, g = (
        problem.gpus_per_node,
        problem.num_local_experts,
        problem.rank % problem.gpus_per_node,
    )
    dx, dprobs = torch.zeros_like(x), torch.zeros_like(probs)

    def compute(node, parts, trail):
        def grads(d: dict):
            rows = _node_pairs(problem, node)
            return expert_hop_backward(
                dy, x, parts["w13"], parts["w2"], probs, index,
                expert_range=(node * G * El, (node + 1) * G * El), **biases(parts),
                grads=hop_grads({**d, "dx": dx, "dprobs": dprobs}),
                options=hop_options(problem, kernel_choice, rows, problem.accum_dtype),
            )  # fmt: skip

        if G == 1:  # no row: the gradients go straight into the trail, as in the flat ring
            if x.shape[0] > 0:
                grads(trail)
            return
        # the weight gradients written, not added (no zero fill of the G*El gradients); the
        # bias gradients are added into zeros (the hop primitives' contract), and a rank with
        # no tokens sends zero shares (its peers wait for them)
        d = {"dw13": None, "dw2": None}
        d |= {"d" + n: torch.zeros_like(t, dtype=problem.accum_dtype)
              for n, t in parts.items() if n.startswith("b")}  # fmt: skip
        if x.shape[0] > 0:
            _, _, d["dw13"], d["dw2"] = grads(d)
        else:
            d["dw13"] = torch.zeros_like(parts["w13"], dtype=problem.accum_dtype)
            d["dw2"] = torch.zeros_like(parts["w2"], dtype=problem.accum_dtype)
        names = list(trail)  # the trail's order: dw13, dw2, then the biases'
        # reduce-scatter over the row: partition (node, q)'s share to local rank q
        got = {q: [torch.empty_like(d[n][g * El : (g + 1) * El]) for n in names]
               for q in range(G) if q != g}  # fmt: skip
        row_exchange(
            call, problem.rank, G, lambda q: [d[n][q * El : (q + 1) * El] for n in names],
            lambda q: got[q], mode=problem.mode, phase="bwd", device=x.device,
        )  # fmt: skip
        for shares in ([d[n][g * El : (g + 1) * El] for n in names], *got.values()):
            for n, share in zip(names, shares, strict=True):
                trail[n].add_(share)

    grads = _batched_pass(problem, call, x.device, "bwd", compute, experts, True)
    add_home(into, grads, FORWARD)
    return dx, dprobs, home_grads(problem, grads)
