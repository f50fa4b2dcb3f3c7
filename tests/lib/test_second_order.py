"""Second-order gradients (``create_graph=True``): right, or refused at once, never wrong.

A gradient penalty ``L + ||dL/dx||^2`` or a Hessian-vector product differentiates a backward.
The hand-written backwards of ``moe_experts`` (both backends, every recompute mode), ``ring_moe``
and ``linear_cross_entropy`` are not differentiable again: each refuses instead of returning a
second-order gradient that silently drops terms. The float64 oracle
(``relaymoe.reference.moe_experts_reference``, plain autograd), which the refusal names as the
fix, gives the penalty's gradient.
"""

from __future__ import annotations

import pytest
import torch

from relaymoe.experts import moe_experts
from relaymoe.kernels import interpret_mode
from relaymoe.reference import moe_experts_reference
from tests.fixtures import random_problem, rel_err

RECOMPUTES = ("act", "act_retain", "fc1")
BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 on CPU"),
    ),
]


def _problem(backend: str, bias: bool):
    gen = torch.Generator().manual_seed(7)
    x, w13, w2, idx, probs = random_problem(9, 8, 6, 4, 2, gen=gen)
    b13 = torch.randn(4, 12, generator=gen, dtype=torch.float64) if bias else None
    b2 = torch.randn(4, 8, generator=gen, dtype=torch.float64) if bias else None
    dtype = torch.float64 if backend == "torch" else torch.float32  # the interpreter's fp32
    leaves = [t.to(dtype).requires_grad_() for t in (x, w13, w2, probs)]
    biases = [None if b is None else b.to(dtype).requires_grad_() for b in (b13, b2)]
    return leaves, idx, biases


def _penalty_grad(fn, leaves, idx, biases):
    """d/d(w13) of ``L + ||dL/dx||^2`` with ``L = sum(y^2)``: needs the backward's backward."""
    x, w13, w2, probs = leaves
    y = fn(x, w13, w2, idx, probs, b13=biases[0], b2=biases[1])
    loss = y.square().sum()
    (dx,) = torch.autograd.grad(loss, x, create_graph=True)
    return torch.autograd.grad(loss + dx.square().sum(), w13)[0]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("recompute", RECOMPUTES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_experts_refuses_create_graph_naming_the_fix(backend, recompute, bias):
    leaves, idx, biases = _problem(backend, bias)

    def experts(*a, **kw):
        return moe_experts(*a, recompute=recompute, backend=backend, **kw)

    with pytest.raises(NotImplementedError) as info:
        _penalty_grad(experts, leaves, idx, biases)
    msg = str(info.value)
    assert "second-order" in msg and "create_graph=True" in msg, msg
    assert "relaymoe.reference.moe_experts_reference" in msg, msg
    # the fix the message names computes the penalty's gradient (plain autograd, float64)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_biases = [None if b is None else b.detach().double() for b in biases]
    ref = _penalty_grad(moe_experts_reference, ref_leaves, idx, ref_biases)
    assert torch.isfinite(ref).all() and ref.norm() > 0
    # first-order gradients on the same inputs still match the oracle (the refusal is
    # create_graph's only)
    y = experts(*leaves[:3], idx, leaves[3], b13=biases[0], b2=biases[1])
    (dw13,) = torch.autograd.grad(y.square().sum(), leaves[1])
    y_ref = moe_experts_reference(*ref_leaves[:3], idx, ref_leaves[3], b13=ref_biases[0],
                                  b2=ref_biases[1])  # fmt: skip
    (dw13_ref,) = torch.autograd.grad(y_ref.square().sum(), ref_leaves[1])
    assert rel_err(dw13, dw13_ref) < (1e-12 if backend == "torch" else 1e-5)


def test_retained_graph_advice_names_modes_that_backward_twice_right():
    """Triton's recompute="act" overwrites its saved pre-activation: the second backward of a
    retained graph is refused, naming the modes that keep first-order gradients right; both
    then give twice the gradient on a second backward."""
    if not interpret_mode():
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    (x, w13, w2, probs), idx, _ = _problem("triton", bias=False)
    y = moe_experts(x, w13, w2, idx, probs, recompute="act", backend="triton")
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"retain_graph=True \(first-order.*'act_retain'.*'fc1'"):
        y.sum().backward()
    for recompute in ("act_retain", "fc1"):
        xk = x.detach().clone().requires_grad_()
        y = moe_experts(xk, w13, w2, idx, probs, recompute=recompute, backend="triton")
        y.sum().backward(retain_graph=True)
        once = xk.grad.clone()
        y.sum().backward()
        assert torch.allclose(xk.grad, 2 * once) and once.norm() > 0, recompute


def _refused_with_penalty(forward, inputs, wrt):
    """``grad(L + ||dL/dx||^2, wrt)`` with ``L = sum(forward(*inputs)^2)``: refused in the first
    backward (create_graph=True). A once-differentiable backward would instead hand back
    gradients detached from ``wrt``, and this ``grad`` would silently return ``dL/dwrt``."""
    loss = forward(*inputs).square().sum()
    with pytest.raises(NotImplementedError) as info:
        (dx,) = torch.autograd.grad(loss, inputs[0], create_graph=True)
        torch.autograd.grad(loss + dx.square().sum(), wrt)
    return str(info.value)


def test_ring_moe_refuses_create_graph():
    from relaymoe.ring import ring_moe

    (x, w13, w2, probs), idx, _ = _problem("torch", bias=False)
    msg = _refused_with_penalty(
        lambda x, w13, w2, probs: ring_moe(x, w13, w2, idx, probs, backend="torch"),
        (x, w13, w2, probs),
        w13,
    )
    assert msg.startswith("ring_moe: second-order gradients (create_graph=True"), msg
    assert "without create_graph=True" in msg, msg
    # first-order gradients are the oracle's
    y = ring_moe(x, w13, w2, idx, probs, backend="torch")
    (dw13,) = torch.autograd.grad(y.square().sum(), w13)
    ref = [t.detach().requires_grad_() for t in (x, w13, w2, probs)]
    y_ref = moe_experts_reference(ref[0], ref[1], ref[2], idx, ref[3])
    assert rel_err(dw13, torch.autograd.grad(y_ref.square().sum(), ref[1])[0]) < 1e-12


def test_linear_cross_entropy_refuses_create_graph():
    from relaymoe.loss import linear_cross_entropy

    gen = torch.Generator().manual_seed(3)
    h = torch.randn(6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (6,), generator=gen)
    msg = _refused_with_penalty(
        lambda h, w: linear_cross_entropy(h, w, labels, impl="torch"), (h, w), w
    )
    assert msg.startswith("linear_cross_entropy: second-order gradients"), msg
    assert "torch.nn.functional.cross_entropy" in msg, msg
