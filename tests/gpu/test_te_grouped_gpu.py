"""The ``te_grouped`` provider of ``benchmarks/bench_experts.py`` computes the same layer as the
float64 oracle (bf16 bound), gradients included, before any of its rows is trusted."""

from __future__ import annotations

import pytest
import torch

from relaymoe.reference import moe_experts_reference
from tests.fixtures import random_routing, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BF16_BOUND = 1e-2


@pytest.mark.parametrize("T,H,I,E,K", [(1024, 256, 128, 16, 4), (777, 512, 256, 8, 1)])
def test_te_grouped_matches_the_oracle(T, H, I, E, K):
    from benchmarks.te_grouped import TEGroupedExperts, unavailable

    why = unavailable()
    if why is not None:
        pytest.skip(why)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w13 = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H**0.5
    w2 = torch.randn(E, H, I, generator=g, dtype=torch.float64) / I**0.5
    idx = random_routing(T, E, K, gen=g, kind="skewed")
    probs = torch.rand(T, K, generator=g, dtype=torch.float64)
    dy = torch.randn(T, H, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, probs)]
    ref = moe_experts_reference(leaves[0], leaves[1], leaves[2], idx, leaves[3])
    ref.backward(dy)
    bf = [t.cuda().to(torch.bfloat16) for t in (x, w13, w2, probs)]
    xb, pb = bf[0].requires_grad_(), bf[3].requires_grad_()
    provider = TEGroupedExperts(bf[1], bf[2], K)
    out = provider(xb, bf[1], bf[2], idx.cuda(), pb)
    out.backward(dy.cuda().to(torch.bfloat16))
    dw13, dw2 = provider.weight_grads()
    got = {"out": out, "dx": xb.grad, "dw13": dw13, "dw2": dw2, "dprobs": pb.grad}
    want = {"out": ref, "dx": leaves[0].grad, "dw13": leaves[1].grad, "dw2": leaves[2].grad,
            "dprobs": leaves[3].grad}  # fmt: skip
    errs = {k: rel_err(got[k].double().cpu(), want[k]) for k in got}
    assert all(e < BF16_BOUND for e in errs.values()), errs
