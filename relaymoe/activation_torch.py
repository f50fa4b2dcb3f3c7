"""The torch backend's expert activation: forward and hand-written backward, every kind.

Shape legend: P token-expert pairs, I expert FFN width, J fc1 rows (2I gated, I not). The
formulas are ``relaymoe.activation``'s; the oracle (``relaymoe.reference``) writes the same
activation with autograd-differentiated ``torch.nn.functional`` ops, so the two are checked
against each other rather than sharing code.

Gradients match torch's own away from the kinks, so the hand-written backward equals autograd
of the oracle there; at the kinks it follows fixed rules that the Triton kernels share
(``relaymoe.kernels.grouped.activation``), whatever torch is installed: ``relu`` passes the
gradient where ``x > 0`` (zero at 0, ``F.relu``'s backward); the clamp passes it where
``lo <= x <= hi``, the closed interval (torch's ``torch.clamp`` up to 2.13; from 2.14 torch's own
is zero at ``x == lo`` or ``x == hi``, so autograd of the oracle differs from this at exactly the
bound there). Values exactly at the limit are rare but do occur in bf16 (7.0 is one); one rule
for both backends keeps them agreeing on every torch.
Compute in the dtype you pass (the backend passes fp32 or wider). Level 1 (torch only): the
kernels may import it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from relaymoe.activation import ExpertActivation

__all__ = ["activation_backward", "activation_forward"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_C = 0.044715


def _fn(act: ExpertActivation, x: Tensor) -> Tensor:
    if act.fn == "silu":
        return F.silu(x) if act.alpha == 1.0 else x * torch.sigmoid(act.alpha * x)
    if act.fn == "gelu":
        return F.gelu(x)
    if act.fn == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act.fn == "relu":
        return F.relu(x)
    return F.relu(x).square()  # squared_relu


def _fn_and_grad(act: ExpertActivation, x: Tensor) -> tuple[Tensor, Tensor]:
    """``(fn(x), fn'(x))`` elementwise."""
    if act.fn == "silu":  # x s(ax): s + a x s (1 - s)
        sig = torch.sigmoid(act.alpha * x)
        return x * sig, sig * (1 + act.alpha * x * (1 - sig))
    if act.fn == "gelu":  # x Phi(x): Phi + x phi
        cdf = 0.5 * (1 + torch.erf(x * _INV_SQRT_2))
        pdf = torch.exp(-0.5 * x * x) * _INV_SQRT_2PI
        return x * cdf, cdf + x * pdf
    if act.fn == "gelu_tanh":  # 0.5 x (1 + tanh u), u = c0 (x + c1 x^3)
        th = torch.tanh(_SQRT_2_OVER_PI * (x + _GELU_TANH_C * x * x * x))
        du = _SQRT_2_OVER_PI * (1 + 3 * _GELU_TANH_C * x * x)
        return 0.5 * x * (1 + th), 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * du
    pos = x > 0
    r = F.relu(x)
    if act.fn == "relu":
        return r, pos.to(x.dtype)
    return r * r, 2 * r  # squared_relu


def _split(act: ExpertActivation, h_PJ: Tensor) -> tuple[Tensor, Tensor]:
    ffn = h_PJ.shape[1] // 2
    return h_PJ[:, :ffn], h_PJ[:, ffn:]


def activation_forward(act: ExpertActivation, h_PJ: Tensor) -> Tensor:
    """``a (P, I)`` from the pre-activation ``h (P, J)``, in ``h``'s dtype."""
    if not act.gated:
        return _fn(act, h_PJ)
    gate, linear = _split(act, h_PJ)
    if act.limit is not None:
        gate, linear = gate.clamp(max=act.limit), linear.clamp(-act.limit, act.limit)
    return _fn(act, gate) * (linear + act.linear_offset)


def activation_backward(
    act: ExpertActivation, h_PJ: Tensor, da_PI: Tensor
) -> tuple[Tensor, Tensor]:
    """``(dh (P, J), a (P, I))``: the pre-activation's gradient from ``da = dL/da`` (P, I), and
    the activation itself (the backward needs it for ``dw2`` and the router gradient), both
    recomputed from ``h``, in ``h``'s dtype."""
    if not act.gated:
        a, grad = _fn_and_grad(act, h_PJ)
        return da_PI * grad, a
    gate, linear = _split(act, h_PJ)
    if act.limit is not None:
        lim = act.limit
        gate_in, linear_in = gate <= lim, (linear >= -lim) & (linear <= lim)
        gate, linear = gate.clamp(max=lim), linear.clamp(-lim, lim)
    f, grad = _fn_and_grad(act, gate)
    lin = linear + act.linear_offset
    d_gate, d_linear = da_PI * lin * grad, da_PI * f
    if act.limit is not None:  # zero where clamped, passed at the bounds
        d_gate = torch.where(gate_in, d_gate, 0.0)
        d_linear = torch.where(linear_in, d_linear, 0.0)
    return torch.cat([d_gate, d_linear], dim=1), f * lin
