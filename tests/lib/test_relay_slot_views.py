"""The executor's views of the ring's slots: kept from pass to pass where the transport's slots
persist (``Transport.persistent_slots``, the copy engines' workspace), cut again for slots at
other addresses and for slots fresh every pass; and the trail handed to a compute that writes
it itself (``PassWork(zero_trail=False)``) as it is."""

from __future__ import annotations

import torch

from relaymoe.ring.executor import PassWork, Transport, relay
from relaymoe.ring.plan import Layout, RingPlan

CPU = torch.device("cpu")
R = 3
LEAD = Layout.of(("w", torch.float32, (4, 5)), ("ids", torch.int32, (3,)))
TRAIL = Layout.of(("g", torch.float32, (4, 5)))


class _Slots(Transport):
    """Slots that persist (made again only to grow) or are fresh every pass; moves nothing."""

    name = "test"

    def __init__(self, persistent: bool):
        from relaymoe.ring.runtime import RingRuntime

        self.persistent_slots = persistent
        self.group = None
        self.made = None
        self.runtime = RingRuntime()  # the passes over these slots share one (its slot memo)

    def slots(self, capacity, device):
        if self.made is None or not self.persistent_slots or self.made[0].numel() < capacity:
            self.made = tuple(torch.full((capacity,), 7, dtype=torch.uint8) for _ in range(2))
        return self.made

    def issue(self, xfer, sends, recvs):
        return []


def _pass(transport, own, *, capacity=None, zero_trail=True, runtime=None):
    """One pass of rank 0 in a ring of R: each hop's lead views and what its trail held."""
    seen = []

    def compute(hop, part, lead, trail):
        seen.append((hop, lead, {n: t.clone() for n, t in trail.items()}))
        trail["g"].fill_(1.0)

    plan = RingPlan(0, R, [LEAD.nbytes] * R, [TRAIL.nbytes] * R)
    work = PassWork(
        lead_layout=lambda p: LEAD,
        own_lead=own,
        compute=compute,
        trail_layout=lambda p: TRAIL,
        capacity=capacity,
        zero_trail=zero_trail,
    )
    relay(plan, work, transport=transport, device=CPU, call=_call(runtime or transport.runtime))
    return seen


def _call(runtime=None):
    from relaymoe.options import KernelOptions
    from relaymoe.ring.runtime import KernelChoice, RingCall, RingRuntime

    return RingCall(None, runtime or RingRuntime(), KernelChoice("auto", KernelOptions()))


def _own(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 5, generator=g),
        "ids": torch.randint(0, 9, (3,), generator=g, dtype=torch.int32),
    }


def test_persistent_slots_keep_their_views_across_passes():
    tr = _Slots(persistent=True)
    first, second = _pass(tr, _own(0)), _pass(tr, _own(1))
    for (h, a, _), (_, b, _) in zip(first, second, strict=True):
        assert all(a[n] is b[n] for n in LEAD.names), h  # the same view objects
    own = _own(1)  # and they read this pass's values: hop 0 computes with its own partition
    assert all(torch.equal(second[0][1][n], own[n]) for n in LEAD.names)
    grown = _pass(tr, _own(2), capacity=tr.made[0].numel() * 2)  # new slots: views cut again
    assert tr.made[0].numel() > first[0][1]["w"].untyped_storage().nbytes()
    for (_, a, _), (_, b, _) in zip(first, grown, strict=True):
        assert all(a[n] is not b[n] for n in LEAD.names)
        assert b["w"].untyped_storage().data_ptr() in {t.data_ptr() for t in tr.made}


def test_fresh_slots_get_fresh_views():
    tr = _Slots(persistent=False)
    first, second = _pass(tr, _own(0)), _pass(tr, _own(1))
    for (_, a, _), (_, b, _) in zip(first, second, strict=True):
        assert all(a[n] is not b[n] for n in LEAD.names)


def test_trail_reaches_the_compute_as_it_is_without_zero_trail():
    """The slots start as byte 7 everywhere: zeroed views by default; with zero_trail=False
    the compute sees those bytes at hop 0 (its region of the next slot), its own writes are what
    travels on (here every hop writes ones, so every arriving trail is the last hop's)."""
    for persistent in (False, True):
        zeroed = _pass(_Slots(persistent), _own(0))
        assert all(not t["g"].any() for _, _, t in zeroed)
        raw = _pass(_Slots(persistent), _own(0), zero_trail=False)
        seven = torch.full((TRAIL.nbytes,), 7, dtype=torch.uint8).view(torch.float32)
        assert torch.equal(raw[0][2]["g"].reshape(-1), seven)


def test_slot_memo_is_bounded(monkeypatch):
    """Problems of other sizes add their own views to the memo of persistent slots: past
    ``MAX_SLOT_MEMO`` entries it starts afresh instead of growing for the whole run."""
    from relaymoe.ring import executor

    tr = _Slots(persistent=True)
    runtime = tr.runtime
    first = _pass(tr, _own(0), runtime=runtime)
    monkeypatch.setattr(executor, "MAX_SLOT_MEMO", 1)
    second = _pass(tr, _own(1), runtime=runtime)
    assert all(a[n] is not b[n] for (_, a, _), (_, b, _) in zip(first, second, strict=True)
               for n in LEAD.names)  # fmt: skip
    assert sum(map(len, runtime.slot_memos[CPU][1].values())) < 64
