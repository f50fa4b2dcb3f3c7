"""A dead or stalled EP peer is named fast (issue #17 item 1), over spawned gloo worlds.

The test runs ``benchmarks/fault.py``'s cases over gloo: one rank exits before a call or inside a
forward/backward hop, or stalls, at world 2 and 3, for both ring modes and the all-to-all mode;
every survivor must raise ``RingPeerError`` naming the call, the EP group, the timeout and (where
knowable) the dead rank, within the timeout + 15 s, and never return data. The waits and the
agreement without a process group: tests/lib/test_ring_faults.py.
"""

from __future__ import annotations

import itertools

import pytest

from tests.lib.test_ring_faults import TIMEOUT_S


def _specs():
    from benchmarks.fault import Spec

    specs = []
    for world in (2, 3):
        for mode in ("expert", "token", "alltoall"):
            for case in ("before", "mid_fwd"):
                specs.append(Spec(case=case, mode=mode, world=world, timeout_s=TIMEOUT_S))
    specs += [
        # the cached agreement of a trusted caller: the first hop meets the dead rank
        Spec(case="before_cached", mode="expert", world=2, timeout_s=TIMEOUT_S),
        Spec(case="before_cached", mode="alltoall", world=3, timeout_s=TIMEOUT_S),
        Spec(case="mid_bwd", mode="token", world=3, timeout_s=TIMEOUT_S),
        # a trusted caller over the pair-buffer budget: the per-call pair counts' all-reduce
        Spec(
            case="before_cached",
            mode="token",
            world=3,
            timeout_s=TIMEOUT_S,
            env=(("RELAYMOE_PAIR_BUFFER_MIB", "0"),),
        ),  # fmt: skip
        Spec(case="mid_bwd", mode="alltoall", world=2, timeout_s=TIMEOUT_S),
        # alive but silent: only a bounded wait ends these
        Spec(case="stall", mode="expert", world=3, timeout_s=TIMEOUT_S),
        Spec(case="stall", mode="token", world=2, timeout_s=TIMEOUT_S),
        Spec(case="stall", mode="alltoall", world=2, timeout_s=TIMEOUT_S),
        # a ring timeout (RELAYMOE_RING_TIMEOUT_S) far below the group's: only the ring's own
        # explicit wait timeouts end these (gloo would wait the group's 120 s)
        Spec(case="stall", mode="expert", world=2, timeout_s=TIMEOUT_S, pg_timeout_s=120.0),
        Spec(case="stall", mode="alltoall", world=3, timeout_s=TIMEOUT_S, pg_timeout_s=120.0),
        # an EP group of global ranks [0, 2] (rank 1 a bystander): the error names global ranks
        Spec(case="mid_fwd", mode="token", world=3, ep=(0, 2), victim=2, timeout_s=TIMEOUT_S),
    ]
    # the hops replayed from recorded bodies (capture_hops; on CPU the eager plumbing): a dead
    # peer is named as without them, at a pass's first hop and inside one
    specs += [
        Spec(case="before_cached", mode="expert", world=2, timeout_s=TIMEOUT_S, capture_hops=True),
        Spec(case="mid_fwd", mode="token", world=2, timeout_s=TIMEOUT_S, capture_hops=True),
        Spec(case="mid_bwd", mode="expert", world=2, timeout_s=TIMEOUT_S, capture_hops=True),
    ]
    # node-batched rounds: the victim dies in a row exchange (the node's all-gather forward, its
    # reduce-scatter backward) or in the column ring (one GPU a node), or stalls
    nb = dict(mode="expert", schedule="node_batched", timeout_s=TIMEOUT_S)
    specs += [
        Spec(case="mid_fwd", world=2, gpus_per_node=2, **nb),
        Spec(case="mid_bwd", world=4, gpus_per_node=2, **nb),
        Spec(case="stall", world=4, gpus_per_node=2, **nb),
        Spec(case="mid_fwd", world=3, gpus_per_node=1, **nb),
    ]
    return specs


def _stalls_spread(specs):
    """``specs`` with each stall case after one of the others: a stall waits out the timeout with
    little CPU, so that spread among the first cases its wait overlaps their work instead of
    ending the run alone (``run_isolated`` starts the cases in order, ``concurrency`` at once)."""
    stalls = [s for s in specs if s.case == "stall"]
    others = [s for s in specs if s.case != "stall"]
    pairs = itertools.zip_longest(others, stalls)
    return [s for pair in pairs for s in pair if s is not None]


@pytest.mark.slow
@pytest.mark.alone  # survivors must raise within the timeout: no other test's worlds beside it
def test_dead_or_stalled_peer_raises_ring_peer_error_within_the_timeout(tmp_path):
    from benchmarks.fault import SLACK_S, run_isolated

    specs = _stalls_spread(_specs())
    assert sorted(map(repr, specs)) == sorted(map(repr, _specs()))  # every case, reordered
    rows = run_isolated(specs, str(tmp_path), concurrency=6, deadline_s=240)
    assert len(rows) == len(specs)
    bad = [f"{r['case']} {r['mode']} ep{r['ep']} world {r['world']}: {r['why']}" for r in rows
           if not r["ok"]]  # fmt: skip
    assert not bad, "\n".join(bad)
    for r in rows:
        assert r["detected_s"] is not None and r["detected_s"] <= TIMEOUT_S + SLACK_S, r
        if r["case"] == "stall":  # the survivors waited for the timeout, then gave up
            assert r["detected_s"] >= TIMEOUT_S - 0.5, r
    sub = next(r for r in rows if r["world"] == 3 and r["ep"] == 2)
    assert "EP group [0, 2]" in sub["message"] and "rank 2 did not answer" in sub["message"]
    counts = [r for r in rows if r["case"] == "before_cached" and r["mode"] == "token"]
    assert len(counts) == 1 and "token pair counts (all_reduce)" in counts[0]["message"]
