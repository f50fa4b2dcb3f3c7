"""The two-level ring (issue #18) over spawned gloo worlds arranged as nodes x GPUs per node.

Worlds 4 (2 nodes x 2 GPUs) and 6 (3x2 and 2x3) against the float64 oracle: outputs, input
gradients and the accumulated expert-weight gradients (which follow their weights home), with
uneven T, a zero-token rank, skewed routing, top-1 and top-k = E, both ring modes, with and
without overlap. Nodes are either named (``gpus_per_node``) or read from the ranks' hosts, which
each rank fakes here by patching the host hash the agreement exchanges. The schedule itself
(every pair visited once, node crossings on disjoint links) is tested in test_ring_schedule.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from relaymoe.options import RingConfig
from tests.fixtures import scenario_params
from tests.lib.test_ring_dist import _problem, _rel, _run_case

pytestmark = pytest.mark.slow

F64, F32 = torch.float64, torch.float32


def _cases(R: int, G: int) -> list[dict]:
    uneven = [5, 0, 9, 3, 1, 6][:R]
    kw = dict(gpus_per_node=G, schedule="two_level")
    return [
        dict(mode="expert", seed=1, tokens=uneven, El=2, K=2, dtype=F64, **kw),
        dict(mode="token", seed=1, tokens=uneven, El=2, K=2, dtype=F64, **kw),
        dict(mode="expert", seed=2, tokens=[3] * R, El=1, K=1, dtype=F32, overlap=False, **kw),
        dict(mode="token", seed=3, tokens=[2, 4, 1, 3, 2, 5][:R], El=1, K=R, dtype=F64, **kw),
        dict(mode="expert", seed=4, tokens=[0, 3, 0, 6, 2, 0][:R], El=2, K=2, dtype=F64,
             route="skew", **kw),
        dict(mode="token", seed=5, tokens=[4, 0, 2, 0, 3, 1][:R], El=2, K=1, dtype=F64,
             route="one", overlap=False, **kw),
        # a trusted caller (Megatron's): cached agreement, pair buffers from the bound
        dict(mode="token", seed=6, tokens=[3] * R, El=2, K=2, dtype=F64, trusted=True, **kw),
    ]  # fmt: skip


def _resolved(rank, world, group, **options):
    """The problem every rank agrees on for ``RingConfig(mode="expert", **options)``."""
    from relaymoe.ring import resolved_problem

    pb = _problem(31, [3] * world, 2, 2, world)
    lo, hi = 3 * rank, 3 * rank + 3
    e0, e1 = 2 * rank, 2 * rank + 2
    return resolved_problem(
        pb["x"][lo:hi], pb["w13"][e0:e1], pb["w2"][e0:e1], pb["idx"][lo:hi], pb["probs"][lo:hi],
        group=group, config=RingConfig(**{"mode": "expert", **options}),
    )  # fmt: skip


def _fake_hosts(hosts):
    """Make the agreement see host ``hosts[rank]`` on each rank."""
    import relaymoe.ring.agreement as agree_mod

    rank = dist.get_rank()
    agree_mod.host_hash = lambda: 1000 + hosts[rank]


def _two_level(rank, world, group):
    nodes = {4: [2], 6: [2, 3]}[world]
    for G in nodes:
        problem = _resolved(rank, world, group, gpus_per_node=G)
        assert (problem.schedule, problem.gpus_per_node) == ("two_level", G), problem
        for c in _cases(world, G):
            _run_case(rank, world, group, **c)


def _one_gpu_per_node_is_the_flat_ring(rank, world, group):
    """Forced with one GPU per node the two-level code path runs the flat order: bitwise the
    flat ring's results."""
    for mode in ("expert", "token"):
        kw = dict(mode=mode, seed=21, tokens=[4, 1, 0, 5, 2, 3][:world], El=2, K=2, dtype=F32)
        flat_out, flat_g = _run_case(rank, world, group, schedule="flat", **kw)
        one_out, one_g = _run_case(rank, world, group, schedule="two_level", gpus_per_node=1, **kw)
        assert torch.equal(flat_out, one_out), mode
        for a, b in zip(flat_g, one_g, strict=True):
            assert torch.equal(a, b), mode


def _nodes_from_hosts(rank, world, group):
    import relaymoe.ring.agreement as agree_mod

    real = agree_mod.host_hash
    try:
        G = 2 if world == 4 else 3
        _fake_hosts([r // G for r in range(world)])  # node by node: auto runs two levels
        problem = _resolved(rank, world, group)
        assert (problem.schedule, problem.gpus_per_node) == ("two_level", G), problem
        _run_case(rank, world, group, mode="expert", seed=41, tokens=[2, 5, 0, 3, 4, 1][:world],
                  El=2, K=2, dtype=F64)  # fmt: skip
        assert _resolved(rank, world, group, schedule="flat").schedule == "flat"
        _fake_hosts([r % 2 for r in range(world)])  # interleaved placement: auto stays flat
        assert _resolved(rank, world, group).schedule == "flat"
        with pytest.raises(ValueError, match=r"hosts by rank are \[host0, host1, host0"):
            _resolved(rank, world, group, schedule="two_level")
        # an explicit node size wins over the hosts
        problem = _resolved(rank, world, group, gpus_per_node=2)
        assert (problem.schedule, problem.gpus_per_node) == ("two_level", 2)
    finally:
        agree_mod.host_hash = real
    # one host: one node, the flat ring (nothing to split)
    assert _resolved(rank, world, group).schedule == "flat"


def _bad_topologies(rank, world, group):
    bad = 4 if world == 6 else 3
    with pytest.raises(ValueError, match=f"gpus_per_node={bad} does not divide the EP group's"):
        _resolved(rank, world, group, gpus_per_node=bad)
    # a value no ring can run is refused where the config is made, on the rank that makes it,
    # before any call (2**63 overflowed the agreement's int64 row when a keyword carried it)
    with pytest.raises(ValueError, match="RingConfig.schedule='tree' is not one of"):
        RingConfig(schedule="tree")
    for absurd in (0, 2**63):
        with pytest.raises(ValueError, match=rf"gpus_per_node={absurd} must be an int in \[1, "):
            RingConfig(gpus_per_node=absurd)
    if rank == 0:  # ranks that disagree get the same error everywhere, before any P2P
        kw = dict(gpus_per_node=2)
    else:
        kw = dict(gpus_per_node=1)
    with pytest.raises(ValueError, match="gpus_per_node .* differs across ranks"):
        _resolved(rank, world, group, **kw)


SCENARIOS = (_two_level, _one_gpu_per_node_is_the_flat_ring, _nodes_from_hosts, _bad_topologies)


@pytest.mark.parametrize(("world", "scenario"), scenario_params(SCENARIOS, [4, 6]))
def test_two_level_ring_gloo(world, scenario, gloo_worlds):
    gloo_worlds.run(scenario, world, timeout=420)


def test_rel_helper_is_strict():  # the comparisons above would pass anything if this did
    a = torch.ones(3, dtype=F64)
    assert _rel(a, a) == 0 and _rel(a * 1.001, a) > 1e-4
