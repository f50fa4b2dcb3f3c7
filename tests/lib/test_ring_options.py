"""``ring_moe``'s options take effect: installed ones where a keyword is None, keywords over them.

Each of ``mode``, ``transport``, ``schedule``, ``gpus_per_node``, ``grad_accum`` and ``kernels``
is set once by ``relaymoe.options.install`` and once by keyword, and the test sees it change what
runs: the agreed request and problem (mode, grad dtype, schedule's node size), the error an
option that cannot run on CPU raises (the copy engine, a node-batched token ring), and the
``KernelOptions`` that reaches the hops. World of one in this process; worlds 2 and 3 over gloo.
"""

from __future__ import annotations

import re

import pytest
import torch

from relaymoe.options import KernelOptions, RingOptions, installed
from relaymoe.reference import moe_experts_reference
from relaymoe.ring import engine
from relaymoe.ring.engine import resolved_problem, ring_moe
from tests.fixtures import ring_problem, scenario_params

# (field, an installed value, another value a keyword passes)
FIELDS = [
    ("mode", "token", "alltoall"),
    ("transport", "nccl", "copy_engine"),
    ("schedule", "flat", "two_level"),
    ("gpus_per_node", 2, 4),
    ("grad_accum", "fp32", "param"),
]


def _inputs(rank=0, world=1, dtype=torch.float64, T=5, El=2, K=2):
    pb = ring_problem(11, [T] * world, El * world, K, 8, 4)
    lo, hi, e0, e1 = rank * T, (rank + 1) * T, rank * El, (rank + 1) * El
    x, w13, w2 = pb["x"][lo:hi], pb["w13"][e0:e1], pb["w2"][e0:e1]
    return [x.to(dtype), w13.to(dtype), w2.to(dtype), pb["idx"][lo:hi], pb["probs"][lo:hi]], pb


@pytest.fixture
def seen(monkeypatch):
    """What ``ring_moe`` hands on: the request it agrees on and the ``Hop`` of its hops."""
    record = {"req": [], "hop": []}
    real_agree, real_hop = engine.agree, engine.Hop

    def agree(*args, request, **kw):
        record["req"].append(request)
        return real_agree(*args, request=request, **kw)

    def hop(*args):
        record["hop"].append(real_hop(*args))
        return record["hop"][-1]

    monkeypatch.setattr(engine, "agree", agree)
    monkeypatch.setattr(engine, "Hop", hop)
    return record


@pytest.mark.parametrize(("name", "installed_value", "keyword_value"), FIELDS)
def test_installed_option_reaches_the_request_and_a_keyword_overrides_it(
    seen, name, installed_value, keyword_value
):
    args, _ = _inputs()
    ring_moe(*args)
    default = getattr(RingOptions(), name)
    assert getattr(seen["req"][-1], name) == default
    with installed(RingOptions(**{name: installed_value})):
        ring_moe(*args)
        assert getattr(seen["req"][-1], name) == installed_value, name
        ring_moe(*args, **{name: keyword_value})  # a keyword wins over the installed value
        assert getattr(seen["req"][-1], name) == keyword_value, name
    ring_moe(*args)
    assert getattr(seen["req"][-1], name) == default  # uninstalled: the defaults again


def test_installed_mode_and_grad_accum_change_the_agreed_problem():
    args, _ = _inputs(dtype=torch.float16)
    prob = resolved_problem(*args, mode="expert")
    assert prob.mode == "expert" and prob.grad_dtype == torch.float16
    with installed(RingOptions(mode="token", grad_accum="fp32")):
        prob = resolved_problem(*args)
        assert prob.mode == "token" and prob.grad_dtype == torch.float32
        prob = resolved_problem(*args, mode="alltoall", grad_accum="param")
        assert prob.mode == "alltoall" and prob.grad_dtype == torch.float16


def test_installed_kernels_reach_the_hops_and_a_keyword_overrides_them(seen):
    args, pb = _inputs()
    mine, other = KernelOptions(pair_buffer_mib=7), KernelOptions(pair_buffer_mib=9)
    ring_moe(*args)
    assert seen["hop"][-1].kernels == KernelOptions()
    with installed(RingOptions(kernels=mine)):
        out = ring_moe(*args)
        assert seen["hop"][-1].kernels is mine
        ring_moe(*args, kernels=other)
        assert seen["hop"][-1].kernels is other
    ref = moe_experts_reference(pb["x"][:5], pb["w13"][:2], pb["w2"][:2], pb["idx"][:5],
                                pb["probs"][:5])  # fmt: skip
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# worlds of 2 and 3 over gloo: installed options change which collectives run, on every rank
# ---------------------------------------------------------------------------------------------
def _raises(pattern: str, fn) -> None:
    try:
        fn()
    except ValueError as err:
        assert re.search(pattern, str(err)), err
    else:
        raise AssertionError(f"no ValueError matching {pattern!r}")


def _installed_options_take_effect(rank, world, group):
    args, pb = _inputs(rank, world)
    lo, hi = rank * 5, (rank + 1) * 5
    ref = moe_experts_reference(pb["x"], pb["w13"], pb["w2"], pb["idx"], pb["probs"])[lo:hi]

    def run(**kw):
        return ring_moe(*args, group=group, **kw)

    # transport: the copy engine cannot run on CPU; the keyword nccl overrides the installed one
    with installed(RingOptions(transport="copy_engine")):
        _raises("transport='copy_engine' needs CUDA", run)
        assert torch.allclose(run(transport="nccl"), ref, rtol=1e-12, atol=1e-12)
    # schedule and mode: a node-batched token ring is refused; keywords override either
    with installed(RingOptions(schedule="node_batched", mode="token")):
        _raises("schedule='node_batched' batches expert partitions", run)
        assert torch.allclose(run(schedule="flat"), ref, rtol=1e-12, atol=1e-12)
        assert torch.allclose(run(mode="expert"), ref, rtol=1e-12, atol=1e-12)
        assert resolved_problem(*args, group=group, mode="expert").schedule == "node_batched"
    # gpus_per_node: the node size of the node-batched schedule (from the hosts: the world)
    assert resolved_problem(*args, group=group, schedule="node_batched").gpus_per_node == world
    with installed(RingOptions(schedule="node_batched", gpus_per_node=1)):
        assert resolved_problem(*args, group=group).gpus_per_node == 1
        assert resolved_problem(*args, group=group, gpus_per_node=world).gpus_per_node == world
    # grad_accum: the accumulators' dtype in 16-bit
    half, _ = _inputs(rank, world, dtype=torch.float16)
    with installed(RingOptions(grad_accum="fp32")):
        assert resolved_problem(*half, group=group).grad_dtype == torch.float32
        assert resolved_problem(*half, group=group, grad_accum="param").grad_dtype == torch.half


def _refused_on_every_rank(pattern: str, fn, within_s: float = 10.0) -> None:
    """``fn`` raises a ValueError matching ``pattern`` on this rank within ``within_s`` (a rank
    left waiting on a failed peer would instead raise RingPeerError after the group's 30 s)."""
    import time

    start = time.monotonic()
    _raises(pattern, fn)
    assert time.monotonic() - start < within_s, f"refused after {time.monotonic() - start} s"


def _bad_kernels_on_one_rank(rank, world, group):
    """Issue #50: a bad ``kernels=`` on one rank raised there after the agreement, its peers
    waited in hop 0. It is the agreement's error code now: every rank raises, trusted or not;
    valid options that differ are each rank's own choice and run."""
    args, pb = _inputs(rank, world)
    lo, hi = rank * 5, (rank + 1) * 5
    ref = moe_experts_reference(pb["x"], pb["w13"], pb["w2"], pb["idx"], pb["probs"])[lo:hi]
    last = world - 1
    for trusted in (False, True):
        for bad in ("fast", {"autotune": "first"}):
            kernels = bad if rank == last else None
            _refused_on_every_rank(
                rf"invalid input on rank {last}: .*kernels",
                lambda: ring_moe(*args, group=group, kernels=kernels, trusted=trusted),  # noqa: B023
            )
        # the group is still in step; differing valid options run
        kernels = KernelOptions(autotune="first") if rank == last else None
        out = ring_moe(*args, group=group, kernels=kernels, trusted=trusted)
        assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
        # a trusted call whose signature is agreed and cached: a bad value on one rank alone
        # changes that rank's signature (the trusted contract); every rank changing it together
        # is refused on every rank
        if trusted:
            _refused_on_every_rank(
                r"kernels=3 must be a relaymoe.options.KernelOptions|kernels is not",
                lambda: ring_moe(*args, group=group, kernels=3, trusted=True),
            )


SCENARIOS = [_installed_options_take_effect, _bad_kernels_on_one_rank]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "scenario"), scenario_params(SCENARIOS, [2, 3]))
def test_ring_options_gloo(world, scenario, gloo_worlds):
    gloo_worlds.run(scenario, world, timeout=120)
