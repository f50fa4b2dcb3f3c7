"""Routing index: the torch build's invariants, the RoutingIndex helpers, input validation."""

from __future__ import annotations

import pytest
import torch

from relaymoe.kernels import interpret_mode
from relaymoe.routing import RoutingIndex, build_routing_index, validate_topk_idx
from tests.fixtures import random_routing


def check_invariants(index: RoutingIndex, topk_idx: torch.Tensor) -> None:
    """Everything the index promises, checked from topk_idx alone (no second build)."""
    num_tokens, topk = topk_idx.shape
    num_experts, num_pairs = index.num_experts, num_tokens * topk
    eti, off = index.expert_token_indices, index.expert_token_offsets
    tei, tim = index.token_expert_indices, index.token_index_map
    assert eti.dtype == torch.int32 and tei.dtype == torch.int32 and off.dtype == torch.int64
    assert tim.dtype == (torch.int64 if num_pairs >= 2**31 else torch.int32)
    assert eti.shape == tei.shape == tim.shape == (num_pairs,) and off.shape == (num_experts + 1,)
    flat = topk_idx.reshape(-1).long()
    assert torch.equal(tei.long(), flat)
    counts = torch.bincount(flat, minlength=num_experts)
    assert off[0] == 0 and torch.equal(off[1:], torch.cumsum(counts, 0))
    pairs = torch.arange(num_pairs)
    pos = tim.long()
    assert torch.equal(torch.sort(pos).values, pairs), "token_index_map is not a permutation"
    assert torch.equal(eti.long()[pos], pairs // topk), "eti[tim[t*K+k]] != t"
    expert_at = torch.repeat_interleave(torch.arange(num_experts), counts)
    assert torch.equal(expert_at[pos], flat), "the expert at the position is not topk_idx[t, k]"
    for e in range(num_experts):  # ascending token ids inside each expert
        seg = eti[off[e] : off[e + 1]].long()
        assert bool((seg[1:] > seg[:-1]).all()), f"tokens of expert {e} not ascending"


@pytest.mark.parametrize(
    "num_tokens, num_experts, topk, kind",
    [
        (97, 8, 2, "uniform"),
        (64, 16, 4, "skewed"),
        (33, 5, 1, "one"),
        (40, 7, 3, "empty"),
        (25, 6, 6, "uniform"),  # K = E
        (1, 1, 1, "uniform"),
        (3, 384, 16, "uniform"),
    ],
)
def test_torch_build_invariants(num_tokens, num_experts, topk, kind):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + num_experts)
    idx = random_routing(num_tokens, num_experts, topk, gen=gen, kind=kind)
    index = build_routing_index(idx, num_experts, impl="torch")
    assert (index.num_tokens, index.topk, index.num_experts) == (num_tokens, topk, num_experts)
    assert index.num_pairs == num_tokens * topk
    check_invariants(index, idx)
    if kind == "empty":
        assert index.tokens_per_expert()[-1] == 0
    if kind == "one":
        assert index.tokens_per_expert()[0] == num_tokens


def test_torch_build_matches_handmade():
    idx = torch.tensor([[2, 0], [0, 1], [2, 1]])
    index = build_routing_index(idx, 4, impl="torch")
    assert index.expert_token_indices.tolist() == [0, 1, 1, 2, 0, 2]
    assert index.expert_token_offsets.tolist() == [0, 2, 4, 6, 6]
    assert index.token_expert_indices.tolist() == [2, 0, 0, 1, 2, 1]
    assert index.token_index_map.tolist() == [4, 0, 1, 2, 5, 3]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_integer_dtypes(dtype):
    gen = torch.Generator().manual_seed(3)
    idx = random_routing(50, 9, 3, gen=gen)
    want = build_routing_index(idx, 9, impl="torch")
    got = build_routing_index(idx.to(dtype), 9, impl="torch")
    for name in ("expert_token_indices", "expert_token_offsets", "token_expert_indices",
                 "token_index_map"):  # fmt: skip
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_helpers_slice_expert_ranges():
    gen = torch.Generator().manual_seed(5)
    idx = random_routing(60, 10, 3, gen=gen, kind="skewed")
    index = build_routing_index(idx, 10)
    off = index.expert_token_offsets
    view = index.offsets_for(3, 7)
    assert view.shape == (5,) and torch.equal(view, off[3:8])
    assert view.data_ptr() == off[3:].data_ptr(), "offsets_for must be a view (no copy)"
    start, stop = index.pair_range(3, 7)
    assert (start, stop) == (int(off[3]), int(off[7]))
    toks = index.tokens_for(3, 7)
    want = [t for e in range(3, 7) for t in range(60) if e in idx[t].tolist()]
    assert toks.tolist() == want
    assert index.tokens_for(4, 4).numel() == 0 and index.pair_range(0, 10) == (0, 180)
    assert torch.equal(index.tokens_per_expert(), torch.bincount(idx.reshape(-1), minlength=10))
    for e0, e1 in [(-1, 2), (3, 2), (0, 11)]:
        for fn in (index.offsets_for, index.pair_range, index.tokens_for):
            with pytest.raises(ValueError, match="expert range"):
                fn(e0, e1)


def test_zero_tokens():
    for impl in ("torch", "auto"):
        index = build_routing_index(torch.empty(0, 4, dtype=torch.int64), 8, impl=impl)
        assert index.num_pairs == 0 and index.expert_token_indices.numel() == 0
        assert index.token_index_map.numel() == 0 and index.token_expert_indices.numel() == 0
        assert index.expert_token_offsets.tolist() == [0] * 9
        assert index.tokens_for(0, 8).numel() == 0


@pytest.mark.parametrize(
    "idx, num_experts, match",
    [
        (torch.tensor([0, 1, 2]), 4, "2-D"),
        (torch.zeros(2, 2, 2, dtype=torch.int64), 4, "2-D"),
        (torch.tensor([[0.0, 1.0]]), 4, "integer"),
        (torch.tensor([[True, False]]), 4, "integer"),
        (torch.tensor([[0, 4]]), 4, "expert id 4, outside \\[0, 4\\)"),
        (torch.tensor([[-1, 2]]), 4, "expert id -1"),
        (torch.tensor([[1, 3], [2, 2]]), 4, "repeats an expert"),
        (torch.tensor([[0, 1, 2]]), 2, "K=3 exceeds num_experts E=2"),
        (torch.tensor([[0]]), 0, "num_experts must be an int >= 1"),
        (torch.zeros(3, 0, dtype=torch.int64), 4, "topk"),
    ],
)
def test_bad_input_raises(idx, num_experts, match):
    for impl in ("torch", "triton"):
        with pytest.raises(ValueError, match=match):
            build_routing_index(idx, num_experts, impl=impl)
    with pytest.raises(ValueError, match=match):
        validate_topk_idx(idx, num_experts)


def test_bad_impl_and_non_tensor():
    with pytest.raises(ValueError, match="impl"):
        build_routing_index(torch.tensor([[0]]), 1, impl="cuda")
    with pytest.raises(ValueError, match="torch.Tensor"):
        build_routing_index([[0, 1]], 2)


IMPLS = ["torch"] + (["triton"] if interpret_mode() else [])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_tokens,num_experts,topk", [(37, 8, 2), (5, 3, 3), (0, 4, 1)])
def test_build_into_one_buffer_equals_the_fresh_build(impl, num_tokens, num_experts, topk):
    """``out=``: the arrays written in place into views of one buffer (what a recorded ring hop
    builds) are the fresh build's, and the index holds exactly those views."""
    from relaymoe.ring.hop_graphs import INDEX_FIELDS, index_layout, packed_index

    idx = random_routing(num_tokens, num_experts, topk, gen=torch.Generator().manual_seed(3))
    want = build_routing_index(idx, num_experts, impl=impl)
    sizes = (num_tokens, topk, num_experts)
    buf = torch.full((index_layout(sizes).nbytes,), 255, dtype=torch.uint8)
    index = packed_index(buf, sizes)
    arrays = tuple(getattr(index, f) for f in INDEX_FIELDS)
    got = build_routing_index(idx, num_experts, impl=impl, out=arrays)
    for f in INDEX_FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
        assert getattr(got, f).data_ptr() == getattr(index, f).data_ptr(), f


def test_build_into_bad_arrays_raises():
    idx = random_routing(6, 4, 2, gen=torch.Generator().manual_seed(1))
    good = build_routing_index(idx, 4)
    arrays = [good.expert_token_indices, good.expert_token_offsets, good.token_expert_indices,
              good.token_index_map]  # fmt: skip
    with pytest.raises(ValueError, match=r"out\[1\] must be a contiguous torch.int64"):
        build_routing_index(idx, 4, out=(arrays[0], arrays[1].int(), *arrays[2:]))
    with pytest.raises(ValueError, match=r"out\[0\].*shape \(12,\)"):
        build_routing_index(idx, 4, out=(arrays[0][:5], *arrays[1:]))
    with pytest.raises(ValueError, match="4 arrays"):
        build_routing_index(idx, 4, out=tuple(arrays[:3]))
