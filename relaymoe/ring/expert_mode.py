"""Expert mode: the weights travel, the tokens stay; a forward and a backward pass of the ring.

The experts' biases travel in their weights' partition (``passes.weights_layout``) and their
gradients trail home with the weight gradients, in the same accumulators' dtype.
"""

from __future__ import annotations

import torch

from relaymoe.experts import expert_hop_backward, expert_hop_forward
from relaymoe.ring.passes import (
    bias_grads,
    capacity,
    expert_plans,
    home_grads,
    local_parts,
    mlp,
    pack_own,
    pair_rows,
    ring_pass,
    weights_layout,
)


def expert_forward(prob, group, how, overlap, x, experts, probs, index, order):
    El = prob.num_local_experts
    out = torch.zeros_like(x)
    T = x.shape[0]
    local = local_parts(experts, order) if prob.world_size == 1 else None

    def compute(hop, part, lead, trail):
        if T == 0:
            return
        w = local if lead is None else lead
        expert_hop_forward(
            x, w["w13"], w["w2"], probs, index,
            expert_range=(part * El, (part + 1) * El), out_TH=out, save="none",
            backend=how.backend, kernels=how.kernels, **pair_rows(prob, prob.rank, part),
            **mlp(prob, w),
        )  # fmt: skip

    fwd, bwd = expert_plans(prob)
    w = weights_layout(prob)  # every partition's, built once: the executor's views recur
    ring_pass(
        prob, group, overlap, x.device, "fwd", fwd,
        lead_layout=lambda p: w, own_lead=lambda views: pack_own(experts, views),
        trail_layout=None, compute=compute, capacity=capacity(fwd, bwd, prob),
    )  # fmt: skip
    return out


def expert_backward(prob, group, how, overlap, dy, x, experts, probs, index, order):
    """Returns ``(dx, dprobs, grads)``, ``grads`` this rank's experts' gradients by part name
    (``w13``, ``w2``, and the biases'); their rows are in the row order the compute used:
    expert order for ``R > 1`` (slot 0 is packed in expert order), ``order`` in a world of
    one."""
    El = prob.num_local_experts
    dx = torch.zeros_like(x)
    dprobs = torch.zeros_like(probs)
    T = x.shape[0]
    local = local_parts(experts, order) if prob.world_size == 1 else None

    def compute(hop, part, lead, trail):
        if T == 0:
            return  # no pairs: this rank's share of the weight gradient is exactly zero
        w = local if lead is None else lead
        expert_hop_backward(
            dy, x, w["w13"], w["w2"], probs, index,
            expert_range=(part * El, (part + 1) * El), saved_h=None,
            dx_TH=dx, dprobs_TK=dprobs, dw13=trail["dw13"], dw2=trail["dw2"],
            backend=how.backend, kernels=how.kernels, **pair_rows(prob, prob.rank, part),
            **mlp(prob, w), **bias_grads(trail),
        )  # fmt: skip

    _, bwd = expert_plans(prob)
    w, dw = weights_layout(prob), weights_layout(prob, "d")  # built once, as forward
    grads = ring_pass(
        prob, group, overlap, x.device, "bwd", bwd,
        lead_layout=lambda p: w, own_lead=lambda views: pack_own(experts, views),
        trail_layout=lambda p: dw, compute=compute,
    )  # fmt: skip
    return dx, dprobs, home_grads(prob, grads)
