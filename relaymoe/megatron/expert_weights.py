"""A Megatron experts module's own parameters as the ring's per-expert weight and bias lists.

The ring computes with the ``MoELayer``'s parameters themselves, so DDP, the distributed
optimizer, gradient clipping and ``main_grad`` see ordinary parameters and checkpoints keep
Megatron's keys (a checkpoint moves between the ring and Megatron's dispatchers unchanged).
Supported experts (expert tensor parallel size 1, so every weight is whole; J is fc1's rows,
2I for a gated unit, I otherwise):

* ``SequentialMLP`` (local spec, or TransformerEngine without ``--moe-grouped-gemm``):
  ``local_experts[j].linear_fc1.weight`` ``(J, H)`` and ``local_experts[j].linear_fc2.weight``
  ``(H, I)``; with ``--add-bias-linear`` (Megatron's default) ``linear_fc1.bias`` ``(J,)`` and
  ``linear_fc2.bias`` ``(H,)`` (None without);
* ``TEGroupedMLP``: ``linear_fc1.weight{j}`` ``(J, H)`` and ``linear_fc2.weight{j}`` ``(H, I)``;
  with biases TransformerEngine's ``GroupedLinear`` registers ``bias{j}`` parameters, without
  them it sets ``bias{j}`` to an empty plain tensor (no parameter), which reads as no bias.

A gated fc1's rows ``[0, I)`` are the gate branch and ``[I, 2I)`` the linear branch in both
(Megatron's ``chunk(2)``), which is the ring's ``w13`` layout; a non-gated fc1 is ``(I, H)``.
The biases match the ring's semantics: fc1's bias inside fc1, fc2's added scaled by the router
probability (TEGroupedMLP's ``_apply_bias``, SequentialMLP's ``output_bias * per_token_scale``),
both inside the experts' output, so ``MoELayer`` gets no separate bias to add again.

The dispatcher passes the two weight lists (and the bias lists, when there are biases) to
``ring_moe`` as they are (its list form): each parameter is an autograd input of the ring,
which saves the parameters themselves for backward and returns each one its own gradient, so
no stacked copy of the layer's experts exists between forward and backward, whatever the
memory layout. Where a ring pass needs the ``(El, ...)`` form (token mode, a world of one) it
views the parameters in place when they lie back to back in one storage in expert order or in
reverse expert order (Megatron's DDP buffer holds parameters in reverse registration order,
which is reverse expert order for TEGroupedMLP), and otherwise stacks them for that pass only.
Why lists rather than a view: a tensor viewed out of DDP's buffer (or of ``param.data``) has no
autograd link to the parameters, so it needs a wrapper ``autograd.Function`` to route gradients
back, and the ring then saves the wrapper's output for backward, a full copy whenever the
layout forces a stack (e.g. SequentialMLP under DDP, whose buffer interleaves fc1 and fc2).
With the parameters as the ring's inputs the zero-copy view is an internal detail of a pass.

``make_expert_weights_contiguous`` re-homes the weight parameters into one buffer per
projection at build time so that the in-place view applies before DDP (if any) moves them into
its buffer; ``expert_weights_layout`` tells which layout a module has now. Biases stay where
Megatron allocated them (El x J values: nothing worth viewing in place).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relaymoe.ring.weights import layout_order

__all__ = [
    "expert_bias_lists",
    "expert_param_lists",
    "expert_weights_layout",
    "make_expert_weights_contiguous",
]


def expert_param_lists(experts) -> tuple[list[Tensor], list[Tensor]]:
    """The per-expert fc1 ``(J, H)`` and fc2 ``(H, I)`` parameters of an experts module."""
    local = getattr(experts, "local_experts", None)
    if local is not None:  # SequentialMLP
        return [e.linear_fc1.weight for e in local], [e.linear_fc2.weight for e in local]
    lin1, lin2, n = _grouped(experts)
    return [getattr(lin1, f"weight{j}") for j in range(n)], [
        getattr(lin2, f"weight{j}") for j in range(n)
    ]


def expert_bias_lists(experts) -> tuple[list[Tensor] | None, list[Tensor] | None]:
    """The per-expert fc1 ``(J,)`` and fc2 ``(H,)`` bias parameters of an experts module, each
    None where that projection has no bias (``--disable-bias-linear``)."""
    local = getattr(experts, "local_experts", None)
    if local is not None:  # SequentialMLP
        b13 = [getattr(e.linear_fc1, "bias", None) for e in local]
        b2 = [getattr(e.linear_fc2, "bias", None) for e in local]
    else:
        lin1, lin2, n = _grouped(experts)
        b13 = [getattr(lin1, f"bias{j}", None) for j in range(n)]
        b2 = [getattr(lin2, f"bias{j}", None) for j in range(n)]
    return _biases(b13, "fc1"), _biases(b2, "fc2")


def _biases(bs: list, name: str) -> list[Tensor] | None:
    """Every expert's bias parameter, or None when none has one (TransformerEngine's empty
    placeholder is empty); some experts with and some without cannot be computed."""
    have = [isinstance(b, Tensor) and b.numel() > 0 for b in bs]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(
            f"{sum(have)} of {len(bs)} experts have a {name} bias: the ring computes every "
            f"expert with a bias or none with one; fix: build the experts from one config "
            f"(--add-bias-linear or --disable-bias-linear)"
        )
    return bs


def _grouped(experts):
    """``(linear_fc1, linear_fc2, num_local_experts)`` of a TEGroupedMLP (one TE GroupedLinear
    parameter per gemm), else ``NotImplementedError`` naming what is supported."""
    lin1 = getattr(experts, "linear_fc1", None)
    lin2 = getattr(experts, "linear_fc2", None)
    n = getattr(experts, "num_local_experts", None)
    if lin1 is not None and lin2 is not None and n is not None:
        if all(hasattr(lin1, f"weight{j}") for j in range(n)) and all(
            hasattr(lin2, f"weight{j}") for j in range(n)
        ):
            return lin1, lin2, n
    raise NotImplementedError(
        f"the ring dispatcher does not know how to read the weights of {type(experts).__name__}; "
        f"supported: SequentialMLP (local spec) and TEGroupedMLP with one weight per expert "
        f"(no --moe-single-grouped-weight)"
    )


def expert_weights_layout(experts) -> tuple[str | None, str | None]:
    """``(fc1 order, fc2 order)``: ``"forward"``/``"reversed"`` where the per-expert parameters
    lie back to back in one storage in expert order / reverse expert order (the ring views them
    in place), None where a ring pass that needs the stacked form stacks them for that pass."""
    fc1, fc2 = expert_param_lists(experts)
    return layout_order(fc1), layout_order(fc2)


@torch.no_grad()
def make_expert_weights_contiguous(experts) -> None:
    """Re-home the per-expert parameters into one ``(El, ...)`` buffer per projection.

    Values, parameter objects, names and attributes are unchanged; only ``.data`` now views a
    shared buffer (the old storages are freed), so that ring passes needing the stacked form
    view the parameters in place. Projections already back to back (either order) are left."""
    for ws in expert_param_lists(experts):
        if layout_order(ws) is not None:
            continue
        buf = torch.stack([w.data for w in ws])
        for j, w in enumerate(ws):
            w.data = buf[j]
