"""Fused expert kernels (Triton interpreter, fp32/fp16) against float64 torch computations.

Each kernel alone (poisoned outputs, odd shapes, empty experts, expert-range slices, two tile
configs), then ``moe_experts(backend="triton")`` against the oracle for output and all four
gradients, range slices summing to the full result, and bitwise determinism.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from relaymoe.experts import (
    HopGrads,
    HopOptions,
    expert_hop_backward,
    expert_hop_forward,
    moe_experts,
)
from relaymoe.kernels import grouped, interpret_mode, pairs, select
from relaymoe.options import KernelOptions
from relaymoe.reference import moe_experts_reference
from relaymoe.routing import build_routing_index
from tests.fixtures import random_problem, rel_err, use_env

pytestmark = pytest.mark.skipif(
    not interpret_mode(), reason="CPU tests run the kernels under TRITON_INTERPRET=1"
)

F32 = 1e-5
CFG_A = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
CFG_B = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 32}  # other tile edges, EVEN_K both ways
# the tile order in groups of 5 M tiles: with the third case below, a short last group holding
# real tiles (8 real M tiles of 9 launched, 3 N tiles)
CFG_G = {**CFG_A, "GROUP_M": 5}


def _setup(t, h, i, e, k, kind, e0, e1, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2, idx, probs = random_problem(t, h, i, e, k, gen=gen, kind=kind)
    index = build_routing_index(idx, e)
    offs = index.offsets_for(e0, e1)
    start, stop = index.pair_range(e0, e1)
    pair = torch.empty(t * k, dtype=torch.long)
    pair[index.token_index_map.long()] = torch.arange(t * k)
    pair = pair[start:stop]  # flat (t, k) of each position of the range
    tok = index.expert_token_indices[start:stop].long()
    expert = index.token_expert_indices.long()[pair] - e0  # local expert of each position
    cast = lambda v: v.to(dtype)  # noqa: E731
    return dict(
        x=x, w13=w13[e0:e1], w2=w2[e0:e1], probs=probs, idx=idx, index=index, offs=offs,
        n=stop - start, pair=pair, tok=tok, expert=expert, cast=cast,
    )  # fmt: skip


def _h_ref(s):
    """float64 h (n, 2I) of the range's pairs."""
    return torch.einsum("nh,njh->nj", s["x"][s["tok"]], s["w13"][s["expert"]])


@pytest.mark.parametrize("cfg", [CFG_A, CFG_B, CFG_G])
@pytest.mark.parametrize(
    "case",
    [
        (29, 24, 20, 7, 3, "skewed", 2, 6),
        (13, 16, 12, 4, 4, "uniform", 0, 4),
        (50, 16, 36, 2, 2, "uniform", 0, 2),
    ],
)
def test_up_swiglu_and_rows_gemm(case, cfg):
    s = _setup(*case)
    c = s["cast"]
    n, ffn = s["n"], s["w2"].shape[2]
    prob_P = s["probs"].reshape(-1)[s["pair"]].float()
    h = torch.full((n, 2 * ffn), float("nan"))
    a = torch.full((n, ffn), float("nan"))
    idx_P = s["index"].expert_token_indices
    grouped.up_swiglu(c(s["x"]), c(s["w13"]), idx_P, s["offs"], prob_P, h, a, config=cfg)
    h_ref = _h_ref(s)
    a_ref = F.silu(h_ref[:, :ffn]) * h_ref[:, ffn:] * prob_P.double()[:, None]
    assert rel_err(h, h_ref) < F32 and rel_err(a, a_ref) < F32
    # each output alone (the fc1 recompute wants h only): the same values, the other untouched
    h_only = torch.full_like(h, float("nan"))
    grouped.up_swiglu(c(s["x"]), c(s["w13"]), idx_P, s["offs"], None, h_only, None, config=cfg)
    assert torch.equal(h_only, h)
    a_only = torch.full_like(a, float("nan"))
    grouped.up_swiglu(c(s["x"]), c(s["w13"]), idx_P, s["offs"], prob_P, None, a_only, config=cfg)
    assert torch.equal(a_only, a)
    with pytest.raises(ValueError, match="needs an output"):
        grouped.up_swiglu(c(s["x"]), c(s["w13"]), idx_P, s["offs"], None, None, None)
    y = torch.full((n, s["x"].shape[1]), float("nan"))
    grouped.rows_gemm(a, c(s["w2"]).transpose(1, 2), s["offs"], y, config=cfg)
    y_ref = torch.einsum("ni,nhi->nh", a_ref, s["w2"][s["expert"]])
    assert rel_err(y, y_ref) < F32


@pytest.mark.parametrize("cfg", [CFG_A, CFG_B])
@pytest.mark.parametrize(
    "case", [(29, 24, 20, 7, 3, "skewed", 2, 6), (19, 12, 7, 5, 2, "empty", 0, 5),
             (13, 30, 12, 4, 4, "uniform", 0, 4)],  # H=30: 120-byte rows, no descriptor
)  # fmt: skip
def test_up_swiglu_weight_tiles_through_a_tensor_descriptor(case, cfg, monkeypatch):
    """RELAYMOE_TMA=1 (weight tiles by a tensor descriptor, past-the-expert rows masked) gives
    the pointer path's h and a to fp32 rounding (the interpreter's dot of a transposed tile may
    sum in another order), both within the fp32 bound of the float64 h: odd I, a partial range,
    empty experts, and a width the descriptor cannot take (the launcher falls back)."""
    s = _setup(*case)
    n, ffn = s["n"], s["w2"].shape[2]
    prob_P = s["probs"].reshape(-1)[s["pair"]].float()
    idx_P = s["index"].expert_token_indices
    got = {}
    for tma in ("0", "1"):
        kernels = use_env(monkeypatch, RELAYMOE_TMA=tma).kernels
        h = torch.full((n, 2 * ffn), float("nan"))
        a = torch.full((n, ffn), float("nan"))
        w13 = s["w13"].float().contiguous()
        grouped.up_swiglu(s["x"].float(), w13, idx_P, s["offs"], prob_P, h, a, config=cfg,
                          kernels=kernels)  # fmt: skip
        got[tma] = (h, a)
    assert select.tma_weights(s["w13"].float().contiguous(), KernelOptions(tma="on")) == (
        case[1] != 30
    )
    h_ref = _h_ref(s)
    for tma, (h, a) in got.items():
        assert rel_err(h, h_ref) < F32, tma
        assert rel_err(a, got["0"][1]) < 1e-6, tma
    # auto: descriptors for sm90 GPUs only, never on CPU
    assert not select.tma_weights(s["w13"].float().contiguous(), KernelOptions())
    with pytest.raises(ValueError, match="RELAYMOE_TMA='yes'"):
        use_env(monkeypatch, RELAYMOE_TMA="yes")


def test_gather_ws_switch(monkeypatch):
    """``gather_ws``: never the Gluon kernel on CPU; a bad environment value names the choices."""
    x, w13 = torch.zeros(4, 64), torch.zeros(2, 32, 64)
    assert select.gather_ws_for("up_swiglu", x, w13, k=KernelOptions()) is None
    with pytest.raises(ValueError, match="RELAYMOE_GATHER_WS='yes'.*'auto'.*'0'"):
        use_env(monkeypatch, RELAYMOE_GATHER_WS="yes")
    with pytest.raises(ValueError, match="gather_ws='yes' is not one of"):
        KernelOptions(gather_ws="yes")


def test_gluon_build_failure_falls_back(monkeypatch):
    """A Gluon kernel this Triton cannot build (its errors, an MLIR pass failure) warns once and
    leaves that kind to the Triton kernels; any other error propagates."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(select, "GATHER_WS_UNBUILT", {})

    def raising(exc):
        def launch():
            raise exc

        return launch

    with pytest.warns(RuntimeWarning, match="Gluon up_swiglu kernel does not build"):
        assert not select.launch_ws("up_swiglu", raising(OutOfResources(300000, 232448, "x")))
    with pytest.warns(RuntimeWarning, match="PassManager"):
        assert not select.launch_ws("rows_gemm", raising(RuntimeError("PassManager::run failed")))
    assert set(select.GATHER_WS_UNBUILT) == {"up_swiglu", "rows_gemm"}
    for exc in (ValueError("a bad argument"), RuntimeError("CUDA error: an illegal access")):
        with pytest.raises(type(exc)):
            select.launch_ws("up_swiglu", raising(exc))
    assert select.launch_ws("up_swiglu", lambda: None)


def test_descriptor_allocator_is_set_in_every_thread():
    """Triton's allocator is per thread (a ContextVar): autograd's backward thread, where the ring
    recomputes up_swiglu, must get one too, and a user's own allocator is kept."""
    import threading

    seen = {}

    def in_thread(name, preset=None):
        def body():
            if preset is not None:
                triton.set_allocator(preset)
            seen[name, "before"] = grouped.configs._triton_allocator()
            grouped.configs.set_descriptor_allocator()
            seen[name, "after"] = grouped.configs._triton_allocator()

        t = threading.Thread(target=body)
        t.start()
        t.join()

    def mine(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8)

    in_thread("forward")
    in_thread("backward")
    in_thread("user", preset=mine)
    for name in ("forward", "backward"):
        assert isinstance(seen[name, "before"], grouped.configs._NullAllocator), name
        assert seen[name, "after"] is grouped.configs._torch_scratch, name
    assert seen["user", "after"] is mine


@pytest.mark.parametrize("tma", ["0", "1"])
@pytest.mark.parametrize("cfg", [CFG_A, CFG_B, {**CFG_B, "PRELOAD_C": True}],
                         ids=["a", "b", "b_preload"])  # fmt: skip
def test_wgrads(cfg, tma, monkeypatch):
    """Both weight gradients, write and accumulate modes, an empty expert; with ``tma=1`` the
    contiguous operand's full blocks come through a tensor descriptor; ``PRELOAD_C``: the
    accumulating launch reads its output tile before the pairs' loop."""
    kernels = use_env(monkeypatch, RELAYMOE_TMA=tma).kernels
    s = _setup(31, 20, 24, 6, 2, "empty", 1, 6, seed=1)  # last expert (local 4) gets no pair
    c = s["cast"]
    ffn = s["w2"].shape[2]
    dy = torch.randn_like(s["x"])
    prob_P = s["probs"].reshape(-1)[s["pair"]].float()
    h_ref = _h_ref(s)
    idx_P = s["index"].expert_token_indices
    gate, up = h_ref[:, :ffn], h_ref[:, ffn:]
    g = torch.einsum("nh,nhi->ni", dy[s["tok"]], s["w2"][s["expert"]])
    act = F.silu(gate) * up
    p = prob_P.double()[:, None]
    sig = torch.sigmoid(gate)
    dh_ref = torch.cat([g * p * up * sig * (1 + gate * (1 - sig)), g * p * F.silu(gate)], 1)
    a, dh = c(act * p), c(dh_ref)
    # wgrads: write mode into NaN, then accumulate mode onto a base
    dw2 = torch.full(s["w2"].shape, float("nan"))
    grouped.wgrad(c(dy), a, idx_P, s["offs"], dw2, a_gather=True, b_gather=False,
                  accumulate=False, config=cfg, kernels=kernels)  # fmt: skip
    dw2_ref = torch.zeros_like(s["w2"]).index_add_(
        0, s["expert"], torch.einsum("nh,ni->nhi", dy[s["tok"]], act * p)
    )
    assert rel_err(dw2, dw2_ref) < F32
    assert torch.equal(dw2[-1], torch.zeros_like(dw2[-1]))  # empty expert: exact zeros
    base = torch.randn(s["w13"].shape)
    dw13 = base.clone()
    grouped.wgrad(dh, c(s["x"]), idx_P, s["offs"], dw13, a_gather=False, b_gather=True,
                  accumulate=True, config=cfg, kernels=kernels)  # fmt: skip
    dw13_ref = base.double().index_add(
        0, s["expert"], torch.einsum("nj,nh->njh", dh_ref, s["x"][s["tok"]])
    )
    assert rel_err(dw13, dw13_ref) < F32
    assert torch.equal(dw13[-1], base[-1])  # nothing added for the empty expert


@pytest.mark.parametrize("gmm", [False, "preload", True])
def test_wgrad_adds_into_a_span_in_reverse_expert_order(gmm):
    """``reverse=True`` (Megatron's ``main_grad``: a layer's experts back to back in reverse
    order): expert ``e`` of the range is added into row ``El-1-e`` of the span, through a
    negative expert stride (the Triton kernel) or a flipped chunk (the grouped-GEMM path); an
    empty expert's row keeps its value and nothing outside the span is written."""
    from relaymoe.kernels.experts import HopGroups, wgrad_gmm

    s = _setup(31, 20, 24, 6, 2, "empty", 1, 6, seed=4)  # local expert 4 gets no pair
    el, rows = s["w13"].shape[0], s["w13"].shape[1]
    dh_ref = torch.randn(s["n"], rows, dtype=torch.float64)
    buf = torch.randn(el + 2, *s["w13"].shape[1:])  # the span with a row either side
    before = buf.clone()
    span = buf[1 : el + 1]
    idx_P = s["index"].expert_token_indices
    if gmm is True:
        groups = HopGroups(idx_P, s["offs"], s["n"], True)
        wgrad_gmm(dh_ref.float(), s["x"].float(), span, groups, a_gather=False, accumulate=True,
                  reverse=True)  # fmt: skip
    else:  # the Triton kernel, the output tile read after the pairs' loop or before it
        cfg = {**CFG_A, "PRELOAD_C": True} if gmm == "preload" else CFG_A
        grouped.wgrad(dh_ref.float(), s["x"].float(), idx_P, s["offs"], span, a_gather=False,
                      b_gather=True, accumulate=True, config=cfg, reverse=True)  # fmt: skip
    dw = torch.zeros(s["w13"].shape, dtype=torch.float64).index_add_(
        0, s["expert"], torch.einsum("nj,nh->njh", dh_ref, s["x"][s["tok"]])
    )
    want = before[1 : el + 1].double() + dw.flip(0)
    assert rel_err(span, want) < F32
    assert torch.equal(span[0], before[1])  # the empty expert (last of the range): row 0
    assert torch.equal(buf[0], before[0]) and torch.equal(buf[-1], before[-1])


def test_fp8_hop_refuses_weight_gradients_in_reverse_order():
    """The fp8 hop's weight-gradient kernel writes expert order only: reverse order is refused
    by name, not written in the wrong rows."""
    from relaymoe.kernels.fp8.hop import fp8_hop_backward

    with pytest.raises(NotImplementedError, match="dw_reversed"):
        fp8_hop_backward(None, None, None, None, None, 0, 1, recipe=None,
                         grads=HopGrads(dw_reversed=True))  # fmt: skip


@pytest.mark.parametrize("tma", ["0", "1"])
def test_wgrad_never_reads_the_next_experts_rows(tma, monkeypatch):
    """An expert's last, partial block of pairs must not read the next expert's rows of the
    contiguous operand (a masked load, not a full tile): a non-finite row of expert 1 leaves
    expert 0's gradient finite and exact (inf * 0 would be NaN)."""
    kernels = use_env(monkeypatch, RELAYMOE_TMA=tma).kernels
    s = _setup(40, 16, 16, 3, 1, "uniform", 0, 3, seed=2)
    offs = s["offs"]
    lo1 = int(offs[1])
    assert lo1 % 16, "expert 0 must end inside a 16-row block"
    dy = torch.randn_like(s["x"]).float()
    a = torch.randn(s["n"], 16)
    a[lo1:] = float("inf")  # every row of experts 1 and 2
    dw2 = torch.full((3, 16, 16), float("nan"))
    grouped.wgrad(dy, a, s["index"].expert_token_indices, offs, dw2, a_gather=True,
                  b_gather=False, accumulate=False, config=CFG_A, kernels=kernels)  # fmt: skip
    ref0 = dy[s["tok"][:lo1]].double().T @ a[:lo1].double()
    assert torch.isfinite(dw2[0]).all()
    assert rel_err(dw2[0], ref0) < F32


@pytest.mark.parametrize(
    "cfg,blocks,in_place",
    [(CFG_A, (16, 16), True), (CFG_B, (32, 32), False), (CFG_A, (8, 8), True)],
)
def test_split_down_backward(cfg, blocks, in_place):
    """Gathered-dy rows_gemm (g = dy[tok] @ w2[e]) + swiglu_backward (dh over h, p*a over g,
    dprob exact per row) against float64; ffn=24 is not a multiple of 16 or 32."""
    s = _setup(31, 20, 24, 6, 2, "empty", 1, 6, seed=3)  # last expert (local 4) gets no pair
    c = s["cast"]
    n, ffn = s["n"], s["w2"].shape[2]
    dy = torch.randn_like(s["x"])
    prob_P = s["probs"].reshape(-1)[s["pair"]].float()
    h_ref = _h_ref(s)
    idx_P = s["index"].expert_token_indices
    g_buf = torch.full((n, ffn), float("nan"))
    grouped.rows_gemm(c(dy), c(s["w2"]), s["offs"], g_buf, a_idx=idx_P, config=cfg)
    g = torch.einsum("nh,nhi->ni", dy[s["tok"]], s["w2"][s["expert"]])
    assert rel_err(g_buf, g) < F32
    h = c(h_ref).clone()
    dh = h if in_place else torch.full((n, 2 * ffn), float("nan"))
    dprob = torch.full((n,), float("nan"))
    grouped.swiglu_backward(h, g_buf, prob_P, dh, dprob, block_rows=blocks[0],
                            block_cols=blocks[1])  # fmt: skip
    gate, up = h_ref[:, :ffn], h_ref[:, ffn:]
    act = F.silu(gate) * up
    p = prob_P.double()[:, None]
    sig = torch.sigmoid(gate)
    dh_ref = torch.cat([g * p * up * sig * (1 + gate * (1 - sig)), g * p * F.silu(gate)], 1)
    assert rel_err(dprob, (g * act).sum(1)) < F32
    assert rel_err(dh, dh_ref) < F32 and rel_err(g_buf, act * p) < F32
    if not in_place:
        assert torch.equal(h, c(h_ref))  # h only read
    # bitwise repeatable
    g2 = torch.full((n, ffn), float("nan"))
    grouped.rows_gemm(c(dy), c(s["w2"]), s["offs"], g2, a_idx=idx_P, config=cfg)
    dh2, dprob2 = torch.empty(n, 2 * ffn), torch.empty(n)
    grouped.swiglu_backward(c(h_ref), g2, prob_P, dh2, dprob2, block_rows=blocks[0],
                            block_cols=blocks[1])  # fmt: skip
    assert torch.equal(dh2, dh) and torch.equal(dprob2, dprob) and torch.equal(g2, g_buf)


def test_swiglu_backward_zero_width_and_no_rows():
    dprob = torch.full((3,), float("nan"))
    grouped.swiglu_backward(torch.empty(3, 0), torch.empty(3, 0), torch.ones(3),
                            torch.empty(3, 0), dprob)  # fmt: skip
    assert torch.equal(dprob, torch.zeros(3))
    grouped.swiglu_backward(torch.empty(0, 8), torch.empty(0, 4), torch.ones(0),
                            torch.empty(0, 8), torch.empty(0))  # fmt: skip


def test_combine_gather_reduce_range_and_determinism():
    s = _setup(23, 12, 8, 5, 3, "skewed", 1, 4, seed=2)
    n, t, k = s["n"], s["x"].shape[0], 3
    y = torch.randn(n, 12)
    ref = torch.zeros(t, 12, dtype=torch.float64).index_add_(0, s["tok"], y.double())
    out = torch.full((t, 12), float("nan"))
    grouped.combine(y, s["index"].token_index_map, s["offs"], out, k, accumulate=False)
    assert rel_err(out, ref) < F32
    base = torch.randn(t, 12)
    acc = base.clone()
    grouped.combine(y, s["index"].token_index_map, s["offs"], acc, k, accumulate=True)
    assert rel_err(acc, ref + base.double()) < F32
    again = base.clone()
    grouped.combine(y, s["index"].token_index_map, s["offs"], again, k, accumulate=True)
    assert torch.equal(acc, again)


@pytest.mark.parametrize("case", [(23, 5, 3, "skewed", 1, 4), (17, 4, 4, "uniform", 0, 4),
                                  (9, 6, 2, "empty", 4, 6)])  # fmt: skip
def test_pair_probs_and_dprobs_move_between_token_and_pair_order(case):
    """pair_probs puts each in-range (t, k) probability at its pair row (rows past the count of a
    bound-sized buffer untouched); add_pair_dprobs adds each pair row back into its (t, k) entry
    and leaves every other entry bit-for-bit, contiguous or strided."""
    t, e, k, kind, e0, e1 = case
    s = _setup(t, 4, 4, e, k, kind, e0, e1, seed=5)
    tim, offs, n, pair = s["index"].token_index_map, s["offs"], s["n"], s["pair"]
    for dtype in (torch.float32, torch.float16):
        probs = s["probs"].to(dtype)
        got = pairs.pair_probs(probs, tim, offs, n)
        assert got.dtype == torch.float32 and torch.equal(got, probs.reshape(-1)[pair].float())
        spare = pairs.pair_probs(probs, tim, offs, n + 3)  # a buffer sized from a bound
        assert torch.equal(spare[:n], got)
    dprob = torch.randn(n, generator=torch.Generator().manual_seed(1))
    inside = torch.zeros(t * k, dtype=torch.bool)
    inside[pair] = True
    for layout in ("contiguous", "strided"):
        base = torch.randn(k, t).t() if layout == "strided" else torch.randn(t, k)
        out = base.clone()
        pairs.add_pair_dprobs(dprob, tim, offs, out)
        want = base.reshape(-1).clone()
        want[pair] += dprob
        assert torch.equal(out.reshape(-1)[~inside], base.reshape(-1)[~inside]), layout
        assert rel_err(out.reshape(-1), want) < F32, layout
    with pytest.raises(ValueError, match="expected a contiguous T\\*K"):
        pairs.pair_probs(s["probs"][:-1], tim, offs, n)


CASES = [
    # (T, H, I, E, K, kind)
    (37, 24, 20, 6, 3, "uniform"),
    (53, 16, 12, 9, 1, "skewed"),  # K = 1
    (21, 8, 10, 4, 4, "uniform"),  # K = E
    (19, 12, 7, 5, 2, "empty"),
    (1, 8, 6, 3, 2, "one"),
]


def _grads(fn, x, w13, w2, idx, probs, g, dtype):
    ins = [t.detach().to(dtype).clone().requires_grad_() for t in (x, w13, w2, probs)]
    y = fn(ins[0], ins[1], ins[2], idx, ins[3])
    torch.autograd.backward(y, g.to(dtype))
    return [y.detach()] + [t.grad for t in ins]


def check_triton_vs_oracle(case, seed: int, recompute: str, kernels=None) -> None:
    """fp32 ``moe_experts(backend="triton", kernels=kernels)`` vs the float64 oracle on a fresh
    problem of ``case``: output and the four gradients within ``F32``; empty experts get exact
    zeros."""
    t, h, i, e, k, kind = case
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2, idx, probs = random_problem(t, h, i, e, k, gen=gen, kind=kind)
    g = torch.randn(t, h, generator=gen, dtype=torch.float64)
    fn = lambda *a: moe_experts(*a, recompute=recompute, backend="triton", kernels=kernels)  # noqa: E731
    got = _grads(fn, x, w13, w2, idx, probs, g, torch.float32)
    ref = _grads(moe_experts_reference, x, w13, w2, idx, probs, g, torch.float64)
    for name, a, b in zip(("out", "dx", "dw13", "dw2", "dprobs"), got, ref, strict=True):
        assert rel_err(a, b) < F32, name
    if kind == "empty":
        assert torch.equal(got[2][-1], torch.zeros_like(got[2][-1]))
        assert torch.equal(got[3][-1], torch.zeros_like(got[3][-1]))


@pytest.mark.parametrize("recompute", ["act", "fc1"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_moe_experts_triton_matches_oracle(case, recompute):
    check_triton_vs_oracle(case, sum(case[:5]), recompute)


@pytest.mark.parametrize(
    "case,chunk_mib",
    [((41, 32, 24, 6, 2, "empty"), "512"), ((37, 24, 20, 5, 5, "skewed"), "0")],
    ids=["empty-experts", "K=E"],
)
def test_wgrad_gmm_path_matches_oracle(case, chunk_mib, monkeypatch):
    """RELAYMOE_WGRAD=gmm: weight gradients by torch._grouped_mm over the pairs (torch's CPU
    implementation here) equal the oracle's, empty experts get exact zeros, and the Triton wgrad
    is never called. (Several column chunks: the next test.)"""
    kernels = use_env(monkeypatch, RELAYMOE_WGRAD="gmm", RELAYMOE_PAIR_BUFFER_MIB=chunk_mib).kernels

    def no_triton_wgrad(*a, **k):
        raise AssertionError("the Triton wgrad ran")

    monkeypatch.setattr(grouped, "wgrad", no_triton_wgrad)
    check_triton_vs_oracle(case, sum(case[:5]) + 3, "act", kernels)


@pytest.mark.parametrize("recompute", ["act", "fc1"])
@pytest.mark.parametrize(
    "case", [(41, 32, 24, 6, 2, "empty"), (37, 24, 20, 5, 5, "skewed"), (29, 16, 12, 4, 1, "one")],
    ids=["empty-experts", "K=E", "top-1"],
)  # fmt: skip
def test_rows_gather_copy_matches_oracle(case, recompute, monkeypatch):
    """RELAYMOE_ROWS_GATHER=copy: the up-projection (forward, and the fc1 recompute) and the down
    backward by one gathered copy and torch._grouped_mm (torch's CPU implementation here) plus
    the separate SwiGLU pass: the oracle's output and gradients, and neither gather-on-load
    kernel runs. With a budget the copy cannot fit, the index kernels run instead."""
    kernels = use_env(monkeypatch, RELAYMOE_ROWS_GATHER="copy").kernels
    calls = []

    def refuse(name):
        def fn(*a, **k):
            calls.append(name)
            raise AssertionError(f"{name} ran")

        return fn

    up, rows = grouped.up_swiglu, grouped.rows_gemm
    monkeypatch.setattr(grouped, "up_swiglu", refuse("up_swiglu"))

    def contiguous_rows_only(*a, **k):
        if k.get("a_idx") is not None:
            refuse("the gathered rows_gemm")()
        return rows(*a, **k)

    monkeypatch.setattr(grouped, "rows_gemm", contiguous_rows_only)
    check_triton_vs_oracle(case, sum(case[:5]) + 5, recompute, kernels)
    assert not calls
    monkeypatch.setattr(grouped, "up_swiglu", up)
    monkeypatch.setattr(grouped, "rows_gemm", rows)
    kernels = use_env(monkeypatch, RELAYMOE_PAIR_BUFFER_MIB="0").kernels  # and rows_gather copy
    used = []
    monkeypatch.setattr(grouped, "up_swiglu", lambda *a, **k: (used.append(1), up(*a, **k)))
    check_triton_vs_oracle(case, sum(case[:5]) + 6, recompute, kernels)
    assert used


def test_swiglu_forward_pass():
    """a = silu(gate) * up (* p) over rows, NaN-poisoned output fully written, p optional."""
    gen = torch.Generator().manual_seed(8)
    h = torch.randn(37, 2 * 21, generator=gen)
    p = torch.rand(37, generator=gen)
    ref = F.silu(h[:, :21].double()) * h[:, 21:].double()
    for prob, want in ((p, ref * p.double()[:, None]), (None, ref)):
        a = torch.full((37, 21), float("nan"))
        grouped.swiglu_forward(h, prob, a)
        assert rel_err(a, want) < F32


def test_wgrad_gmm_ranges_accumulate_and_wide_rows_chunk(monkeypatch):
    """Ring-style use: expert ranges accumulate into shared dx/dprobs and write their own dw
    slices; H = 264 with a 0 MiB budget gathers x and dy in two 256-column chunks (the second 8
    wide: H just past one chunk, as the interpreter's time grows with H's tiles). Odd widths
    (H not a multiple of 16 bytes) fall back to the Triton kernel, still exact."""
    kernels = use_env(monkeypatch, RELAYMOE_WGRAD="gmm", RELAYMOE_PAIR_BUFFER_MIB="0").kernels
    real, calls = torch._grouped_mm, []

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    for h, expect_gmm in ((264, True), (30, False)):
        calls.clear()
        gen = torch.Generator().manual_seed(h)
        t, i, e, k = 23, 8, 6, 2
        x, w13, w2, idx, probs = (
            v.float() if v.is_floating_point() else v
            for v in random_problem(t, h, i, e, k, gen=gen, kind="skewed")
        )
        index = build_routing_index(idx, e)
        dy = torch.randn(t, h, generator=gen)
        dx, dp = torch.zeros_like(x), torch.zeros_like(probs)
        dw13, dw2 = torch.full_like(w13, float("nan")), torch.full_like(w2, float("nan"))
        options = HopOptions(backend="triton", kernels=kernels)
        for e0, e1 in [(0, 2), (2, 2), (2, 6)]:
            _, h_part = expert_hop_forward(x, w13[e0:e1], w2[e0:e1], probs, index,
                                           expert_range=(e0, e1), options=options)  # fmt: skip
            d = expert_hop_backward(dy, x, w13[e0:e1], w2[e0:e1], probs, index,
                                    expert_range=(e0, e1), saved_h=h_part,
                                    grads=HopGrads(dx_TH=dx, dprobs_TK=dp),
                                    options=options)  # fmt: skip
            dw13[e0:e1], dw2[e0:e1] = d[2], d[3]
        ins = [v.double().requires_grad_() for v in (x, w13, w2, probs)]
        moe_experts_reference(ins[0], ins[1], ins[2], idx, ins[3]).backward(dy.double())
        got = (dx, dw13, dw2, dp)
        for name, a, v in zip(("dx", "dw13", "dw2", "dprobs"), got, ins, strict=True):
            assert rel_err(a, v.grad) < F32, (h, name)
        assert bool(calls) == expect_gmm, (h, len(calls))


@pytest.mark.parametrize("var", ["RELAYMOE_DENSE_GEMM", "RELAYMOE_WGRAD", "RELAYMOE_ROWS_GATHER"])
def test_bad_switch_values_are_refused(var, monkeypatch):
    """A bad value is refused where the environment is read (an entry point), naming the
    variable; the options object refuses it by field name."""
    with pytest.raises(ValueError, match=f"{var}='fastest'"):
        use_env(monkeypatch, **{var: "fastest"})
    field = var.removeprefix("RELAYMOE_").lower()
    with pytest.raises(ValueError, match=f"{field}='fastest' is not one of"):
        KernelOptions(**{field: "fastest"})


def test_fp16_within_bound():
    gen = torch.Generator().manual_seed(11)
    x, w13, w2, idx, probs = random_problem(41, 32, 24, 5, 2, gen=gen, kind="skewed")
    g = torch.randn(41, 32, generator=gen, dtype=torch.float64)
    fn = lambda *a: moe_experts(*a, backend="triton")  # noqa: E731
    got = _grads(fn, x, w13, w2, idx, probs, g, torch.float16)
    ref = _grads(moe_experts_reference, x, w13, w2, idx, probs, g, torch.float64)
    for name, a, b in zip(("out", "dx", "dw13", "dw2", "dprobs"), got, ref, strict=True):
        assert rel_err(a, b) < 3e-3, name


@pytest.mark.parametrize("wgrad", ["triton", "gmm"])
def test_fp16_ranges_accumulate_weight_gradients_in_fp32(wgrad, monkeypatch):
    """The ring's fp32 accumulators (``grad_accum``): fp16 operands, fp32 dw buffers that
    several expert ranges add into, with either weight-gradient path, equal the float64 oracle
    within fp16 rounding of the inputs; the buffers stay fp32."""
    kernels = use_env(monkeypatch, RELAYMOE_WGRAD=wgrad).kernels
    gen = torch.Generator().manual_seed(13)
    x, w13, w2, idx, probs = random_problem(37, 32, 16, 6, 2, gen=gen, kind="skewed")
    dy = torch.randn(37, 32, generator=gen, dtype=torch.float64)
    h16 = [t.half() for t in (x, w13, w2, dy)]
    index = build_routing_index(idx, 6)
    dw13 = torch.zeros(6, 32, 32, dtype=torch.float32)
    dw2 = torch.zeros(6, 32, 16, dtype=torch.float32)
    for _pass in (0, 1):  # two passes over the same experts: the second adds onto the first
        for e0, e1 in [(0, 2), (2, 6)]:
            expert_hop_backward(
                h16[3], h16[0], h16[1][e0:e1], h16[2][e0:e1], probs.float(), index,
                expert_range=(e0, e1), grads=HopGrads(dw13=dw13[e0:e1], dw2=dw2[e0:e1]),
                options=HopOptions(backend="triton", max_pairs=37 * 2, kernels=kernels),
            )  # fmt: skip
    ref = _grads(moe_experts_reference, *(t.double() for t in h16[:3]), idx, probs, h16[3].double(),
                 torch.float64)  # fmt: skip
    assert dw13.dtype == dw2.dtype == torch.float32
    assert rel_err(dw13 / 2, ref[2]) < 2e-3 and rel_err(dw2 / 2, ref[3]) < 2e-3


def _f32_problem(seed: int, t: int, h: int, i: int, e: int, k: int):
    """A skewed fp32 problem: (x, w13, w2, idx, probs, its routing index, dy)."""
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2, idx, probs = (
        v.float() if v.is_floating_point() else v
        for v in random_problem(t, h, i, e, k, gen=gen, kind="skewed")
    )
    return x, w13, w2, idx, probs, build_routing_index(idx, e), torch.randn_like(x)


def test_ranges_sum_to_full_touch_nothing_else_and_are_deterministic():
    x, w13, w2, idx, probs, index, dy = _f32_problem(4, 40, 20, 12, 7, 3)
    tri = HopOptions(backend="triton")
    full_out, full_h = expert_hop_forward(x, w13, w2, probs, index, options=tri)
    full = expert_hop_backward(dy, x, w13, w2, probs, index, saved_h=full_h, options=tri)
    base = torch.randn_like(x)
    out = base.clone()
    dx, dp = base.clone(), torch.zeros_like(probs)
    dw13 = torch.full_like(w13, float("nan"))
    dw2 = torch.full_like(w2, float("nan"))
    for e0, e1 in [(0, 3), (3, 3), (3, 6), (6, 7)]:
        _, h_part = expert_hop_forward(
            x, w13[e0:e1], w2[e0:e1], probs, index, expert_range=(e0, e1), out_TH=out,
            options=tri,
        )  # fmt: skip
        assert h_part.shape[0] == index.pair_range(e0, e1)[1] - index.pair_range(e0, e1)[0]
        _, _, g13, g2 = expert_hop_backward(
            dy, x, w13[e0:e1], w2[e0:e1], probs, index, expert_range=(e0, e1),
            saved_h=h_part if e0 != 3 else None, grads=HopGrads(dx_TH=dx, dprobs_TK=dp),
            options=tri,
        )  # fmt: skip
        dw13[e0:e1], dw2[e0:e1] = g13, g2
    ref = moe_experts_reference(*(v.double() for v in (x, w13, w2)), idx, probs.double())
    assert rel_err(out - base, ref) < F32
    assert rel_err(dx - base, full[0]) < F32
    for a, b in zip((dp, dw13, dw2), full[1:], strict=True):
        assert rel_err(a, b) < F32
    # one range alone only touches tokens that have a pair in it
    part = base.clone()
    expert_hop_forward(x, w13[3:6], w2[3:6], probs, index, expert_range=(3, 6), out_TH=part,
                       options=tri)  # fmt: skip
    untouched = ~((idx >= 3) & (idx < 6)).any(1)
    assert torch.equal(part[untouched], base[untouched])
    # bitwise determinism
    again_out, again_h = expert_hop_forward(x, w13, w2, probs, index, options=tri)
    assert torch.equal(again_out, full_out) and torch.equal(again_h, full_h)
    again = expert_hop_backward(dy, x, w13, w2, probs, index, saved_h=full_h, options=tri)
    for a, b in zip(again, full, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("wgrad", ["triton", "gmm"])
def test_ranges_with_bound_sized_buffers_match_exact_counts(wgrad, monkeypatch):
    """The ring's form (``max_pairs``: buffers sized from a bound, the count read on the device)
    gives the exact-count results, with either weight-gradient path; the bound past the index's
    last pair (the gmm gathers clamp their rows there) included."""
    kernels = use_env(monkeypatch, RELAYMOE_WGRAD=wgrad).kernels
    x, w13, w2, idx, probs, index, dy = _f32_problem(8, 31, 16, 8, 6, 3)
    for e0, e1 in [(0, 2), (2, 5), (5, 6)]:
        start, stop = index.pair_range(e0, e1)
        got = []
        for kw in ({"n_pairs": stop - start}, {"max_pairs": 31 * 3}):
            w13r, w2r = w13[e0:e1], w2[e0:e1]
            options = HopOptions(backend="triton", kernels=kernels, **kw)
            out, _ = expert_hop_forward(x, w13r, w2r, probs, index, expert_range=(e0, e1),
                                        save="none", options=options)  # fmt: skip
            grads = expert_hop_backward(dy, x, w13r, w2r, probs, index, expert_range=(e0, e1),
                                        options=options)  # fmt: skip
            got.append((out, *grads))
        for name, a, b in zip(("out", "dx", "dprobs", "dw13", "dw2"), *got, strict=True):
            assert rel_err(a, b) < F32, (e0, e1, name)


def test_consumed_saved_h_and_errors():
    gen = torch.Generator().manual_seed(5)
    x, w13, w2, idx, probs = (
        v.float() if v.is_floating_point() else v for v in random_problem(12, 8, 6, 3, 2, gen=gen)
    )
    xr = x.clone().requires_grad_()
    y = moe_experts(xr, w13, w2, idx, probs, recompute="act", backend="triton")
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice.*act_retain"):
        y.sum().backward()
    # "act_retain" keeps the pre-activation: a second backward adds the same gradient again
    xk = x.clone().requires_grad_()
    y = moe_experts(xk, w13, w2, idx, probs, recompute="act_retain", backend="triton")
    y.sum().backward(retain_graph=True)
    once = xk.grad.clone()
    y.sum().backward()
    assert torch.equal(xk.grad, 2 * once) and once.norm() > 0
    index = build_routing_index(idx, 3)
    tri = HopOptions(backend="triton")
    with pytest.raises(ValueError, match="saved_h has shape"):
        expert_hop_backward(torch.ones_like(x), x, w13, w2, probs, index,
                            saved_h=torch.zeros(5, 12), options=tri)  # fmt: skip
    # zero tokens: empty outputs, zero weight gradients
    z = torch.zeros(0, 8)
    out, saved = expert_hop_forward(z, w13, w2, torch.zeros(0, 2), build_routing_index(
        torch.zeros(0, 2, dtype=torch.long), 3), options=tri)  # fmt: skip
    assert out.shape == (0, 8) and saved.shape == (0, 12)
