"""Megatron's gradient-accumulation fusion, in one place: a layer adds its weight gradients into
``param.main_grad`` itself, marks the parameter, and hands autograd a dummy gradient.

Megatron's DDP gives every trained parameter ``main_grad`` (a view of its gradient buffer: fp32
with ``--accumulate-allreduce-grads-in-fp32``, the default of ``--bf16`` runs, else the
parameter's dtype) and ``grad_added_to_main_grad`` (False at every step's
``zero_grad_buffer``). Its hook on each parameter's gradient accumulator runs when a gradient
reaches the parameter: it adds ``param.grad`` into ``main_grad`` unless ``grad_added_to_main_grad``
is set (or ``zero_out_wgrad``), drops ``param.grad`` and, with ``overlap_grad_reduce``, marks the
parameter ready for its bucket's reduction. So under ``gradient_accumulation_fusion`` a layer
(megatron-core's linear layers, TransformerEngine's, the ring's experts, the fused loss):

1. adds its weight gradient into ``main_grad`` (:func:`add_to_main_grad`; the ring's experts
   inside their weight-gradient kernel, ``relaymoe/ring/main_grads.py``);
2. sets ``grad_added_to_main_grad = True`` and returns a dummy gradient of the parameter's
   shape and dtype (:func:`handed_back`): the hook must still run, and then skips its add. The
   dummy is one shared buffer (TransformerEngine's ``get_dummy_wgrad`` where megatron-core
   found TE, else one per call and shape), handed out as a fresh alias per parameter so that
   autograd takes it as ``param.grad`` without a copy; zeros where ``zero_out_wgrad`` (the hook
   adds it then). A parameter without the attribute (no DDP) gets None.

Under megatron-core's whole-step CUDA graph (``--cuda-graph-impl full_iteration``) the backward
runs once, at capture, with DDP's hooks: the marks set then decide which adds the graph holds
(the layer's, not the hook's), and every replay repeats exactly them; ``zero_grad_buffer``
resets the marks between steps outside the graph and nothing reads them during a replay.
Megatron-FSDP's parameters (``__fsdp_param__``) take their gradient through ``get_main_grad()``
(:func:`add_to_main_grad`); the ring's experts do not fuse for them (:func:`fused_main_grads`).

The output-layer weight of ``--relaymoe-fused-loss`` (``fused_loss.py``) follows the same
protocol: :func:`add_to_main_grad`, then :func:`handed_back`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from relaymoe.ring import MainGrads

__all__ = ["add_to_main_grad", "dummy_wgrad", "fused_main_grads", "handed_back"]


def add_to_main_grad(weight: Tensor, grad: Tensor) -> None:
    """Step 1 for a layer that has its weight gradient as a tensor: ``main_grad += grad``
    (Megatron-FSDP: its buffer, fetched by ``get_main_grad()``, takes the gradient)."""
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
        weight.main_grad.copy_(grad)
    else:
        weight.main_grad.add_(grad)


def dummy_wgrad(shape, dtype, device, *, zero: bool = False, made: dict | None = None) -> Tensor:
    """A gradient nobody reads (zeros with ``zero``), of ``shape``/``dtype`` on ``device``: a
    fresh alias of one shared buffer. TransformerEngine's (one per shape and dtype, shared by
    every layer) where megatron-core found TE on CUDA, else the one in ``made`` (a dict the
    caller keeps for one call) per ``(shape, dtype, device)``."""
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "HAVE_TE", False) and torch.device(device).type == "cuda":
        if zero:
            return layers.get_dummy_wgrad(list(shape), dtype, zero=True)
        return layers.get_dummy_wgrad(list(shape), dtype)
    made = {} if made is None else made
    key = (tuple(shape), dtype, torch.device(device))
    buf = made.get(key)
    if buf is None:
        buf = made[key] = torch.empty(shape, dtype=dtype, device=device)
    if zero:
        buf.zero_()
    return buf.detach()  # a new alias: autograd takes it as param.grad without copying


def handed_back(weights: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
    """Step 2 for ``weights`` whose gradients are already in their ``main_grad``: each marked
    ``grad_added_to_main_grad`` and given a dummy gradient (its dtype, its shape), or None
    where it has no such attribute (no DDP: nothing waits for a gradient)."""
    made: dict = {}
    out = []
    for w in weights:
        if not hasattr(w, "grad_added_to_main_grad"):
            out.append(None)
            continue
        w.grad_added_to_main_grad = True
        zero = getattr(w, "zero_out_wgrad", False)
        out.append(dummy_wgrad(w.shape, w.dtype, w.device, zero=zero, made=made))
    return tuple(out)


def fused_main_grads(config, fc1: Sequence[Tensor], fc2: Sequence[Tensor]) -> MainGrads | None:
    """The ring's :class:`~relaymoe.ring.MainGrads` for an experts module's weight parameters
    ``fc1``/``fc2`` (per expert): their ``main_grad`` when ``config.gradient_accumulation_fusion``
    is on and every one has one (DDP has wrapped the model), with :func:`handed_back` as what
    autograd gets; None otherwise (plain ``.grad``, which DDP's hooks add). Megatron-FSDP's
    parameters keep the plain path."""
    if not getattr(config, "gradient_accumulation_fusion", False):
        return None
    params = (*fc1, *fc2)
    for p in params:
        if getattr(p, "main_grad", None) is None or hasattr(p, "__fsdp_param__"):
            return None
    return MainGrads([p.main_grad for p in fc1], [p.main_grad for p in fc2], finish=handed_back)
