"""A Megatron experts module's own parameters as the ring's ``w13 (El, 2I, H)``, ``w2 (El, H, I)``.

The ring computes with the ``MoELayer``'s parameters themselves, so DDP, the distributed
optimizer, gradient clipping and ``main_grad`` see ordinary parameters and checkpoints keep
Megatron's keys. Supported experts (expert tensor parallel size 1, so every weight is whole):

* ``SequentialMLP`` (local spec, no TransformerEngine): ``local_experts[j].linear_fc1.weight``
  ``(2I, H)`` and ``local_experts[j].linear_fc2.weight`` ``(H, I)``;
* ``TEGroupedMLP``: ``linear_fc1.weight{j}`` ``(2I, H)`` and ``linear_fc2.weight{j}`` ``(H, I)``.

fc1 rows ``[0, I)`` are the gate branch and ``[I, 2I)`` the up branch in both (Megatron's
``chunk(2)``), which is the ring's ``w13`` layout.

Cost: when the ``El`` per-expert tensors lie back to back in one storage (ascending, same
shape and strides) ``stacked_expert_weights`` returns a zero-copy strided view of that storage;
otherwise it stacks them, one copy of the layer's local expert weights
(``El * 3 * I * H`` elements) that lives from the forward until the ring's backward has used it.
``make_expert_weights_contiguous`` re-homes the parameters into one buffer per projection at
build time so that the view applies; Megatron's DDP keeps that layout unless its distributed
optimizer moves parameters into its own buffer (which stores them in reverse order), in which
case the stack path is taken. ``last_stack_copied`` tells which path the last call took.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "expert_param_lists",
    "stacked_expert_weights",
    "make_expert_weights_contiguous",
    "stack_is_view",
    "last_stack_copied",
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


def stack_is_view(ws: list[Tensor]) -> bool:
    """True when ``ws`` lie back to back (ascending) in one storage with equal shape/strides."""
    w0 = ws[0]
    if not w0.is_contiguous():
        return False
    step = w0.numel()
    base = w0.untyped_storage().data_ptr()
    for j, w in enumerate(ws):
        if (
            w.shape != w0.shape
            or w.dtype != w0.dtype
            or not w.is_contiguous()
            or w.untyped_storage().data_ptr() != base
            or w.storage_offset() != w0.storage_offset() + j * step
        ):
            return False
    return True


class _StackExperts(torch.autograd.Function):
    """(El, *shape) from El parameters: a strided view when they are adjacent, else a stack.

    Backward hands each parameter its slice of the gradient (views, no copy)."""

    @staticmethod
    def forward(ctx, *ws: Tensor) -> Tensor:
        if stack_is_view(list(ws)):
            w0 = ws[0]
            out = w0.as_strided(
                (len(ws), *w0.shape), (w0.numel(), *w0.stride()), w0.storage_offset()
            )
            ctx.copied = False
        else:
            out = torch.stack([w.detach() for w in ws])
            ctx.copied = True
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return tuple(grad.unbind(0))


_LAST = {"copied": None}


def last_stack_copied() -> bool | None:
    """Whether the last ``stacked_expert_weights`` call copied (None before any call)."""
    return _LAST["copied"]


def stacked_expert_weights(experts) -> tuple[Tensor, Tensor]:
    """``(w13 (El, 2I, H), w2 (El, H, I))`` of ``experts``, differentiable into its parameters."""
    fc1, fc2 = expert_param_lists(experts)
    w13 = _StackExperts.apply(*fc1)
    w2 = _StackExperts.apply(*fc2)
    _LAST["copied"] = not (stack_is_view(fc1) and stack_is_view(fc2))
    return w13, w2


@torch.no_grad()
def make_expert_weights_contiguous(experts) -> None:
    """Re-home the per-expert parameters into one ``(El, ...)`` buffer per projection.

    Values, parameter objects, names and attributes are unchanged; only ``.data`` now views a
    shared buffer so that ``stacked_expert_weights`` needs no copy."""
    for ws in expert_param_lists(experts):
        if stack_is_view(ws):
            continue
        buf = torch.stack([w.data for w in ws])
        for j, w in enumerate(ws):
            w.data = buf[j]
