"""Expert mode: the weights travel, the tokens stay; a forward and a backward pass of the ring.

The experts' biases travel in their weights' partition (``passes.weights_layout``) and their
gradients trail home with the weight gradients, in the same accumulators' dtype. A hop's compute
is a body over named tensors (``run_hop``): called on the live ones, or replayed from
``hop_graphs.py``'s cache with ``RingConfig.capture_hops``.
"""

from __future__ import annotations

import torch

from relaymoe.experts import expert_hop_backward, expert_hop_forward
from relaymoe.ring.executor import ring_pass
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
from relaymoe.ring.plan import capacity, expert_plans, pair_rows, weights_layout
from relaymoe.ring.weights import (
    bias_grads,
    home_grads,
    local_parts,
    mlp,
    pack_own,
    present,
)


def range_offsets(index, El: int) -> tuple:
    """Every expert range's ``El+1`` pair offsets (``index.offsets_for(p*El, (p+1)*El)`` for
    each partition ``p``) as views made in one call a pass, not one a hop: what a recorded hop
    copies in when one body serves every range (``hop_index.range_window``)."""
    return index.expert_token_offsets.unfold(0, El + 1, El).unbind(0)


def expert_forward(prob, call, x, experts, probs, index, order):
    how = call.hop
    El = prob.num_local_experts
    out = torch.zeros_like(x)
    T = x.shape[0]
    local = local_parts(experts, order) if prob.world_size == 1 else None

    graphs = hop_graphs_of(prob, call, x.device)
    own, sizes = {"x": x, "probs": probs, **index_inputs(index)}, index_sizes(index)
    # Recorded hops share one graph for every expert range (range_window): a GPU given many
    # distinct graphs back to back idles between them, one graph per range would be R of them
    any_range = graphs is not None and window_fits(prob)
    head = graphs and hop_head(prob, call, "fwd")
    offsets = range_offsets(index, El) if any_range else None

    def compute(hop, part, lead, trail):
        if T == 0:
            return
        w = local if lead is None else lead
        rng, rows = (part * El, (part + 1) * El), pair_rows(prob, prob.rank, part)
        inputs = {**own, **present(w)}
        if any_range:  # the range's pair offsets reach the graph as an input, copied each hop
            inputs["range_offsets"] = offsets[part]

        def body(t):
            full = index_from(t, sizes)
            hop_index, hop_range = range_window(full, t["range_offsets"]) if any_range else (
                full, rng)  # fmt: skip
            expert_hop_forward(
                t["x"], t["w13"], t["w2"], t["probs"], hop_index,
                expert_range=hop_range, out_TH=t["out"], save="none", backend=how.backend,
                kernels=how.kernels, **rows, **mlp(prob, t),
            )  # fmt: skip

        # only a cache reads the key; shared by every range when the window serves them
        key = graphs and hop_key(head, (0, El) if any_range else rng, rows) + (any_range,)
        run_hop(graphs, key, body, inputs, {"out": out})

    fwd, bwd = expert_plans(prob)
    w = weights_layout(prob)  # every partition's, built once: the executor's views recur
    with stage_pass(graphs, own, {"out": out}):  # recorded hops: copied once a pass, not a hop
        ring_pass(
            prob, call, x.device, "fwd", fwd,
            lead_layout=lambda p: w, own_lead=lambda views: pack_own(experts, views),
            trail_layout=None, compute=compute, capacity=capacity(fwd, bwd, prob),
        )  # fmt: skip
    return out


def expert_backward(prob, call, dy, x, experts, probs, index, order):
    """Returns ``(dx, dprobs, grads)``, ``grads`` this rank's experts' gradients by part name
    (``w13``, ``w2``, and the biases'); their rows are in the row order the compute used:
    expert order for ``R > 1`` (slot 0 is packed in expert order), ``order`` in a world of
    one."""
    how = call.hop
    El = prob.num_local_experts
    dx = torch.zeros_like(x)
    dprobs = torch.zeros_like(probs)
    T = x.shape[0]
    local = local_parts(experts, order) if prob.world_size == 1 else None

    graphs = hop_graphs_of(prob, call, x.device)
    own, sizes = {"dy": dy, "x": x, "probs": probs, **index_inputs(index)}, index_sizes(index)
    any_range = graphs is not None and window_fits(prob)  # one body for every range, as forward
    head = graphs and hop_head(prob, call, "bwd")
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
        rng, rows = (part * El, (part + 1) * El), pair_rows(prob, prob.rank, part)
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
            expert_hop_backward(
                t["dy"], t["x"], t["w13"], t["w2"], t["probs"], hop_index,
                expert_range=hop_range, saved_h=None, dx_TH=t["dx"], dprobs_TK=t["dprobs"],
                dw13=t["dw13"], dw2=t["dw2"], backend=how.backend, kernels=how.kernels,
                dw_accumulate=False, **rows, **mlp(prob, t), **bias_grads(t),
            )  # fmt: skip

        key = graphs and hop_key(head, (0, El) if any_range else rng, rows) + (any_range,)
        run_hop(graphs, key, body, inputs, {"dx": dx, "dprobs": dprobs, **trail})

    _, bwd = expert_plans(prob)
    w, dw = weights_layout(prob), weights_layout(prob, "d")  # built once, as forward
    with stage_pass(graphs, own, {"dx": dx, "dprobs": dprobs}):
        grads = ring_pass(
            prob, call, x.device, "bwd", bwd,
            lead_layout=lambda p: w, own_lead=lambda views: pack_own(experts, views),
            trail_layout=lambda p: dw, compute=compute, zero_trail=False,
        )  # fmt: skip
    return dx, dprobs, home_grads(prob, grads)
