"""Atomic-free Triton routing build == the torch build, bitwise, under TRITON_INTERPRET=1.

Every kernel path runs: the one-hot and the pairwise tile rank, two launches (scan fused into
the scatter) and three, one block and many (``max_blocks`` forces small blocks).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from relaymoe.kernels import triton_available
from relaymoe.kernels.routing import build_routing_index_triton, routing_config
from relaymoe.routing import _build_torch, build_routing_index
from tests.fixtures import random_routing
from tests.lib.test_routing import check_invariants

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not importable")

NAMES = ("expert_token_indices", "expert_token_offsets", "token_expert_indices", "token_index_map")
PATHS = list(itertools.product((False, True), (False, True)))  # (pairwise, fused)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Outputs start as garbage (-7 / NaN), so an entry the kernels never write shows up."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.dtype.is_floating_point else -7)

    monkeypatch.setattr(torch, "empty", empty)


def assert_same(got, want, what):
    for name, g, w in zip(NAMES, got, want, strict=True):
        assert g.dtype == w.dtype, f"{what}: {name} dtype {g.dtype} != {w.dtype}"
        assert torch.equal(g, w), f"{what}: {name} differs from the torch build"


CASES = [
    # (T, E, K, kind, max_blocks): odd T and E, K=1, K=E, skewed, all-to-one, an empty expert
    (101, 8, 2, "uniform", 3),
    (75, 13, 4, "skewed", 4),
    (67, 40, 1, "one", 2),  # K=1, every token on expert 0 (E_PAD=64: pairwise by default)
    (90, 9, 3, "empty", 5),
    (23, 7, 7, "uniform", 3),  # K = E
    (31, 5, 1, "uniform", 2),
    (19, 1, 1, "uniform", 2),  # E = 1
    (17, 300, 12, "skewed", 2),  # E_PAD = 512
]


@pytest.mark.parametrize("num_tokens, num_experts, topk, kind, max_blocks", CASES)
def test_triton_equals_torch_every_path(
    num_tokens, num_experts, topk, kind, max_blocks, poisoned_empty
):
    gen = torch.Generator().manual_seed(7 * num_tokens + num_experts)
    idx = random_routing(num_tokens, num_experts, topk, gen=gen, kind=kind)
    want = _build_torch(idx, num_experts)
    for pairwise, fused in PATHS:
        cfg = routing_config(
            idx.numel(), num_experts, pairwise=pairwise, fused=fused, max_blocks=max_blocks
        )
        assert cfg["num_blocks"] > 1 or idx.numel() <= cfg["tile"]
        got = build_routing_index_triton(
            idx, num_experts, pairwise=pairwise, fused=fused, max_blocks=max_blocks
        )
        assert_same(got, want, f"pairwise={pairwise} fused={fused} cfg={cfg}")


@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_tuned_config_many_blocks(kind):
    """The launch choices the GPU makes, on a routing big enough for several blocks."""
    gen = torch.Generator().manual_seed(11)
    num_tokens, num_experts, topk = 1111, 64, 6
    idx = random_routing(num_tokens, num_experts, topk, gen=gen, kind=kind)
    cfg = routing_config(idx.numel(), num_experts)
    assert cfg["pairwise"] and cfg["num_blocks"] > 1
    index = build_routing_index(idx, num_experts, impl="triton")
    assert_same([getattr(index, n) for n in NAMES], _build_torch(idx, num_experts), f"tuned {cfg}")
    check_invariants(index, idx)


def test_onehot_tiles_span_blocks():
    """One-hot tiles of 512 pairs (E_PAD=8) over several blocks, the last one partial."""
    gen = torch.Generator().manual_seed(13)
    idx = random_routing(1503, 8, 3, gen=gen, kind="skewed")
    for fused in (False, True):
        got = build_routing_index_triton(idx, 8, pairwise=False, fused=fused, max_blocks=4)
        assert_same(got, _build_torch(idx, 8), f"fused={fused}")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_input_dtypes_and_layout(dtype):
    gen = torch.Generator().manual_seed(17)
    idx = random_routing(41, 11, 3, gen=gen)
    want = _build_torch(idx, 11)
    assert_same(build_routing_index_triton(idx.to(dtype), 11, max_blocks=3), want, str(dtype))
    # A non-contiguous (K, T)-transposed view gives the same index.
    idx_t = idx.t().contiguous().t()
    assert not idx_t.is_contiguous()
    assert_same(build_routing_index_triton(idx_t, 11, max_blocks=3), want, "non-contiguous")
    # Top-1 ids as a column of a wider tensor: reshape(-1) is then a strided view, not a copy.
    top1 = idx[:, :1]
    wide = torch.cat([top1, torch.full_like(top1, 10**6)], dim=1)[:, :1]
    assert wide.reshape(-1).stride() == (2,)
    assert_same(build_routing_index_triton(wide, 11), _build_torch(top1, 11), "strided column")


def test_zero_tokens_and_limits():
    eti, off, tei, tim = build_routing_index_triton(torch.empty(0, 3, dtype=torch.int64), 5)
    assert eti.numel() == tei.numel() == tim.numel() == 0 and off.tolist() == [0] * 6
    with pytest.raises(ValueError, match="num_experts=513"):
        build_routing_index_triton(torch.zeros(2, 1, dtype=torch.int64), 513)
    with pytest.raises(ValueError, match="2-D"):
        build_routing_index_triton(torch.zeros(4, dtype=torch.int64), 4)


def test_config_pads_experts_and_covers_pairs():
    for num_pairs, num_experts in itertools.product([1, 63, 4096, 262144, 2**25, 2**31 + 16],
                                                    [1, 2, 7, 64, 128, 384, 512]):  # fmt: skip
        cfg = routing_config(num_pairs, num_experts)
        assert cfg["e_pad"] >= max(2, num_experts) and cfg["e_pad"] & (cfg["e_pad"] - 1) == 0
        assert (
            cfg["num_blocks"] * cfg["chunk"] >= num_pairs > (cfg["num_blocks"] - 1) * cfg["chunk"]
        )
        assert cfg["pairwise"] == (cfg["e_pad"] >= 64)


def test_build_passes_its_overrides_to_the_launch_config(monkeypatch):
    """The paths above are bitwise equal whatever the config, so the build must be seen to take
    the overrides: a spy on ``routing_config`` records what the build asked for."""
    import relaymoe.kernels.routing as kr

    seen = []
    real = kr.routing_config

    def spy(num_pairs, num_experts, **kw):
        seen.append(kw)
        return real(num_pairs, num_experts, **kw)

    monkeypatch.setattr(kr, "routing_config", spy)
    idx = random_routing(41, 6, 2, gen=torch.Generator().manual_seed(3))
    for pairwise, fused in PATHS:
        seen.clear()
        build_routing_index_triton(idx, 6, pairwise=pairwise, fused=fused, max_blocks=3)
        assert seen == [{"pairwise": pairwise, "fused": fused, "max_blocks": 3}], seen
    with pytest.raises(TypeError):
        build_routing_index_triton(idx, 6, pairwize=True)  # a misspelt keyword is an error


@pytest.mark.parametrize(("pairwise", "fused"), PATHS)
def test_out_of_range_ids_stay_in_bounds(pairwise, fused):
    """The garbage of a transfer a dead peer never filled (ids < 0 or >= E) must not make the
    build, or the kernels indexing through it, address memory out of bounds: every output stays
    a valid index, and the pairs of valid ids keep their experts."""
    T, K, E = 37, 3, 6  # E_PAD 8 (or more for pairwise): ids 6, 7 also fall outside E
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, E, (T, K), generator=g)
    bad = torch.rand(T, K, generator=g) < 0.3
    ids[bad] = torch.tensor([-3, 9, 2**20, -(2**31)])[torch.arange(int(bad.sum())) % 4]
    eti, offs, tei, tim = build_routing_index_triton(
        ids.to(torch.int32), E, pairwise=pairwise, fused=fused, max_blocks=4
    )
    P = T * K
    assert ((eti >= 0) & (eti < T)).all()
    assert sorted(tim.tolist()) == list(range(P))  # a permutation: no position twice
    assert (offs.diff() >= 0).all() and 0 <= offs[0] <= offs[-1] <= P
    e_pad = routing_config(P, E, pairwise=pairwise)["e_pad"]
    assert ((tei >= 0) & (tei < e_pad)).all()
    good = ~bad.reshape(-1)
    assert torch.equal(tei[good], ids.reshape(-1)[good].to(torch.int32))
    for e in range(E):  # the valid pairs of expert e sit in its range, in token order
        pos = tim[good & (tei == e)].long()
        assert ((pos >= offs[e]) & (pos < offs[e + 1])).all()
