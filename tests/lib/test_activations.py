"""Every expert MLP kind (``relaymoe.activation``) with and without biases: the spec, the oracle,
the torch backend against the float64 oracle, and the refusals of bad input."""

import math

import pytest
import torch

from relaymoe.activation import NAMES, SWIGLU, ExpertActivation, as_activation
from relaymoe.activation_torch import activation_backward, activation_forward
from relaymoe.experts import (
    RECOMPUTES,
    HopGrads,
    HopOptions,
    expert_hop_backward,
    expert_hop_forward,
    moe_experts,
)
from relaymoe.reference import moe_experts_reference, reference_activation
from relaymoe.routing import build_routing_index
from tests.fixtures import (
    BIASES,
    EXPERT_ACTIVATIONS,
    activation_problem,
    assert_all_close,
    assert_close,
    expert_activation,
    run_with_grads,
)

F64_TOL = 1e-10


def _torch(**kw):
    return lambda *a, **k: moe_experts(*a, backend="torch", **kw, **k)


def _clamped_share(pb) -> float:
    """Share of the clamped problem's pre-activations the clamp changes (gate or linear)."""
    act, ffn = pb["act"], pb["w2"].shape[2]
    h = torch.einsum("th,ejh->tej", pb["x"], pb["w13"])
    if pb["b13"] is not None:
        h = h + pb["b13"]
    gate, lin = h[..., :ffn], h[..., ffn:]
    return ((gate > act.limit).double().mean() + (lin.abs() > act.limit).double().mean()).item()


# ---------------------------------------------------------------------------------------------
# the spec
# ---------------------------------------------------------------------------------------------
def test_names_rows_and_round_trip():
    assert as_activation(None) is SWIGLU and SWIGLU.name == str(SWIGLU) == "swiglu"
    assert ExpertActivation(fn="gelu").name == "geglu"
    assert ExpertActivation(fn="gelu", gated=False).name == "gelu"
    assert ExpertActivation(fn="squared_relu", gated=False).name == "squared_relu"
    clamped = expert_activation("clamped_swiglu")
    assert clamped.name == "clamped_swiglu(alpha=1.702,limit=7.0,offset=1.0)"
    assert ExpertActivation(alpha=1.702).name == "swiglu(alpha=1.702)"
    assert SWIGLU.fc1_rows(5) == 10 and as_activation("relu").fc1_rows(5) == 5
    for name, act in NAMES.items():
        assert as_activation(name) is act and as_activation(act.name) == act
    assert as_activation(clamped) is clamped
    assert ExpertActivation(alpha=1, linear_offset=0) == SWIGLU
    assert hash(ExpertActivation(fn="silu", alpha=1)) == hash(SWIGLU)
    assert as_activation("gelu_tanh") == ExpertActivation(fn="gelu_tanh", gated=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fn="tanh"), "fn='tanh' is not one of"),
        (dict(gated="yes"), "gated='yes' must be a bool"),
        (dict(alpha=0.0), "alpha=0.0 must be a finite number > 0"),
        (dict(alpha=math.nan), "alpha=nan must be a finite number"),
        (dict(alpha=True), "alpha=True must be a finite number"),
        (dict(fn="gelu", alpha=2.0), "alpha=2.0 applies to fn='silu' only"),
        (dict(limit=-1.0), "limit=-1.0 must be None or a finite number > 0"),
        (dict(limit=math.inf), "limit=inf must be None or a finite"),
        (dict(gated=False, limit=7.0), "limit=7.0 applies to gated activations only"),
        (dict(linear_offset=math.inf), "linear_offset=inf must be a finite number"),
        (dict(gated=False, linear_offset=1.0), "linear_offset=1.0 applies to gated"),
    ],
)
def test_bad_fields_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExpertActivation(**kwargs)


def test_bad_names_raise():
    with pytest.raises(ValueError, match="got 'swishglu'; pass one of those names"):
        as_activation("swishglu")
    with pytest.raises(ValueError, match="got 3"):
        as_activation(3)
    for name in ("clamped_swiglu", "quick_geglu"):
        with pytest.raises(ValueError, match=f"{name}' has knobs .*ExpertActivation\\(fn='silu'"):
            as_activation(name)


# ---------------------------------------------------------------------------------------------
# the oracle and the torch backend's hand-written activation
# ---------------------------------------------------------------------------------------------
def _formula(act: ExpertActivation, x: torch.Tensor) -> torch.Tensor:
    """``fn`` written out from its definition (no torch.nn.functional)."""
    if act.fn == "silu":
        return x / (1 + torch.exp(-act.alpha * x))
    if act.fn == "gelu":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    if act.fn == "gelu_tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    pos = torch.where(x > 0, x, torch.zeros_like(x))
    return pos if act.fn == "relu" else pos * pos


def _token_loop(x, w13, w2, idx, probs, act, b13, b2):
    ffn = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            h = w13[e] @ x[t] + (0 if b13 is None else b13[e])
            if act.gated:
                gate, lin = h[:ffn], h[ffn:]
                if act.limit is not None:
                    lim = x.new_tensor(act.limit)
                    gate, lin = (
                        torch.minimum(gate, lim),
                        torch.minimum(torch.maximum(lin, -lim), lim),
                    )
                a = _formula(act, gate) * (lin + act.linear_offset)
            else:
                a = _formula(act, h)
            out[t] += probs[t, k] * (w2[e] @ a + (0 if b2 is None else b2[e]))
    return out


def test_oracle_matches_token_loop():
    gen = torch.Generator().manual_seed(11)
    for name in EXPERT_ACTIVATIONS:
        pb = activation_problem(9, 5, 3, 4, 2, name, gen=gen)
        args = (pb["x"], pb["w13"], pb["w2"], pb["idx"], pb["probs"])
        ref = moe_experts_reference(*args, activation=pb["act"], b13=pb["b13"], b2=pb["b2"])
        loop = _token_loop(*args, pb["act"], pb["b13"], pb["b2"])
        torch.testing.assert_close(ref, loop, rtol=1e-12, atol=1e-12, msg=name)


def _closed_clamp_activation(act: ExpertActivation, h: torch.Tensor) -> torch.Tensor:
    """The oracle's activation with its clamps written as ``torch.where``: autograd then passes
    the gradient at ``x == bound`` (the closed interval, the backends' fixed rule) on any torch."""
    ffn = h.shape[1] // 2
    gate, linear = h[:, :ffn], h[:, ffn:]
    lim = act.limit
    gate = torch.where(gate > lim, lim, gate)
    linear = torch.where(linear > lim, lim, torch.where(linear < -lim, -lim, linear))
    plain = ExpertActivation(fn=act.fn, alpha=act.alpha, linear_offset=act.linear_offset)
    return reference_activation(plain, torch.cat([gate, linear], 1))


@pytest.mark.parametrize("name", list(EXPERT_ACTIVATIONS))
def test_hand_written_activation_matches_autograd(name):
    """Forward and backward of ``activation_torch`` against autograd of the oracle's activation,
    at random points and at the kinks: 0 (relu), exactly +-limit and beyond. At exactly the
    bound the clamp passes the gradient (the fixed closed-interval rule, whatever this torch's
    ``torch.clamp`` does there): checked against a clamp written with ``torch.where``."""
    act = expert_activation(name)
    gen = torch.Generator().manual_seed(12)
    lim = act.limit or 1.0
    special = torch.tensor([0.0, lim, -lim, 2 * lim, -2 * lim, 0.5, -0.5], dtype=torch.float64)
    ffn = special.numel()
    h = 3 * torch.randn(40, act.fc1_rows(ffn), generator=gen, dtype=torch.float64)
    h[:2, :ffn], h[2:4, -ffn:] = special, special  # the gate half and the linear half
    da = torch.randn(40, ffn, generator=gen, dtype=torch.float64)
    leaf = h.clone().requires_grad_()
    a_ref = reference_activation(act, leaf)
    (dh_ref,) = torch.autograd.grad(a_ref, leaf, da)
    dh, a = activation_backward(act, h, da)
    torch.testing.assert_close(activation_forward(act, h), a_ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(a, a_ref.detach(), rtol=1e-13, atol=1e-13)
    if act.limit is None:
        torch.testing.assert_close(dh, dh_ref, rtol=1e-12, atol=1e-12)
        return
    off_bound = h.abs() != act.limit  # torch's own clamp decides these alike on every version
    torch.testing.assert_close(dh[off_bound], dh_ref[off_bound], rtol=1e-12, atol=1e-12)
    (dh_closed,) = torch.autograd.grad(_closed_clamp_activation(act, leaf), leaf, da)
    torch.testing.assert_close(dh, dh_closed, rtol=1e-12, atol=1e-12)
    # the clamp bites: zero gradient where it clamped
    gate, linear = dh[:2, :ffn], dh[2:4, -ffn:]
    assert (gate[:, 3] == 0).all() and (gate[:, 4] != 0).all()  # gate: clamped above only
    assert (linear[:, 3:5] == 0).all()
    # exactly at +-limit: passed (gate at +limit, linear at both bounds)
    assert (torch.stack([gate[:, 1], linear[:, 1], linear[:, 2]]) != 0).all()


# ---------------------------------------------------------------------------------------------
# torch backend vs the float64 oracle
# ---------------------------------------------------------------------------------------------
COMBOS = [(name, bias) for name in EXPERT_ACTIVATIONS for bias in BIASES]


@pytest.mark.parametrize("name, bias", COMBOS, ids=[f"{n}-{b}" for n, b in COMBOS])
def test_every_activation_and_bias_matches_oracle(name, bias):
    """Each activation x bias combo once, odd sizes (H=11, I=7), the recompute modes in turn."""
    i = COMBOS.index((name, bias))
    recompute = RECOMPUTES[i % len(RECOMPUTES)]
    gen = torch.Generator().manual_seed(100 + i)
    pb = activation_problem(23, 11, 7, 5, 2, name, bias=bias, gen=gen)
    if pb["act"].limit is not None:
        assert _clamped_share(pb) > 0.05
    got = run_with_grads(_torch(recompute=recompute), pb)
    assert_all_close(got, run_with_grads(moe_experts_reference, pb), F64_TOL)
    assert ("db13" in got) == (bias in ("b13", "both"))
    assert ("db2" in got) == (bias in ("b2", "both"))


ODD = {
    # (T, H, I, E, K, routing kind, transposed x)
    "top1_skewed": (29, 8, 6, 5, 1, "skewed", False),
    "topk_eq_E": (13, 9, 5, 4, 4, "uniform", False),
    "empty_expert": (19, 8, 6, 5, 2, "empty", False),
    "skewed": (41, 7, 6, 6, 2, "skewed", False),
    "no_tokens": (0, 8, 6, 4, 2, "uniform", False),
    "one_token": (1, 8, 6, 3, 2, "one", False),
    "transposed_x": (17, 9, 5, 4, 2, "uniform", True),
}
ODD_ACTS = ("geglu", "squared_relu", "clamped_swiglu")


@pytest.mark.parametrize("name", ODD_ACTS)
@pytest.mark.parametrize("case", list(ODD))
def test_odd_cases_match_oracle(case, name):
    t, h, i, e, k, kind, transpose_x = ODD[case]
    gen = torch.Generator().manual_seed(len(case) * 31 + len(name))
    pb = activation_problem(t, h, i, e, k, name, gen=gen, kind=kind)
    got = run_with_grads(_torch(), pb, transpose_x=transpose_x)
    assert_all_close(got, run_with_grads(moe_experts_reference, pb), F64_TOL)
    if kind == "empty":  # the last expert has no pairs: its gradients are exact zeros
        for g in ("dw13", "dw2", "db13", "db2"):
            assert torch.equal(got[g][-1], torch.zeros_like(got[g][-1])), g


@pytest.mark.parametrize("name", ["gelu", "clamped_swiglu", "geglu_tanh"])
def test_float32_within_bound(name):
    gen = torch.Generator().manual_seed(13)
    pb = activation_problem(64, 32, 24, 8, 2, name, gen=gen)
    assert_all_close(
        run_with_grads(_torch(), pb, dtype=torch.float32),
        run_with_grads(moe_experts_reference, pb),
        1e-5,
    )


def test_act_retain_backwards_twice():
    gen = torch.Generator().manual_seed(14)
    pb = activation_problem(21, 8, 6, 4, 2, "clamped_swiglu", gen=gen)
    twice = run_with_grads(_torch(recompute="act_retain"), pb, retain_twice=True)
    ref = run_with_grads(moe_experts_reference, pb)
    assert_all_close({n: g / 2 if n != "out" else g for n, g in twice.items()}, ref, F64_TOL)


def test_bias_lists_get_their_gradients():
    gen = torch.Generator().manual_seed(15)
    pb = activation_problem(15, 8, 6, 3, 2, "reglu", gen=gen)
    b13 = [r.clone().requires_grad_() for r in pb["b13"]]
    b2 = [r.clone().requires_grad_() for r in pb["b2"]]
    out = moe_experts(pb["x"], pb["w13"], pb["w2"], pb["idx"], pb["probs"], backend="torch",
                      activation="reglu", b13=b13, b2=b2)  # fmt: skip
    out.backward(pb["dy"])
    ref = run_with_grads(moe_experts_reference, pb)
    assert_close("out", out.detach(), ref["out"], F64_TOL)
    assert_close("db13", torch.stack([b.grad for b in b13]), ref["db13"], F64_TOL)
    assert_close("db2", torch.stack([b.grad for b in b2]), ref["db2"], F64_TOL)


@pytest.mark.parametrize("name", ["gelu", "clamped_swiglu"])
def test_expert_ranges_sum_to_the_whole(name):
    """Hop primitives over [0, 2), [2, 5), [5, 6) add up to the oracle's whole: out, dx and
    dprobs accumulate in one buffer each; each range's weight and bias gradients are its slice.
    The bias gradients are ADDED into fp32 accumulators (prefilled with ones here)."""
    gen = torch.Generator().manual_seed(16)
    pb = activation_problem(31, 10, 6, 6, 3, name, gen=gen)
    ref = run_with_grads(moe_experts_reference, pb)
    x, w13, w2, probs, b13, b2 = (pb[n] for n in ("x", "w13", "w2", "probs", "b13", "b2"))
    dy = pb["dy"]
    index = build_routing_index(pb["idx"], 6)
    out, dx, dprobs = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(probs)
    dw13, dw2 = torch.zeros_like(w13), torch.zeros_like(w2)
    db13 = torch.ones(b13.shape, dtype=torch.float32)
    db2 = torch.ones(b2.shape, dtype=torch.float32)
    for (e0, e1), save in zip([(0, 2), (2, 5), (5, 6)], ["act", "none", "act"], strict=True):
        r = slice(e0, e1)
        options = HopOptions(backend="torch", activation=pb["act"])
        kw = dict(expert_range=(e0, e1), b13=b13[r], b2=b2[r], options=options)
        _, saved = expert_hop_forward(x, w13[r], w2[r], probs, index, out_TH=out, save=save, **kw)
        grads = HopGrads(dx_TH=dx, dprobs_TK=dprobs, dw13=dw13[r], dw2=dw2[r], db13=db13[r],
                         db2=db2[r])  # fmt: skip
        expert_hop_backward(dy, x, w13[r], w2[r], probs, index, saved_h=saved, grads=grads, **kw)
    got = dict(out=out, dx=dx, dw13=dw13, dw2=dw2, dprobs=dprobs)
    assert_all_close(got, {n: ref[n] for n in got}, F64_TOL)
    assert_close("db13", db13.double() - 1, ref["db13"], 1e-6)
    assert_close("db2", db2.double() - 1, ref["db2"], 1e-6)


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------
def _args(name="swiglu", **over):
    pb = activation_problem(6, 8, 6, 4, 2, name, gen=torch.Generator().manual_seed(17))
    args = dict(x=pb["x"], w13=pb["w13"], w2=pb["w2"], topk_idx=pb["idx"],
                topk_probs=pb["probs"], activation=pb["act"], b13=pb["b13"],
                b2=pb["b2"])  # fmt: skip
    args.update(over)
    return args


@pytest.mark.parametrize(
    "name, mutate, match",
    [
        ("swiglu", lambda a: a.update(w13=a["w13"][:, :6]),
         r"w13 \(4, 6, 8\) has 6 rows per expert but activation swiglu \(gated.*needs 12"),
        ("gelu", lambda a: a.update(w13=torch.cat([a["w13"]] * 2, 1)),
         r"w13 \(4, 12, 8\) has 12 rows .*activation gelu \(not gated\).*needs 6"),
        ("swiglu", lambda a: a.update(b13=a["b13"][:, :6]),
         r"b13 has shape \(4, 6\), want \(4, 12\)"),
        ("gelu", lambda a: a.update(b2=a["b2"][:, :-1]), r"b2 has shape \(4, 7\), want \(4, 8\)"),
        ("geglu", lambda a: a.update(b13=a["b13"].float()), "b13 is torch.float32 on cpu but w13"),
        ("geglu", lambda a: a.update(b2=a["b2"].to("meta")), "b2 is torch.float64 on meta"),
        ("geglu", lambda a: a.update(b2=2.0), "b2 must be a tensor"),
        ("geglu", lambda a: a.update(b13=[a["b13"][0], a["b13"][1][:-1]] * 2),
         "elements of b13 must be 1-D with one shape"),
        ("geglu", lambda a: a.update(activation="swishglu"), "activation must be None"),
    ],
)  # fmt: skip
def test_bad_inputs_raise(name, mutate, match):
    args = _args(name)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        moe_experts(**args, backend="torch")


def test_hop_backward_needs_bias_grad_buffers():
    a = _args("geglu")
    x, w13, w2, probs = a["x"], a["w13"], a["w2"], a["topk_probs"]
    index = build_routing_index(a["topk_idx"], 4)
    kw = dict(options=HopOptions(backend="torch", activation="geglu"), b13=a["b13"], b2=a["b2"])
    db13, db2 = torch.zeros_like(a["b13"]), torch.zeros_like(a["b2"])
    with pytest.raises(ValueError, match=r"b13 is given but grads.db13 is None; pass a buffer"):
        expert_hop_backward(x, x, w13, w2, probs, index, grads=HopGrads(db2=db2), **kw)
    with pytest.raises(ValueError, match=r"b2 is given but grads.db2 is None"):
        expert_hop_backward(x, x, w13, w2, probs, index, grads=HopGrads(db13=db13), **kw)
    with pytest.raises(ValueError, match=r"grads.db2 has shape \(4, 7\), want b2's \(4, 8\)"):
        grads = HopGrads(db13=db13, db2=a["b2"][:, 1:].clone())
        expert_hop_backward(x, x, w13, w2, probs, index, grads=grads, **kw)


def test_triton_hop_backward_needs_bias_grad_buffers():
    """The Triton hop primitive called directly (as the ring does) checks its bias-gradient
    buffers too, before any work; what it computes is tests/lib/test_triton_activations.py's."""
    from relaymoe.kernels.experts import triton_hop_backward

    a = _args("geglu")
    x, w13, w2, probs, b2 = (a[n].float() for n in ("x", "w13", "w2", "topk_probs", "b2"))
    index = build_routing_index(a["topk_idx"], 4)
    geglu = HopOptions(activation=expert_activation("geglu"))
    with pytest.raises(ValueError, match=r"b2 is given, so grads.db2 must be a buffer shaped"):
        triton_hop_backward(x, x, w13, w2, probs, index, 0, 4, None, b2=b2, options=geglu)
    with pytest.raises(ValueError, match=r"b13 has shape \(4, 5\), want \(4, 12\)"):
        triton_hop_backward(x, x, w13, w2, probs, index, 0, 4, None, b13=b2[:, :5],
                            grads=HopGrads(db13=b2[:, :5]))  # fmt: skip


def test_hop_primitives_refuse_w13_rows_that_are_not_the_activations():
    """A w13 built for another activation is a ValueError at the hop, not a read past it."""
    pb = activation_problem(9, 8, 6, 3, 2, "squared_relu", bias="none")  # w13 (3, 6, 8)
    on_torch = HopOptions(backend="torch")  # the default activation, SwiGLU: 12 rows
    index = build_routing_index(pb["idx"], 3)
    with pytest.raises(ValueError, match="w13 has 6 rows per expert but activation swiglu"):
        expert_hop_forward(pb["x"], pb["w13"], pb["w2"], pb["probs"], index, options=on_torch)
    with pytest.raises(ValueError, match="needs 12"):
        expert_hop_backward(pb["dy"], pb["x"], pb["w13"], pb["w2"], pb["probs"], index,
                            options=on_torch)  # fmt: skip
