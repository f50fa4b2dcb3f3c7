"""The fp8 expert layer emulated in float64: the oracle (``relaymoe.reference``'s activation,
float64 GEMMs) applied to the same quantise-dequantise inputs the kernels use, stage by stage.

Every tensor the fp8 path quantises is quantised here at the same point, with the library's
torch quantisers (``relaymoe.kernels.fp8.quant_torch``, themselves checked against their
definition in ``tests/lib/test_fp8_quant.py``) and rounded to the inputs' dtype first where the
kernels store it in that dtype (a, g, dh, p*a, the saved h); every GEMM and the activation run
in float64 on the dequantised values. What separates the kernels from this is their fp32
accumulation and, rarely, an intermediate that lands on the other side of an fp8 rounding
boundary because its fp32 value differs from the float64 one in the last bits.
"""

from __future__ import annotations

import torch

from relaymoe.activation import as_activation
from relaymoe.fp8_recipe import Fp8Recipe
from relaymoe.kernels.fp8 import quant_torch as qt
from relaymoe.kernels.fp8.weights import Fp8ExpertWeights
from relaymoe.reference import reference_activation

F64 = torch.float64


def _one_scale(t, fmt, amax=None):
    """float64 dequantised ``t`` with one scale from ``amax`` (default: its own amax)."""
    if amax is None:
        amax = t.abs().amax() if t.numel() else t.new_zeros(())
    s = qt.scale_from_amax(amax.reshape(()).to(t.device), fmt)
    return qt.quantize_with(t, s, fmt).to(F64) * (1.0 / s).to(F64)


class _Amaxes:
    """Which amax each one-scale tensor's scale comes from: ``given`` (role -> amax, the
    kernels' own) where it names the role, else the emulated tensor's; ``own`` is filled with
    the emulated tensors' amaxes, role by role."""

    def __init__(self, given, own):
        self.given = {} if given is None else given
        self.own = {} if own is None else own

    def dequant(self, t, fmt: str, role: str):
        self.own[role] = t.abs().amax().double() if t.numel() else t.new_zeros((), dtype=F64)
        return _one_scale(t, fmt, self.given.get(role, self.own[role]))


class RecordedScaling:
    """A tensor-scale source (``relaymoe.kernels.fp8.scaling``) that answers as ``inner`` and
    keeps, per role, the last amax the kernels measured (``amax``, for :func:`fp8_emulation`'s
    ``amax``) and the scale it answered (``used``). Installed as ``state.scales`` of an
    ``Fp8State``."""

    def __init__(self, inner):
        self.inner, self.amax, self.used = inner, {}, {}

    def scale(self, role, amax, fmt):
        self.amax[role] = amax.detach().double().reshape(()).clone()
        self.used[role] = self.inner.scale(role, amax, fmt)
        return self.used[role]


def dequant_input(t, fmt: str, recipe: Fp8Recipe, scale=None):
    """x or dy as the kernels read it: one scale (``scale``, else from its amax) or 1x128."""
    if recipe.blockwise:
        return qt.dequantize_rows(*qt.quantize_rows(t, fmt, pow2=recipe.power_2_scales)).to(F64)
    if scale is not None:
        return qt.quantize_with(t, scale, fmt).to(F64) * (1.0 / scale).to(F64)
    return _one_scale(t, fmt)


def _dequant(t, fmt, recipe, role, amaxes: _Amaxes):
    """x, dy, a, dh or p*a (rounded to the dtype already) as the next GEMM reads it."""
    if recipe.blockwise:
        q, inv = qt.quantize_rows(t, fmt, pow2=recipe.power_2_scales)
        return qt.dequantize_rows(q, inv).to(F64)
    return amaxes.dequant(t, fmt, role)


def dequant_weights(wq: Fp8ExpertWeights):
    if wq.blockwise:
        return (qt.dequantize_blocks(wq.w13, wq.inv13).to(F64),
                qt.dequantize_blocks(wq.w2, wq.inv2).to(F64))  # fmt: skip
    return (wq.w13.to(F64) * wq.inv13.to(F64)[:, None, None],
            wq.w2.to(F64) * wq.inv2.to(F64)[:, None, None])  # fmt: skip


def _pairs(idx, num_experts):
    """(token, slot, expert bounds) of every pair in expert-grouped order (by token inside an
    expert, as the routing index)."""
    tok_slot = [torch.nonzero(idx == e, as_tuple=True) for e in range(num_experts)]
    counts = [0] + [len(t) for t, _ in tok_slot]
    bounds = torch.tensor(counts).cumsum(0).tolist()
    return torch.cat([t for t, _ in tok_slot]), torch.cat([s for _, s in tok_slot]), bounds


def _per_expert(bounds, fn):
    """``fn(e, rows)`` for each expert's slice of the pair rows, in expert order."""
    spans = enumerate(zip(bounds, bounds[1:], strict=False))
    return [fn(e, slice(lo, hi)) for e, (lo, hi) in spans]


def run_layer(x, w13, w2, idx, probs, dy, **kw) -> dict:
    """``{"out", "dx", "dw13", "dw2", "dprobs"}`` of ``moe_experts`` (Triton backend, ``kw``:
    its options, ``fp8`` among them) on copies of the inputs, for upstream gradient ``dy``."""
    from relaymoe.experts import moe_experts

    ins = [v.detach().clone().requires_grad_() for v in (x, w13, w2, probs)]
    out = moe_experts(ins[0], ins[1], ins[2], idx, ins[3], backend="triton", **kw)
    out.backward(dy)
    return {"out": out.detach(), "dx": ins[0].grad, "dw13": ins[1].grad, "dw2": ins[2].grad,
            "dprobs": ins[3].grad}  # fmt: skip


def check_delayed_window(x, w13, w2, idx, probs, dy, hist_len: int, **kw):
    """TE's ``DelayedScaling`` (``max``) on the kernels: a call quantises each tensor with the
    scale of the largest amax among the ``hist_len`` (L) calls before it, the first call with
    1. A tensorwise call (its amaxes recorded), then 2L+2 delayed calls of ``run_layer``
    (``kw``: its options), the first on 3x x and dy: x's and dy's scales come from that
    step's amax for L calls, then from their own; a, dh and p*a are made from x and dy, so
    their amaxes are current scaling's from call L+2 on and their scales from call 2L+2 on,
    which is then the tensorwise call bit for bit (the kernels are deterministic: no atomic
    but amax's max). Asserts that; returns ``(last call, tensorwise call's amaxes)``."""
    from relaymoe.fp8_state import Fp8State

    tensorwise = Fp8State(Fp8Recipe("tensorwise"))
    tensorwise.scales = current = RecordedScaling(tensorwise.scales)
    want = run_layer(x, w13, w2, idx, probs, dy, fp8=tensorwise, **kw)
    state = Fp8State(Fp8Recipe("delayed", amax_history_len=hist_len))
    state.scales = delayed = RecordedScaling(state.scales)
    calls, used, first = [], [], None
    for c in range(2 * hist_len + 2):
        k = 3.0 if c == 0 else 1.0
        calls.append(run_layer(k * x, w13, w2, idx, probs, k * dy, fp8=state, **kw))
        used.append(dict(delayed.used))  # the scales call c quantised with
        first = first or dict(delayed.amax)
    for role, fmt in (("x", "e4m3"), ("dy", state.recipe.grad_format)):
        assert torch.equal(used[0][role].cpu(), torch.ones(1)), role
        for c in range(1, len(calls)):
            amax = first[role] if c <= hist_len else current.amax[role]
            want_scale = qt.scale_from_amax(amax.float(), fmt).reshape(1)
            assert torch.equal(used[c][role], want_scale), (role, c)
    for name in want:
        assert torch.equal(calls[-1][name], want[name]), name
    # call L+1 still scales x from call 1's amax
    assert (calls[hist_len]["out"] - want["out"]).norm() > 1e-3 * want["out"].norm()
    return calls[-1], current.amax


def fp8_emulation(x, wq: Fp8ExpertWeights, idx, probs, dy, recipe: Fp8Recipe, activation=None,
                  amax=None, own_amax=None):  # fmt: skip
    """``{"out", "dx", "dw13", "dw2", "dprobs"}`` (float64) of the fp8 layer on ``x``'s dtype:
    the forward and the backward for upstream gradient ``dy``.

    Tensor-scaled recipes: ``amax`` maps a role (``x``, ``a``, ``dy``, ``dh``, ``pa``) to the
    amax its one scale comes from, the kernels' (:class:`RecordedScaling`); a role not given
    takes the emulated tensor's own. ``own_amax``, a dict, is filled with the emulated tensors'
    amaxes. Why a comparison pins the scales: a scale ``fmax / amax`` is not a power of two, so
    an amax one bf16 ulp off (its element computed with another accumulation) moves the
    rounding grid of the whole tensor, a few percent of every result it feeds."""
    amaxes = _Amaxes(amax, own_amax)
    act = as_activation(activation)
    dtype, gf = x.dtype, recipe.grad_format
    rnd = lambda t: t.to(dtype).to(F64)  # noqa: E731  (a value as stored in x's dtype)
    w13d, w2d = dequant_weights(wq)
    tok, slot, bounds = _pairs(idx.to(x.device), wq.w13.shape[0])
    p = probs.to(F64)[tok, slot][:, None]
    xd = _dequant(x, "e4m3", recipe, "x", amaxes)
    h = torch.cat(_per_expert(bounds, lambda e, r: xd[tok[r]] @ w13d[e].T))
    a = reference_activation(act, h) * p
    ad = _dequant(rnd(a).to(dtype), "e4m3", recipe, "a", amaxes)
    out = torch.zeros(x.shape, dtype=F64, device=x.device)
    out.index_add_(0, tok, torch.cat(_per_expert(bounds, lambda e, r: ad[r] @ w2d[e].T)))
    dyd = _dequant(dy, gf, recipe, "dy", amaxes)
    g = rnd(torch.cat(_per_expert(bounds, lambda e, r: dyd[tok[r]] @ w2d[e])))
    h_r = rnd(h).requires_grad_()
    act_h = reference_activation(act, h_r)
    (dh,) = torch.autograd.grad(act_h, h_r, g * p)
    act_h = act_h.detach()
    dprobs = torch.zeros(probs.shape, dtype=F64, device=x.device)
    dprobs[tok, slot] = (g * act_h).sum(1)
    dh_r, pa_r = rnd(dh), rnd(act_h * p)
    dhd = _dequant(dh_r.to(dtype), gf, recipe, "dh", amaxes)
    if not recipe.fp8_wgrad:  # bf16 weight gradients: the unquantised operands
        dy_w, pa_w, dh_w, x_w = dy.to(F64), pa_r, dh_r, x.to(F64)
    else:
        pa_w = _dequant(pa_r.to(dtype), "e4m3", recipe, "pa", amaxes)
        dy_w, dh_w, x_w = dyd, dhd, xd
    dw2 = torch.stack(_per_expert(bounds, lambda e, r: dy_w[tok[r]].T @ pa_w[r]))
    dw13 = torch.stack(_per_expert(bounds, lambda e, r: dh_w[r].T @ x_w[tok[r]]))
    dx = torch.zeros(x.shape, dtype=F64, device=x.device)
    dx.index_add_(0, tok, torch.cat(_per_expert(bounds, lambda e, r: dhd[r] @ w13d[e])))
    return {"out": out, "dx": dx, "dw13": dw13, "dw2": dw2, "dprobs": dprobs}
