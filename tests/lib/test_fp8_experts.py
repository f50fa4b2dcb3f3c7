"""fp8 experts on the Triton interpreter (fp32 inputs): each fp8 GEMM against float64 on the
same fp8 operands (the kernels' error is then fp32 accumulation only: relative error below
``ACC`` = 1e-5 with fp32 outputs, where an fp32 sum of K exact fp8 products is off by about
sqrt(K) * 2^-24 of the sum of their magnitudes), then ``moe_experts(fp8=...)`` against the
float64 emulation of the whole recipe (``tests/fp8_emulation.py``: the same quantised inputs,
weights and intermediates, float64 GEMMs), the weight cache and the call-time refusals.

What the interpreter cannot tell (the GPU tests do, ``tests/gpu/test_fp8_experts_gpu.py``): the
hardware's fp8 tensor-core accumulation (the interpreter multiplies fp8 exactly in fp32), its
cast (here an explicit rounding, ``quantize.py``), bf16, and the tile configurations of the GPU.
"""

from __future__ import annotations

import pytest
import torch

from relaymoe.activation import SWIGLU
from relaymoe.experts import moe_experts
from relaymoe.fp8_recipe import Fp8Recipe
from relaymoe.fp8_state import Fp8State, capability_problem
from relaymoe.kernels import interpret_mode, pairs
from relaymoe.kernels.fp8 import quant_torch as qt
from relaymoe.kernels.fp8.quantize import quantize_rows
from relaymoe.kernels.fp8.rows import fp8_rows_gemm
from relaymoe.kernels.fp8.up import fp8_up
from relaymoe.kernels.fp8.weights import quantize_expert_weights
from relaymoe.kernels.fp8.wgrad import fp8_wgrad
from relaymoe.kernels.grouped.swiglu import SwigluFp8, swiglu_backward
from relaymoe.options import KernelOptions
from relaymoe.reference import moe_experts_reference, reference_activation
from relaymoe.routing import build_routing_index
from tests.fixtures import random_routing, rel_err
from tests.fp8_emulation import (
    RecordedScaling,
    check_delayed_window,
    dequant_input,
    dequant_weights,
    fp8_emulation,
    run_layer,
)

pytestmark = pytest.mark.skipif(
    not interpret_mode(), reason="CPU tests run the kernels under TRITON_INTERPRET=1"
)

ACC = 1e-5  # fp32 accumulation of exact fp8 products, fp32 outputs
EMU = 1e-5  # the whole layer against its float64 emulation (fp32 inputs and intermediates)
F64 = torch.float64
# the bf16 weight gradients of blockwise run torch's grouped GEMM here (fast on CPU); the Triton
# bf16 weight-gradient kernel is tested in test_kernels.py
GMM = KernelOptions(wgrad="gmm")


def _problem(t, h, i, e, k, kind="uniform", seed=0):
    """x, w13, w2, ids, probabilities; the weights' 128-wide row and column blocks at scales a
    power of two apart (so that a blockwise kernel reading another block's scale is caught)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    for w in (w13, w2):
        w[:, 128:] *= 4.0
        w[:, :, 128:] *= 0.125
    idx = random_routing(t, e, k, gen=g, kind=kind)
    probs = torch.rand(t, k, generator=g)
    return x, w13, w2, idx, probs


def _pair_layout(index):
    """(tok, expert) of each pair position (expert-grouped order) and the full range's offs."""
    offs = index.offsets_for(0, index.num_experts)
    counts = (offs[1:] - offs[:-1]).long()
    expert = torch.repeat_interleave(torch.arange(index.num_experts), counts)
    return index.expert_token_indices.long(), expert, offs


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_up_projection_against_float64_on_its_fp8_operands(recipe):
    r = Fp8Recipe(recipe)
    h_dim, i_dim = (128, 128) if r.blockwise else (72, 40)
    x, w13, w2, idx, probs = _problem(29, h_dim, i_dim, 5, 2, "skewed", seed=3)
    w13[:, i_dim:] *= 2.0  # the up half's blocks scaled apart from the gate half's
    index = build_routing_index(idx, 5)
    tok, expert, offs = _pair_layout(index)
    n = tok.shape[0]
    wq = quantize_expert_weights(w13, w2, r)
    xd = dequant_input(x, "e4m3", r)
    if r.blockwise:
        xq, x_inv = quantize_rows(x, "e4m3")
    else:
        s = qt.scale_from_amax(x.abs().amax(), "e4m3").reshape(1)
        xq, x_inv = quantize_rows(x, "e4m3", scale=s)[0], 1.0 / s
    prob_P = pairs.pair_probs(probs, index.token_index_map, offs, n)
    h = torch.full((n, 2 * i_dim), float("nan"))
    a = torch.full((n, i_dim), float("nan"))
    amax = torch.zeros(1)
    blocks = None
    if r.blockwise:
        blocks = (torch.empty(n, i_dim, dtype=torch.float8_e4m3fn), torch.empty(n, i_dim // 128))
    fp8_up(xq, x_inv, wq.w13, wq.inv13, index.expert_token_indices, offs, prob_P, h_PJ=h,
           a_PI=a, a_amax=amax, a_blocks=blocks)  # fmt: skip
    w13d, _ = dequant_weights(wq)
    h_ref = torch.einsum("ph,pjh->pj", xd[tok], w13d[expert])
    assert rel_err(h, h_ref) < ACC
    a_ref = reference_activation(SWIGLU, h_ref) * prob_P.to(F64)[:, None]
    assert rel_err(a, a_ref) < ACC
    assert amax.item() == a.abs().max().item()
    if r.blockwise:  # a quantised in the epilogue: exactly the torch quantiser on the stored a
        want_q, want_inv = qt.quantize_rows(a, "e4m3")
        assert torch.equal(blocks[0].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(blocks[1], want_inv)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("gather", [True, False])
def test_row_gemm_against_float64_on_its_fp8_operands(recipe, gather):
    r = Fp8Recipe(recipe)
    h_dim, i_dim = (256, 256) if r.blockwise else (72, 40)
    x, w13, w2, idx, _ = _problem(11, h_dim, i_dim, 4, 3, "empty", seed=4)
    index = build_routing_index(idx, 4)
    tok, expert, offs = _pair_layout(index)
    n = tok.shape[0]
    wq = quantize_expert_weights(w13, w2, r)
    _, w2d = dequant_weights(wq)
    if gather:  # g = dy[tok] @ w2[e]: dy e5m2 gathered, w2 through its transposed copy
        a_src, b, inv_idx = x, wq.w2_t.transpose(1, 2), (0, 2, 1)
        b_ref = w2d  # (E, H, I) = (E, K, N)
    else:  # y = a @ w2[e]^T: a in pair order
        a_src, b, inv_idx = torch.randn(n, i_dim), wq.w2.transpose(1, 2), (0, 1, 2)
        b_ref = w2d.transpose(1, 2)
    fmt = "e5m2" if gather else "e4m3"
    if r.blockwise:
        a_q, a_inv = quantize_rows(a_src, fmt)
    else:
        a_q, a_inv = quantize_rows(a_src, fmt, scale=torch.tensor([3.0]))[0], torch.tensor([1 / 3])
    ad = (qt.dequantize_rows(a_q, a_inv) if r.blockwise else a_q.float() * a_inv).to(F64)
    strides = None
    if r.blockwise:
        st = wq.inv2.stride()
        strides = tuple(st[j] for j in inv_idx)
    c = torch.full((n, b.shape[2]), float("nan"))
    fp8_rows_gemm(a_q, a_inv, b, wq.inv2, offs, c, a_idx=index.expert_token_indices if gather
                  else None, b_inv_strides=strides)  # fmt: skip
    rows = ad[tok] if gather else ad
    ref = torch.einsum("pk,pkn->pn", rows, b_ref[expert])
    assert rel_err(c, ref) < ACC


def test_weight_gradients_against_float64_on_their_fp8_operands():
    x, w13, w2, idx, _ = _problem(31, 40, 24, 4, 2, "empty", seed=5)
    index = build_routing_index(idx, 4)
    tok, expert, offs = _pair_layout(index)
    n = tok.shape[0]
    s_x, s_c = torch.tensor([2.0]), torch.tensor([5.0])
    xq = quantize_rows(x, "e4m3", scale=s_x)[0]
    c_src = torch.randn(n, 48)  # dh-like, in pair order
    cq = quantize_rows(c_src, "e5m2", scale=s_c)[0]
    xd, cd = xq.to(F64) / 2.0, cq.to(F64) / 5.0
    dw = torch.full((4, 48, 40), float("nan"))
    fp8_wgrad(cq, 1 / s_c, xq, 1 / s_x, index.expert_token_indices, offs, dw, a_gather=False,
              accumulate=False)  # fmt: skip
    ref = torch.zeros(4, 48, 40, dtype=F64).index_add_(0, expert, cd[:, :, None] * xd[tok][:, None])
    assert rel_err(dw, ref) < ACC
    assert torch.equal(dw[3], torch.zeros_like(dw[3]))  # the expert without pairs: zeros
    before = dw.clone()
    # the other operand gathered, into a strided view
    fp8_wgrad(xq, 1 / s_x, cq, 1 / s_c, index.expert_token_indices, offs, dw.transpose(1, 2),
              a_gather=True, accumulate=True)  # fmt: skip
    assert rel_err(dw, before + ref) < ACC


def test_activation_backward_fp8_outputs_are_the_quantisers_of_what_it_stores():
    g = torch.Generator().manual_seed(6)
    n, i_dim = 37, 256
    h, g_in = torch.randn(n, 2 * i_dim, generator=g), torch.randn(n, i_dim, generator=g)
    h[:, :i_dim] *= 3.0  # a large gate, a small up: the up half of dh holds its amax
    h[:, i_dim:] *= 0.05
    prob = torch.rand(n, generator=g)
    plain = (torch.empty_like(h), g_in.clone(), torch.empty(n))
    swiglu_backward(h, plain[1], prob, plain[0], plain[2], block_cols=128)  # as the fp8 pass
    amax = torch.zeros(2)
    dh, pa, dprob = torch.empty_like(h), g_in.clone(), torch.empty(n)
    blocks = (torch.empty(n, 2 * i_dim, dtype=torch.float8_e5m2), torch.empty(n, 4))
    swiglu_backward(h, pa, prob, dh, dprob, fp8=SwigluFp8(amax=amax, dh_blocks=blocks,
                                                          fmt="e5m2"))  # fmt: skip
    for got, want in zip((dh, pa, dprob), plain, strict=True):  # the bf16 outputs unchanged
        assert torch.equal(got, want)
    assert amax[0] == dh.abs().max() and amax[1] == pa.abs().max()
    want_q, want_inv = qt.quantize_rows(dh, "e5m2")
    assert torch.equal(blocks[0].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(blocks[1], want_inv)


CASES = [
    # (recipe, (T, H, I, E, K, routing), recompute)
    ("tensorwise", (24, 40, 24, 4, 2, "uniform"), "act"),
    ("tensorwise", (13, 72, 40, 5, 5, "skewed"), "fc1"),  # K = E, nothing a tile multiple
    ("tensorwise", (19, 48, 32, 3, 1, "one"), "act_retain"),  # top-1, one hot expert
    ("tensorwise", (37, 40, 24, 6, 2, "empty"), "act"),  # an expert without tokens
    ("blockwise", (16, 128, 128, 2, 1, "uniform"), "act"),
    ("blockwise", (6, 256, 256, 3, 2, "empty"), "fc1"),  # an expert without tokens
]


@pytest.mark.parametrize("recipe,case,recompute", CASES, ids=lambda c: str(c))
def test_moe_experts_fp8_matches_its_float64_emulation(recipe, case, recompute):
    """On the kernels' own tensor scales (``RecordedScaling``; the emulation's docstring says
    why), whose amaxes are those of the whole tensors as stored (no padded row, no row of an
    empty expert): the emulation's to fp32 rounding."""
    *dims, kind = case
    x, w13, w2, idx, probs = _problem(*dims, kind=kind, seed=sum(dims))
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    state = Fp8State(recipe)
    recorded = None if state.scales is None else RecordedScaling(state.scales)
    state.scales = recorded if recorded is not None else state.scales
    got = run_layer(x, w13, w2, idx, probs, dy, fp8=state, recompute=recompute, kernels=GMM)
    own = {}
    want = fp8_emulation(x, state.expert_weights(w13, w2), idx, probs, dy, state.recipe,
                         amax=recorded.amax if recorded else None, own_amax=own)  # fmt: skip
    for name in got:
        assert rel_err(got[name], want[name]) < EMU, (name, rel_err(got[name], want[name]))
    if recorded is not None:
        assert set(recorded.amax) == set(own) == {"x", "a", "dy", "dh", "pa"}
        for role, amax in recorded.amax.items():
            assert abs(amax / own[role] - 1) < EMU, (role, amax, own[role])
    if kind == "empty":
        assert torch.equal(got["dw13"][-1], torch.zeros_like(got["dw13"][-1]))
    # and the recipe's own error against the unquantised float64 oracle: a few percent
    ref = moe_experts_reference(x.double(), w13.double(), w2.double(), idx, probs.double())
    assert rel_err(got["out"], ref) < 0.15


def test_delayed_scaling_keeps_a_step_in_its_window_for_history_len_calls():
    """TE's ``DelayedScaling``: a step's amax stays in the window for ``amax_history_len`` calls
    (``check_delayed_window`` says what is asserted). Also: the weight gradients in bf16 on
    request."""
    x, w13, w2, idx, probs = _problem(12, 40, 24, 3, 2, seed=7)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    check_delayed_window(x, w13, w2, idx, probs, dy, hist_len=2)
    bf16_w = Fp8Recipe("tensorwise", fp8_wgrad=False)
    got = run_layer(x, w13, w2, idx, probs, dy, fp8=bf16_w, kernels=GMM)
    want = fp8_emulation(x, quantize_expert_weights(w13, w2, bf16_w), idx, probs, dy, bf16_w)
    for name in got:
        assert rel_err(got[name], want[name]) < EMU, name


def test_weights_are_quantised_once_per_step():
    x, w13, w2, idx, probs = _problem(12, 32, 16, 3, 2, seed=8)
    state = Fp8State("tensorwise")
    w13, w2 = w13.requires_grad_(), w2.requires_grad_()
    for _ in range(2):  # two micro-batches of one step
        moe_experts(x, w13, w2, idx, probs, backend="triton", fp8=state).sum().backward()
    assert state.quantizations == 1
    with torch.no_grad():  # the optimizer step: an in-place update bumps the version
        w13.sub_(0.01 * w13.grad)
    moe_experts(x, w13, w2, idx, probs, backend="triton", fp8=state)
    assert state.quantizations == 2
    w13.data.mul_(2.0)  # bypasses the version counter: the owner says so
    state.invalidate()
    moe_experts(x, w13, w2, idx, probs, backend="triton", fp8=state)
    assert state.quantizations == 3
    lists = ([w.detach() for w in w13], [w.detach() for w in w2])  # Megatron's per-expert weights
    for _ in range(2):
        moe_experts(x, *lists, idx, probs, backend="triton", fp8=state)
    assert state.quantizations == 4
    other = w13.detach().clone()  # a new tensor of the same values is another weight
    moe_experts(x, other, w2, idx, probs, backend="triton", fp8=state)
    assert state.quantizations == 5
    # so is another tensor object at the same storage and version: a freed weight's address
    # and version 0 come back with the next stacked copy, so identity is part of the key
    alias = other.detach()
    moe_experts(x, alias, w2, idx, probs, backend="triton", fp8=state)
    assert state.quantizations == 6


def test_fp8_calls_the_kernels_cannot_honour_are_refused(monkeypatch):
    x, w13, w2, idx, probs = _problem(8, 40, 24, 2, 1)
    call = lambda **kw: moe_experts(x, w13, w2, idx, probs, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="backend='torch'"):
        call(fp8="tensorwise", backend="torch")
    with pytest.raises(ValueError, match="float64"):
        moe_experts(x.double(), w13.double(), w2.double(), idx, probs, fp8="tensorwise")
    with pytest.raises(ValueError, match="biases"):
        call(fp8="tensorwise", b2=torch.zeros(2, 40))
    with pytest.raises(ValueError, match="H \\(hidden size\\) = 40 is not a multiple of 128; "
                                         "pad it to 128"):  # fmt: skip
        call(fp8="blockwise")
    with pytest.raises(ValueError, match="Fp8State\\('delayed'\\)"):
        call(fp8="delayed")
    with pytest.raises(ValueError, match="recipe name"):
        call(fp8=3)
    monkeypatch.setattr("relaymoe.kernels.interpret_mode", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        call(fp8="tensorwise")
    problem = capability_problem((8, 0), "NVIDIA A100-SXM4-80GB")
    assert "A100" in problem and "capability 8.0 (sm80)" in problem and "Hopper" in problem
    assert capability_problem((9, 0), "H100") is None


def test_blockwise_expert_ranges_add_up_and_out_accumulates():
    """Blockwise scales are local (x's and a's rows, weight blocks): ranges of experts computed
    apart add up to the whole layer (the ring's hops), and ``out=`` is added into."""
    x, w13, w2, idx, probs = _problem(10, 128, 128, 4, 2, seed=9)
    index = build_routing_index(idx, 4)
    kw = {"fp8": "blockwise", "backend": "triton", "index": index}
    whole = moe_experts(x, w13, w2, idx, probs, **kw)
    parts = torch.ones_like(x)
    for e0, e1 in [(0, 1), (1, 4)]:
        moe_experts(x, w13[e0:e1], w2[e0:e1], idx, probs, expert_range=(e0, e1), out=parts, **kw)
    assert rel_err(parts - 1.0, whole) < ACC
