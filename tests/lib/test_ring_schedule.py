"""Ring schedule, byte layouts and the comm-volume model (pure Python / in-process torch)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from relaymoe import cost
from relaymoe.options import RING_MODES
from relaymoe.ring import RingPlan
from relaymoe.ring.plan import ALIGN, Layout

# (R, G): flat rings (G None) and two-level rings of N = R/G nodes (2x2, 3x2, 2x3, 2x4, 4x2, ...)
_TOPOLOGIES = [(R, None) for R in (1, 2, 3, 4, 5)] + [
    (4, 2), (6, 2), (6, 3), (8, 4), (8, 2), (4, 1), (4, 4), (9, 3),
]  # fmt: skip


def _plans():
    sizes = [0, 100, 256, 1000, 7]
    for R, G in _TOPOLOGIES:
        for lead, trail in itertools.product(
            [[512] * R, [sizes[i % 5] for i in range(R)]],
            [None, [300] * R, [sizes[(i + 2) % 5] for i in range(R)]],
        ):
            yield R, G, lead, trail


_PLAN_CASES = list(_plans())
_PLAN_IDS = [f"R{R}-G{G}-{'u' if len(set(lead)) == 1 else 'v'}-{t is None}" for R, G, lead, t in
             _PLAN_CASES]  # fmt: skip


@pytest.mark.parametrize("R,G,lead,trail", _PLAN_CASES, ids=_PLAN_IDS)
def test_plan_every_send_matches_its_receive(R, G, lead, trail):
    plans = [RingPlan(r, R, lead, trail, gpus_per_node=G) for r in range(R)]
    cap = plans[0].capacity()
    assert all(p.capacity() == cap for p in plans)  # identical on every rank
    last = R if trail is not None else R - 1
    for h in range(R + 1):
        xs = [plans[r].transfer(h) for r in range(R)]
        sent = {(r, leg.peer): leg for r in range(R) for leg in xs[r].sends}
        got = {(leg.peer, r): leg for r in range(R) for leg in xs[r].recvs}
        assert sent.keys() == got.keys()  # every send has its receive, nothing else arrives
        for (a, b), leg in sent.items():
            assert got[(a, b)].src == leg.range and got[(a, b)].nbytes == leg.nbytes > 0
            assert leg.range.stop <= cap and (got[(a, b)].range.slot < 0 or
                                              got[(a, b)].range.stop <= cap)  # fmt: skip
            assert h <= last
        for x in xs:  # at most one message per peer and direction
            assert len({leg.peer for leg in x.sends}) == len(x.sends) <= 2
            assert len({leg.peer for leg in x.recvs}) == len(x.recvs) <= 2
            if R == 1:
                assert not x.sends and not x.recvs


@pytest.mark.parametrize("R,G,lead,trail", _PLAN_CASES, ids=_PLAN_IDS)
def test_plan_pass_cache_is_the_per_hop_plan(R, G, lead, trail):
    """``transfers()``/``trail_offsets()`` (planned once per sizes, cached; what the executor
    reads) are exactly ``transfer(h)``/``slot_layout(h).trail_offset`` hop by hop."""
    for r in range(R):
        plan = RingPlan(r, R, lead, trail, gpus_per_node=G)
        again = RingPlan(r, R, list(lead), None if trail is None else list(trail),
                         gpus_per_node=G)  # fmt: skip
        assert plan.transfers() == tuple(plan.transfer(h) for h in range(R + 1))
        assert plan.trail_offsets() == tuple(plan.slot_layout(s).trail_offset
                                             for s in range(R + 1))  # fmt: skip
        assert again.transfers() is plan.transfers()  # shared by plans of the same sizes
        for x in plan.transfers():
            assert x.peers == {leg.peer for leg in (*x.sends, *x.recvs)}
        table = plan.pass_table()  # the executor's per-hop reads: the same answers, as indices
        assert table.partitions == tuple(plan.partition(s) for s in range(R))
        assert len(set(table.ranges)) == len(table.ranges)
        for x, (sends, recvs) in zip(table.transfers, table.legs, strict=True):
            assert [table.ranges[i] for i in sends] == [leg.range for leg in x.sends]
            assert [table.ranges[i] for i in recvs] == [leg.range for leg in x.recvs]


@pytest.mark.parametrize("R,G,lead,trail", _PLAN_CASES, ids=_PLAN_IDS)
def test_plan_data_lands_where_it_is_read(R, G, lead, trail):
    """Simulate the bytes: each rank's slots hold tags; after every hop the receiver's next slot
    must hold the lead of the partition it computes next and the trail of the partition it just
    computed, exactly where ``slot_layout`` says."""
    if R == 1:
        return
    plans = [RingPlan(r, R, lead, trail, gpus_per_node=G) for r in range(R)]
    cap = plans[0].capacity()
    slots = [[[None] * cap, [None] * cap] for _ in range(R)]
    for r in range(R):  # own lead packed into slot 0
        for b in range(lead[r]):
            slots[r][0][b] = ("lead", r, b)
    for h in range(R + 1 if trail is not None else R):
        for r in range(R):
            lay = plans[r].slot_layout(h)
            if h <= R - 1:
                assert lay.lead_partition == plans[r].partition(h)
                for b in range(lay.lead_bytes):
                    assert slots[r][h % 2][b] == ("lead", lay.lead_partition, b), (h, r, b)
            if trail is not None and h >= 1:
                p = plans[r].partition(h - 1)
                for b in range(lay.trail_bytes):
                    assert slots[r][h % 2][lay.trail_offset + b] == ("trail", p, b)
        if h == R:
            break
        # compute: rank r writes its trail share of partition (r-h) into slot (h+1)%2 at h == 0
        new = [[list(s[0]), list(s[1])] for s in slots]
        for r in range(R):
            for leg in plans[r].transfer(h).recvs:
                src = slots[leg.peer][leg.src.slot][leg.src.start : leg.src.stop]
                new[r][leg.range.slot][leg.range.start : leg.range.stop] = src
            if trail is not None and h == 0:
                nxt = plans[r].slot_layout(1)
                for b in range(nxt.trail_bytes):
                    new[r][1][nxt.trail_offset + b] = ("trail", r, b)
        slots = new
    if trail is not None:
        for r in range(R):  # the final return brings every rank its own trail
            x = plans[r].transfer(R)
            if trail[r] == 0:
                assert not x.recvs
                continue
            (leg,) = x.recvs
            got = slots[leg.peer][leg.src.slot][leg.src.start : leg.src.stop]
            assert got == [("trail", r, b) for b in range(trail[r])]


@pytest.mark.parametrize("R,G", [(4, 2), (6, 2), (6, 3), (8, 4), (8, 2), (12, 4), (16, 8)])
def test_two_level_visits_every_pair_once_and_crosses_nodes_on_disjoint_links(R, G):
    plans = [RingPlan(r, R, [1] * R, [1] * R, gpus_per_node=G) for r in range(R)]
    N = R // G
    assert plans[0].schedule == "two_level" and plans[0].nodes == N
    node = [r // G for r in range(R)]
    for r in range(R):  # each rank computes each partition exactly once, its own first
        seen = [plans[r].partition(s) for s in range(R)]
        assert sorted(seen) == list(range(R)) and seen[0] == r
        for s in range(R):
            assert plans[r].who(s, seen[s]) == r
    for s in range(R):  # at every step the partitions form a permutation of the ranks
        assert sorted(plans[r].partition(s) for r in range(R)) == list(range(R))
    inter_hops = []
    for h in range(R - 1):
        lead_dst = {r: plans[r].who(h + 1, plans[r].partition(h)) for r in range(R)}
        crossing = [r for r in range(R) if node[lead_dst[r]] != node[r]]
        if crossing:  # a node crossing: every GPU at once, each to the same local rank
            inter_hops.append(h)
            assert crossing == list(range(R))
            assert all(lead_dst[r] == (r + G) % R for r in range(R))  # G disjoint links a node
        else:  # inside the node: its ring g -> g+1
            assert all(lead_dst[r] == node[r] * G + (r % G + 1) % G for r in range(R))
    assert inter_hops == [j * G + G - 1 for j in range(N - 1)]  # N-1 crossings of R-1 lead hops
    # the trail parts from its lead only around a crossing: on the hop after it
    for h in range(1, R):
        split = any(len(plans[r].transfer(h).sends) == 2 for r in range(R))
        assert split == (h - 1 in inter_hops or h in inter_hops)


@pytest.mark.parametrize("R", [2, 3, 4, 6])
def test_one_gpu_per_node_and_one_node_are_the_flat_ring(R):
    sizes = [(37 * r) % 700 + 1 for r in range(R)]
    for G in (1, R):
        for r in range(R):
            a = RingPlan(r, R, sizes, sizes[::-1])
            b = RingPlan(r, R, sizes, sizes[::-1], gpus_per_node=G)
            assert b.schedule == "flat" and b.capacity() == a.capacity()
            for h in range(R + 1):
                assert a.transfer(h) == b.transfer(h)
                assert a.slot_layout(h) == b.slot_layout(h)


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank 3"):
        RingPlan(3, 3, [1, 1, 1], None)
    with pytest.raises(ValueError, match="one entry per rank"):
        RingPlan(0, 2, [1], None)
    with pytest.raises(ValueError, match="outside"):
        RingPlan(0, 2, [1, 1], None).transfer(3)
    for bad in (0, 4, -2, 2.0, True):
        with pytest.raises(ValueError, match=f"gpus_per_node={bad!r} must be a positive divisor"):
            RingPlan(0, 6, [1] * 6, None, gpus_per_node=bad)


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


def test_layout_views_share_flat_views_and_runs_cover_the_segments():
    """``views`` with a buffer's shared flat views are the plain views (same bytes, shapes,
    strides); ``runs`` cover exactly the segments' bytes, adjacent segments of one dtype in one
    run, and never the alignment gaps."""

    def plain(lay, buf, base):
        return {s.name: buf[base + s.offset : base + s.offset + s.nbytes].view(s.dtype)
                .view(s.shape) for s in lay.segments}  # fmt: skip

    mixed = Layout.of(("x", torch.bfloat16, (3, 5)), ("idx", torch.int32, (3, 2)),
                      ("p", torch.float64, (3, 2)), ("q", torch.float64, (0, 2)))  # fmt: skip
    packed = Layout.of(("a", torch.float32, (4, 64)), ("b", torch.float32, (2, 3, 64)),
                       ("c", torch.float32, (5,)))  # fmt: skip
    for lay in (mixed, packed):
        for extra, off in itertools.product((0, 1, 3, ALIGN + 5), (0, ALIGN)):
            store = torch.zeros(off + ALIGN + lay.nbytes + extra, dtype=torch.uint8)
            buf, flats = store[off:], {}
            for base in (0, ALIGN):
                want, got = plain(lay, buf, base), lay.views(buf, base, flats)
                for name, w in want.items():
                    g = got[name]
                    assert (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride())
                    assert g.data_ptr() == w.data_ptr() and g.is_contiguous()
                covered = set()
                for run in lay.runs(buf, base, flats):
                    at = run.data_ptr() - buf.data_ptr()
                    covered |= set(range(at, at + run.numel() * run.element_size()))
                assert covered == {base + s.offset + i for s in lay.segments
                                   for i in range(s.nbytes)}  # fmt: skip
    assert len(packed.runs(torch.empty(packed.nbytes, dtype=torch.uint8))) == 1
    assert len(mixed.runs(torch.empty(mixed.nbytes, dtype=torch.uint8))) == 3


def test_hop_bytes_table2_and_the_ring_mode_choice():
    # qwen3-30b-a3b at EP=2: 64 local experts, H=2048, I=768, bf16; T=32k tokens per rank.
    sizes = dict(tokens=32768, hidden=2048, ffn=768, num_local_experts=64, topk=8, world=2,
                 act_bytes=torch.bfloat16, prob_bytes=torch.float32)  # fmt: skip
    d = cost.dims(**sizes)
    e, t = cost.hop_bytes("expert", d), cost.hop_bytes("token", d)
    assert e.fwd == 64 * 3 * 2048 * 768 * 2  # the 604 MB partition of the anchor probe
    assert e.bwd == 2 * e.fwd
    act = 32768 * 2048 * 2
    meta = 32768 * 8 * (4 + 4)
    assert t.fwd == 2 * act + meta
    # backward: x, dy and the probabilities lead (the forward kept every partition's routing
    # index, so no ids travel), dx and the fp32 dprobs trail
    assert t.bwd == 3 * act + 2 * 32768 * 8 * 4
    assert cost.choose_mode(**sizes, modes=RING_MODES) == "token"
    # Long sequences with few small experts: expert routing.
    long = dict(sizes, tokens=131072, num_local_experts=4)
    assert cost.choose_mode(**long, modes=RING_MODES) == "expert"
    assert cost.choose_mode(**long, modes=RING_MODES, training=False) == "expert"
    with pytest.raises(dataclasses_frozen_error()):
        e.fwd_lead = 0
    with pytest.raises(ValueError, match="H=-1"):
        cost.dims(**dict(sizes, hidden=-1))


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


def test_copied_weight_bytes_counts_stacks_and_packs_only():
    """The step report's count of expert-weight bytes the ring copies: nothing for views of
    back-to-back parameters, each stacked element's bytes, and a slot pack's bytes."""
    from relaymoe.ring.runtime import RingRuntime
    from relaymoe.ring.weights import LocalExperts

    _, ws = _buffer_views(3, (6, 4), "reversed")  # Megatron's DDP buffer order: a view
    _, w2s = _buffer_views(3, (4, 3), "reversed")
    _, gapped = _buffer_views(3, (6, 4), "forward", gap=2)  # padded: a stack
    rt = RingRuntime()  # the tally: the runtime of the calls that copy
    LocalExperts(ws, w2s, tally=rt).stacked()
    assert rt.copied_weight_bytes == 0
    LocalExperts(gapped, w2s, tally=rt).stacked()
    assert rt.copied_weight_bytes == 3 * 6 * 4 * 4  # the stacked w13 (fp32), w2 viewed
    c1 = rt.copied_weight_bytes
    dst = torch.empty(3, 6, 4)
    LocalExperts(ws, w2s, tally=rt).pack("w13", dst)
    assert rt.copied_weight_bytes - c1 == dst.numel() * 4
    assert torch.equal(dst[0], ws[0])


def test_reverse_local_ids():
    from relaymoe.ring.weights import reverse_local_ids

    El, R = 3, 4
    ids = torch.arange(El * R, dtype=torch.int32).view(R, El)
    got = reverse_local_ids(ids, El)
    assert got.dtype == torch.int32
    assert torch.equal(got, ids.flip(1))  # q*El + l -> q*El + (El-1-l): owner q unchanged
    assert torch.equal(reverse_local_ids(got, El), ids)
    assert torch.equal(reverse_local_ids(ids, 1), ids)


def test_local_experts_with_biases_round_trip():
    """Biases ride with the weights: the autograd inputs list after list (w13, w2, b13, b2),
    rebuilt from them, stacked in the weights' row order (a view where back to back, else a
    stack), packed per element and their gradients split back per element."""
    from relaymoe.ring.weights import LocalExperts

    _, ws = _buffer_views(3, (6, 4), "reversed")
    _, w2s = _buffer_views(3, (4, 3), "reversed")
    _, b13s = _buffer_views(3, (6,), "reversed")  # back to back: a view
    b2s = [torch.randn(4) for _ in range(3)]  # separate storages: a stack
    ex = LocalExperts(ws, w2s, b13s, b2s)
    assert ex.parts == ("w13", "w2", "b13", "b2") and len(ex.inputs()) == 12
    again = LocalExperts.from_inputs(True, ex.inputs(), True, True)
    assert all(a is b for a, b in zip(again.inputs(), ex.inputs(), strict=True))
    only_b2 = LocalExperts.from_inputs(True, [*ws, *w2s, *b2s], False, True)
    assert only_b2.parts == ("w13", "w2", "b2") and only_b2.b2 == b2s
    w13, _, order = ex.stacked()
    b13, b2 = ex.biases(order)
    same = b13.untyped_storage().data_ptr() == b13s[0].untyped_storage().data_ptr()
    assert order == "reversed" and same  # a view of the bias buffer, no copy
    assert all(
        torch.equal(b13[j], b13s[2 - j]) and torch.equal(b2[j], b2s[2 - j]) for j in range(3)
    )
    dst = torch.empty(3, 4)
    ex.pack("b2", dst)
    assert all(torch.equal(dst[j], b2s[j]) for j in range(3))  # expert order
    g = ex.split(torch.zeros(3, 6, 4), torch.zeros(3, 4, 3), "reversed", b13, b2)
    assert all(torch.equal(g[9 + j], b2s[j]) for j in range(3))  # per element, expert order
    t = LocalExperts(torch.zeros(3, 6, 4), torch.zeros(3, 4, 3), None, torch.zeros(3, 4))
    assert t.parts == ("w13", "w2", "b2") and len(t.inputs()) == 3
    assert t.split(1, 2, "forward", None, 3) == (1, 2, 3)


def test_expert_mlp_row_fields_round_trip_and_refusals():
    """The agreement row carries every field of the activation exactly (float bits), and the
    group refuses a rank whose activation or biases differ, naming each rank's value."""
    from relaymoe.activation import NAMES, ExpertActivation
    from relaymoe.ring.agreement import (
        activation_fields,
        activation_of,
        bias_code,
        same_expert_mlp,
    )

    acts = [*NAMES.values(), ExpertActivation(fn="silu", alpha=1.702, limit=7.0,
                                              linear_offset=1.0)]  # fmt: skip
    for act in acts:
        fields = activation_fields(act)
        assert all(isinstance(f, int) for f in fields) and activation_of(fields) == act
    clamped = acts[-1]
    other = ExpertActivation(fn="silu", alpha=1.702, limit=7.0 + 2**-40, linear_offset=1.0)
    assert activation_of(activation_fields(other)) == other != clamped
    got = same_expert_mlp([activation_fields(clamped)] * 2, [bias_code(True, False)] * 2)
    assert got == (clamped, True, False)
    with pytest.raises(ValueError, match=r"rank 1: geglu = ExpertActivation\(fn='gelu'"):
        same_expert_mlp([activation_fields(NAMES["swiglu"]), activation_fields(NAMES["geglu"])],
                        [1, 1])  # fmt: skip
    with pytest.raises(ValueError, match=r"rank 0: b13 and b2, rank 1: none"):
        same_expert_mlp([activation_fields(clamped)] * 2, [bias_code(True, True), 1])
