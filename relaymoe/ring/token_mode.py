"""Token mode: the tokens travel with their routing metadata, the experts stay; a forward and a
backward pass of the ring.

The experts' biases stay with them and their gradients accumulate here, beside the weights'
(in ``prob.accum_dtype``). A hop's compute is a body over named tensors (``run_hop``), called on
the live ones or replayed from ``hop_graphs.py``'s cache with ``RingConfig.capture_hops``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relaymoe.experts import expert_hop_backward, expert_hop_forward
from relaymoe.ring.executor import ring_pass
from relaymoe.ring.hop_graphs import (
    INDEX_FIELDS,
    PackedIndex,
    hop_graphs_of,
    hop_head,
    hop_key,
    index_from,
    index_inputs,
    index_layout,
    index_sizes,
    packed_index,
    run_hop,
)
from relaymoe.ring.plan import RingProblem, capacity, pair_rows, token_layouts, token_plans
from relaymoe.ring.weights import (
    REVERSED,
    bias_grads,
    home_grads,
    local_parts,
    mlp,
    present,
    reverse_local_ids,
)
from relaymoe.routing import build_routing_index

# What a recorded hop binds by address besides the weights (hop_graphs.run_hop): the visiting
# partition and the trail, views of the ring's slots and trail scratch (a world of one: the
# caller's own tensors, copied)
FWD_TRAVELLING = ("x", "idx", "probs", "out")
BWD_TRAVELLING = ("x", "probs", "dy", "dx", "dprobs")


def _arrays(index) -> tuple[Tensor, ...]:
    return tuple(getattr(index, f) for f in INDEX_FIELDS)


def token_ids(ids: Tensor, prob: RingProblem, order: str) -> Tensor:
    """A visiting partition's expert ids in the row order of the local stacked experts."""
    return reverse_local_ids(ids, prob.num_local_experts) if order == REVERSED else ids


def token_forward(prob, call, x, experts, probs, idx32, order):
    """Returns ``(out, indices)``: ``indices[p]`` is the routing index of partition ``p``'s
    tokens (built once, when it visits; the backward reuses it), a ``PackedIndex`` where the
    hops are recorded."""
    how = call.hop
    E, Ts, own = prob.num_experts, prob.tokens, prob.expert_range
    # local experts compute every hop: their (El, ...) form for this pass only (a zero-copy view
    # when the list form is back to back, else a transient stack dropped when the pass ends)
    local = local_parts(experts, order)
    indices: dict[int, object] = {}
    graphs = hop_graphs_of(prob, call, x.device)
    weights = present(local)
    head = graphs and hop_head(prob, call, "fwd")

    def compute(hop, part, lead, trail):
        if Ts[part] == 0:
            return
        xs, ids, ps = (x, idx32, probs) if lead is None else (lead["x"], lead["idx"], lead["probs"])
        rows = pair_rows(prob, part, prob.rank)
        sizes = (Ts[part], prob.topk, E)
        lay = index_layout(sizes)

        def body(t):  # the index is built in the hop: it is among what the body returns
            if graphs is not None:  # the trail share, zeroed in the graph (zero_trail=False)
                t["out"].zero_()
            ids = token_ids(t["idx"], prob, order)
            if graphs is None:
                index = build_routing_index(ids, E, validate=False)
            else:  # recorded: built into one buffer, returned (and cloned) as one tensor
                buf = torch.empty(lay.nbytes, dtype=torch.uint8, device=ids.device)
                index = packed_index(buf, sizes)
                build_routing_index(ids, E, validate=False, out=_arrays(index))
            expert_hop_forward(
                t["x"], t["w13"], t["w2"], t["probs"], index,
                expert_range=own, out_TH=t["out"], save="none", backend=how.backend,
                kernels=how.kernels, **rows, **mlp(prob, t),
            )  # fmt: skip
            return index_inputs(index)

        key = graphs and hop_key(head, own, rows) + (order,)  # only a cache reads it
        made = run_hop(graphs, key, body, {"x": xs, "idx": ids, "probs": ps, **weights},
                       {"out": trail["out"]}, () if lead is None else FWD_TRAVELLING)  # fmt: skip
        packed = made.get("index.packed")  # recorded: the arrays' views only where read
        indices[part] = index_from(made, sizes) if packed is None else PackedIndex(packed, sizes)

    fwd, bwd = token_plans(prob)
    result = ring_pass(
        prob, call, x.device, "fwd", fwd, own_lead={"x": x, "idx": idx32, "probs": probs},
        compute=compute, capacity=capacity(fwd, bwd, prob), zero_trail=graphs is None,
        **token_layouts(prob, False),
    )  # fmt: skip
    return result["out"], indices


def token_backward(prob, call, dy, x, experts, probs, indices, order):
    """Returns ``(dx, dprobs, grads)``, ``grads`` this rank's experts' gradients by part name
    (rows in ``order``). ``indices``: the forward's routing index of every visiting partition."""
    how = call.hop
    Ts, own = prob.tokens, prob.expert_range
    local = local_parts(experts, order)  # again for this pass only
    w13, w2 = local["w13"], local["w2"]
    graphs = hop_graphs_of(prob, call, x.device)
    # Eager, the first hop with pairs writes the local weight gradients and later hops add (no
    # zero fill). Accumulators wider than the weights start as zeros that every hop adds to.
    # Recorded hops get their accumulators bound (added into at their address: nothing of their
    # size is returned from the graphs' pool and cloned), and the first hop with pairs writes
    # over them (dw_accumulate=False) as the eager one writes fresh ones: no zero fill, and the
    # same sums bitwise. The bias gradients are added into (the hop primitives' contract):
    # zeros from the start.
    dw: dict[str, Tensor | None] = {"dw13": None, "dw2": None}
    wide = prob.accum_dtype != prob.dtype
    if wide or graphs is not None:
        new = torch.zeros_like if wide else torch.empty_like
        dw = {"dw13": new(w13, dtype=prob.accum_dtype), "dw2": new(w2, dtype=prob.accum_dtype)}
    written = [wide]  # whether dw holds a sum yet (zeros count as one)
    for name in ("b13", "b2"):
        if local[name] is not None:
            dw["d" + name] = torch.zeros_like(local[name], dtype=prob.accum_dtype)

    weights = present(local)
    head = graphs and hop_head(prob, call, "bwd")

    def compute(hop, part, lead, trail):
        if Ts[part] == 0:
            return
        if lead is None:
            xs, ps, dys = x, probs, dy
        else:
            xs, ps, dys = lead["x"], lead["probs"], lead["dy"]
        rows, first = pair_rows(prob, part, prob.rank), dw["dw13"] is None
        over = not written[0]  # this hop's weight gradients write over the accumulators
        written[0] = True
        sizes = index_sizes(indices[part])

        def body(t):  # eager, the first hop's weight gradients are written, not added: returned
            if graphs is not None:  # the trail share, zeroed in the graph (zero_trail=False)
                t["dx"].zero_()
                t["dprobs"].zero_()
            _, _, dw13, dw2 = expert_hop_backward(
                t["dy"], t["x"], t["w13"], t["w2"], t["probs"], index_from(t, sizes),
                expert_range=own, saved_h=None, dx_TH=t["dx"], dprobs_TK=t["dprobs"],
                dw13=t.get("dw13"), dw2=t.get("dw2"), backend=how.backend, kernels=how.kernels,
                dw_accumulate=not over, **rows, **mlp(prob, t), **bias_grads(t),
            )  # fmt: skip
            return {"dw13": dw13, "dw2": dw2} if first else None

        key = graphs and hop_key(head, own, rows) + (over,)
        inputs = {"dy": dys, "x": xs, "probs": ps, **index_inputs(indices[part]), **weights}
        made = run_hop(graphs, key, body, inputs, {**trail, **present(dw)},
                       () if lead is None else BWD_TRAVELLING)  # fmt: skip
        dw.update(made)

    _, bwd = token_plans(prob)
    result = ring_pass(
        prob, call, x.device, "bwd", bwd, own_lead={"x": x, "probs": probs, "dy": dy},
        compute=compute, zero_trail=graphs is None, **token_layouts(prob, True),
    )  # fmt: skip
    if dw["dw13"] is None:  # no hop had pairs
        dw["dw13"], dw["dw2"] = torch.zeros_like(w13), torch.zeros_like(w2)
    elif not written[0]:  # recorded hops' accumulators, and no hop had pairs to write them
        dw["dw13"].zero_()
        dw["dw2"].zero_()
    return result["dx"], result["dprobs"], home_grads(prob, dw)
