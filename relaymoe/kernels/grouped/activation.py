"""The expert activation inside the Triton kernels: one forward and one backward ``@triton.jit``
helper, specialised at compile time by the constexprs :func:`act_meta` builds.

Every kernel that computes an activation (the up-projection's epilogue, the memory-bound forward
and backward passes) calls these two helpers with the same ``**act_meta(activation)`` keywords,
so one ``ExpertActivation`` (``relaymoe.activation``) is one compiled specialisation everywhere,
and the default SwiGLU compiles to the plain SwiGLU expressions (``gate * sigmoid(gate) * up``
forward, ``da * up * s * (1 + gate * (1 - s))`` and ``da * silu(gate)`` backward): no branch,
clamp or offset of the other kinds is left in its code.

The constexprs: ``ACT_FN`` (one of ``relaymoe.activation.FNS``), ``GATED``, ``ALPHA`` (silu's
slope), ``HAS_LIMIT`` / ``LIMIT`` (the gated clamp), ``OFFSET`` (the gated linear offset).
Inputs are fp32 tiles; ``lin`` is ignored when not ``GATED`` (pass ``gate`` again).

The clamp's gradient passes where ``-limit <= linear <= limit`` and ``gate <= limit``: the
closed interval, a fixed rule (the torch backend's too, ``relaymoe.activation_torch``), not the
installed torch's ``torch.clamp``. ``relu`` passes the gradient where ``x > 0``.
GELU: the exact erf form through ``tl.math.erf``; the tanh form through
``tanh(u) = 2 * sigmoid(2u) - 1`` (``tl`` has no tanh), written so neither needs ``1 - tanh^2``.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from relaymoe.activation import SWIGLU, ExpertActivation

__all__ = ["act_bwd", "act_fwd", "act_meta"]

# constexprs: a jit function may read a module global only as one
_INV_SQRT_2 = tl.constexpr(1.0 / math.sqrt(2.0))
_INV_SQRT_2PI = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
_SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
_GELU_TANH_C = tl.constexpr(0.044715)


def act_meta(activation: ExpertActivation | None) -> dict:
    """The kernels' constexpr keywords of ``activation`` (None: SwiGLU)."""
    act = SWIGLU if activation is None else activation
    return dict(
        ACT_FN=act.fn,
        GATED=act.gated,
        ALPHA=act.alpha,
        HAS_LIMIT=act.limit is not None,
        LIMIT=0.0 if act.limit is None else act.limit,
        OFFSET=act.linear_offset,
    )


@triton.jit
def _fn(x, ACT_FN: tl.constexpr, ALPHA: tl.constexpr):
    """fn(x) elementwise (fp32)."""
    if ACT_FN == "silu":
        if ALPHA == 1.0:
            y = x * tl.sigmoid(x)
        else:
            y = x * tl.sigmoid(ALPHA * x)
    elif ACT_FN == "gelu":
        y = x * (0.5 * (1.0 + tl.math.erf(x * _INV_SQRT_2)))
    elif ACT_FN == "gelu_tanh":  # 0.5 x (1 + tanh u) = x sigmoid(2u)
        u = _SQRT_2_OVER_PI * (x + _GELU_TANH_C * x * x * x)
        y = x * tl.sigmoid(2.0 * u)
    elif ACT_FN == "relu":
        y = tl.maximum(x, 0.0)
    else:  # squared_relu
        r = tl.maximum(x, 0.0)
        y = r * r
    return y


@triton.jit
def _fn_and_grad(x, ACT_FN: tl.constexpr, ALPHA: tl.constexpr):
    """(fn(x), fn'(x)) elementwise (fp32)."""
    if ACT_FN == "silu":  # x s(ax): s (1 + a x (1 - s))
        if ALPHA == 1.0:
            sig = tl.sigmoid(x)
            grad = sig * (1.0 + x * (1.0 - sig))
        else:
            sig = tl.sigmoid(ALPHA * x)
            grad = sig * (1.0 + ALPHA * x * (1.0 - sig))
        y = x * sig
    elif ACT_FN == "gelu":  # x Phi(x): Phi + x phi
        cdf = 0.5 * (1.0 + tl.math.erf(x * _INV_SQRT_2))
        y = x * cdf
        grad = cdf + x * (tl.exp(-0.5 * x * x) * _INV_SQRT_2PI)
    elif ACT_FN == "gelu_tanh":  # x s(2u): s + 2 x s (1 - s) u'
        u = _SQRT_2_OVER_PI * (x + _GELU_TANH_C * x * x * x)
        s = tl.sigmoid(2.0 * u)
        du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * x * x)
        y = x * s
        grad = s + 2.0 * x * s * (1.0 - s) * du
    elif ACT_FN == "relu":
        y = tl.maximum(x, 0.0)
        grad = tl.where(x > 0.0, 1.0, 0.0)
    else:  # squared_relu
        r = tl.maximum(x, 0.0)
        y = r * r
        grad = 2.0 * r
    return y, grad


@triton.jit
def act_fwd(
    gate, lin, ACT_FN: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr,
    HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr,
):  # fmt: skip
    """a = fn(gate) * (lin + OFFSET) (clamped first with ``HAS_LIMIT``) gated, else fn(gate).
    SwiGLU: ``gate * sigmoid(gate) * lin``."""
    if GATED:
        if HAS_LIMIT:
            gate = tl.minimum(gate, LIMIT)
            lin = tl.minimum(tl.maximum(lin, -LIMIT), LIMIT)
        if OFFSET != 0.0:
            lin = lin + OFFSET
        a = _fn(gate, ACT_FN, ALPHA) * lin
    else:
        a = _fn(gate, ACT_FN, ALPHA)
    return a


@triton.jit
def act_bwd(
    gate, lin, da, ACT_FN: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr,
    HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr,
):  # fmt: skip
    """``(a, d_gate, d_lin)`` from the pre-activation halves and ``da = dL/da``: the activation
    (recomputed) and the gradients of ``gate`` (the whole h when not gated) and ``lin`` (gated;
    a copy of ``d_gate`` otherwise, which the callers do not store). SwiGLU:
    ``d_gate = da * up * s * (1 + gate * (1 - s))``, ``d_lin = da * silu(gate)``."""
    if GATED:
        if HAS_LIMIT:  # the gradient passes where the clamp is the identity, bounds included
            gate_in = gate <= LIMIT
            lin_in = (lin >= -LIMIT) & (lin <= LIMIT)
            gate = tl.minimum(gate, LIMIT)
            lin = tl.minimum(tl.maximum(lin, -LIMIT), LIMIT)
        if OFFSET != 0.0:
            lin = lin + OFFSET
        if ACT_FN == "silu" and ALPHA == 1.0:  # SwiGLU's products, in their order
            sig = tl.sigmoid(gate)
            f = gate * sig
            d_gate = da * lin * sig * (1.0 + gate * (1.0 - sig))
        else:
            f, grad = _fn_and_grad(gate, ACT_FN, ALPHA)
            d_gate = da * lin * grad
        d_lin = da * f
        a = f * lin
        if HAS_LIMIT:
            d_gate = tl.where(gate_in, d_gate, 0.0)
            d_lin = tl.where(lin_in, d_lin, 0.0)
    else:
        a, grad = _fn_and_grad(gate, ACT_FN, ALPHA)
        d_gate = da * grad
        d_lin = d_gate
    return a, d_gate, d_lin
