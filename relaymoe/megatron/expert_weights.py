"""A Megatron experts module's own parameters as the ring's per-expert weight lists.

The ring computes with the ``MoELayer``'s parameters themselves, so DDP, the distributed
optimizer, gradient clipping and ``main_grad`` see ordinary parameters and checkpoints keep
Megatron's keys. Supported experts (expert tensor parallel size 1, so every weight is whole):

* ``SequentialMLP`` (local spec, no TransformerEngine): ``local_experts[j].linear_fc1.weight``
  ``(2I, H)`` and ``local_experts[j].linear_fc2.weight`` ``(H, I)``;
* ``TEGroupedMLP``: ``linear_fc1.weight{j}`` ``(2I, H)`` and ``linear_fc2.weight{j}`` ``(H, I)``.

fc1 rows ``[0, I)`` are the gate branch and ``[I, 2I)`` the up branch in both (Megatron's
``chunk(2)``), which is the ring's ``w13`` layout.

The dispatcher passes the two parameter lists to ``ring_moe`` as they are (its list form):
each parameter is an autograd input of the ring, which saves the parameters themselves for
backward and returns each one its own gradient, so no stacked copy of the layer's experts
exists between forward and backward, whatever the memory layout. Where a ring pass needs the
``(El, ...)`` form (token mode, a world of one) it views the parameters in place when they lie
back to back in one storage in expert order or in reverse expert order (Megatron's DDP buffer
holds parameters in reverse registration order, which is reverse expert order for
TEGroupedMLP), and otherwise stacks them for that pass only. Why lists rather than a view:
a tensor viewed out of DDP's buffer (or of ``param.data``) has no autograd link to the
parameters, so it needs a wrapper ``autograd.Function`` to route gradients back, and the ring
then saves the wrapper's output for backward, a full copy whenever the layout forces a stack
(e.g. SequentialMLP under DDP, whose buffer interleaves fc1 and fc2). With the parameters as
the ring's inputs the zero-copy view is an internal detail of a pass.

``make_expert_weights_contiguous`` re-homes the parameters into one buffer per projection at
build time so that the in-place view applies before DDP (if any) moves them into its buffer;
``expert_weights_layout`` tells which layout a module has now.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relaymoe.ring.weights import layout_order

__all__ = [
    "expert_param_lists",
    "expert_weights_layout",
    "make_expert_weights_contiguous",
]


def expert_param_lists(experts) -> tuple[list[Tensor], list[Tensor]]:
    """The per-expert fc1 ``(2I, H)`` and fc2 ``(H, I)`` parameters of an experts module."""
    local = getattr(experts, "local_experts", None)
    if local is not None:  # SequentialMLP
        fc1 = [e.linear_fc1.weight for e in local]
        fc2 = [e.linear_fc2.weight for e in local]
        for e in local:
            if (
                getattr(e.linear_fc1, "bias", None) is not None
                or getattr(e.linear_fc2, "bias", None) is not None
            ):
                raise ValueError(
                    "the ring computes experts without bias but this SequentialMLP has biases; "
                    "fix: --disable-bias-linear"
                )
        return fc1, fc2
    lin1 = getattr(experts, "linear_fc1", None)
    lin2 = getattr(experts, "linear_fc2", None)
    n = getattr(experts, "num_local_experts", None)
    if lin1 is not None and lin2 is not None and n is not None:
        if all(hasattr(lin1, f"weight{j}") for j in range(n)) and all(
            hasattr(lin2, f"weight{j}") for j in range(n)
        ):  # TEGroupedMLP (TE GroupedLinear: one parameter per gemm)
            return [getattr(lin1, f"weight{j}") for j in range(n)], [
                getattr(lin2, f"weight{j}") for j in range(n)
            ]
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
