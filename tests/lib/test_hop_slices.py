"""A hop over more pairs than one slice (``KernelOptions.hop_slice_mib``) computes slice by slice.

The Triton hop primitives against the float64 oracle with slices of a few pairs (the slice
size is ``select.hop_slice_rows``, patched small here: a real budget's slice holds hundreds of
thousands of pairs, beyond what the interpreter runs), forward and backward, over odd shapes,
every routing kind, top-1 and top-k = E, fp32 and fp16, saved and recomputed pre-activations,
biases, a partial expert range sized from an upper bound, the caller's buffers added into or
written over (reversed rows included); the slices' arithmetic; the weight-gradient kernel
leaving an absent expert's accumulator untouched; and the slice budget shared by the kernels
and the memory model.
"""

from __future__ import annotations

import pytest
import torch

from relaymoe import cost
from relaymoe.experts import HopGrads, HopOptions, expert_hop_backward, expert_hop_forward
from relaymoe.kernels import grouped, interpret_mode, select
from relaymoe.kernels.experts import pair_slices
from relaymoe.options import HOP_SLICE_MIB, KernelOptions
from relaymoe.reference import moe_experts_reference
from relaymoe.routing import build_routing_index
from tests.fixtures import activation_problem, random_problem, rel_err

pytestmark = pytest.mark.skipif(
    not interpret_mode(), reason="CPU tests run the kernels under TRITON_INTERPRET=1"
)

TRI = HopOptions(backend="triton")
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _slices_of(monkeypatch, rows: int | None) -> list[int]:
    """Make every hop slice at ``rows`` pairs; returns the list each hop's slice count is
    appended to (so a test sees that it sliced)."""
    counts: list[int] = []
    real = pair_slices

    def counted(offs, n_pairs, _rows):
        out = real(offs, n_pairs, rows)
        counts.append(len(out))
        return out

    monkeypatch.setattr("relaymoe.kernels.experts.pair_slices", counted)
    return counts


def _oracle(p, dtype):
    """float64 (out, dx, dw13, dw2, dprobs) of the problem's inputs rounded to ``dtype``."""
    ins = {k: p[k].to(dtype).double().requires_grad_() for k in ("x", "w13", "w2", "probs")}
    biases = {k: p[k].to(dtype).double().requires_grad_() for k in ("b13", "b2") if p.get(k)
              is not None}  # fmt: skip
    out = moe_experts_reference(ins["x"], ins["w13"], ins["w2"], p["idx"], ins["probs"],
                                activation=p.get("act"), **biases)  # fmt: skip
    out.backward(p["dy"].to(dtype).double())
    grads = [ins[k].grad for k in ("x", "w13", "w2", "probs")]
    return [out.detach(), *grads, *(biases[k].grad for k in ("b13", "b2") if k in biases)]


def _hop(p, dtype, save: str, *, options=TRI):
    """(out, dx, dw13, dw2, dprobs[, db13, db2]) of the whole range by the hop primitives."""
    c = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    E = p["w13"].shape[0]
    index = build_routing_index(p["idx"], E)
    b13, b2 = c(p.get("b13")), c(p.get("b2"))
    out, h = expert_hop_forward(c(p["x"]), c(p["w13"]), c(p["w2"]), c(p["probs"]), index,
                                b13=b13, b2=b2, save=save, options=options)  # fmt: skip
    db13 = None if b13 is None else torch.zeros(b13.shape, dtype=torch.float32)
    db2 = None if b2 is None else torch.zeros(b2.shape, dtype=torch.float32)
    dx, dp, dw13, dw2 = expert_hop_backward(
        c(p["dy"]), c(p["x"]), c(p["w13"]), c(p["w2"]), c(p["probs"]), index, b13=b13, b2=b2,
        saved_h=h, grads=HopGrads(db13=db13, db2=db2), options=options,
    )  # fmt: skip
    return [out, dx, dw13, dw2, dp, *(t for t in (db13, db2) if t is not None)]


@pytest.mark.parametrize(
    "case",
    [
        # (T, H, I, E, K, routing kind, slice rows, dtype, save)
        (21, 16, 12, 7, 3, "skewed", 7, torch.float32, "act"),
        (33, 16, 12, 5, 5, "uniform", 16, torch.float32, "none"),  # top-k = E
        (41, 20, 8, 6, 1, "one", 5, torch.float16, "none"),  # top-1, one hot expert
        (23, 16, 16, 6, 2, "empty", 3, torch.float16, "act"),  # an expert without pairs
    ],
)
def test_sliced_hop_matches_the_oracle_and_one_pass(case, monkeypatch):
    t, h, i, e, k, kind, rows, dtype, save = case
    gen = torch.Generator().manual_seed(t)
    x, w13, w2, idx, probs = random_problem(t, h, i, e, k, gen=gen, kind=kind)
    p = dict(x=x, w13=w13, w2=w2, idx=idx, probs=probs,
             dy=torch.randn(t, h, generator=gen, dtype=torch.float64))  # fmt: skip
    whole = _hop(p, dtype, save)
    counts = _slices_of(monkeypatch, rows)
    sliced = _hop(p, dtype, save)
    assert counts and min(counts) >= 2, counts  # forward and backward both sliced
    ref = _oracle(p, dtype)
    for name, a, b, r in zip(("out", "dx", "dw13", "dw2", "dprobs"), sliced, whole, ref,
                             strict=True):  # fmt: skip
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, r) < TOL[dtype], (name, rel_err(a, r))
        assert rel_err(a, b) < TOL[dtype], (name, rel_err(a, b))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_sliced_hop_with_biases(activation, monkeypatch):
    """fc1/fc2 biases and their gradients (segment sums per slice, added into the caller's
    fp32 buffers), a gated and a plain activation."""
    gen = torch.Generator().manual_seed(5)
    p = activation_problem(31, 16, 12, 5, 2, activation, bias="both", gen=gen, kind="skewed")
    _slices_of(monkeypatch, 6)
    got = _hop(p, torch.float32, "none", options=HopOptions(backend="triton",
                                                           activation=p["act"]))  # fmt: skip
    ref = _oracle(p, torch.float32)
    names = ("out", "dx", "dw13", "dw2", "dprobs", "db13", "db2")
    for name, a, r in zip(names, got, ref, strict=True):
        assert rel_err(a, r) < 1e-5, (name, rel_err(a, r))


def test_sliced_partial_range_from_a_bound_into_the_callers_buffers(monkeypatch):
    """A ring hop's call: experts [2, 5) of 7 with buffers sized from an upper bound on the
    pair count (the slices past the real count hold no pairs), out and dx added into, dprobs
    added into, the weight gradients written over a NaN-filled buffer in reversed rows
    (Megatron's main_grad order), then added into on a second pass."""
    gen = torch.Generator().manual_seed(3)
    t, h, i, e, k, e0, e1 = 27, 16, 12, 7, 3, 2, 5
    problem = random_problem(t, h, i, e, k, gen=gen, kind="skewed")
    x, w13, w2, idx, probs = (v.float() if v.is_floating_point() else v for v in problem)
    dy = torch.randn(t, h, generator=gen)
    index = build_routing_index(idx, e)
    counts = _slices_of(monkeypatch, 8)
    bound = HopOptions(backend="triton", max_pairs=t * k)
    base = torch.randn(t, h, generator=gen)
    out = base.clone()
    expert_hop_forward(x, w13[e0:e1], w2[e0:e1], probs, index, expert_range=(e0, e1),
                       out_TH=out, save="none", options=bound)  # fmt: skip
    assert counts[-1] == -(-t * k // 8)  # sliced over the bound, not the count
    dx, dp = base.clone(), torch.ones_like(probs)
    dw13 = torch.full((e1 - e0, 2 * i, h), float("nan"))
    dw2 = torch.full((e1 - e0, h, i), float("nan"))
    for acc in (False, True):
        expert_hop_backward(dy, x, w13[e0:e1], w2[e0:e1], probs, index, expert_range=(e0, e1),
                            grads=HopGrads(dx_TH=dx if not acc else torch.zeros_like(dx),
                                           dprobs_TK=dp if not acc else torch.zeros_like(dp),
                                           dw13=dw13, dw2=dw2, dw_accumulate=acc,
                                           dw_reversed=True),
                            options=bound)  # fmt: skip
    # the oracle of the range: the other experts' pairs carry probability 0
    in_range = (idx >= e0) & (idx < e1)
    ins = [v.double().requires_grad_() for v in (x, w13, w2)]
    pr = probs.double().requires_grad_()
    ref = moe_experts_reference(ins[0], ins[1], ins[2], idx, pr * in_range)
    ref.backward(dy.double())
    assert rel_err(out - base, ref.detach()) < 1e-5
    assert rel_err(dx - base, ins[0].grad) < 1e-5
    assert rel_err(dp - 1, pr.grad * in_range) < 1e-5
    assert rel_err(dw13.flip(0) / 2, ins[1].grad[e0:e1]) < 1e-5
    assert rel_err(dw2.flip(0) / 2, ins[2].grad[e0:e1]) < 1e-5


def test_pair_slices_partition_the_range():
    """Slices cover the range's pairs once, in order, each at most ``rows``; a bound above the
    real count leaves the slices past it empty; one slice is the range itself (no copy)."""
    offs = torch.tensor([10, 13, 13, 30, 31])  # 21 pairs from position 10, an empty expert
    assert pair_slices(offs, 21, None)[0][0] is offs
    assert pair_slices(offs, 21, 21)[0][0] is offs
    got = pair_slices(offs, 21, 8)
    assert [(n, r0) for _, n, r0 in got] == [(8, 0), (8, 8), (5, 16)]
    assert [s.tolist() for s, _, _ in got] == [
        [10, 13, 13, 18, 18], [18, 18, 18, 26, 26], [26, 26, 26, 30, 31]]  # fmt: skip
    bounded = pair_slices(offs, 40, 16)  # 40: a bound on 21
    assert [(n, r0) for _, n, r0 in bounded] == [(16, 0), (16, 16), (8, 32)]
    assert bounded[2][0].tolist() == [42] * 5  # past the real end: every offset equal, no pairs
    sizes = [int(s[-1] - s[0]) for s, _, _ in bounded]
    assert sizes == [16, 5, 0]


@pytest.mark.parametrize("accumulate", [True, False])
def test_weight_gradient_leaves_an_absent_expert_untouched(accumulate):
    """Accumulating, an expert without pairs in the range is neither read nor written (its -0.0
    stays -0.0: a read-add-write would make it +0.0); written over, it gets zeros."""
    gen = torch.Generator().manual_seed(2)
    x, _, _, idx, _ = random_problem(19, 16, 8, 4, 2, gen=gen, kind="empty")
    index = build_routing_index(idx, 4)
    b = torch.randn(19 * 2, 16, generator=gen, dtype=torch.float32)
    c = torch.full((4, 16, 16), -0.0)
    grouped.wgrad(x.float(), b, index.expert_token_indices, index.offsets_for(0, 4), c,
                  a_gather=True, b_gather=False, accumulate=accumulate)  # fmt: skip
    assert index.tokens_per_expert()[3] == 0
    assert torch.equal(c[3], torch.zeros(16, 16))
    assert bool(torch.signbit(c[3]).all()) == accumulate
    assert not torch.equal(c[0], torch.zeros(16, 16))


def test_kernels_and_memory_model_share_the_slice():
    """One slice size for the kernels (``select.hop_slice_rows``) and the memory model
    (``Dims.slice_pairs``); a long enough call's modelled intermediates stop growing with T
    at that size, unsliced they grow as T*K."""
    H, I, El, K = 2048, 768, 128, 8
    for mib in (0, 1, 512, HOP_SLICE_MIB):
        d = cost.dims(tokens=4096, hidden=H, ffn=I, num_local_experts=El, topk=K, world=1,
                      slice_mib=mib)  # fmt: skip
        assert select.hop_slice_rows(KernelOptions(hop_slice_mib=mib), 2 * I, I, H, 2) == (
            d.slice_pairs)  # fmt: skip
    assert cost.hop_slice_pairs(0, 2 * I, I, H, 2) is None
    per_pair = cost.hop_pair_bytes(2 * I, I, H, 2)
    assert per_pair == (2 * 2 * I + I + H) * 2
    rows = cost.hop_slice_pairs(2**30, 2 * I, I, H, 2)
    assert rows % cost.SLICE_QUANTUM == 0 and rows * per_pair <= 2**30
    assert (rows + cost.SLICE_QUANTUM) * per_pair > 2**30
    assert cost.hop_slice_pairs(1, 2 * I, I, H, 2) == cost.SLICE_QUANTUM  # at least one quantum

    def bwd(T, mib):
        d = cost.dims(tokens=T, hidden=H, ffn=I, num_local_experts=El, topk=K, world=1,
                      slice_mib=mib)  # fmt: skip
        return cost.memory_bytes("expert", d).bwd

    assert bwd(2**17, 1024) == bwd(2**18, 1024) < bwd(2**17, 0) < bwd(2**18, 0)
    assert bwd(2**10, 1024) == bwd(2**10, 0)  # a short call is one slice
