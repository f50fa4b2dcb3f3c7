"""Fused expert kernels on the GPU: bf16 against the float64 oracle at real sizes.

Skipped without CUDA; run by ``scripts/gpu_suite.sh``. bf16 relative-error bound 1e-2
(CONTRIBUTING.md); outputs poisoned (NaN) where the kernels write them.

Every test pins each kernel's first config (``RELAYMOE_AUTOTUNE=0``, read by ``use_env`` into
the ``KernelOptions`` the test passes as ``kernels=``): correctness does not
depend on the config, and autotuning compiles and times every config of every kernel per shape
key (on 2026-11-30 the file then overran its limit). The autotuned path, with its own hazard
(kernels that write in place re-run per config), is checked where it runs: ``bench_experts.py``
compares every gradient with the naive implementation at the real shapes and exits 1 on a
disagreement.
"""

from __future__ import annotations

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
from tests.fixtures import random_routing, rel_err, use_env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BF16_BOUND = 1e-2

CASES = [
    # (T, H, I, E, K, kind)
    (4096, 2048, 768, 128, 8, "uniform"),  # qwen3-30b-a3b layer, fewer tokens
    (2048, 1024, 4096, 16, 4, "skewed"),  # moeblaze conf3 widths
    (1531, 1000, 700, 24, 3, "empty"),  # nothing a multiple of a tile
    (777, 512, 384, 8, 1, "one"),  # top-1, one hot expert
    (300, 256, 192, 6, 6, "uniform"),  # K = E
]


def _problem(t, h, i, e, k, kind, seed):
    # float64 values drawn on the GPU: at the qwen3 widths w13 and w2 hold 600M values, which
    # took ~15 s per test on the host's generator (2026-11-30, the file's whole time budget)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = {"generator": gen, "dtype": torch.float64, "device": "cuda"}
    x = torch.randn(t, h, **kw)
    w13 = torch.randn(e, 2 * i, h, **kw) / h**0.5
    w2 = torch.randn(e, h, i, **kw) / i**0.5
    idx = random_routing(t, e, k, gen=torch.Generator().manual_seed(seed), kind=kind).cuda()
    probs = torch.rand(t, k, **kw)
    return [x, w13, w2, idx, probs]


def _run(fn, x, w13, w2, idx, probs, dy, dtype):
    ins = [v.detach().to(dtype).requires_grad_() for v in (x, w13, w2, probs)]
    y = fn(ins[0], ins[1], ins[2], idx, ins[3])
    y.backward(dy.to(dtype))
    return [y.detach()] + [v.grad for v in ins]


def _assert_bf16_matches_oracle(x, w13, w2, idx, probs, recompute, kernels):
    """moe_experts (Triton, bf16, ``kernels``: a ``KernelOptions``) within BF16_BOUND of the
    float64 oracle in the output and every gradient; returns its (out, dx, dw13, dw2, dprobs)."""
    dy = torch.randn_like(x)
    got = _run(lambda *a: moe_experts(*a, recompute=recompute, backend="triton", kernels=kernels),
               x, w13, w2, idx, probs, dy, torch.bfloat16)  # fmt: skip
    ref = _run(moe_experts_reference, x, w13, w2, idx, probs, dy, torch.float64)
    for name, a, b in zip(("out", "dx", "dw13", "dw2", "dprobs"), got, ref, strict=True):
        assert rel_err(a, b) < BF16_BOUND, (name, rel_err(a, b))
    return got


@pytest.mark.parametrize("recompute", ["act", "fc1"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_bf16_matches_float64_oracle(case, recompute, monkeypatch):
    kernels = use_env(monkeypatch, RELAYMOE_AUTOTUNE="0").kernels
    got = _assert_bf16_matches_oracle(*_problem(*case, seed=sum(case[:5])), recompute, kernels)
    if case[-1] == "empty":
        assert torch.equal(got[2][-1], torch.zeros_like(got[2][-1]))
        assert torch.equal(got[3][-1], torch.zeros_like(got[3][-1]))


def test_ranges_sum_to_full_and_are_deterministic(monkeypatch):
    k_opts = use_env(monkeypatch, RELAYMOE_AUTOTUNE="0").kernels
    t, h, i, e, k = 2048, 1024, 512, 32, 4
    x, w13, w2, idx, probs = _problem(t, h, i, e, k, "skewed", seed=7)
    x, w13, w2, probs = (v.to(torch.bfloat16) for v in (x, w13, w2, probs))
    index = build_routing_index(idx, e)
    dy = torch.randn_like(x)
    tri = {"options": HopOptions(backend="triton", kernels=k_opts)}
    full_out, full_h = expert_hop_forward(x, w13, w2, probs, index, **tri)
    again_out, again_h = expert_hop_forward(x, w13, w2, probs, index, **tri)
    assert torch.equal(full_out, again_out) and torch.equal(full_h, again_h)
    full = expert_hop_backward(dy, x, w13, w2, probs, index, saved_h=full_h, **tri)
    again = expert_hop_backward(dy, x, w13, w2, probs, index, saved_h=full_h, **tri)
    for a, b in zip(full, again, strict=True):
        assert torch.equal(a, b)
    out = torch.zeros_like(x)
    dx, dp = torch.zeros_like(x), torch.zeros_like(probs)
    dw13 = torch.full_like(w13, float("nan"))
    dw2 = torch.full_like(w2, float("nan"))
    for e0, e1 in [(0, 5), (5, 5), (5, 31), (31, 32)]:
        part = (w13[e0:e1], w2[e0:e1], probs, index)  # the range's weights, then the routing
        kw = {"expert_range": (e0, e1), **tri}
        _, h_part = expert_hop_forward(x, *part, out_TH=out, **kw)
        grads = HopGrads(dx_TH=dx, dprobs_TK=dp)
        d = expert_hop_backward(dy, x, *part, saved_h=h_part, grads=grads, **kw)
        dw13[e0:e1], dw2[e0:e1] = d[2], d[3]
    ref = moe_experts_reference(*(v.double() for v in (x, w13, w2)), idx, probs.double())
    assert rel_err(out, ref) < BF16_BOUND
    for a, b in zip((dx, dp, dw13, dw2), full, strict=True):
        assert rel_err(a, b) < BF16_BOUND


@pytest.mark.parametrize(
    "dense,chunk_mib,wgrad,tma",
    [("triton", "512", "triton", "0"), ("auto", "1", "triton", "0"), ("auto", "512", "gmm", "0"),
     ("auto", "1", "gmm", "0"), ("auto", "512", "gmm", "1"), ("auto", "512", "gmm", "auto"),
     ("auto", "512", "triton", "1"), ("auto", "512", "auto", "auto")],
)  # fmt: skip
def test_backend_switches_match_oracle(dense, chunk_mib, wgrad, tma, monkeypatch):
    """Each dispatch variant (Triton/torch._grouped_mm dense GEMMs, column-chunked (P, H)
    buffers: 1 MiB -> 256-column strided weight views, weight gradients by the Triton kernel or
    by torch._grouped_mm over gathered column chunks, up_swiglu's weight tiles by TMA) against
    float64 at the qwen3 widths, with pinned configs: each variant autotuned would tune new shape
    keys."""
    kernels = use_env(monkeypatch, RELAYMOE_AUTOTUNE="0", RELAYMOE_TMA=tma, RELAYMOE_WGRAD=wgrad,
                      RELAYMOE_DENSE_GEMM=dense,
                      RELAYMOE_PAIR_BUFFER_MIB=chunk_mib).kernels  # fmt: skip
    case = (4096, 2048, 768, 128, 8, "skewed")
    _assert_bf16_matches_oracle(*_problem(*case, seed=99), recompute="act", kernels=kernels)


@pytest.mark.parametrize("recompute", ["act", "fc1"])
def test_rows_gather_copy_matches_oracle(recompute, monkeypatch):
    """RELAYMOE_ROWS_GATHER=copy (x and dy gathered into one copy, torch._grouped_mm, the
    separate SwiGLU pass) against float64 at the qwen3 widths, bf16."""
    kernels = use_env(monkeypatch, RELAYMOE_AUTOTUNE="0", RELAYMOE_ROWS_GATHER="copy").kernels
    case = (4096, 2048, 768, 128, 8, "skewed")
    _assert_bf16_matches_oracle(*_problem(*case, seed=98), recompute=recompute, kernels=kernels)


@pytest.mark.parametrize("num_experts", [6, 128])  # the one-hot and the pairwise tile rank
def test_routing_build_survives_garbage_ids(num_experts):
    """Ids a dead peer never sent (the receive buffer's garbage: negative, past E, past E_PAD)
    must not fault the GPU in the unvalidated routing build; valid ids keep their experts."""
    T, K = 5000, 4
    g = torch.Generator(device="cuda").manual_seed(3)
    ids = torch.randint(0, num_experts, (T, K), device="cuda", generator=g, dtype=torch.int32)
    bad = torch.rand(T, K, device="cuda", generator=g) < 0.2
    junk = torch.tensor([-7, num_experts, 4096, 2**30], device="cuda", dtype=torch.int32)
    ids = torch.where(bad, junk[torch.arange(T * K, device="cuda").reshape(T, K) % 4], ids)
    index = build_routing_index(ids, num_experts, validate=False)
    torch.cuda.synchronize()  # a fault of the build surfaces here
    eti, tei = index.expert_token_indices, index.token_expert_indices
    assert ((eti >= 0) & (eti < T)).all()
    good = ~bad.reshape(-1)
    assert torch.equal(tei[good], ids.reshape(-1)[good])
