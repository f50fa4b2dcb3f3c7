"""The warp-specialised Gluon up-projection (``relaymoe.kernels.gather_ws``) on sm90: h and
a = silu(gate) * up * p against float64, over whole and partial expert ranges, in bf16 and fp16.

Skipped without an sm90 GPU or without Triton's Gluon (the module's import)."""

from __future__ import annotations

import pytest
import torch

from relaymoe.kernels import pairs, select
from relaymoe.options import KernelOptions
from relaymoe.routing import build_routing_index
from tests.fixtures import random_routing, rel_err, use_env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs an sm90 GPU",
    ),
]

gather_ws = pytest.importorskip("relaymoe.kernels.gather_ws")

BOUND = 1e-2
QWEN = (4096, 2048, 768, 128, 8)  # (T, H, I, E, K): the qwen3 widths, fewer tokens

CASES = [
    # (T, H, I, E, K, kind, expert range or None for all)
    (*QWEN, "skewed", None),  # qwen3 widths
    (*QWEN, "uniform", (37, 101)),  # a ring hop's range: offs[0] > 0
    (1531, 1024, 700, 24, 3, "empty", None),  # I not a tile multiple; an empty expert
    (777, 512, 384, 8, 1, "one", None),  # top-1, one hot expert
    (300, 256, 192, 6, 6, "uniform", (2, 5)),  # K = E
    (5, 256, 128, 4, 2, "uniform", None),  # fewer pairs than one tile
    (700, 256, 4200, 3, 2, "skewed", None),  # wide experts: the default's WIDE_GROUP_M order
]


def _qwen_up_problem(seed):
    """bf16 x, w13, the routing index and its whole-range offsets at the qwen3 widths."""
    t, h, i, e, k = QWEN
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) / h**0.5).to(torch.bfloat16)
    idx = random_routing(t, e, k, gen=torch.Generator().manual_seed(seed)).cuda()
    index = build_routing_index(idx.to(torch.int32), e)
    return x, w13, index, index.offsets_for(0, e)


def _oracle(x, w13, idx_P, offs, e0):
    """h and silu(gate) * up in float64 for the range's pairs (rows in range order)."""
    starts = offs.tolist()
    hs = []
    for j in range(len(starts) - 1):
        tok = idx_P[starts[j] : starts[j + 1]].long()
        hs.append(x[tok].double() @ w13[e0 + j].double().t())
    h = torch.cat(hs) if hs else x.new_zeros(0, w13.shape[1]).double()
    ffn = h.shape[1] // 2
    gate, up = h[:, :ffn], h[:, ffn:]
    return h, gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_up_swiglu_matches_float64(case, dtype):
    t, h, i, e, k, kind, rng = case
    gen = torch.Generator(device="cuda").manual_seed(t + e)
    x = torch.randn(t, h, device="cuda", generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) / h**0.5).to(dtype)
    idx = random_routing(t, e, k, gen=torch.Generator().manual_seed(e), kind=kind).cuda()
    probs = torch.rand(t, k, device="cuda", generator=gen).to(dtype)
    index = build_routing_index(idx.to(torch.int32), e)
    e0, e1 = rng or (0, e)
    offs = index.offsets_for(e0, e1)
    n_pairs = int(offs[-1] - offs[0])
    prob_P = pairs.pair_probs(probs, index.token_index_map, offs, n_pairs)
    w_range = w13[e0:e1]
    assert gather_ws.supports_up_swiglu(x, w_range)
    h_out = torch.full((n_pairs, 2 * i), float("nan"), device="cuda", dtype=dtype)
    a_out = torch.full((n_pairs, i), float("nan"), device="cuda", dtype=dtype)
    gather_ws.up_swiglu(x, w_range, index.expert_token_indices, offs, prob_P, h_out, a_out)
    tok_P = index.expert_token_indices[int(offs[0]) :]
    h_ref, act_ref = _oracle(x, w13, tok_P, offs - offs[0], e0)
    assert rel_err(h_out, h_ref) < BOUND
    assert rel_err(a_out, act_ref * prob_P.double()[:, None]) < BOUND
    # h alone (the fc1 recompute) and a alone, unscaled
    h_only = torch.full_like(h_out, float("nan"))
    gather_ws.up_swiglu(x, w_range, index.expert_token_indices, offs, None, h_only, None)
    assert torch.equal(h_only, h_out)
    a_only = torch.full_like(a_out, float("nan"))
    gather_ws.up_swiglu(x, w_range, index.expert_token_indices, offs, None, None, a_only)
    assert rel_err(a_only, act_ref) < BOUND


def test_grouped_dispatch_and_triton_agree(monkeypatch):
    """grouped.up_swiglu takes the Gluon kernel on sm90 by default, the Triton one with
    RELAYMOE_GATHER_WS=0 or a Triton config; h is the same bf16 result either way."""
    from relaymoe.kernels import grouped

    t, i, k = QWEN[0], QWEN[2], QWEN[4]
    x, w13, index, offs = _qwen_up_problem(seed=6)
    assert use_env(monkeypatch, RELAYMOE_GATHER_WS=None).kernels == KernelOptions()
    assert select.gather_ws_for("up_swiglu", x, w13, k=KernelOptions()) is gather_ws
    h32 = torch.empty(t * k, 2 * i, device="cuda")  # an fp32 output: the Triton kernel's
    assert select.gather_ws_for("up_swiglu", x, w13, h32, None, k=KernelOptions()) is None
    monkeypatch.setattr(select, "GATHER_WS_UNBUILT", {"up_swiglu": "a build failure"})
    assert (
        select.gather_ws_for("up_swiglu", x, w13, k=KernelOptions()) is None
    )  # remembered: Triton from then on
    monkeypatch.setattr(select, "GATHER_WS_UNBUILT", {})
    outs, taken = {}, {}
    for mode in ("auto", "0"):
        kernels = use_env(monkeypatch, RELAYMOE_GATHER_WS=mode).kernels
        taken[mode] = select.gather_ws_for("up_swiglu", x, w13, k=kernels)
        out = torch.full((t * k, 2 * i), float("nan"), device="cuda", dtype=torch.bfloat16)
        grouped.up_swiglu(x, w13, index.expert_token_indices, offs, None, out, None,
                          kernels=kernels)  # fmt: skip
        outs[mode] = out
    # the environment reaches the kernels through the options its entry point builds
    assert taken == {"auto": gather_ws, "0": None}, taken
    assert not select.GATHER_WS_UNBUILT, select.GATHER_WS_UNBUILT  # the Gluon kernel built
    assert torch.equal(outs["auto"], outs["0"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_rows_gemm_matches_float64(case, dtype):
    """c[q] = dy[tok[q]] @ w2[e] (the down projection's backward), N = I not always a multiple
    of the 256-column tile, through grouped.rows_gemm's dispatch."""
    from relaymoe.kernels import grouped

    t, h, i, e, k, kind, rng = case
    gen = torch.Generator(device="cuda").manual_seed(t + e + 1)
    dy = torch.randn(t, h, device="cuda", generator=gen).to(dtype)
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) / h**0.5).to(dtype)
    idx = random_routing(t, e, k, gen=torch.Generator().manual_seed(e + 1), kind=kind).cuda()
    index = build_routing_index(idx.to(torch.int32), e)
    e0, e1 = rng or (0, e)
    offs = index.offsets_for(e0, e1)
    n_pairs = int(offs[-1] - offs[0])
    aligned = (i * dy.element_size()) % 16 == 0  # TMA's row stride rule on w2's (El*H, I) rows
    assert select.gather_ws_for("rows_gemm", dy, w2[e0:e1], k=KernelOptions()) is (
        gather_ws if aligned else None
    )
    c = torch.full((n_pairs, i), float("nan"), device="cuda", dtype=dtype)
    grouped.rows_gemm(dy, w2[e0:e1], offs, c, a_idx=index.expert_token_indices)
    tok = index.expert_token_indices[int(offs[0]) :].long()
    starts = (offs - offs[0]).tolist()
    ref = torch.cat([dy[tok[starts[j] : starts[j + 1]]].double() @ w2[e0 + j].double()
                     for j in range(e1 - e0)])  # fmt: skip
    assert rel_err(c, ref) < BOUND


def test_up_swiglu_is_deterministic():
    t, i, k = QWEN[0], QWEN[2], QWEN[4]
    x, w13, index, offs = _qwen_up_problem(seed=5)
    outs = []
    for _ in range(2):
        a = torch.empty(t * k, i, device="cuda", dtype=torch.bfloat16)
        gather_ws.up_swiglu(x, w13, index.expert_token_indices, offs, None, None, a)
        outs.append(a)
    assert torch.equal(outs[0], outs[1])
