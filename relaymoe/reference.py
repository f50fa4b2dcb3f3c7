"""The oracle: plain-torch MoE expert computation that every relaymoe path must match.

Semantics (shape legend: T tokens, H hidden, I expert FFN width, E experts, K top-k):
``x (T, H)``, ``w13 (E, 2I, H)`` with rows ``[0, I)`` the gate (SiLU) branch and rows ``[I, 2I)``
the up branch (Megatron's fc1 weight ``[2*ffn, hidden]`` split with ``chunk(2)``),
``w2 (E, H, I)``, ``topk_idx (T, K)``, ``topk_probs (T, K)``:

    out[t] = sum_k p[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),
    e = topk_idx[t, k]

Differentiable in every float input. Depends on nothing but torch, on purpose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["moe_experts_reference"]


def moe_experts_reference(
    x: Tensor, w13: Tensor, w2: Tensor, topk_idx: Tensor, topk_probs: Tensor
) -> Tensor:
    """Per-expert loop in the inputs' dtype; pass float64 inputs for an exact oracle."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    ffn = two_i // 2
    out = x.new_zeros(num_tokens, hidden)
    for e in range(num_experts):
        tok, slot = torch.nonzero(topk_idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e].t()  # (n, 2I)
        a = F.silu(h[:, :ffn]) * h[:, ffn:]
        y = (a @ w2[e].t()) * topk_probs[tok, slot].unsqueeze(1).to(x.dtype)
        out = out.index_add(0, tok, y)
    return out
