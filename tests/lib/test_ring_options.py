"""``ring_moe``'s options take effect: the call's ``RingConfig`` (``config=``) where a keyword is
None, keywords over it, the documented defaults without either.

Each of ``mode``, ``transport``, ``schedule``, ``gpus_per_node``, ``grad_accum`` and ``kernels``
is set once in the config and once by keyword, and the test sees it change what runs: the agreed
request and problem (mode, grad dtype, schedule's node size), the error an option that cannot
run on CPU raises (the copy engine, a node-batched token ring), and the ``KernelOptions`` that
reaches the hops. The config's other fields (``agree``, ``overlap``, ``capture_hops``,
``host_wait``, ``timeout_s``) reach the call's request and passes. World of one in this process;
worlds 2 and 3 over gloo.
"""

from __future__ import annotations

import re

import pytest
import torch

from relaymoe.options import KernelOptions, RingConfig
from relaymoe.reference import moe_experts_reference
from relaymoe.ring import engine
from relaymoe.ring.engine import resolved_problem, ring_moe
from tests.fixtures import ring_problem, scenario_params

# (field, a configured value, another value a keyword passes)
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
    """What ``ring_moe`` hands on: the request it agrees on, the ``KernelChoice`` of its hops and
    the ``RingCall`` its passes run with."""
    record = {"req": [], "kernel_choice": [], "call": []}
    real_agree, real_choice, real_apply = engine.agree, engine.KernelChoice, engine._RingMoE.apply

    def agree(*args, request, **kw):
        record["req"].append(request)
        return real_agree(*args, request=request, **kw)

    def kernel_choice(*args):
        record["kernel_choice"].append(real_choice(*args))
        return record["kernel_choice"][-1]

    def apply(*args):
        record["call"].append(args[4])  # x, probs, topk_idx, problem, call, ...
        return real_apply(*args)

    monkeypatch.setattr(engine, "agree", agree)
    monkeypatch.setattr(engine, "KernelChoice", kernel_choice)
    monkeypatch.setattr(engine._RingMoE, "apply", apply)
    return record


@pytest.mark.parametrize(("name", "configured", "keyword_value"), FIELDS)
def test_configured_option_reaches_the_request_and_a_keyword_overrides_it(
    seen, name, configured, keyword_value
):
    args, _ = _inputs()
    ring_moe(*args)
    default = getattr(RingConfig(), name)
    assert getattr(seen["req"][-1], name) == default
    config = RingConfig(**{name: configured})
    ring_moe(*args, config=config)
    assert getattr(seen["req"][-1], name) == configured, name
    ring_moe(*args, config=config, **{name: keyword_value})  # a keyword wins over the config
    assert getattr(seen["req"][-1], name) == keyword_value, name
    ring_moe(*args)
    assert getattr(seen["req"][-1], name) == default  # no config: the defaults again


def test_configured_mode_and_grad_accum_change_the_agreed_problem():
    args, _ = _inputs(dtype=torch.float16)
    problem = resolved_problem(*args, mode="expert")
    assert problem.mode == "expert" and problem.grad_dtype == torch.float16
    config = RingConfig(mode="token", grad_accum="fp32")
    problem = resolved_problem(*args, config=config)
    assert problem.mode == "token" and problem.grad_dtype == torch.float32
    problem = resolved_problem(*args, config=config, mode="alltoall", grad_accum="param")
    assert problem.mode == "alltoall" and problem.grad_dtype == torch.float16


def test_configured_kernels_reach_the_hops_and_a_keyword_overrides_them(seen):
    args, pb = _inputs()
    mine, other = KernelOptions(pair_buffer_mib=7), KernelOptions(pair_buffer_mib=9)
    ring_moe(*args)
    assert seen["kernel_choice"][-1].kernels == KernelOptions()
    out = ring_moe(*args, config=RingConfig(kernels=mine))
    assert seen["kernel_choice"][-1].kernels is mine
    ring_moe(*args, config=RingConfig(kernels=mine), kernels=other)
    assert seen["kernel_choice"][-1].kernels is other
    ref = moe_experts_reference(pb["x"][:5], pb["w13"][:2], pb["w2"][:2], pb["idx"][:5],
                                pb["probs"][:5])  # fmt: skip
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_this_ranks_options_reach_the_call(seen):
    """``overlap``, ``capture_hops``, ``host_wait``, ``timeout_s`` reach the call's passes,
    ``agree`` and ``pair_buffer_mib`` its request; the defaults without a config."""
    args, _ = _inputs()
    ring_moe(*args)
    call, req = seen["call"][-1], seen["req"][-1]
    assert (call.overlap, call.kernel_choice.capture, call.host_wait, call.timeout_s) == (
        True, False, "lag", None)  # fmt: skip
    assert (req.agree, req.pair_buffer_mib) == ("cached", 512)
    config = RingConfig(overlap=False, capture_hops=True, host_wait="pass", timeout_s=3.5,
                        agree="every_call", kernels=KernelOptions(pair_buffer_mib=3))  # fmt: skip
    ring_moe(*args, config=config)
    call, req = seen["call"][-1], seen["req"][-1]
    assert (call.overlap, call.kernel_choice.capture, call.host_wait, call.timeout_s) == (
        False, True, "pass", 3.5)  # fmt: skip
    assert (req.agree, req.pair_buffer_mib) == ("every_call", 3)


def test_a_bad_config_is_refused_by_name():
    args, _ = _inputs()
    with pytest.raises(ValueError, match=r"config=.*must be a relaymoe.options.RingConfig"):
        ring_moe(*args, config={"mode": "token"})
    with pytest.raises(ValueError, match=r"RingConfig.mode='diagonal' is not one of"):
        RingConfig(mode="diagonal")


# ---------------------------------------------------------------------------------------------
# worlds of 2 and 3 over gloo: configured options change which collectives run, on every rank
# ---------------------------------------------------------------------------------------------
def _raises(pattern: str, fn) -> None:
    try:
        fn()
    except ValueError as err:
        assert re.search(pattern, str(err)), err
    else:
        raise AssertionError(f"no ValueError matching {pattern!r}")


def _configured_options_take_effect(rank, world, group):
    args, pb = _inputs(rank, world)
    lo, hi = rank * 5, (rank + 1) * 5
    ref = moe_experts_reference(pb["x"], pb["w13"], pb["w2"], pb["idx"], pb["probs"])[lo:hi]

    def with_config(config: RingConfig):
        def run(**kw):
            return ring_moe(*args, group=group, config=config, **kw)

        def problem(*inputs, **kw):
            return resolved_problem(*(inputs or args), group=group, config=config, **kw)

        return run, problem

    # transport: the copy engine cannot run on CPU; the keyword nccl overrides the config's
    run, _ = with_config(RingConfig(transport="copy_engine"))
    _raises("transport='copy_engine' needs CUDA", run)
    assert torch.allclose(run(transport="nccl"), ref, rtol=1e-12, atol=1e-12)
    # schedule and mode: a node-batched token ring is refused; keywords override either
    run, problem = with_config(RingConfig(schedule="node_batched", mode="token"))
    _raises("schedule='node_batched' batches expert partitions", run)
    assert torch.allclose(run(schedule="flat"), ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(run(mode="expert"), ref, rtol=1e-12, atol=1e-12)
    assert problem(mode="expert").schedule == "node_batched"
    # gpus_per_node: the node size of the node-batched schedule (from the hosts: the world)
    assert resolved_problem(*args, group=group, schedule="node_batched").gpus_per_node == world
    _, problem = with_config(RingConfig(schedule="node_batched", gpus_per_node=1))
    assert problem().gpus_per_node == 1
    assert problem(gpus_per_node=world).gpus_per_node == world
    # grad_accum: the accumulators' dtype in 16-bit
    half, _ = _inputs(rank, world, dtype=torch.float16)
    _, problem = with_config(RingConfig(grad_accum="fp32"))
    assert problem(*half).grad_dtype == torch.float32
    assert problem(*half, grad_accum="param").grad_dtype == torch.half


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


SCENARIOS = [_configured_options_take_effect, _bad_kernels_on_one_rank]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "scenario"), scenario_params(SCENARIOS, [2, 3]))
def test_ring_options_gloo(world, scenario, gloo_worlds):
    gloo_worlds.run(scenario, world, timeout=120)
