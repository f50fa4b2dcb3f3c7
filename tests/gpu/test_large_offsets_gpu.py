"""Large offsets on the GPU (issue #17 item 5): the Triton expert path past 2^31 elements.

Where the kernels keep int64 offsets (token rows of ``x``/``out``/``dx``, expert bases of the
weights), problems whose tensors pass 2^31 elements must still be right:

* ``T*H > 2^31``: tokens past row ``2^31 / H`` read and write the right rows (forward output and
  input gradient checked on rows at both ends against the float64 oracle of those rows alone:
  a token's output and dx depend on its own row only);
* ``E_local*2I*H > 2^31``: experts past element ``2^31`` of ``w13`` (forward and weight gradients
  checked against the torch backend, which indexes in int64, on the last experts).

Skipped without CUDA or with less than 40 GiB free. bf16 bound 1e-2 (CONTRIBUTING.md).
"""

from __future__ import annotations

import pytest
import torch

from relaymoe.experts import moe_experts
from relaymoe.reference import moe_experts_reference
from tests.fixtures import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.mem_get_info()[0] < 40 * 2**30,
        reason="needs CUDA with 40 GiB free",
    ),
]

LIMIT = 2**31
BF16_BOUND = 1e-2


def _routing(T, E, K, gen):
    return torch.rand(T, E, device="cuda", generator=gen).argsort(1)[:, :K].to(torch.int32)


def test_token_rows_past_two_to_the_31_elements():
    H, I, E, K = 2048, 64, 2, 1
    T = LIMIT // H + 4099  # x has more than 2^31 elements; the last rows lie past it
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).bfloat16()
    idx = _routing(T, E, K, gen)
    probs = torch.rand(T, K, device="cuda", generator=gen)
    assert x.numel() > LIMIT
    out = moe_experts(x, w13, w2, idx, probs, backend="triton")
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    out.backward(dy)
    for rows in (torch.arange(0, 512, device="cuda"), torch.arange(T - 512, T, device="cuda")):
        xr = x.detach()[rows].double().requires_grad_()
        ref = moe_experts_reference(xr, w13.double(), w2.double(), idx[rows], probs[rows].double())
        ref.backward(dy[rows].double())
        assert rel_err(out.detach()[rows], ref.detach()) < BF16_BOUND, int(rows[0])
        assert rel_err(x.grad[rows], xr.grad) < BF16_BOUND, int(rows[0])


def test_expert_bases_past_two_to_the_31_elements():
    H, I, E, K, T = 2048, 2048, 264, 2, 8192  # w13: 264 * 4096 * 2048 > 2^31 elements
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).bfloat16()
    assert w13.numel() > LIMIT
    # every token routes to one of the last 8 experts (whose w13 rows lie past 2^31) and one other
    last = torch.randint(E - 8, E, (T, 1), device="cuda", generator=gen)
    other = torch.randint(0, E - 8, (T, 1), device="cuda", generator=gen)
    idx = torch.cat([last, other], 1).to(torch.int32)
    probs = torch.rand(T, K, device="cuda", generator=gen)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    got = {}
    for backend in ("triton", "torch"):
        a = w13.clone().requires_grad_()
        b = w2.clone().requires_grad_()
        out = moe_experts(x, a, b, idx, probs, backend=backend)
        out.backward(dy)
        got[backend] = (out.detach(), a.grad[E - 8 :], b.grad[E - 8 :])
        del a, b, out
        torch.cuda.empty_cache()
    for name, t, r in zip(("out", "dw13 (last experts)", "dw2 (last experts)"), got["triton"],
                          got["torch"], strict=True):  # fmt: skip
        assert rel_err(t, r) < BF16_BOUND, name
