"""``ring_moe``: MoE experts over an expert-parallel group by circulating experts or tokens.

Shape legend: T tokens of this rank, H hidden, I expert FFN width, El experts per rank,
E = El*R all experts, K top-k, R ranks of the group.

**Expert mode** (tokens stay, expert weights travel). Forward hop ``h``: rank ``r`` adds its
tokens' pairs with the visiting experts of rank ``o = (r-h) mod R`` (the contiguous range
``[o*El, (o+1)*El)`` of a routing index built once per call over all E experts) while the next
partition is in flight. Saved for backward: x, topk_idx, topk_probs, the index (no
activations) and the weights as given (list form: the caller's per-expert tensors, no copy).
Every pass packs the rank's own experts into slot 0 (per expert in list form) and hop 0
computes from that slot. Backward hop ``h`` recomputes that hop's intermediates
(``expert_hop_backward`` with ``saved_h=None``), adds into the local dx/dprobs, and computes
the visiting partition's weight-gradient share; the gradient buffer of a partition travels one
hop behind its weights, merged into the same transfer, and returns to its owner after the last
hop (RelayMoE Fig. 5).

**Token mode** (experts stay, tokens travel). Forward hop ``h``: rank ``r`` receives the tokens
of rank ``s = (r-h) mod R`` with their routing metadata (int32 ids, probabilities), builds their
routing index and adds the pairs of its own experts into the partition's output accumulator,
which travels one hop behind its tokens and returns home after the last hop. Backward
circulates x, dy and the metadata, with dx/dprobs accumulators trailing; weight gradients stay
local. Ranks may hold different T (including 0): every rank knows every T from the agreement
step, so each hop sends and receives exactly the partition's bytes.

**Memory bound** (besides inputs, outputs and gradients; ``W = El*3*H*I`` elements, ``b`` bytes
per element, ``gb`` bytes of a weight-gradient accumulator element (``b``, or 4 with fp32
accumulators: ``grad_accum``), ``Tm`` the largest T of the group, ``m = K*(4+pb)`` metadata
bytes per token; ``cost.memory_bytes`` is this list):

* expert forward: two weight slots ``2*W*b``, plus one hop's compute intermediates;
* expert backward: two slots of weights + trailing gradient ``2*W*(b + gb)``, one gradient
  scratch ``W*gb``, the returned gradient ``W*gb`` (and its cast ``W*b`` when ``gb != b``),
  plus one hop's intermediates (recomputed per hop, freed before the next);
* token forward: two slots ``2*Tm*(2*H*b + m)``, one output scratch ``Tm*H*b``, plus one hop's
  intermediates and routing index;
* token backward: two slots ``2*Tm*(3*H*b + m + K*pb)``, one dx/dprobs scratch, the local
  weight-gradient accumulator ``W*gb`` (and its cast), plus one hop's intermediates and routing
  index;
* list-form weights (``weights.py``): nothing more in expert mode; in token mode (and in a world
  of one) ``W*b`` more for the duration of each pass when the per-expert tensors are not back
  to back in one storage (in expert order or its reverse), else nothing (a zero-copy view).
* from forward to backward: expert mode keeps the call's routing index, token mode the routing
  index of every visiting partition (``12*T*K`` bytes each: built once per call, no ids travel
  backward), nothing else.

**Node-batched rounds** (``schedule="node_batched"``, expert mode, ``nodebatch.py``): the
expert pass over the column ring of each local rank (``N`` nodes, one hop per node); each hop
all-gathers the node's ``G`` partitions and computes the node's ``G*El`` experts at once, and
the backward reduce-scatters their gradients inside the node before they travel. Memory: the
gathered experts (and their gradients) of one hop, ``G`` times a flat hop's, on top of the
expert bounds above.

**All-to-all mode** (``mode="alltoall"``, ``alltoall.py``): the same hop primitives behind one
all-to-all of index-dispatched tokens, for the small-T regime where the ring's per-hop host cost
dominates. ``mode="auto"`` picks among the three with ``relaymoe.cost.choose_mode`` (a time
model calibrated on H200 rows), identically on every rank.

No ``(T*K, H)`` buffer exists at any time (the hop primitives read tokens through the index).
With ``transport="copy_engine"`` the two slots are a persistent symmetric-memory workspace per
(group, device), shared by all layers and sized by the largest pass so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from relaymoe.experts import expert_hop_backward, expert_hop_forward
from relaymoe.kernels.select import kernel_options
from relaymoe.options import NODE_BATCHED, KernelOptions
from relaymoe.ring.agree import RingProblem, RingRequest, agree
from relaymoe.ring.alltoall import alltoall_backward, alltoall_forward
from relaymoe.ring.executor import relay
from relaymoe.ring.layout import Layout
from relaymoe.ring.nodebatch import ColumnTransport, column_plan, row_exchange
from relaymoe.ring.schedule import RingPlan
from relaymoe.ring.transport import CopyEngineTransport, P2PTransport, Transport
from relaymoe.ring.weights import FORWARD, REVERSED, LocalExperts, reverse_local_ids
from relaymoe.routing import build_routing_index

__all__ = ["ring_moe"]

_IDX = torch.int32  # expert ids travel as int32


class Hop(NamedTuple):
    """How a hop's compute runs: the hop primitives' backend and their kernel options."""

    backend: str
    kernels: KernelOptions


def _resolve_group(group):
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _transport(prob: RingProblem, group) -> Transport | None:
    if prob.transport == "copy_engine":
        return CopyEngineTransport(group)
    if prob.transport == "nccl":
        return P2PTransport(group)
    return None


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------
def _weights_layout(prob: RingProblem, prefix: str = "") -> Layout:
    """The experts' weights, or with ``prefix="d"`` their gradient accumulators (in
    ``prob.accum_dtype``: fp32 for a long ring of 16-bit weights, see options.GRAD_ACCUMS)."""
    El, H, I = prob.num_local_experts, prob.hidden, prob.ffn
    dt = prob.accum_dtype if prefix == "d" else prob.dtype
    return Layout.of((prefix + "w13", dt, (El, 2 * I, H)), (prefix + "w2", dt, (El, H, I)))


def _token_lead(prob: RingProblem, T: int, backward: bool) -> Layout:
    """A visiting token partition: x, ids and probabilities forward; x, probabilities and dy
    backward (the forward kept each partition's routing index, so no ids travel)."""
    H, K = prob.hidden, prob.topk
    if backward:
        return Layout.of(
            ("x", prob.dtype, (T, H)),
            ("probs", prob.prob_dtype, (T, K)),
            ("dy", prob.dtype, (T, H)),
        )
    return Layout.of(
        ("x", prob.dtype, (T, H)), ("idx", _IDX, (T, K)), ("probs", prob.prob_dtype, (T, K))
    )


def _token_trail(prob: RingProblem, T: int, backward: bool) -> Layout:
    H, K = prob.hidden, prob.topk
    if backward:
        return Layout.of(("dx", prob.dtype, (T, H)), ("dprobs", prob.prob_dtype, (T, K)))
    return Layout.of(("out", prob.dtype, (T, H)))


def _plan(prob: RingProblem, lead: list[int], trail: list[int] | None) -> RingPlan:
    return RingPlan(prob.rank, prob.world_size, lead, trail, gpus_per_node=prob.gpus_per_node)


def _expert_plans(prob: RingProblem) -> tuple[RingPlan, RingPlan]:
    R = prob.world_size
    w, dw = _weights_layout(prob).nbytes, _weights_layout(prob, "d").nbytes
    return _plan(prob, [w] * R, None), _plan(prob, [w] * R, [dw] * R)


def _token_layouts(prob: RingProblem, backward: bool) -> dict:
    """A token-mode pass's ``lead_layout``/``trail_layout`` roles (partition ``p`` holds
    ``prob.tokens[p]`` tokens)."""
    Ts = prob.tokens
    return {
        "lead_layout": lambda p: _token_lead(prob, Ts[p], backward),
        "trail_layout": lambda p: _token_trail(prob, Ts[p], backward),
    }


def _token_plans(prob: RingProblem) -> tuple[RingPlan, RingPlan]:
    Ts = prob.tokens
    fwd = _plan(
        prob,
        [_token_lead(prob, t, False).nbytes for t in Ts],
        [_token_trail(prob, t, False).nbytes for t in Ts],
    )
    bwd = _plan(
        prob,
        [_token_lead(prob, t, True).nbytes for t in Ts],
        [_token_trail(prob, t, True).nbytes for t in Ts],
    )
    return fwd, bwd


def _capacity(fwd: RingPlan, bwd: RingPlan, prob: RingProblem) -> int:
    """Reserve the backward's slot size at forward when a backward follows (one allocation
    of the persistent copy-engine workspace instead of two)."""
    return max(fwd.capacity(), bwd.capacity()) if prob.needs_grad else fwd.capacity()


def _ring_pass(
    prob: RingProblem, group, overlap: bool, device, phase: str, plan: RingPlan, **roles
):
    """One ``relay`` pass of this call: the transport, device, overlap and labels every pass
    shares; ``roles``: the pass's own ``lead_layout``/``own_lead``/``trail_layout``/``compute``
    (and ``capacity``)."""
    return relay(
        plan,
        transport=_transport(prob, group),
        device=device,
        overlap=overlap,
        mode=prob.mode,
        phase=phase,
        **roles,
    )


# ---------------------------------------------------------------------------------------------
# expert mode
# ---------------------------------------------------------------------------------------------
def _pair_rows(prob: RingProblem, tokens_rank: int, experts_rank: int) -> dict[str, int]:
    """The hop primitives' pair-count keyword for one hop: the agreed count, else its bound."""
    if prob.pairs is not None:
        return {"n_pairs": prob.pairs[tokens_rank][experts_rank]}
    return {"max_pairs": prob.hop_pairs(tokens_rank, experts_rank)}


def _expert_forward(prob, group, how, overlap, x, experts, probs, index, order):
    El = prob.num_local_experts
    out = torch.zeros_like(x)
    T = x.shape[0]
    local = experts.stacked(order) if prob.world_size == 1 else None

    def compute(hop, part, lead, trail):
        if T == 0:
            return
        a, b = local[:2] if lead is None else (lead["w13"], lead["w2"])
        expert_hop_forward(
            x, a, b, probs, index,
            expert_range=(part * El, (part + 1) * El), out_TH=out, save="none",
            backend=how.backend, kernels=how.kernels, **_pair_rows(prob, prob.rank, part),
        )  # fmt: skip

    fwd, bwd = _expert_plans(prob)
    _ring_pass(
        prob, group, overlap, x.device, "fwd", fwd,
        lead_layout=lambda p: _weights_layout(prob), own_lead=lambda views: _pack(experts, views),
        trail_layout=None, compute=compute, capacity=_capacity(fwd, bwd, prob),
    )  # fmt: skip
    return out


def _expert_backward(prob, group, how, overlap, dy, x, experts, probs, index, order):
    """Returns ``(dx, dprobs, dw13, dw2)``; the weight gradients' rows are in the row order the
    compute used: expert order for ``R > 1`` (slot 0 is packed in expert order), ``order`` in a
    world of one."""
    El = prob.num_local_experts
    dx = torch.zeros_like(x)
    dprobs = torch.zeros_like(probs)
    T = x.shape[0]
    local = experts.stacked(order) if prob.world_size == 1 else None

    def compute(hop, part, lead, trail):
        if T == 0:
            return  # no pairs: this rank's share of the weight gradient is exactly zero
        a, b = local[:2] if lead is None else (lead["w13"], lead["w2"])
        expert_hop_backward(
            dy, x, a, b, probs, index,
            expert_range=(part * El, (part + 1) * El), saved_h=None,
            dx_TH=dx, dprobs_TK=dprobs, dw13=trail["dw13"], dw2=trail["dw2"],
            backend=how.backend, kernels=how.kernels, **_pair_rows(prob, prob.rank, part),
        )  # fmt: skip

    _, bwd = _expert_plans(prob)
    grads = _ring_pass(
        prob, group, overlap, x.device, "bwd", bwd,
        lead_layout=lambda p: _weights_layout(prob), own_lead=lambda views: _pack(experts, views),
        trail_layout=lambda p: _weights_layout(prob, "d"), compute=compute,
    )  # fmt: skip
    return dx, dprobs, grads["dw13"].to(prob.dtype), grads["dw2"].to(prob.dtype)


# ---------------------------------------------------------------------------------------------
# expert mode, node-batched rounds (nodebatch.py)
# ---------------------------------------------------------------------------------------------
def _node_pairs(prob: RingProblem, node: int) -> dict[str, int]:
    """The pair-count keyword of one round: this rank's tokens against node ``node``'s experts."""
    G, T = prob.gpus_per_node, prob.tokens[prob.rank]
    if prob.pairs is not None:
        return {"n_pairs": sum(prob.pairs[prob.rank][node * G : (node + 1) * G])}
    return {"max_pairs": T * min(prob.topk, G * prob.num_local_experts)}


def _node_experts(prob: RingProblem, group, lead, local, device, phase):
    """The round's ``G*El`` experts ``(w13, w2)``: this rank's visiting partition (``lead``, or
    ``local`` in a column of one) and its node peers', all-gathered over the row."""
    G, El, g = prob.gpus_per_node, prob.num_local_experts, prob.rank % prob.gpus_per_node
    mine = (lead["w13"], lead["w2"]) if lead is not None else tuple(local[:2])
    if G == 1:  # the node is this rank: its partition as it is, no copy
        return mine
    w13 = mine[0].new_empty((G * El, *mine[0].shape[1:]))
    w2 = mine[1].new_empty((G * El, *mine[1].shape[1:]))
    w13[g * El : (g + 1) * El].copy_(mine[0])
    w2[g * El : (g + 1) * El].copy_(mine[1])
    row_exchange(
        group, prob.rank, G, lambda q: list(mine),
        lambda q: [w13[q * El : (q + 1) * El], w2[q * El : (q + 1) * El]],
        mode=prob.mode, phase=phase, device=device,
    )  # fmt: skip
    return w13, w2


def _batched_pass(prob, group, overlap, device, phase, compute, experts, backward):
    """One column pass; the hop's experts are all-gathered over the row before the hop's column
    transfer is issued (``relay``'s ``prepare``) and handed to ``compute(node, w13, w2,
    trail)``."""
    G = prob.gpus_per_node
    w, dw = _weights_layout(prob), _weights_layout(prob, "d")
    plan = column_plan(prob.rank, prob.world_size, G, w.nbytes, dw.nbytes if backward else None)
    local = experts.stacked(FORWARD) if plan.world_size == 1 else None  # a column of one node
    gathered = {}

    def prepare(hop, node, lead):
        gathered["w"] = _node_experts(prob, group, lead, local, device, phase)

    def run(hop, node, lead, trail):
        w13, w2 = gathered.pop("w")
        compute(node, w13, w2, trail)

    return relay(
        plan, lead_layout=lambda p: w, own_lead=lambda views: _pack(experts, views),
        trail_layout=(lambda p: dw) if backward else None, compute=run, prepare=prepare,
        transport=ColumnTransport(group, prob.rank, G), device=device, overlap=overlap,
        mode=prob.mode, phase=phase,
    )  # fmt: skip


def _batched_expert_forward(prob, group, how, overlap, x, experts, probs, index, order):
    G, El = prob.gpus_per_node, prob.num_local_experts
    out = torch.zeros_like(x)

    def compute(node, w13, w2, trail):
        if x.shape[0] == 0:
            return
        expert_hop_forward(
            x, w13, w2, probs, index, expert_range=(node * G * El, (node + 1) * G * El),
            out_TH=out, save="none", backend=how.backend, kernels=how.kernels,
            **_node_pairs(prob, node),
        )  # fmt: skip

    _batched_pass(prob, group, overlap, x.device, "fwd", compute, experts, False)
    return out


def _batched_expert_backward(prob, group, how, overlap, dy, x, experts, probs, index, order):
    """As ``_expert_backward``; the weight gradients' rows in expert order."""
    G, El, g = prob.gpus_per_node, prob.num_local_experts, prob.rank % prob.gpus_per_node
    dx, dprobs = torch.zeros_like(x), torch.zeros_like(probs)

    def compute(node, w13, w2, trail):
        def grads(d13, d2):
            return expert_hop_backward(
                dy, x, w13, w2, probs, index, expert_range=(node * G * El, (node + 1) * G * El),
                saved_h=None, dx_TH=dx, dprobs_TK=dprobs, dw13=d13, dw2=d2, backend=how.backend,
                kernels=how.kernels, grad_dtype=prob.accum_dtype, **_node_pairs(prob, node),
            )  # fmt: skip

        if G == 1:  # no row: the gradients go straight into the trail, as in the flat ring
            if x.shape[0] > 0:
                grads(trail["dw13"], trail["dw2"])
            return
        if x.shape[0] > 0:  # written, not added: no zero fill of the G*El gradients
            _, _, d13, d2 = grads(None, None)
        else:  # the peers still wait for this rank's (zero) shares
            d13 = torch.zeros_like(w13, dtype=prob.accum_dtype)
            d2 = torch.zeros_like(w2, dtype=prob.accum_dtype)
        # reduce-scatter over the row: partition (node, q)'s share to local rank q
        mine = (d13[g * El : (g + 1) * El], d2[g * El : (g + 1) * El])
        got = {q: (torch.empty_like(mine[0]), torch.empty_like(mine[1]))
               for q in range(G) if q != g}  # fmt: skip
        row_exchange(
            group, prob.rank, G,
            lambda q: [d13[q * El : (q + 1) * El], d2[q * El : (q + 1) * El]],
            lambda q: list(got[q]), mode=prob.mode, phase="bwd", device=x.device,
        )  # fmt: skip
        for a, b in (mine, *got.values()):
            trail["dw13"].add_(a)
            trail["dw2"].add_(b)

    grads = _batched_pass(prob, group, overlap, x.device, "bwd", compute, experts, True)
    return dx, dprobs, grads["dw13"].to(prob.dtype), grads["dw2"].to(prob.dtype)


def _pack(experts: LocalExperts, views: dict[str, Tensor]) -> None:
    """The rank's own experts into slot 0, in expert order (per element in list form)."""
    for name, view in views.items():
        experts.pack(name, view)


# ---------------------------------------------------------------------------------------------
# token mode
# ---------------------------------------------------------------------------------------------
def _token_ids(ids: Tensor, prob: RingProblem, order: str) -> Tensor:
    """A visiting partition's expert ids in the row order of the local stacked experts."""
    return reverse_local_ids(ids, prob.num_local_experts) if order == REVERSED else ids


def _token_forward(prob, group, how, overlap, x, experts, probs, idx32, order):
    """Returns ``(out, indices)``: ``indices[p]`` is the routing index of partition ``p``'s
    tokens (built once, when it visits; the backward reuses it)."""
    E, Ts, own = prob.num_experts, prob.tokens, prob.expert_range
    # local experts compute every hop: their (El, ...) form for this pass only (a zero-copy view
    # when the list form is back to back, else a transient stack dropped when the pass ends)
    w13, w2, order = experts.stacked(order)
    indices: dict[int, object] = {}

    def compute(hop, part, lead, trail):
        if Ts[part] == 0:
            return
        xs, ids, ps = (x, idx32, probs) if lead is None else (lead["x"], lead["idx"], lead["probs"])
        index = build_routing_index(_token_ids(ids, prob, order), E, validate=False)
        indices[part] = index
        expert_hop_forward(
            xs, w13, w2, ps, index,
            expert_range=own, out_TH=trail["out"], save="none", backend=how.backend,
            kernels=how.kernels, **_pair_rows(prob, part, prob.rank),
        )  # fmt: skip

    fwd, bwd = _token_plans(prob)
    result = _ring_pass(
        prob, group, overlap, x.device, "fwd", fwd, own_lead={"x": x, "idx": idx32, "probs": probs},
        compute=compute, capacity=_capacity(fwd, bwd, prob), **_token_layouts(prob, False),
    )  # fmt: skip
    return result["out"], indices


def _token_backward(prob, group, how, overlap, dy, x, experts, probs, indices, order):
    """Returns ``(dx, dprobs, dw13, dw2)``, the weight gradients' rows in ``order``.
    ``indices``: the forward's routing index of every visiting partition."""
    Ts, own = prob.tokens, prob.expert_range
    w13, w2, order = experts.stacked(order)  # again for this pass only
    # the first hop with pairs writes the local weight gradients, later hops add (no zero fill);
    # accumulators wider than the weights start as zeros that every hop adds to
    dw: dict[str, Tensor | None] = {"dw13": None, "dw2": None}
    if prob.accum_dtype != prob.dtype:
        dw = {"dw13": torch.zeros_like(w13, dtype=prob.accum_dtype),
              "dw2": torch.zeros_like(w2, dtype=prob.accum_dtype)}  # fmt: skip

    def compute(hop, part, lead, trail):
        if Ts[part] == 0:
            return
        if lead is None:
            xs, ps, dys = x, probs, dy
        else:
            xs, ps, dys = lead["x"], lead["probs"], lead["dy"]
        _, _, dw["dw13"], dw["dw2"] = expert_hop_backward(
            dys, xs, w13, w2, ps, indices[part],
            expert_range=own, saved_h=None, dx_TH=trail["dx"], dprobs_TK=trail["dprobs"],
            dw13=dw["dw13"], dw2=dw["dw2"], backend=how.backend, kernels=how.kernels,
            **_pair_rows(prob, part, prob.rank),
        )  # fmt: skip

    _, bwd = _token_plans(prob)
    result = _ring_pass(
        prob, group, overlap, x.device, "bwd", bwd, own_lead={"x": x, "probs": probs, "dy": dy},
        compute=compute, **_token_layouts(prob, True),
    )  # fmt: skip
    dw13 = dw["dw13"].to(prob.dtype) if dw["dw13"] is not None else torch.zeros_like(w13)
    dw2 = dw["dw2"].to(prob.dtype) if dw["dw2"] is not None else torch.zeros_like(w2)
    return result["dx"], result["dprobs"], dw13, dw2


# ---------------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------------
class _RingMoE(torch.autograd.Function):
    """Inputs ``(x, probs, topk_idx, prob, group, how, overlap, listed, *ws)`` (``how``: the hop
    primitives' backend and kernel options, a :class:`Hop`) with ``ws``
    ``(w13, w2)`` (tensor form) or ``(*w13_list, *w2_list)`` (list form). Saves x, probs, the
    int32 ids and ``ws`` themselves (list form: the caller's tensors, no copy)."""

    @staticmethod
    def forward(ctx, x, probs, topk_idx, prob, group, how, overlap, listed, *ws):
        x, probs = x.contiguous(), probs.contiguous()
        if not listed:
            ws = tuple(w.contiguous() for w in ws)
        experts = LocalExperts.from_inputs(listed, ws)
        idx32 = topk_idx.to(_IDX).contiguous()
        ctx.prob, ctx.group, ctx.how, ctx.overlap = prob, group, how, overlap
        ctx.listed = listed
        # the row order of the local experts' stacked form where a pass uses it (token mode, a
        # world of one); expert mode with R > 1 packs slot 0 in expert order and needs none
        order = experts.preferred_order()
        ctx.order = order
        if prob.mode == "expert":
            ids = idx32
            if prob.world_size == 1 and order == REVERSED:
                ids = reverse_local_ids(idx32, prob.num_local_experts)
            index = build_routing_index(ids, prob.num_experts, validate=False)
            fwd = _batched_expert_forward if prob.schedule == NODE_BATCHED else _expert_forward
            out = fwd(prob, group, how, overlap, x, experts, probs, index, order)
            ctx.index = index
        elif prob.mode == "token":
            out, ctx.index = _token_forward(
                prob, group, how, overlap, x, experts, probs, idx32, order
            )
        else:
            out, ctx.index = alltoall_forward(prob, group, how, x, experts, probs, idx32, order)
        ctx.save_for_backward(x, probs, idx32, *ws)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, probs, idx32, *ws = ctx.saved_tensors
        prob, order = ctx.prob, ctx.order
        experts = LocalExperts.from_inputs(ctx.listed, ws)
        dy = dy.to(prob.dtype).contiguous()
        args = (prob, ctx.group, ctx.how, ctx.overlap, dy, x, experts, probs)
        if prob.mode == "expert":
            bwd = _batched_expert_backward if prob.schedule == NODE_BATCHED else _expert_backward
            dx, dprobs, dw13, dw2 = bwd(*args, ctx.index, order)
            rows = order if prob.world_size == 1 else FORWARD
        elif prob.mode == "token":
            dx, dprobs, dw13, dw2 = _token_backward(*args, ctx.index, order)
            rows = order
        else:
            dx, dprobs, dw13, dw2 = alltoall_backward(
                prob, ctx.group, ctx.how, dy, x, experts, probs, ctx.index, order
            )
            rows = order
        need = ctx.needs_input_grad
        wgrads = experts.split(dw13, dw2, rows)  # views of the returned gradient, no copy
        wgrads = tuple(g if need[8 + j] else None for j, g in enumerate(wgrads))
        return (
            dx if need[0] else None,
            dprobs if need[1] else None,
            None,
            None,
            None,
            None,
            None,
            None,
            *wgrads,
        )


def ring_moe(
    x: Tensor,
    w13: Tensor | Sequence[Tensor],
    w2: Tensor | Sequence[Tensor],
    topk_idx: Tensor,
    topk_probs: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    mode: str = "auto",
    transport: str = "auto",
    overlap: bool = True,
    backend: str = "auto",
    trusted: bool = False,
    schedule: str = "auto",
    gpus_per_node: int | None = None,
    grad_accum: str = "auto",
    kernels: KernelOptions | None = None,
) -> Tensor:
    """MoE experts over the expert-parallel ``group`` by ring execution (RelayMoE §3.1-3.3).

    ``x (T, H)`` this rank's tokens; ``w13 (E_local, 2I, H)`` / ``w2 (E_local, H, I)`` this rank's
    experts, global experts ``[rank*E_local, (rank+1)*E_local)``; ``topk_idx (T, K)`` global
    expert ids, ``topk_probs (T, K)``. Returns ``(T, H)`` equal to the oracle over all experts,
    differentiable in x, w13, w2, topk_probs. Ranks may hold different T (including 0).

    ``w13``/``w2`` may instead be lists (or tuples) of ``E_local`` per-expert tensors ``(2I, H)``
    / ``(H, I)`` (e.g. a Megatron experts module's parameters), each differentiable on its own.
    Then no stacked copy of the experts is kept from forward to backward: the ring saves the
    elements themselves, packs them into its send slot per pass (expert mode) or uses a
    zero-copy view (elements back to back in one storage, in list order or in reverse list
    order) or a stack that lives for one pass only (token mode). See ``weights.py``.

    ``group``: the EP group (default: the default group; without an initialized process group
    a world of one). ``mode``: ``"expert"``, ``"token"``, ``"alltoall"`` or ``"auto"`` (the
    fastest by :func:`relaymoe.cost.choose_mode`, identical on every rank).
    ``transport``: ``"nccl"`` (``batch_isend_irecv``; gloo on CPU; the all-to-all mode always
    uses the group's collectives), ``"copy_engine"`` (symmetric-memory pulls, CUDA within
    a node) or ``"auto"`` (copy engine when every rank is a CUDA device of one node with
    symmetric memory, else nccl). ``overlap=False`` serialises transfer and compute (ablation).
    ``backend``: the hop primitives' backend (``"auto"``, ``"triton"``, ``"torch"``);
    ``kernels``: how their kernels run (``relaymoe.options.KernelOptions``; default: this
    process's). The host wait, the timeout and how often the ranks agree are this process's
    ``relaymoe.options.RingOptions`` (``relaymoe.options.defaults()``).
    ``schedule``: the hop order (``schedule.py``): ``"flat"`` (one ring), ``"two_level"`` (rings
    inside each node of ``gpus_per_node`` consecutive ranks, joined by hops that every GPU of a
    node makes to the same local rank of the next node at once) or ``"auto"`` (two-level when the
    group spans several nodes of several GPUs); or ``"node_batched"`` (expert mode, asked for by
    name: one hop per node over the node's experts, all-gathered inside it; ``nodebatch.py``).
    ``gpus_per_node``: None to read the nodes from the ranks' hosts (exchanged in the agreement),
    else the GPUs per node of the group.
    ``grad_accum``: the dtype of the ring's weight-gradient accumulators: ``"param"`` (the
    weights'), ``"fp32"``, or ``"auto"`` (fp32 from ``options.FP32_GRAD_ACCUM_MIN_EP`` ranks,
    where the per-hop rounding of 16-bit accumulators would take the weight-gradient error past
    twice an all-to-all's; in expert mode the travelling gradients then cost 2x the bytes).

    Every rank of the group must call it (and its backward) with the same mode/transport; bad
    input raises ``ValueError`` on every rank before any P2P. Ranks may mix the two weight forms.
    A peer that dies or stalls raises :class:`relaymoe.ring.faults.RingPeerError` (naming the
    call, the group, the peer and the timeout) on the surviving ranks within the group's timeout;
    no data is returned from a failed transfer (``faults.py``).

    ``trusted=True`` (Megatron's dispatcher): ``topk_idx`` comes from a router and is not
    validated, and every rank changes its input signature (shapes, dtypes, mode, transport,
    whether a backward follows, the collective-deciding options ``agree`` and
    ``pair_buffer_mib``) in the same call; the ranks' agreement is then reused per
    signature, so a call in steady state has no host synchronisation (``agree.py``).

    Dtypes: x, w13 and w2 share one of float16, bfloat16, float32, float64 (float64 runs on the
    torch hops: ``backend="triton"`` refuses it, ``"auto"`` keeps it); topk_probs any of those;
    topk_idx any integer dtype. The output has x's dtype, the gradients their inputs' dtypes.
    Layouts: any strides for every tensor (and list element) and for the upstream gradient;
    x, topk_probs, tensor-form weights and dy are made contiguous once per call (a no-op for
    contiguous ones), topk_idx is converted to contiguous int32 (T*K elements).

    Validated on every rank before any P2P, the same ``ValueError`` raised on every rank
    (``agree.py``): types, shapes, dtypes and devices of every input on every rank, and their
    agreement across ranks (E_local, H, I, K, dtypes, device type, mode, transport, schedule,
    gpus_per_node, grad_accum, whether a backward follows, the settings above); that the hop
    backend can run the inputs; the int32 limits; the expert ids (in ``[0, E)``, distinct per
    row: one host sync). ``trusted=True`` skips the id check and, for a signature already
    agreed, the whole agreement: inputs that change without the signature changing are not
    checked again.
    """
    group, rank, world = _resolve_group(group)
    listed = isinstance(w13, (list, tuple)) and isinstance(w2, (list, tuple))
    ws = (*w13, *w2) if listed else (w13, w2)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in (x, topk_probs, *ws)
    )
    req = RingRequest(mode, transport, schedule, gpus_per_node, needs_grad, grad_accum, backend)
    with torch.profiler.record_function("relaymoe.agree"):
        prob = agree(
            x, w13, w2, topk_idx, topk_probs, group=group, rank=rank, world=world, request=req,
            trusted=trusted,
        )  # fmt: skip
    how = Hop(backend, kernel_options(kernels))
    return _RingMoE.apply(x, topk_probs, topk_idx, prob, group, how, overlap, listed, *ws)


def resolved_problem(*args, **kwargs) -> RingProblem:
    """The agreed :class:`RingProblem` (mode, transport, sizes) ``ring_moe`` would run."""
    group, rank, world = _resolve_group(kwargs.pop("group", None))
    trusted = kwargs.pop("trusted", False)
    # mode, transport, schedule, gpus_per_node, needs_grad, grad_accum, backend
    req = RingRequest(**kwargs)
    return agree(*args, group=group, rank=rank, world=world, request=req, trusted=trusted)
