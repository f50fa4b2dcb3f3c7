"""Ring schedule, byte layouts and the comm-volume model (pure Python / in-process torch)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from relaymoe.ring import CommVolume, RingPlan, comm_volume
from relaymoe.ring.layout import ALIGN, Layout


def _plans():
    for R in (1, 2, 3, 4, 5):
        sizes = [0, 100, 256, 1000, 7]
        for lead, trail in itertools.product(
            [[512] * R, [sizes[i % 5] for i in range(R)]],
            [None, [300] * R, [sizes[(i + 2) % 5] for i in range(R)]],
        ):
            yield R, lead, trail


@pytest.mark.parametrize("R,lead,trail", list(_plans()))
def test_plan_every_send_matches_its_receive(R, lead, trail):
    plans = [RingPlan(r, R, lead, trail) for r in range(R)]
    cap = plans[0].capacity()
    assert all(p.capacity() == cap for p in plans)  # identical on every rank
    last = R if trail is not None else R - 1
    for h in range(R + 1):
        for r in range(R):
            x = plans[r].transfer(h)
            y = plans[(r + 1) % R].transfer(h)  # the receiver of r's send
            if x.send is None:
                assert y.recv is None
            else:
                assert y.recv is not None and y.recv.nbytes == x.send.nbytes
                assert y.recv_src == x.send and y.recv_peer == r and x.send_peer == (r + 1) % R
                assert x.send.stop <= cap and (y.recv.slot < 0 or y.recv.stop <= cap)
                assert h <= last
            if R == 1:
                assert x.send is None and x.recv is None


@pytest.mark.parametrize("R,lead,trail", list(_plans()))
def test_plan_data_lands_where_it_is_read(R, lead, trail):
    """Simulate the bytes: each rank's slots hold tags; after every hop the receiver's next slot
    must hold the lead of the partition it computes next and the trail of the partition it just
    computed, exactly where ``slot_layout`` says."""
    if R == 1:
        return
    plans = [RingPlan(r, R, lead, trail) for r in range(R)]
    cap = plans[0].capacity()
    slots = [[[None] * cap, [None] * cap] for _ in range(R)]
    for r in range(R):  # own lead packed into slot 0
        for b in range(lead[r]):
            slots[r][0][b] = ("lead", r, b)
    for h in range(R + 1 if trail is not None else R):
        for r in range(R):
            lay = plans[r].slot_layout(h)
            if h <= R - 1:
                assert lay.lead_partition == (r - h) % R
                for b in range(lay.lead_bytes):
                    assert slots[r][h % 2][b] == ("lead", lay.lead_partition, b), (h, r, b)
            if trail is not None and h >= 1:
                p = (r - h + 1) % R
                for b in range(lay.trail_bytes):
                    assert slots[r][h % 2][lay.trail_offset + b] == ("trail", p, b)
        if h == R:
            break
        # compute: rank r writes its trail share of partition (r-h) into slot (h+1)%2 at h == 0
        new = [[list(s[0]), list(s[1])] for s in slots]
        for r in range(R):
            x = plans[r].transfer(h)
            if x.recv is not None and x.recv.slot >= 0:
                src = slots[x.recv_peer][x.recv_src.slot][x.recv_src.start : x.recv_src.stop]
                new[r][x.recv.slot][x.recv.start : x.recv.stop] = src
            if trail is not None and h == 0:
                nxt = plans[r].slot_layout(1)
                for b in range(nxt.trail_bytes):
                    new[r][1][nxt.trail_offset + b] = ("trail", r, b)
        slots = new
    if trail is not None:
        for r in range(R):  # the final return brings every rank its own trail
            x = plans[r].transfer(R)
            if trail[r] == 0:
                assert x.recv is None
                continue
            got = slots[x.recv_peer][x.recv_src.slot][x.recv_src.start : x.recv_src.stop]
            assert got == [("trail", r, b) for b in range(trail[r])]


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank 3"):
        RingPlan(3, 3, [1, 1, 1], None)
    with pytest.raises(ValueError, match="one entry per rank"):
        RingPlan(0, 2, [1], None)
    with pytest.raises(ValueError, match="outside"):
        RingPlan(0, 2, [1, 1], None).transfer(3)


def test_layout_views_are_aligned_and_disjoint():
    lay = Layout.of(
        ("x", torch.bfloat16, (3, 5)), ("idx", torch.int32, (3, 2)), ("p", torch.float64, (3, 2))
    )
    buf = torch.zeros(lay.nbytes + ALIGN, dtype=torch.uint8)
    v = lay.views(buf, ALIGN)
    assert [s.offset % ALIGN for s in lay.segments] == [0, 0, 0]
    v["x"].fill_(1.5)
    v["idx"].fill_(-7)
    v["p"].fill_(0.25)
    w = lay.views(buf, ALIGN)
    assert torch.all(w["x"] == 1.5) and torch.all(w["idx"] == -7) and torch.all(w["p"] == 0.25)
    assert lay.nbytes == 2 * ALIGN + 3 * 2 * 8
    with pytest.raises(ValueError, match="overflows"):
        lay.views(buf, 2 * ALIGN)
    with pytest.raises(ValueError, match="multiple"):
        lay.views(buf, 4)
    empty = Layout.of(("x", torch.float32, (0, 4)), ("y", torch.int32, (0, 2)))
    assert empty.nbytes == 0 and empty.views(torch.empty(0, dtype=torch.uint8))["x"].shape == (0, 4)


def test_comm_volume_table2_and_preference():
    # qwen3-30b-a3b at EP=2: 64 local experts, H=2048, I=768, bf16; T=32k tokens per rank.
    v = comm_volume(32768, 2048, 768, 64, 8, dtype=torch.bfloat16, prob_dtype=torch.float32)
    assert isinstance(v, CommVolume)
    assert v.expert_fwd == 64 * 3 * 2048 * 768 * 2  # the 604 MB partition of the anchor probe
    assert v.expert_bwd == 2 * v.expert_fwd
    act = 32768 * 2048 * 2
    meta = 32768 * 8 * (4 + 4)
    assert v.token_fwd == 2 * act + meta
    # backward: x, dy and the probabilities lead (the forward kept every partition's routing
    # index, so no ids travel), dx and the fp32 dprobs trail
    assert v.token_bwd == 3 * act + 2 * 32768 * 8 * 4
    assert v.preferred() == "token"
    # Long sequences with few small experts: expert routing.
    v2 = comm_volume(131072, 2048, 768, 4, 8)
    assert v2.preferred() == "expert" and v2.preferred(training=False) == "expert"
    with pytest.raises(dataclasses_frozen_error()):
        v.expert_fwd = 0
    with pytest.raises(ValueError, match="hidden"):
        comm_volume(1, -1, 1, 1, 1)


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


# ---------------------------------------------------------------------------------------------
# the list form of the expert weights (relaymoe/ring/weights.py)
# ---------------------------------------------------------------------------------------------
def _buffer_views(n, shape, order, gap=0):
    numel = math.prod(shape)
    buf = torch.randn(n * (numel + gap) + 3)
    rows = [
        buf[3 + k * (numel + gap) : 3 + k * (numel + gap) + numel].view(shape) for k in range(n)
    ]
    return buf, rows if order == "forward" else rows[::-1]


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_layout_order_and_zero_copy_view(n, order):
    from relaymoe.ring.weights import LocalExperts, layout_order, stacked_view

    buf, ws = _buffer_views(n, (6, 4), order)
    want = "forward" if n == 1 else order
    assert layout_order(ws) == want
    v = stacked_view(ws, want)
    assert v.shape == (n, 6, 4) and v.is_contiguous()
    assert v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    rows = ws if want == "forward" else ws[::-1]
    for j in range(n):
        assert v[j].data_ptr() == rows[j].data_ptr()
    # LocalExperts picks the views (no copy) and splits gradients back per element
    _, w2s = _buffer_views(n, (4, 3), order)
    ex = LocalExperts(ws, w2s)
    a, b, got = ex.stacked()
    assert got == want and a.data_ptr() == v.data_ptr()
    grads = ex.split(torch.arange(n).view(n, 1, 1) * torch.ones(n, 6, 4), b.clone(), got)
    for j in range(n):
        assert torch.all(grads[j] == (j if want == "forward" else n - 1 - j))


def test_layout_order_refuses_what_is_not_back_to_back():
    from relaymoe.ring.weights import LocalExperts, layout_order

    _, gapped = _buffer_views(3, (6, 4), "forward", gap=2)
    assert layout_order(gapped) is None
    _, ws = _buffer_views(3, (6, 4), "forward")
    assert layout_order([ws[0], ws[2], ws[1]]) is None  # shuffled
    assert layout_order([w.t() for w in ws]) is None  # not contiguous
    assert layout_order([torch.randn(6, 4) for _ in range(3)]) is None  # separate storages
    assert layout_order([ws[0], ws[1].double()]) is None
    assert layout_order([]) is None
    # no view possible: a stack in the requested order, equal to the elements
    _, w2s = _buffer_views(3, (4, 3), "reversed")
    ex = LocalExperts(gapped, w2s)
    assert ex.preferred_order() == "reversed"  # w2's order when w13 has none
    a, b, order = ex.stacked()
    assert order == "reversed"
    assert a.untyped_storage().data_ptr() != gapped[0].untyped_storage().data_ptr()
    assert all(torch.equal(a[j], gapped[2 - j]) for j in range(3))
    assert b.untyped_storage().data_ptr() == w2s[0].untyped_storage().data_ptr()


def test_reverse_local_ids():
    from relaymoe.ring.weights import reverse_local_ids

    El, R = 3, 4
    ids = torch.arange(El * R, dtype=torch.int32).view(R, El)
    got = reverse_local_ids(ids, El)
    assert got.dtype == torch.int32
    assert torch.equal(got, ids.flip(1))  # q*El + l -> q*El + (El-1-l): owner q unchanged
    assert torch.equal(reverse_local_ids(got, El), ids)
    assert torch.equal(reverse_local_ids(ids, 1), ids)
