"""moe_experts (plain-torch backend) against the float64 oracle; argument checks."""

import zlib

import pytest
import torch

from relaymoe.experts import (
    HopGrads,
    HopOptions,
    expert_hop_backward,
    expert_hop_forward,
    moe_experts,
)
from relaymoe.reference import moe_experts_reference
from relaymoe.routing import build_routing_index
from tests.fixtures import random_problem, rel_err

CASES = [
    # (T, H, I, E, K, kind)
    (37, 24, 20, 6, 3, "uniform"),
    (53, 16, 12, 9, 1, "skewed"),
    (21, 8, 10, 4, 4, "uniform"),  # K = E
    (19, 12, 7, 5, 2, "empty"),
    (1, 8, 6, 3, 2, "one"),
]


def _grads(fn, x, w13, w2, idx, probs, g):
    ins = [t.detach().clone().requires_grad_() for t in (x, w13, w2, probs)]
    y = fn(ins[0], ins[1], ins[2], idx, ins[3])
    torch.autograd.backward(y, g)
    return y.detach(), [t.grad for t in ins]


def case_seed(case) -> int:
    """A seed of the case that every process agrees on (``hash()`` of a str is salted)."""
    return zlib.crc32(repr(case).encode())


@pytest.mark.parametrize("recompute", ["act", "act_retain", "fc1"])
@pytest.mark.parametrize("case", CASES)
def test_torch_backend_matches_oracle(case, recompute):
    t, h, i, e, k, kind = case
    gen = torch.Generator().manual_seed(case_seed(case))
    x, w13, w2, idx, probs = random_problem(t, h, i, e, k, gen=gen, kind=kind)
    g = torch.randn(t, h, generator=gen, dtype=torch.float64)
    y, grads = _grads(
        lambda *a: moe_experts(*a, recompute=recompute, backend="torch"), x, w13, w2, idx, probs, g
    )
    y_ref, grads_ref = _grads(moe_experts_reference, x, w13, w2, idx, probs, g)
    assert rel_err(y, y_ref) < 1e-12
    for a, b in zip(grads, grads_ref, strict=True):
        assert rel_err(a, b) < 1e-12
    if kind == "empty":
        assert torch.equal(grads[1][-1], torch.zeros_like(grads[1][-1]))
        assert torch.equal(grads[2][-1], torch.zeros_like(grads[2][-1]))


def test_float32_within_bound():
    gen = torch.Generator().manual_seed(3)
    x, w13, w2, idx, probs = random_problem(64, 32, 24, 8, 2, gen=gen)
    y = moe_experts(x.float(), w13.float(), w2.float(), idx, probs.float(), backend="torch")
    assert rel_err(y, moe_experts_reference(x, w13, w2, idx, probs)) < 1e-5


def test_expert_ranges_sum_to_full_and_touch_nothing_else():
    gen = torch.Generator().manual_seed(4)
    x, w13, w2, idx, probs = random_problem(40, 10, 8, 7, 3, gen=gen, kind="skewed")
    index = build_routing_index(idx, 7)
    out = torch.zeros_like(x)
    for e0, e1 in [(0, 3), (3, 3), (3, 6), (6, 7)]:
        moe_experts(
            x, w13[e0:e1], w2[e0:e1], idx, probs, index=index, expert_range=(e0, e1), out=out,
            backend="torch",
        )  # fmt: skip
    assert rel_err(out, moe_experts_reference(x, w13, w2, idx, probs)) < 1e-12
    # one range alone equals the oracle restricted to those experts' pairs
    keep = (idx >= 3) & (idx < 6)
    part = moe_experts(x, w13[3:6], w2[3:6], idx, probs, index=index, expert_range=(3, 6))
    assert rel_err(part, moe_experts_reference(x, w13, w2, idx, probs * keep)) < 1e-12


def test_hop_backward_accumulates_into_buffers():
    gen = torch.Generator().manual_seed(5)
    x, w13, w2, idx, probs = random_problem(30, 8, 6, 4, 2, gen=gen)
    index = build_routing_index(idx, 4)
    dy = torch.randn_like(x)
    on_torch = HopOptions(backend="torch")
    full = expert_hop_backward(dy, x, w13, w2, probs, index, options=on_torch)
    dx, dp = torch.zeros_like(x), torch.zeros_like(probs)
    dw13, dw2 = torch.zeros_like(w13), torch.zeros_like(w2)
    for e0, e1 in [(0, 1), (1, 4)]:
        expert_hop_backward(
            dy, x, w13[e0:e1], w2[e0:e1], probs, index, expert_range=(e0, e1),
            grads=HopGrads(dx_TH=dx, dprobs_TK=dp, dw13=dw13[e0:e1], dw2=dw2[e0:e1]),
            options=on_torch,
        )  # fmt: skip
    for a, b in zip((dx, dp, dw13, dw2), full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    _, saved = expert_hop_forward(x, w13, w2, probs, index, save="act", options=on_torch)
    again = expert_hop_backward(dy, x, w13, w2, probs, index, saved_h=saved, options=on_torch)
    for a, b in zip(again, full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hop_backward_allocates_gradients_in_grad_dtype(backend):
    """``grad_dtype``: 16-bit weights, fp32 weight gradients allocated and written by the hop,
    equal to adding into fp32 zeros (what the node-batched ring did before), experts without pairs
    exact zeros."""
    from relaymoe.kernels import interpret_mode

    if backend == "triton" and not interpret_mode():
        pytest.skip("the Triton backend runs under TRITON_INTERPRET=1 on CPU")
    gen = torch.Generator().manual_seed(6)
    x, w13, w2, idx, probs = random_problem(29, 16, 12, 5, 2, gen=gen, kind="empty")
    x, w13, w2, probs = (t.to(torch.float16) for t in (x, w13, w2, probs))
    index = build_routing_index(idx, 5)
    dy = torch.randn(x.shape, generator=gen).to(torch.float16)
    options = HopOptions(backend=backend, grad_dtype=torch.float32)
    got = expert_hop_backward(dy, x, w13, w2, probs, index, options=options)
    z13, z2 = torch.zeros_like(w13, dtype=torch.float32), torch.zeros_like(w2, dtype=torch.float32)
    ref = expert_hop_backward(dy, x, w13, w2, probs, index, grads=HopGrads(dw13=z13, dw2=z2),
                              options=HopOptions(backend=backend))  # fmt: skip
    for a, b in zip(got[2:], ref[2:], strict=True):
        assert a.dtype == torch.float32
        assert torch.equal(a, b)
    assert torch.equal(got[2][-1], torch.zeros_like(got[2][-1]))  # "empty": the last expert


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hop_backward_writes_over_given_gradients(backend):
    """``HopGrads(dw_accumulate=False)``: given weight-gradient buffers full of garbage are
    written over, bitwise what fresh ones get (experts without pairs exact zeros); the other
    gradients are still added into; a range with no pairs gives zeros."""
    from relaymoe.kernels import interpret_mode

    if backend == "triton" and not interpret_mode():
        pytest.skip("the Triton backend runs under TRITON_INTERPRET=1 on CPU")
    gen = torch.Generator().manual_seed(8)
    x, w13, w2, idx, probs = random_problem(27, 16, 12, 5, 2, gen=gen, kind="empty")
    x, w13, w2, probs = (t.float() for t in (x, w13, w2, probs))
    index = build_routing_index(idx, 5)
    dy = torch.randn(x.shape, generator=gen)
    options = HopOptions(backend=backend)
    want = expert_hop_backward(dy, x, w13, w2, probs, index, options=options)
    g13, g2 = torch.full_like(w13, 7.0), torch.full_like(w2, -3.0)
    over = HopGrads(dw13=g13, dw2=g2, dw_accumulate=False)
    got = expert_hop_backward(dy, x, w13, w2, probs, index, grads=over, options=options)
    assert got[2] is g13 and got[3] is g2
    for name, a, b in zip(("dx", "dprobs", "dw13", "dw2"), got, want, strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(g13[-1], torch.zeros_like(g13[-1]))  # "empty": the last expert
    g13.fill_(5.0)
    expert_hop_backward(dy[:0], x[:0], w13, w2, probs[:0], build_routing_index(idx[:0], 5),
                        grads=over, options=options)  # fmt: skip
    assert not g13.any() and not g2.any()


def test_save_and_recompute_names_are_checked():
    """Only the current names are taken (``recompute="none"`` and ``save="fc1"``, old spellings,
    are refused by name)."""
    gen = torch.Generator().manual_seed(6)
    x, w13, w2, idx, probs = random_problem(17, 8, 6, 4, 2, gen=gen)
    index = build_routing_index(idx, 4)
    on_torch = HopOptions(backend="torch")
    _, saved = expert_hop_forward(x, w13, w2, probs, index, save="none", options=on_torch)
    assert saved is None
    for bad in ("all", "fc1"):
        with pytest.raises(ValueError, match=f"save must be one of .* got '{bad}'"):
            expert_hop_forward(x, w13, w2, probs, index, save=bad, options=on_torch)
    with pytest.raises(ValueError, match="recompute must be one of .* got 'none'"):
        moe_experts(x, w13, w2, idx, probs, recompute="none", backend="torch")


def test_zero_tokens():
    x, w13, w2, idx, probs = random_problem(0, 8, 6, 4, 2)
    ins = [t.requires_grad_() for t in (x, w13, w2, probs)]
    y = moe_experts(ins[0], ins[1], ins[2], idx, ins[3], backend="torch")
    assert y.shape == (0, 8)
    y.sum().backward()
    assert torch.equal(ins[1].grad, torch.zeros_like(w13))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(x=a["x"][:, :-1]), "shapes disagree"),
        (lambda a: a.update(w2=a["w2"][:, :, :-1]), "shapes disagree"),
        (lambda a: a.update(topk_probs=a["topk_probs"][:, :1]), "topk_probs shape"),
        (lambda a: a.update(topk_idx=a["topk_idx"][:-1]), "topk_idx must be"),
        (lambda a: a.update(x=a["x"].float()), "dtypes differ"),
        (lambda a: a.update(recompute="all"), "recompute must be one of .*act_retain"),
        (lambda a: a.update(expert_range=(0, 2)), "expert_range"),
        (lambda a: a.update(topk_idx=a["topk_idx"] + 10), "outside \\[0, 4\\)"),
    ],
)
def test_bad_inputs_raise(mutate, match):
    x, w13, w2, idx, probs = random_problem(6, 8, 6, 4, 2)
    args = dict(x=x, w13=w13, w2=w2, topk_idx=idx, topk_probs=probs)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        moe_experts(**args)
