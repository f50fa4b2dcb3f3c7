"""The oracle: plain-torch MoE expert computation that every relaymoe path must match.

Semantics (shape legend: T tokens, H hidden, I expert FFN width, E experts, K top-k, J fc1 rows:
``activation.fc1_rows(I)``, 2I gated, I not): ``x (T, H)``, ``w13 (E, J, H)`` (gated: rows
``[0, I)`` the gate branch and rows ``[I, 2I)`` the linear/up branch, Megatron's fc1 weight
``[2*ffn, hidden]`` split with ``chunk(2)``), ``w2 (E, H, I)``, ``topk_idx (T, K)``,
``topk_probs (T, K)``, optional biases ``b13 (E, J)``, ``b2 (E, H)``:

    h = w13[e] @ x[t] + b13[e]                       (fc1, bias inside it)
    a = act(h)                                       (relaymoe.activation.ExpertActivation)
    out[t] = sum_k p[t, k] * (w2[e] @ a + b2[e]),    e = topk_idx[t, k]

which is Megatron's TEGroupedMLP (the fc2 bias is added scaled by the router probability). With
the default activation (SwiGLU) and no biases:
``out[t] = sum_k p[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))``.

Differentiable in every float input by autograd: the activation is written here with
``torch.nn.functional`` ops, independent of the backends' hand-written backward. Depends on
nothing but torch and the torch-free activation spec, on purpose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from relaymoe.activation import ExpertActivation, as_activation

__all__ = ["moe_experts_reference", "reference_activation"]


def _fn(act: ExpertActivation, x: Tensor) -> Tensor:
    if act.fn == "silu":
        return x * torch.sigmoid(act.alpha * x)
    if act.fn == "gelu":
        return F.gelu(x)
    if act.fn == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act.fn == "relu":
        return F.relu(x)
    if act.fn == "squared_relu":
        return F.relu(x) ** 2
    raise AssertionError(act.fn)


def reference_activation(act: ExpertActivation, h: Tensor) -> Tensor:
    """``a (n, I)`` from the pre-activation ``h (n, J)`` (autograd-differentiable)."""
    if not act.gated:
        return _fn(act, h)
    gate, linear = h.chunk(2, dim=-1)
    if act.limit is not None:
        gate = torch.clamp(gate, max=act.limit)
        linear = torch.clamp(linear, min=-act.limit, max=act.limit)
    return _fn(act, gate) * (linear + act.linear_offset)


def moe_experts_reference(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_idx: Tensor,
    topk_probs: Tensor,
    *,
    activation: ExpertActivation | str | None = None,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
) -> Tensor:
    """Per-expert loop in the inputs' dtype; pass float64 inputs for an exact oracle.

    ``activation``: an ``ExpertActivation`` or a name (``relaymoe.activation.as_activation``;
    default SwiGLU). ``b13 (E, J)``, ``b2 (E, H)``: optional fc1/fc2 biases."""
    act = as_activation(activation)
    num_tokens, hidden = x.shape
    num_experts = w13.shape[0]
    out = x.new_zeros(num_tokens, hidden)
    for e in range(num_experts):
        tok, slot = torch.nonzero(topk_idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e].t()  # (n, J)
        if b13 is not None:
            h = h + b13[e]
        y = reference_activation(act, h) @ w2[e].t()  # (n, H)
        if b2 is not None:
            y = y + b2[e]
        y = y * topk_probs[tok, slot].unsqueeze(1).to(x.dtype)
        out = out.index_add(0, tok, y)
    return out
