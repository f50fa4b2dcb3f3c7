"""The Triton backend computes every expert MLP kind (``relaymoe.activation``) with and without
the fc1/fc2 biases: against the float64 oracle (fp32 and fp16, under ``TRITON_INTERPRET=1``),
the kernels' pieces alone, expert ranges, bound-sized buffers, empty experts and T = 0."""

from __future__ import annotations

import pytest
import torch

from relaymoe.activation import SWIGLU, ExpertActivation
from relaymoe.activation_torch import activation_backward, activation_forward
from relaymoe.experts import (
    RECOMPUTES,
    HopGrads,
    HopOptions,
    expert_hop_backward,
    expert_hop_forward,
    moe_experts,
)
from relaymoe.kernels import grouped, interpret_mode, select
from relaymoe.options import KernelOptions
from relaymoe.reference import moe_experts_reference
from relaymoe.routing import build_routing_index
from tests.fixtures import (
    BIASES,
    EXPERT_ACTIVATIONS,
    activation_problem,
    assert_all_close,
    expert_activation,
    rel_err,
    run_with_grads,
)

pytestmark = pytest.mark.skipif(
    not interpret_mode(), reason="CPU tests run the kernels under TRITON_INTERPRET=1"
)

F32 = 1e-5
F16 = 5e-3
SHAPE = (37, 24, 20, 5, 2)  # T, H, I, E, K: nothing a multiple of the interpreter's 16 tiles
COPY = KernelOptions(rows_gather="copy")  # h from torch._grouped_mm, the bias in the memory pass


def _triton(**kw):
    return lambda *a, **k: moe_experts(*a, backend="triton", **kw, **k)


COMBOS = [(name, bias) for name in EXPERT_ACTIVATIONS for bias in BIASES]


@pytest.mark.parametrize("name, bias", COMBOS, ids=[f"{n}-{b}" for n, b in COMBOS])
def test_every_activation_and_bias_matches_oracle(name, bias):
    """fp32 against the float64 oracle, forward and every gradient (db13/db2 included), each
    combo once: the recompute modes in turn, and every other activation with h made by
    ``torch._grouped_mm`` (the bias then added by the memory passes, in the forward and in the
    fc1 recompute) instead of the fused up-projection (its epilogue adds it)."""
    i = COMBOS.index((name, bias))
    recompute = RECOMPUTES[i % len(RECOMPUTES)]
    kernels = COPY if (i // len(BIASES)) % 2 else None
    pb = activation_problem(*SHAPE, name, bias=bias, gen=torch.Generator().manual_seed(200 + i))
    got = run_with_grads(_triton(recompute=recompute, kernels=kernels), pb, torch.float32)
    assert_all_close(got, run_with_grads(moe_experts_reference, pb, torch.float64), F32)
    assert ("db13" in got) == (bias in ("b13", "both"))


FP16 = [("geglu", "act"), ("squared_relu", "fc1"), ("clamped_swiglu", "act"), ("gelu_tanh", "fc1")]


@pytest.mark.parametrize("name, recompute", FP16)
def test_fp16_within_bound(name, recompute):
    pb = activation_problem(*SHAPE, name, gen=torch.Generator().manual_seed(len(name)))
    got = run_with_grads(_triton(recompute=recompute), pb, torch.float16)
    assert_all_close(got, run_with_grads(moe_experts_reference, pb, torch.float64), F16)


@pytest.mark.parametrize("name", ["gelu", "clamped_swiglu"])
def test_ranges_with_bound_sized_buffers_sum_to_the_whole(name):
    """Hop primitives over [0, 2), [2, 4), [4, 5) (the last expert gets no pair): out, dx and
    dprobs accumulate in one buffer each, each range's weight and bias gradients are its slice,
    the bias gradients ADDED into fp32 buffers prefilled with ones. The middle range recomputes
    fc1 with buffers sized from a bound (``max_pairs``, rows past the count never read); a
    second backward of it adds bitwise the same bias gradients (fixed summation order)."""
    pb = activation_problem(*SHAPE, name, gen=torch.Generator().manual_seed(21), kind="empty")
    f32 = {n: pb[n].float() for n in ("x", "w13", "w2", "probs", "b13", "b2", "dy")}
    x, w13, w2, probs, b13, b2, dy = f32.values()
    index = build_routing_index(pb["idx"], SHAPE[3])
    out, dx, dprobs = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(probs)
    dw13, dw2 = torch.zeros_like(w13), torch.zeros_like(w2)
    db13, db2 = torch.ones_like(b13), torch.ones_like(b2)
    for e0, e1 in [(0, 2), (2, 4), (4, 5)]:
        r = slice(e0, e1)
        bound = {"max_pairs": x.shape[0] * SHAPE[4]} if e0 == 2 else {}
        options = HopOptions(backend="triton", activation=pb["act"], **bound)
        kw = dict(expert_range=(e0, e1), b13=b13[r], b2=b2[r], options=options)
        save = "none" if bound else "act"
        _, saved = expert_hop_forward(x, w13[r], w2[r], probs, index, out_TH=out, save=save, **kw)
        grads = HopGrads(dx_TH=dx, dprobs_TK=dprobs, dw13=dw13[r], dw2=dw2[r], db13=db13[r],
                         db2=db2[r])  # fmt: skip
        expert_hop_backward(dy, x, w13[r], w2[r], probs, index, saved_h=saved, grads=grads, **kw)
        if bound:  # again into fresh buffers: the bias gradients bitwise the same
            again = HopGrads(db13=torch.ones_like(b13[r]), db2=torch.ones_like(b2[r]))
            expert_hop_backward(dy, x, w13[r], w2[r], probs, index, grads=again, **kw)
            assert torch.equal(again.db13, db13[r]) and torch.equal(again.db2, db2[r])
    ref = run_with_grads(moe_experts_reference, pb, torch.float64)
    got = dict(out=out, dx=dx, dw13=dw13, dw2=dw2, dprobs=dprobs, db13=db13 - 1, db2=db2 - 1)
    assert_all_close(got, {n: ref[n] for n in got}, F32)
    for g in ("dw13", "dw2", "db13", "db2"):  # the empty expert's gradients: exact zeros
        assert torch.equal(got[g][-1], torch.zeros_like(got[g][-1])), g


@pytest.mark.parametrize("name", ["reglu", "gelu"])
def test_no_tokens(name):
    pb = activation_problem(0, 8, 6, 4, 2, name, gen=torch.Generator().manual_seed(5))
    got = run_with_grads(_triton(), pb, torch.float32)
    assert got["out"].shape == (0, 8)
    for n in ("dw13", "dw2", "db13", "db2"):
        assert torch.equal(got[n], torch.zeros_like(got[n])), n


def test_gluon_takes_swiglu_without_bias_only():
    """The one condition of ``select``: the Gluon up-projection stores SwiGLU's a without
    bias, or h alone for any gated fc1 without bias; everything else runs the Triton kernel."""
    b = torch.zeros(2, 4)
    h, a = torch.empty(3, 4), torch.empty(3, 2)
    assert select.gluon_up_computes(None, None, a) and select.gluon_up_computes(SWIGLU, None, a)
    assert select.gluon_up_computes(expert_activation("geglu"), None, None)  # h only
    assert not select.gluon_up_computes(expert_activation("geglu"), None, a)
    assert not select.gluon_up_computes(expert_activation("gelu"), None, None)  # one tile
    assert not select.gluon_up_computes(SWIGLU, b, a)
    assert not select.gluon_up_computes(SWIGLU, b, None)
    assert select.gather_ws_for("up_swiglu", h, h, h, a, k=KernelOptions()) is None  # CPU


# ---------------------------------------------------------------------------------------------
# the kernels' pieces
# ---------------------------------------------------------------------------------------------
def _pairs(seed=4, t=29, e=5, k=2, kind="empty", e0=1, e1=5):
    gen = torch.Generator().manual_seed(seed)
    pb = activation_problem(t, 8, 6, e, k, "swiglu", gen=gen, kind=kind)
    index = build_routing_index(pb["idx"], e)
    start, stop = index.pair_range(e0, e1)
    offs = index.offsets_for(e0, e1)
    expert = torch.repeat_interleave(torch.arange(e1 - e0), index.tokens_per_expert()[e0:e1])
    return index, offs, stop - start, expert, gen


@pytest.mark.parametrize("name", list(EXPERT_ACTIVATIONS))
def test_memory_passes_match_the_torch_activation(name):
    """``swiglu_forward`` (b13 added, h + b13 stored back) and ``swiglu_backward`` (b13 added
    on load) against ``activation_torch`` in float64, over a partial range with an empty expert
    and buffers sized past the pair count (their tail rows belong to no expert: no bias)."""
    act = expert_activation(name)
    index, offs, n, expert, gen = _pairs()
    ffn, rows = 6, act.fc1_rows(6)
    bound = n + 5
    b13 = torch.randn(4, rows, generator=gen)
    h = 3 * torch.randn(bound, rows, generator=gen)
    p = torch.rand(bound, generator=gen)
    h_b = (h[:n] + b13[expert]).double()
    a_ref = activation_forward(act, h_b)
    stored, a = h.clone(), torch.full((bound, ffn), float("nan"))
    grouped.swiglu_forward(stored, p, a, activation=act, b13_EJ=b13, offs=offs, store_h=True)
    assert rel_err(a[:n], a_ref * p[:n, None].double()) < F32
    assert rel_err(stored[:n], h_b) < 1e-6
    g = torch.randn(bound, ffn, generator=gen)
    g0 = g[:n].double()
    dh_ref, a_ref = activation_backward(act, h_b, g0 * p[:n, None].double())
    dh, dprob = torch.full((bound, rows), float("nan")), torch.full((bound,), float("nan"))
    grouped.swiglu_backward(h, g, p, dh, dprob, activation=act, b13_EJ=b13, offs=offs)
    assert rel_err(dh[:n], dh_ref) < F32 and rel_err(g[:n], a_ref * p[:n, None].double()) < F32
    assert rel_err(dprob[:n], (g0 * a_ref).sum(1)) < F32
    g2, dh2 = torch.randn(bound, ffn, generator=gen), torch.empty(bound, rows)
    grouped.swiglu_backward(stored, g2.clone(), p, dh2, dprob, activation=act)  # h holds b13
    dh2_ref, _ = activation_backward(act, h_b, g2[:n].double() * p[:n, None].double())
    assert rel_err(dh2[:n], dh2_ref) < F32


def test_bias_sums_and_the_combine_bias():
    """``segment_sum`` (gathered and scaled, and plain), ``add_bias_dprobs`` and the combine's
    ``p * b2[e]`` against float64 sums, over a partial range with an empty expert; the pair
    buffers' tail rows past the count are NaN and never read."""
    index, offs, n, expert, gen = _pairs(seed=6)
    e0, t, k, hid = 1, 29, 2, 8
    start, _ = index.pair_range(e0, 5)
    tok = index.expert_token_indices[start : start + n].long()
    src = torch.cat([torch.randn(n, 7, generator=gen), torch.full((4, 7), float("nan"))])
    p = torch.cat([torch.rand(n, generator=gen), torch.full((4,), float("nan"))])
    dy = torch.randn(t, hid, generator=gen)
    out = torch.ones(4, 7)
    grouped.segment_sum(src, offs, out)
    ref = torch.zeros(4, 7, dtype=torch.float64).index_add_(0, expert, src[:n].double())
    assert rel_err(out - 1, ref) < F32 and torch.equal(out[-1], torch.ones(7))
    db2 = torch.zeros(4, hid)
    grouped.segment_sum(dy, offs, db2, idx_P=index.expert_token_indices, scale_P=p)
    ref = torch.zeros(4, hid, dtype=torch.float64).index_add_(
        0, expert, dy[tok].double() * p[:n, None].double()
    )
    assert rel_err(db2, ref) < F32
    b2 = torch.randn(4, hid, generator=gen)
    probs = torch.rand(t, k, generator=gen)
    te = index.token_expert_indices.long().view(t, k)
    live = (te >= e0).double()
    dots = (dy.double()[:, None, :] * b2.double()[(te - e0).clamp(min=0)]).sum(2)
    dprobs = torch.ones(t, k)
    grouped.add_bias_dprobs(dy, b2, index.token_expert_indices, index.token_index_map, offs, e0,
                            dprobs)  # fmt: skip
    assert rel_err(dprobs - 1, dots * live) < F32
    assert torch.equal(dprobs[te < e0], torch.ones_like(dprobs[te < e0]))
    y = torch.cat([torch.randn(n, hid, generator=gen), torch.full((4, hid), float("nan"))])
    comb = torch.full((t, hid), float("nan"))
    grouped.combine(y, index.token_index_map, offs, comb, k, accumulate=False,
                    bias=(b2, probs, index.token_expert_indices, e0))  # fmt: skip
    want = torch.zeros(t, hid, dtype=torch.float64).index_add_(0, tok, y[:n].double())
    want += (probs.double()[:, :, None] * b2.double()[(te - e0).clamp(min=0)]
             * live[:, :, None]).sum(1)  # fmt: skip
    assert rel_err(comb, want) < F32


@pytest.mark.parametrize("name", ["gelu", "quick_geglu_offset"])
def test_up_projection_epilogue(name):
    """The fused up-projection for a non-gated and a gated activation with b13 against float64:
    h (bias included) and a together, h alone, a alone; the weight tiles through a tensor
    descriptor give the same values."""
    act = (expert_activation("gelu") if name == "gelu"
           else ExpertActivation(fn="silu", alpha=1.702, linear_offset=0.5))  # fmt: skip
    index, offs, n, expert, gen = _pairs(seed=7, t=23, e=5, k=3, kind="skewed", e0=0)
    hid, ffn = 24, 20
    rows = act.fc1_rows(ffn)
    x = torch.randn(23, hid, generator=gen)
    w13 = torch.randn(5, rows, hid, generator=gen) / hid**0.5
    b13 = torch.randn(5, rows, generator=gen)
    start, _ = index.pair_range(0, 5)
    tok = index.expert_token_indices[start : start + n].long()
    p = torch.rand(n, generator=gen)
    h_ref = torch.einsum("nh,njh->nj", x[tok].double(), w13[expert].double()) + b13[expert]
    a_ref = activation_forward(act, h_ref) * p.double()[:, None]
    idx_P = index.expert_token_indices
    for tma in ("off", "on"):
        k = KernelOptions(tma=tma, gather_ws="off")
        h, a = torch.full((n, rows), float("nan")), torch.full((n, ffn), float("nan"))
        grouped.up_swiglu(x, w13, idx_P, offs, p, h, a, kernels=k, activation=act, b13_EJ=b13)
        assert rel_err(h, h_ref) < F32 and rel_err(a, a_ref) < F32, tma
        h1, a1 = torch.full_like(h, float("nan")), torch.full_like(a, float("nan"))
        grouped.up_swiglu(x, w13, idx_P, offs, None, h1, None, kernels=k, activation=act,
                          b13_EJ=b13)  # fmt: skip
        grouped.up_swiglu(x, w13, idx_P, offs, p, None, a1, kernels=k, activation=act,
                          b13_EJ=b13)  # fmt: skip
        assert rel_err(h1, h_ref) < F32 and rel_err(a1, a_ref) < F32, tma


@pytest.mark.parametrize("ffn", [20, 80, 150])
@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "squared_relu"])
def test_non_gated_epilogue_in_column_halves(name, ffn):
    """A 128-column tile of a non-gated activation computes and stores a in two halves
    (``EPI_HALVES``, for erf and tanh; not for the max-only activations): against float64 with
    the upper half wholly masked (I = 20), partly (80) and over two tiles (150)."""
    from relaymoe.kernels.grouped import up

    act = expert_activation(name)
    assert up._epilogue_halves(act.fn, act.gated, 128) == (name != "squared_relu")
    assert not up._epilogue_halves(act.fn, act.gated, 64)
    index, offs, n, expert, gen = _pairs(seed=11, t=19, e=3, k=2, kind="skewed", e0=0, e1=3)
    hid = 24
    x = torch.randn(19, hid, generator=gen)
    w13 = torch.randn(3, ffn, hid, generator=gen) / hid**0.5
    start, _ = index.pair_range(0, 3)
    tok = index.expert_token_indices[start : start + n].long()
    p = torch.rand(n, generator=gen)
    h_ref = torch.einsum("nh,njh->nj", x[tok].double(), w13[expert].double())
    a_ref = activation_forward(act, h_ref) * p.double()[:, None]
    cfg = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 16}
    a = torch.full((n, ffn), float("nan"))
    grouped.up_swiglu(x, w13, index.expert_token_indices, offs, p, None, a, config=cfg,
                      kernels=KernelOptions(gather_ws="off"), activation=act)  # fmt: skip
    assert rel_err(a, a_ref) < F32
