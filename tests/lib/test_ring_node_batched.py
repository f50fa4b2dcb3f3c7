"""Node-batched rounds of the expert ring (``schedule="node_batched"``, issue #18) over spawned
gloo worlds arranged as nodes x GPUs per node.

Worlds 4 (2 nodes x 2 GPUs, and 4 x 1, 1 x 4) and 6 (3x2, 2x3) against the float64 oracle:
outputs, input gradients and the expert-weight gradients (reduce-scattered inside the node, then
home over the column ring), with uneven T, a zero-token rank, skewed routing, top-1 and
top-k = E, list-form weights, fp32 accumulators, with and without overlap, other activations with
biases. Then what it refuses.
"""

from __future__ import annotations

import pytest
import torch

from relaymoe.kernels import triton_available
from relaymoe.options import RingConfig
from tests.fixtures import scenario_params
from tests.lib.test_ring_dist import TRITON_H, TRITON_I, _run_case
from tests.lib.test_ring_two_level import _resolved

pytestmark = pytest.mark.slow

F64, F32 = torch.float64, torch.float32


def _cases(R: int, G: int) -> list[dict]:
    kw = dict(mode="expert", gpus_per_node=G, schedule="node_batched")
    return [
        dict(seed=1, tokens=[5, 0, 9, 3, 1, 6][:R], El=2, K=2, dtype=F64, **kw),
        dict(seed=2, tokens=[3] * R, El=1, K=1, dtype=F32, overlap=False, **kw),
        dict(seed=3, tokens=[2, 4, 1, 3, 2, 5][:R], El=1, K=R, dtype=F64, **kw),
        dict(seed=4, tokens=[0, 3, 0, 6, 2, 0][:R], El=2, K=2, dtype=F64, route="skew", **kw),
        dict(seed=5, tokens=[4, 0, 2, 0, 3, 1][:R], El=2, K=1, dtype=F64, route="one",
             form="list", **kw),
        dict(seed=6, tokens=[3] * R, El=2, K=2, dtype=F64, trusted=True, **kw),
        # the expert MLP: the biases gathered with their weights over the row, their gradients
        # reduce-scattered with the weights' (list form: per-expert bias parameters)
        dict(seed=7, tokens=[4, 0, 3, 5, 2, 1][:R], El=2, K=2, dtype=F64, act="clamped_swiglu",
             bias="both", form="list", backend="torch", **kw),
        dict(seed=8, tokens=[0, 2, 3, 0, 1, 4][:R], El=1, K=2, dtype=F64, act="squared_relu",
             bias="b13", backend="torch", **kw),
    ]  # fmt: skip


def _node_batched(rank, world, group):
    for G in {4: [2, 1, 4], 6: [2, 3]}[world]:
        problem = _resolved(rank, world, group, gpus_per_node=G, schedule="node_batched")
        assert (problem.schedule, problem.gpus_per_node, problem.mode) == (
            "node_batched",
            G,
            "expert",
        )
        assert problem.transport == "nccl", problem
        for c in _cases(world, G):
            _run_case(rank, world, group, **c)
    if world == 4 and triton_available():  # the fused hop kernels (interpreter on CPU): G*El
        for G in (2, 1):  # experts written into fresh gradients (G=2) or into the trail (G=1)
            _run_case(rank, world, group, mode="expert", seed=13, tokens=[5, 0, 7, 3], El=2,
                      K=2, dtype=F32, backend="triton", tol=1e-4, gpus_per_node=G,
                      schedule="node_batched", hidden=TRITON_H, ffn=TRITON_I)  # fmt: skip


def _errors_name_the_column(rank, world, group):
    """The column plan's peers are node indices: an error names them as group ranks, the whole
    EP group, and the hop's neighbours in the column."""
    from relaymoe.ring.expert_mode import ColumnTransport
    from relaymoe.ring.faults import PeerWatch

    G = 2
    n, g = divmod(rank, G)
    tr = ColumnTransport(group, rank, G)
    column = list(range(g, world, G))  # the default group: group ranks are global ranks
    assert tr.watch_view() == {"ring": column}
    N = len(column)
    assert tr.group_peers({(n + 1) % N}) == {column[(n + 1) % N]}
    err = PeerWatch(group, mode="expert", phase="bwd", **tr.watch_view()).error(
        "no answer", op="p2p", hop=1, peers=sorted(tr.group_peers({(n + 1) % N}))
    )
    assert err.peers == (column[(n + 1) % N],) and err.group_ranks == tuple(range(world)), err
    assert f"sends to {column[(n + 1) % N]}, receives from {column[(n - 1) % N]}" in str(err)


def _same_as_the_flat_ring(rank, world, group):
    """Fp32 sums in another order than the flat ring's: equal within rounding, not bitwise."""
    kw = dict(mode="expert", seed=21, tokens=[4, 1, 0, 5, 2, 3][:world], El=2, K=2, dtype=F32)
    flat_out, flat_g = _run_case(rank, world, group, schedule="flat", **kw)
    nb_out, nb_g = _run_case(rank, world, group, schedule="node_batched", gpus_per_node=2, **kw)
    torch.testing.assert_close(nb_out, flat_out, rtol=1e-5, atol=1e-6)
    for a, b in zip(nb_g, flat_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _refusals(rank, world, group):
    from relaymoe.ring import resolved_problem
    from tests.lib.test_ring_dist import _problem

    with pytest.raises(ValueError, match=r"node_batched.*\(expert mode only\)"):
        resolved_problem(
            *_slice(_problem(31, [3] * world, 2, 2, world), rank), group=group,
            config=RingConfig(mode="token", schedule="node_batched", gpus_per_node=2),
        )  # fmt: skip
    with pytest.raises(ValueError, match="node_batched.* not the copy engine"):
        resolved_problem(
            *_slice(_problem(31, [3] * world, 2, 2, world), rank), group=group,
            config=RingConfig(mode="expert", transport="copy_engine", schedule="node_batched",
                              gpus_per_node=2),
        )  # fmt: skip
    # one host and no node size: nodes unknown, refused by name
    with pytest.raises(ValueError, match="schedule='node_batched' needs nodes"):
        import relaymoe.ring.agreement as agree_mod

        real = agree_mod.host_hash
        try:
            agree_mod.host_hash = lambda: 1000 + rank % 2  # interleaved placement
            _resolved(rank, world, group, schedule="node_batched")
        finally:
            agree_mod.host_hash = real


def _slice(pb, rank):
    lo, hi, e0, e1 = 3 * rank, 3 * rank + 3, 2 * rank, 2 * rank + 2
    return pb["x"][lo:hi], pb["w13"][e0:e1], pb["w2"][e0:e1], pb["idx"][lo:hi], pb["probs"][lo:hi]


SCENARIOS = (_node_batched, _errors_name_the_column, _same_as_the_flat_ring, _refusals)


@pytest.mark.parametrize(("world", "scenario"), scenario_params(SCENARIOS, [4, 6]))
def test_node_batched_gloo(world, scenario, gloo_worlds):
    gloo_worlds.run(scenario, world, timeout=420)
