"""A hop in slices of pairs on the GPU (``KernelOptions.hop_slice_mib``): bf16 against the
float64 oracle and against the same call in one pass, at real widths.

A budget of 1 MiB gives slices of 256 pairs (the quantum) at these widths: over a hundred
slices a call, each expert cut somewhere, so every slice path runs (the clamped offsets, out and
dx added from the second slice, a cut expert's weight gradients added twice, an absent expert's
accumulator left untouched). Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from relaymoe.experts import HopGrads, HopOptions, expert_hop_backward, expert_hop_forward
from relaymoe.options import KernelOptions
from relaymoe.reference import moe_experts_reference
from relaymoe.routing import build_routing_index
from tests.fixtures import random_routing, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BF16_BOUND = 1e-2


@pytest.mark.parametrize(
    ("t", "h", "i", "e", "k", "kind"),
    [
        (4096, 2048, 768, 128, 8, "uniform"),
        (1531, 1000, 700, 24, 3, "empty"),
        (777, 512, 384, 8, 1, "one"),
    ],  # fmt: skip
)
def test_sliced_hop_matches_the_oracle_and_one_pass(t, h, i, e, k, kind):
    gen = torch.Generator(device="cuda").manual_seed(t)
    kw = {"generator": gen, "dtype": torch.float64, "device": "cuda"}
    x, dy = torch.randn(t, h, **kw), torch.randn(t, h, **kw)
    w13, w2 = torch.randn(e, 2 * i, h, **kw) / h**0.5, torch.randn(e, h, i, **kw) / i**0.5
    idx = random_routing(t, e, k, gen=torch.Generator().manual_seed(t), kind=kind).cuda()
    probs = torch.rand(t, k, **kw)
    index = build_routing_index(idx, e)
    b = [v.bfloat16() for v in (x, w13, w2, probs, dy)]

    def hop(mib: int, fp32_grads: bool):
        o = HopOptions(backend="triton", kernels=KernelOptions(hop_slice_mib=mib, autotune="first"))
        out, _ = expert_hop_forward(b[0], b[1], b[2], b[3], index, save="none", options=o)
        grads = HopGrads()
        if fp32_grads:  # Megatron's fp32 main_grad, added into (accumulate, reversed rows)
            grads = HopGrads(dw13=torch.zeros(b[1].shape, device="cuda").flip(0),
                             dw2=torch.zeros(b[2].shape, device="cuda").flip(0),
                             dw_reversed=True)  # fmt: skip
        dx, dp, dw13, dw2 = expert_hop_backward(b[4], b[0], b[1], b[2], b[3], index, grads=grads,
                                                options=o)  # fmt: skip
        if fp32_grads:
            dw13, dw2 = dw13.flip(0), dw2.flip(0)
        return [out, dx, dw13, dw2, dp]

    ins = [v.bfloat16().double().requires_grad_() for v in (x, w13, w2, probs)]
    ref = moe_experts_reference(ins[0], ins[1], ins[2], idx, ins[3])
    ref.backward(dy.bfloat16().double())
    want = [ref.detach(), ins[0].grad, ins[1].grad, ins[2].grad, ins[3].grad]
    whole = hop(0, False)
    for fp32_grads in (False, True):
        sliced = hop(1, fp32_grads)
        for name, a, w, r in zip(("out", "dx", "dw13", "dw2", "dprobs"), sliced, whole, want,
                                 strict=True):  # fmt: skip
            assert rel_err(a, r) < BF16_BOUND, (name, fp32_grads, rel_err(a, r))
            assert rel_err(a, w) < BF16_BOUND, (name, fp32_grads, rel_err(a, w))
