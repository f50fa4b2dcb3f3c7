"""A dead or stalled EP peer is named fast (issue #17 item 1): ``RingPeerError``, bounded waits.

The unit tests drive the waits and the agreement with stand-ins for works, events and a reduce
that lost a rank's contribution (what an aborted NCCL all-reduce leaves), no process group. Killed
and stalled ranks over spawned gloo worlds (``benchmarks/fault.py``'s cases):
tests/harness/test_fault_harness.py.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from relaymoe.options import RingConfig
from relaymoe.ring import agreement as agree_mod
from relaymoe.ring import executor, faults
from relaymoe.ring.faults import PeerWatch, RingPeerError
from relaymoe.ring.plan import ring_request
from relaymoe.ring.runtime import RingRuntime
from tests.fixtures import use_env

TIMEOUT_S = 5.0


def _watch(rank=0, ranks=(0, 1), timeout_s=TIMEOUT_S, mode="expert", phase="fwd",
           host_wait="lag", runtime=None):  # fmt: skip
    return PeerWatch(None, mode=mode, phase=phase, timeout_s=timeout_s, rank=rank, ranks=ranks,
                     host_wait=host_wait, runtime=runtime)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the error and the waits (no process group)
# ---------------------------------------------------------------------------------------------
def test_error_names_call_group_peer_timeout_and_fix():
    err = _watch(rank=1, ranks=(4, 6, 9)).error(
        RuntimeError("Connection reset by peer"), op="p2p", hop=2, peers=[2], waited_s=0.25
    )
    assert isinstance(err, RuntimeError)
    assert err.call == "expert fwd hop 2 (p2p)"
    assert (err.rank, err.group_ranks, err.peers, err.timeout_s) == (6, (4, 6, 9), (9,), 5.0)
    msg = str(err)
    for part in ("expert fwd hop 2 (p2p)", "on rank 6", "EP group [4, 6, 9]", "rank 9 did not",
                 "timeout of 5 s", "sends to 9, receives from 4", "Connection reset by peer",
                 "check the log of rank 9", "raise the process group's timeout",
                 "RELAYMOE_RING_TIMEOUT_S", "restart"):  # fmt: skip
        assert part in msg, (part, msg)
    unknown = _watch(rank=0, ranks=(0, 1, 2)).error("x", op="all_reduce")
    assert unknown.peers is None and "among ranks [1, 2]" in str(unknown)
    assert "unknown which" in str(unknown)
    # in a group of two the other rank is the only one that can have failed to answer
    assert _watch(rank=1, ranks=(3, 5)).error("x", op="all_reduce").peers == (3,)


class _Work:
    def __init__(self, result=True, exc=None, delay=0.0, completed=True):
        self.result, self.exc, self.delay, self.timeouts = result, exc, delay, []
        self.completed = completed

    def is_completed(self):
        return self.completed

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        time.sleep(self.delay)
        if self.exc is not None:
            raise self.exc
        return self.result


def test_wait_passes_the_timeout_and_names_the_failing_work_s_peer():
    watch = _watch(rank=0, ranks=(10, 11, 12))
    ok, failing = _Work(), _Work(exc=RuntimeError("Timed out waiting 5000ms for recv"))
    with pytest.raises(RingPeerError) as info:
        watch.wait([(ok, (1,)), (failing, (2,))], op="p2p", hop=1)
    assert info.value.peers == (12,) and info.value.hop == 1
    assert "Timed out waiting" in str(info.value)
    for w in (ok, failing):  # every wait is bounded: an explicit, positive timedelta
        (t,) = w.timeouts
        assert isinstance(t, timedelta) and 0 < t.total_seconds() <= TIMEOUT_S
    with pytest.raises(RingPeerError, match="reported failure"):
        watch.wait([_Work(result=False)], op="all_to_all")


def test_wait_shares_one_deadline_and_never_passes_zero():
    watch = _watch(timeout_s=0.05)
    slow, late = _Work(delay=0.08), _Work()
    watch.wait([slow, late], op="p2p")
    # past the deadline the next wait still gets 1 ms (0 would mean "no timeout" to c10d)
    assert late.timeouts[0].total_seconds() == pytest.approx(1e-3)


def test_issue_errors_become_ring_peer_error():
    watch = _watch()
    with pytest.raises(RingPeerError) as info:
        with watch.issuing(op="p2p", hop=0, peers={1}):
            raise RuntimeError("Connection closed by peer")
    assert info.value.peers == (1,)
    with pytest.raises(ValueError):  # not a backend error: left alone
        with watch.issuing(op="p2p"):
            raise ValueError("a bug")


class _Event:
    def __init__(self, done_after=None, exc=None):
        self.calls, self.done_after, self.exc = 0, done_after, exc

    def query(self):
        self.calls += 1
        if self.exc is not None:
            raise self.exc
        return self.done_after is not None and self.calls > self.done_after


def test_device_side_waits_are_bounded_on_the_host():
    watch = _watch(timeout_s=0.2, ranks=(0, 1))
    watch.wait_event(_Event(done_after=3), op="copy-engine barrier and pull", hop=1)
    t0 = time.monotonic()
    with pytest.raises(RingPeerError, match="may still spin") as info:
        watch.wait_event(_Event(), op="copy-engine barrier and pull", hop=1)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert info.value.peers == (1,) and "sends to 1, receives from 1" in str(info.value)
    # a barrier that gave up and trapped surfaces as a sticky CUDA error on the next query
    trap = RuntimeError("CUDA error: unspecified launch failure")
    with pytest.raises(RingPeerError, match="unspecified launch failure"):
        watch.wait_event(_Event(exc=trap), op="copy-engine barrier and pull", hop=0)


def test_finish_waits_for_deferred_works_and_events(monkeypatch):
    cuda = torch.device("cuda", 0)  # the device object only: nothing runs on it
    config = use_env(monkeypatch, RELAYMOE_RING_HOST_WAIT=None)
    # default: a pass waits for the one before
    assert faults.host_wait_mode(cuda, config.host_wait) == "lag"
    config = use_env(monkeypatch, RELAYMOE_RING_HOST_WAIT="pass")
    watch = _watch(timeout_s=0.1, host_wait=config.host_wait, runtime=RingRuntime())
    works = [_Work(), _Work(exc=RuntimeError("NCCL communicator was aborted"))]
    watch.defer([(works[0], (1,))], op="p2p", hop=0)
    watch.defer([(works[1], (1,))], op="p2p", hop=1)
    with pytest.raises(RingPeerError, match="aborted") as info:
        watch.finish(cuda)
    assert info.value.hop == 1 and all(len(w.timeouts) == 1 for w in works)
    # RELAYMOE_RING_HOST_WAIT=off: no host wait at all on CUDA (NCCL's watchdog bounds a hang)
    config = use_env(monkeypatch, RELAYMOE_RING_HOST_WAIT="off")
    watch = _watch(timeout_s=0.1, host_wait=config.host_wait, runtime=RingRuntime())
    quiet = _Work(exc=RuntimeError("never waited for"))
    watch.defer([quiet], op="p2p")
    watch.finish(cuda)
    assert quiet.timeouts == []
    with pytest.raises(ValueError, match="RELAYMOE_RING_HOST_WAIT='sometimes'"):
        use_env(monkeypatch, RELAYMOE_RING_HOST_WAIT="sometimes")
    assert faults.host_wait_enabled(torch.device("cpu"), "off")  # CPU: every hop waits, always
    # lag without a runtime to hand the pass to waits at the pass's end
    watch = _watch(timeout_s=0.1, host_wait="lag")
    late = _Work(exc=RuntimeError("NCCL communicator was aborted"))
    watch.defer([(late, (1,))], op="p2p", hop=0)
    with pytest.raises(RingPeerError, match="aborted"):
        watch.finish(cuda)


def test_lag_waits_at_each_pass_end_for_the_pass_before(monkeypatch):
    """RELAYMOE_RING_HOST_WAIT=lag: a pass's end waits (bounded) for the previous pass's
    transfers on the same device, never its own, and names the previous pass when they failed."""
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    runtime = RingRuntime()

    def pass_(phase, work, device=cuda0):
        watch = _watch(0, (4, 7), 0.1, "expert", phase, runtime=runtime)
        watch.defer([(work, (1,))], op="p2p", hop=1)
        watch.finish(device)

    fwd, bwd, other = _Work(), _Work(exc=RuntimeError("NCCL communicator was aborted")), _Work()
    pass_("fwd", fwd)
    assert fwd.timeouts == []  # the host runs on: nothing waited at the pass's own end
    pass_("fwd", other, cuda1)  # another device keeps its own queue
    pass_("bwd", bwd)
    assert len(fwd.timeouts) == 1 and bwd.timeouts == [] and other.timeouts == []
    with pytest.raises(RingPeerError) as info:  # the failed backward, named one pass later
        pass_("fwd", _Work())
    assert (info.value.phase, info.value.hop, info.value.peers) == ("bwd", 1, (7,))
    assert "expert bwd hop 1 (p2p)" in str(info.value)
    # another runtime (another dispatcher) keeps its own pending passes
    mine, theirs = _Work(exc=RuntimeError("aborted")), _Work()
    pass_("fwd", mine)
    watch = _watch(0, (4, 7), 0.1, "expert", "fwd", runtime=RingRuntime())
    watch.defer([(theirs, (1,))], op="p2p", hop=1)
    watch.finish(cuda0)  # waits for nothing of `runtime`'s
    assert mine.timeouts == [] and theirs.timeouts == []


def test_lag_waits_for_a_backwards_last_pass_when_the_backward_ends(monkeypatch):
    """The last ring pass of a backward has no later pass to wait for it: the backward's end does
    (an autograd callback), so its RingPeerError reaches the caller of backward() rather than a
    later sync reading aborted buffers. One wait per backward call; a pass that finished passes."""
    cuda = torch.device("cuda", 0)
    runtime = RingRuntime()
    monkeypatch.setattr(faults, "POLL_S", 60.0)  # the watchdog thread stays out of this test

    class TwoPasses(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, works):
            ctx.works = works
            return x * 2

        @staticmethod
        def backward(ctx, g):
            for hop, work in enumerate(ctx.works):  # two backward passes, as two layers make
                watch = _watch(0, (3, 6), 0.1, "token", "bwd", runtime=runtime)
                watch.defer([(work, (1,))], op="p2p", hop=hop)
                watch.finish(cuda)
            return g * 2, None

    x = torch.ones(3, requires_grad=True)
    good = [_Work(), _Work()]
    TwoPasses.apply(x, good).sum().backward()
    assert [len(w.timeouts) for w in good] == [1, 1]  # the first by the second, the last at the end
    assert runtime.lag.pending() == {}
    bad = [_Work(), _Work(exc=RuntimeError("NCCL communicator was aborted"))]
    with pytest.raises(RingPeerError) as info:
        TwoPasses.apply(x, bad).sum().backward()
    assert (info.value.phase, info.value.hop, info.value.peers) == ("bwd", 1, (6,))
    assert runtime.backward_waits == set()


def test_lag_watchdog_logs_a_last_pass_that_never_finished(monkeypatch):
    """The last pass before a sync outside the ring has no later pass to wait for it: past the
    timeout the watchdog thread logs its error once; a finished pass is never reported. The
    records are caught by a handler on the ring's own logger, so what other tests did to the
    logging tree (a disabled logger, a root handler taken away) cannot hide them."""
    import logging

    runtime = RingRuntime()
    monkeypatch.setattr(faults, "POLL_S", 0.01)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("relaymoe.ring")
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logger, "level", logging.ERROR)
    logger.addHandler(handler)
    try:
        for device, phase, work in (
            (torch.device("cuda", 2), "fwd", _Work()),
            (torch.device("cuda", 3), "bwd", _Work(completed=False)),
        ):
            watch = _watch(1, (2, 5), 0.05, "token", phase, runtime=runtime)
            watch.defer([(work, (0,))], op="p2p", hop=1)
            watch.finish(device)
        t0 = time.monotonic()
        while not records and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        time.sleep(0.1)  # a few more rounds of the watchdog: still one report
    finally:
        logger.removeHandler(handler)
    msgs = [r.getMessage() for r in records]
    assert len(msgs) == 1, msgs
    assert "token bwd hop 1 (p2p) on rank 5" in msgs[0] and "rank 2 did not answer" in msgs[0]
    assert "lag watchdog" in msgs[0]


class _Options:
    _timeout = timedelta(seconds=7)


class _Backend:
    options = _Options()


class _Group:
    def _get_backend(self, device):
        return _Backend()


def test_timeout_is_the_group_s_own_or_the_environment_s(monkeypatch):
    backend = ["gloo"]
    monkeypatch.setattr(faults.dist, "get_backend", lambda group: backend[0])
    monkeypatch.setattr(faults.torch.cuda, "is_available", lambda: False)
    config = use_env(monkeypatch, RELAYMOE_RING_TIMEOUT_S=None)
    assert faults.ring_timeout_s(_Group(), config.timeout_s) == 7.0
    backend[0] = "nccl"  # gives up before NCCL's watchdog: 25% (at most 5 s) earlier
    assert faults.ring_timeout_s(_Group()) == pytest.approx(5.25)
    _Options._timeout = timedelta(seconds=600)  # a real job's: the 5 s cap
    try:
        assert faults.ring_timeout_s(_Group()) == pytest.approx(595.0)
    finally:
        _Options._timeout = timedelta(seconds=7)
    config = use_env(monkeypatch, RELAYMOE_RING_TIMEOUT_S="2.5")
    assert faults.ring_timeout_s(_Group(), config.timeout_s) == 2.5
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(
            ValueError,
            match=rf"RELAYMOE_RING_TIMEOUT_S='{bad}' (\(environment\) is refused: "
            r"RingConfig.timeout_s=.* must be a number of seconds in \(0, 604800\]|must be a "
            "number)",
        ):
            use_env(monkeypatch, RELAYMOE_RING_TIMEOUT_S=bad)


def test_copy_engine_barrier_gets_the_timeout(monkeypatch):
    calls = []

    class NewHandle:
        def barrier(self, channel=0, timeout_ms=0):
            calls.append(("new", channel, timeout_ms))

    class OldHandle:
        def barrier(self, channel=0):
            calls.append(("old", channel))

    executor._barrier(RingRuntime(), NewHandle(), 2.5)
    assert calls == [("new", 0, 2500)]
    calls.clear()
    runtime = RingRuntime()
    executor._barrier(runtime, OldHandle(), 2.5)  # learns once: no timeout argument
    executor._barrier(runtime, OldHandle(), 2.5)
    assert calls == [("old", 0), ("old", 0)]


# ---------------------------------------------------------------------------------------------
# the agreement never reads a partial all-reduce as data (the issue's copy-engine symptom)
# ---------------------------------------------------------------------------------------------
def _inputs(T=4, H=8, I=4, El=2, K=2, E=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(El, 2 * I, H, generator=g), torch.randn(El, H, I, generator=g)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    return x, w13, w2, idx, torch.rand(T, K, generator=g)


@pytest.mark.parametrize("lost", ["row", "garbage"])
def test_agreement_does_not_read_a_reduce_that_lost_a_rank(monkeypatch, lost):
    """An all-reduce that timed out and was aborted can return with the caller's own row only:
    before issue #17 that read as 'E_local differs across ranks: [2, 0]'."""

    def aborted(mat, group, *, mode, phase, timeout_s=None):
        # what the wait let through: this rank's row, rank 1's missing (or a half-written sum)
        if lost == "garbage":
            mat[1] = 3
        return _watch(rank=0, ranks=(0, 1), mode=mode, phase=phase)

    monkeypatch.setattr(agree_mod, "all_reduce_checked", aborted)
    monkeypatch.setattr(agree_mod, "_comm_device", lambda group, x: torch.device("cpu"))
    x, w13, w2, idx, probs = _inputs()
    with pytest.raises(RingPeerError) as info:
        agree_mod._agree_collective(
            (x, w13, w2, idx, probs), group=object(), rank=0, world=2,
            req=ring_request(RingConfig(mode="expert", transport="nccl")), validate_ids=True,
            with_pairs=True,
        )  # fmt: skip
    err = info.value
    assert err.phase == "agree" and err.op == "all_reduce"
    assert err.peers == (1,)  # two ranks: the other one, even when the markers are garbage
    assert "validity marker" in str(err) and "differs across ranks" not in str(err)


def test_markers_name_the_missing_ranks_or_say_unknown():
    watch = _watch(rank=0, ranks=(0, 1, 2, 3))
    faults.check_markers(watch, [1, 1, 1, 1], what="x")
    with pytest.raises(RingPeerError) as info:
        faults.check_markers(watch, [1, 0, 1, 0], what="the agreement's all-reduce")
    assert info.value.peers == (1, 3)
    with pytest.raises(RingPeerError) as info:
        faults.check_markers(watch, [1, 2, 7, 1], what="the agreement's all-reduce")
    assert info.value.peers is None and "unknown which" in str(info.value)


def test_error_survives_pickling():
    import pickle

    err = _watch(rank=0, ranks=(2, 5)).error("gone", op="p2p", hop=3, peers=[1], waited_s=1.0)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is RingPeerError and str(back) == str(err)
    assert (back.call, back.peers, back.group_ranks) == (err.call, (5,), (2, 5))
