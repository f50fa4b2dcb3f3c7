"""fp8 experts on a Hopper GPU, bf16 inputs: the quantisers against torch bit for bit, each fp8
GEMM against float64 on its own fp8 operands, and ``moe_experts(fp8=...)`` per recipe against
the float64 emulation of the recipe (``tests/fp8_emulation.py``), the unquantised float64
oracle and the bf16 experts.

Bounds (relative error ``||got - want|| / ||want||``):

* ``PROMOTED`` = 5e-3, a GEMM whose fp8 products are promoted into fp32 every 128 (blockwise,
  the dgrad and wgrad of the tensor-scaled recipes) against float64 on the same fp8 operands:
  its bf16 output's rounding (at most 2^-9 of each element) and fp32 sums;
* ``FAST`` = 1e-2, the tensor-scaled fprop, which accumulates in the tensor core (TE's fast
  fprop; Hopper keeps about 14 bits there, DeepSeek-V3 §3.3.2);
* ``EMULATED`` = 3e-2, the whole layer against its float64 emulation on the kernels' own tensor
  scales (``RecordedScaling``): not accumulation alone, since h, a, g and dh are rounded to
  bf16 and then quantised, and where a kernel's value (the fprop's fast accumulation: ~1e-3 of
  h) and the emulation's float64 one round to different bf16 values, an fp8 rounding may follow
  on the other side of its boundary (one e4m3 step is 6-12% of that element; out: 0.008). The
  scales are pinned because a tensor scale ``fmax / amax`` is not a power of two: an amax one
  bf16 ulp off (its element rounded the other way) moves the rounding grid of the whole tensor,
  ~0.02 on what an e4m3 tensor feeds and ~0.03 on what e5m2 dh feeds (dx, dw13), on top of the
  above (s28 lab note). That the amax itself is right is checked apart (``AMAX``);
  blockwise scales are powers of two per 1x128 block, which an amax one ulp off changes only
  across a power of two: nothing to pin;
* ``AMAX`` = 2^-5, the kernels' amax of a, dh or p*a against the emulation's own (x's and dy's
  are equal): dh's largest element comes from gate and up, each of which may round to the other
  bf16 neighbour (one ulp: at most 2^-7 of it), and then rounds itself: three ulps at most. A
  padded, stale or missing row that held the largest value is caught beyond it;
* ``RECIPE`` = 0.25, against the unquantised float64 oracle and against the bf16 experts: the
  recipes' own quantisation error (a few percent: e4m3 keeps 3 mantissa bits, e5m2 2), printed
  per recipe by ``benchmarks/lab/fp8_error.py``.
"""

from __future__ import annotations

import pytest
import torch

from relaymoe.activation import SWIGLU
from relaymoe.experts import moe_experts
from relaymoe.fp8_recipe import Fp8Recipe
from relaymoe.fp8_state import Fp8State
from relaymoe.kernels import pairs
from relaymoe.kernels.fp8 import quant_torch as qt
from relaymoe.kernels.fp8.quantize import quantize_rows
from relaymoe.kernels.fp8.rows import fp8_rows_gemm
from relaymoe.kernels.fp8.up import fp8_up
from relaymoe.kernels.fp8.weights import quantize_expert_weights
from relaymoe.kernels.fp8.wgrad import fp8_wgrad
from relaymoe.reference import moe_experts_reference, reference_activation
from relaymoe.routing import build_routing_index
from tests import fp8_emulation as emulation
from tests.fixtures import random_routing, rel_err, sm90_gpu_marks, use_env

pytestmark = sm90_gpu_marks()

PROMOTED, FAST, EMULATED, RECIPE, AMAX = 5e-3, 1e-2, 3e-2, 0.25, 2**-5
F64 = torch.float64
BF16 = torch.bfloat16

CASES = [
    # (T, H, I, E, K, routing)
    (4096, 2048, 768, 128, 8, "uniform"),  # a qwen3-30b-a3b layer, fewer tokens
    (2048, 1024, 1536, 16, 4, "skewed"),
    (777, 512, 384, 8, 1, "one"),  # top-1, one hot expert
    (300, 256, 256, 6, 6, "uniform"),  # K = E
    (1531, 1024, 640, 24, 3, "empty"),  # an expert without tokens
]
ODD = (1531, 1000, 700, 24, 3, "empty")  # nothing a multiple of a tile (tensor-scaled only)


def _problem(t, h, i, e, k, kind, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = {"generator": gen, "device": "cuda", "dtype": torch.float32}
    x = torch.randn(t, h, **kw).to(BF16)
    w13 = (torch.randn(e, 2 * i, h, **kw) / h**0.5).to(BF16)
    w2 = (torch.randn(e, h, i, **kw) / i**0.5).to(BF16)
    idx = random_routing(t, e, k, gen=torch.Generator().manual_seed(seed), kind=kind).cuda()
    probs = torch.rand(t, k, **kw).to(BF16)
    dy = torch.randn(t, h, **kw).to(BF16)
    return x, w13, w2, idx, probs, dy


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantisers_match_torch_bit_for_bit(fmt):
    """The GPU's cast (cvt.rn.satfinite) is torch's nearest-even cast after the same clamp."""
    x = torch.randn(4099, 1000, device="cuda") * torch.logspace(-8, 4, 1000, device="cuda")
    x = x.to(BF16)
    q, inv = quantize_rows(x, fmt)
    want_q, want_inv = qt.quantize_rows(x, fmt)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(inv, want_inv)
    s = qt.scale_from_amax(x.float().abs().amax(), fmt).reshape(1)
    qt_, _ = quantize_rows(x, fmt, scale=s)
    assert torch.equal(qt_.view(torch.uint8), qt.quantize_with(x, s, fmt).view(torch.uint8))


def _layout(index):
    offs = index.offsets_for(0, index.num_experts)
    bounds = offs.tolist()
    return index.expert_token_indices.long(), offs, bounds


def _per_expert(bounds, fn):
    spans = enumerate(zip(bounds, bounds[1:], strict=False))
    return torch.cat([fn(e, slice(lo, hi)) for e, (lo, hi) in spans])


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: "-".join(map(str, c)))
def test_each_fp8_gemm_against_float64_on_its_operands(recipe, case):
    r = Fp8Recipe(recipe)
    x, w13, w2, idx, probs, dy = _problem(*case, seed=11)
    index = build_routing_index(idx, case[3])
    tok, offs, bounds = _layout(index)
    n, i_dim = tok.shape[0], case[2]
    wq = quantize_expert_weights(w13, w2, r)
    w13d, w2d = emulation.dequant_weights(wq)
    xd, dyd = emulation.dequant_input(x, "e4m3", r), emulation.dequant_input(dy, r.grad_format, r)
    xq, x_inv = quantize_rows(x, "e4m3") if r.blockwise else _one_scale(x, "e4m3")
    dyq, dy_inv = quantize_rows(dy, r.grad_format) if r.blockwise else _one_scale(dy, "e5m2")
    prob_P = pairs.pair_probs(probs, index.token_index_map, offs, n)
    h = torch.full((n, 2 * i_dim), float("nan"), dtype=BF16, device="cuda")
    a = torch.full((n, i_dim), float("nan"), dtype=BF16, device="cuda")
    fp8_up(xq, x_inv, wq.w13, wq.inv13, index.expert_token_indices, offs, prob_P, h_PJ=h, a_PI=a)
    h_ref = _per_expert(bounds, lambda e, s: xd[tok[s]] @ w13d[e].T)
    fprop = PROMOTED if r.blockwise else FAST
    assert rel_err(h, h_ref) < fprop
    a_ref = reference_activation(SWIGLU, h_ref) * prob_P.to(F64)[:, None]
    assert rel_err(a, a_ref) < fprop
    # dgrad of fc2: dy gathered, w2 through its transposed copy
    g = torch.full((n, i_dim), float("nan"), dtype=BF16, device="cuda")
    strides = None
    if r.blockwise:
        st = wq.inv2.stride()
        strides = (st[0], st[2], st[1])
    fp8_rows_gemm(dyq, dy_inv, wq.w2_t.transpose(1, 2), wq.inv2, offs, g,
                  a_idx=index.expert_token_indices, b_inv_strides=strides)  # fmt: skip
    assert rel_err(g, _per_expert(bounds, lambda e, s: dyd[tok[s]] @ w2d[e])) < PROMOTED
    if not r.blockwise:  # the tensor-scaled weight gradient dw13 = dh^T x (dh: g here)
        gq, g_inv = _one_scale(g, "e5m2")
        dw = torch.full(w13.shape[:1] + (i_dim, case[1]), float("nan"), dtype=BF16, device="cuda")
        fp8_wgrad(gq, g_inv, xq, x_inv, index.expert_token_indices, offs, dw, a_gather=False,
                  accumulate=False)  # fmt: skip
        gd = gq.to(F64) * g_inv.to(F64)
        spans = (slice(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False))
        want = torch.stack([gd[s].T @ xd[tok[s]] for s in spans])
        assert rel_err(dw, want) < PROMOTED


def _one_scale(t, fmt):
    s = qt.scale_from_amax(t.float().abs().amax(), fmt).reshape(1)
    return quantize_rows(t, fmt, scale=s)[0], 1.0 / s


def _oracle(x, w13, w2, idx, probs, dy):
    leaves = [v.detach().to(F64).requires_grad_() for v in (x, w13, w2, probs)]
    out = moe_experts_reference(leaves[0], leaves[1], leaves[2], idx, leaves[3])
    out.backward(dy.to(F64))
    return {"out": out.detach(), "dx": leaves[0].grad, "dw13": leaves[1].grad,
            "dw2": leaves[2].grad, "dprobs": leaves[3].grad}  # fmt: skip


def _check_layer(recipe, case, recompute, kernels, seed):
    x, w13, w2, idx, probs, dy = _problem(*case, seed=seed)
    state = Fp8State(recipe)
    recorded = None if state.scales is None else emulation.RecordedScaling(state.scales)
    state.scales = recorded if recorded is not None else state.scales
    got = emulation.run_layer(
        x, w13, w2, idx, probs, dy, fp8=state, recompute=recompute, kernels=kernels
    )
    wq, own = state.expert_weights(w13, w2), {}
    kernel_amax = None if recorded is None else recorded.amax
    emu = emulation.fp8_emulation(x, wq, idx, probs, dy, state.recipe, amax=kernel_amax,
                                  own_amax=own)  # fmt: skip
    exact = _oracle(x, w13, w2, idx, probs, dy)
    bf16 = emulation.run_layer(x, w13, w2, idx, probs, dy, recompute=recompute, kernels=kernels)
    errs = {n: (rel_err(got[n], emu[n]), rel_err(got[n], exact[n]), rel_err(got[n], bf16[n]))
            for n in got}  # fmt: skip
    print(f"{state.recipe.recipe} {case} (vs emulation, float64, bf16): {errs}")
    if recorded is not None:  # for the record: the emulation on its own scales
        emu_own = emulation.fp8_emulation(x, wq, idx, probs, dy, state.recipe)
        amaxes = {r: (recorded.amax[r].item(), own[r].item()) for r in recorded.amax}
        print(f"  amax (kernels, emulation): {amaxes}")
        print(f"  vs the emulation on its own scales: "
              f"{ {n: rel_err(got[n], emu_own[n]) for n in got} }")  # fmt: skip
        for role, (kernel_amax, emu_amax) in amaxes.items():
            bound = 0.0 if role in ("x", "dy") else AMAX
            assert abs(kernel_amax / emu_amax - 1) <= bound, (role, kernel_amax, emu_amax)
    for n, (e_emu, e_exact, e_bf16) in errs.items():
        assert e_emu < EMULATED and e_exact < RECIPE and e_bf16 < RECIPE, (n, errs[n])
    if case[-1] == "empty":
        assert torch.equal(got["dw13"][-1], torch.zeros_like(got["dw13"][-1]))
        assert torch.equal(got["dw2"][-1], torch.zeros_like(got["dw2"][-1]))
    return got


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_moe_experts_fp8_per_recipe(recipe, case, monkeypatch):
    kernels = use_env(monkeypatch, RELAYMOE_AUTOTUNE="0").kernels
    _check_layer(recipe, case, "act", kernels, seed=sum(case[:5]))


@pytest.mark.parametrize(
    "recipe",
    [Fp8Recipe("tensorwise"), Fp8Recipe("tensorwise", fmt="e4m3"),
     Fp8Recipe("tensorwise", fp8_wgrad=False), Fp8Recipe("blockwise", fmt="hybrid")],
    ids=["hybrid", "e4m3", "bf16_wgrad", "blockwise_hybrid"],
)  # fmt: skip
@pytest.mark.parametrize("recompute", ["fc1", "act_retain"])
def test_formats_weight_gradients_and_recompute(recipe, recompute, monkeypatch):
    kernels = use_env(monkeypatch, RELAYMOE_AUTOTUNE="0").kernels
    case = ODD if not recipe.blockwise else CASES[1]
    _check_layer(recipe, case, recompute, kernels, seed=5)


def test_delayed_scaling_keeps_a_step_in_its_window_for_history_len_calls(monkeypatch):
    """TE's ``DelayedScaling`` (``max``): a step's amax stays in the window for
    ``amax_history_len`` (L) calls, and call 2L+2 of a repeated input after a first larger step
    is a tensorwise call bit for bit (``check_delayed_window``). Three identical calls at L 16
    are not current scaling: the first call's amaxes (made with scales of 1) stay in the window
    for 16 calls, and where one is larger, that tensor's scale is another (s28 lab note)."""
    kernels = use_env(monkeypatch, RELAYMOE_AUTOTUNE="0").kernels
    x, w13, w2, idx, probs, dy = _problem(*CASES[1], seed=3)
    last, amax = emulation.check_delayed_window(
        x, w13, w2, idx, probs, dy, hist_len=2, kernels=kernels
    )
    wq = Fp8State("tensorwise").expert_weights(w13, w2)
    emu = emulation.fp8_emulation(x, wq, idx, probs, dy, Fp8Recipe("tensorwise"), amax=amax)
    for n in emu:
        assert rel_err(last[n], emu[n]) < EMULATED, n


def test_blockwise_expert_ranges_sum_to_the_whole(monkeypatch):
    """Blockwise scales are local (x's rows, a's rows, weight blocks), so ranges of experts
    computed apart add up to the whole layer (the ring's hops, later): up to the bf16 rounding
    of each part's output (``FAST``)."""
    kernels = use_env(monkeypatch, RELAYMOE_AUTOTUNE="0").kernels
    x, w13, w2, idx, probs, dy = _problem(*CASES[1], seed=4)
    index = build_routing_index(idx, CASES[1][3])
    whole = moe_experts(x, w13, w2, idx, probs, fp8="blockwise", kernels=kernels, index=index)
    out = torch.zeros(x.shape, dtype=torch.float32, device="cuda")
    for e0, e1 in [(0, 5), (5, 6), (6, 16)]:
        part = moe_experts(x, w13[e0:e1], w2[e0:e1], idx, probs, fp8="blockwise",
                           kernels=kernels, index=index, expert_range=(e0, e1))  # fmt: skip
        out += part.float()
    assert rel_err(out, whole) < FAST
