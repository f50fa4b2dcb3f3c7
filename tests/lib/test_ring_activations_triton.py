"""The ring's world of one on the Triton backend with an expert MLP other than SwiGLU, biases on:
the ring's own plumbing of ``activation``/``b13``/``b2`` into the Triton hop primitives (fp32
accumulators for the bias gradients, bound-sized pair buffers) against the float64 oracle. The
gloo worlds test the same plumbing on the torch backend; the kernels' own tests cover every
activation."""

from __future__ import annotations

import pytest
import torch

from relaymoe.options import RingConfig
from relaymoe.reference import moe_experts_reference
from relaymoe.ring import ring_moe
from tests.fixtures import activation_problem, rel_err

pytestmark = pytest.mark.skipif(
    not __import__("relaymoe.kernels", fromlist=["interpret_mode"]).interpret_mode()
    and not torch.cuda.is_available(),
    reason="the Triton backend needs CUDA or TRITON_INTERPRET=1",
)


@pytest.mark.parametrize(
    "activation,bias,mode",
    [("clamped_swiglu", "both", "expert"), ("squared_relu", "b2", "token"),
     ("gelu", "both", "alltoall")],
)  # fmt: skip
def test_ring_of_one_on_triton_matches_the_oracle(activation, bias, mode):
    gen = torch.Generator().manual_seed(7)
    pb = activation_problem(29, 24, 20, 6, 2, activation, bias=bias, dtype=torch.float32, gen=gen)
    names = [n for n in ("x", "w13", "w2", "probs", "b13", "b2") if pb[n] is not None]
    ins = {n: pb[n].clone().requires_grad_() for n in names}
    y = ring_moe(
        ins["x"],
        ins["w13"],
        ins["w2"],
        pb["idx"],
        ins["probs"],
        backend="triton",
        activation=pb["act"],
        b13=ins.get("b13"),
        b2=ins.get("b2"),
        config=RingConfig(mode=mode),
    )
    got = torch.autograd.grad(y, [ins[n] for n in names], pb["dy"])
    ref_in = {n: pb[n].double().requires_grad_() for n in names}
    y_ref = moe_experts_reference(ref_in["x"], ref_in["w13"], ref_in["w2"], pb["idx"],
                                  ref_in["probs"], activation=pb["act"], b13=ref_in.get("b13"),
                                  b2=ref_in.get("b2"))  # fmt: skip
    want = torch.autograd.grad(y_ref, [ref_in[n] for n in names], pb["dy"].double())
    assert rel_err(y, y_ref) < 1e-5
    for n, g, w in zip(names, got, want, strict=True):
        assert rel_err(g, w) < 1e-5, n
