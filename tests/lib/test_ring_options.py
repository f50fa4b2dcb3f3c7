"""``ring_moe``'s options take effect: the call's ``RingConfig`` (``config=``), else the
documented defaults (``RingConfig()``); no keyword overrides a field of it (issue #51: the
keywords ``mode``, ``transport``, ``schedule``, ``gpus_per_node``, ``grad_accum`` and
``kernels`` are gone, and passing one raises ``TypeError``).

Each of those options is set in the config, and the test sees it change what runs: the agreed
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

# (field, a configured value, another value: the one an old keyword would have passed)
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


@pytest.mark.parametrize(("name", "configured", "other"), FIELDS)
def test_the_configs_option_is_what_the_agreement_sees(seen, name, configured, other):
    args, _ = _inputs()
    ring_moe(*args)
    default = getattr(RingConfig(), name)
    assert getattr(seen["req"][-1], name) == default
    config = RingConfig(**{name: configured})
    ring_moe(*args, config=config)
    assert getattr(seen["req"][-1], name) == configured, name
    ring_moe(*args, config=config.replace(**{name: other}))  # another call: another config
    assert getattr(seen["req"][-1], name) == other, name
    ring_moe(*args)
    assert getattr(seen["req"][-1], name) == default  # no config: the defaults again


@pytest.mark.parametrize("name", [*(f[0] for f in FIELDS), "kernels", "timeout_s"])
def test_an_option_keyword_is_refused(seen, name):
    """The options travel in ``config`` only: a keyword naming one (the removed per-call
    overrides, or any other field) is not an argument of ``ring_moe``, nor of
    ``resolved_problem``; nothing was agreed."""
    args, _ = _inputs()
    value = getattr(RingConfig(), name)
    with pytest.raises(TypeError, match=name):
        ring_moe(*args, config=RingConfig(), **{name: value})
    with pytest.raises(TypeError, match=name):
        resolved_problem(*args, **{name: value})
    assert seen["req"] == []


def test_configured_mode_and_grad_accum_change_the_agreed_problem():
    args, _ = _inputs(dtype=torch.float16)
    problem = resolved_problem(*args, config=RingConfig(mode="expert"))
    assert problem.mode == "expert" and problem.grad_dtype == torch.float16
    config = RingConfig(mode="token", grad_accum="fp32")
    problem = resolved_problem(*args, config=config)
    assert problem.mode == "token" and problem.grad_dtype == torch.float32
    problem = resolved_problem(*args, config=config.replace(mode="alltoall", grad_accum="param"))
    assert problem.mode == "alltoall" and problem.grad_dtype == torch.float16


def test_configured_kernels_reach_the_hops(seen):
    args, pb = _inputs()
    mine = KernelOptions(pair_buffer_mib=7)
    ring_moe(*args)
    assert seen["kernel_choice"][-1].kernels == KernelOptions()
    out = ring_moe(*args, config=RingConfig(kernels=mine))
    assert seen["kernel_choice"][-1].kernels is mine
    assert seen["req"][-1].kernels is mine and seen["req"][-1].pair_buffer_mib == 7
    ref = moe_experts_reference(pb["x"][:5], pb["w13"][:2], pb["w2"][:2], pb["idx"][:5],
                                pb["probs"][:5])  # fmt: skip
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    # a bad value never reaches a call: the config refuses it when it is made
    with pytest.raises(ValueError, match=r"RingConfig.kernels='fast' must be a KernelOptions"):
        RingConfig(kernels="fast")


def test_this_ranks_options_reach_the_call(seen):
    """``overlap``, ``capture_hops``, ``host_wait``, ``timeout_s`` reach the call's passes,
    ``agree`` and ``pair_buffer_mib`` its request; the defaults without a config."""
    args, _ = _inputs()
    ring_moe(*args)
    call, req = seen["call"][-1], seen["req"][-1]
    assert (call.overlap, call.kernel_choice.capture, call.host_wait, call.timeout_s) == (
        True, False, "lag", None)  # fmt: skip
    assert (req.agree, req.pair_buffer_mib) == ("cached", 512)
    assert req.timeout_s is None
    config = RingConfig(overlap=False, capture_hops=True, host_wait="pass", timeout_s=3.5,
                        agree="every_call", kernels=KernelOptions(pair_buffer_mib=3))  # fmt: skip
    ring_moe(*args, config=config)
    call, req = seen["call"][-1], seen["req"][-1]
    assert (call.overlap, call.kernel_choice.capture, call.host_wait, call.timeout_s) == (
        False, True, "pass", 3.5)  # fmt: skip
    assert (req.agree, req.pair_buffer_mib, req.timeout_s) == ("every_call", 3, 3.5)


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

    def run(config: RingConfig):
        return ring_moe(*args, group=group, config=config)

    def problem(config: RingConfig, *inputs):
        return resolved_problem(*(inputs or args), group=group, config=config)

    # transport: the copy engine cannot run on CPU; the same config with nccl runs
    copy_engine = RingConfig(transport="copy_engine")
    _raises("transport='copy_engine' needs CUDA", lambda: run(copy_engine))
    out = run(copy_engine.replace(transport="nccl"))
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    # schedule and mode: a node-batched token ring is refused; changing either runs
    batched = RingConfig(schedule="node_batched", mode="token")
    _raises("schedule='node_batched' batches expert partitions", lambda: run(batched))
    out = run(batched.replace(schedule="flat"))
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(run(batched.replace(mode="expert")), ref, rtol=1e-12, atol=1e-12)
    assert problem(batched.replace(mode="expert")).schedule == "node_batched"
    # gpus_per_node: the node size of the node-batched schedule (from the hosts: the world)
    assert problem(RingConfig(schedule="node_batched")).gpus_per_node == world
    one = RingConfig(schedule="node_batched", gpus_per_node=1)
    assert problem(one).gpus_per_node == 1
    assert problem(one.replace(gpus_per_node=world)).gpus_per_node == world
    # grad_accum: the accumulators' dtype in 16-bit
    half, _ = _inputs(rank, world, dtype=torch.float16)
    fp32 = RingConfig(grad_accum="fp32")
    assert problem(fp32, *half).grad_dtype == torch.float32
    assert problem(fp32.replace(grad_accum="param"), *half).grad_dtype == torch.half


def _kernels_differ_across_ranks(rank, world, group):
    """The kernels' options are each rank's own choice (but for ``pair_buffer_mib``, agreed):
    ranks whose valid options differ run, trusted or not. (Issue #50's bad value on one rank
    cannot reach a call any more: ``RingConfig`` refuses it when it is made.)"""
    args, pb = _inputs(rank, world)
    lo, hi = rank * 5, (rank + 1) * 5
    ref = moe_experts_reference(pb["x"], pb["w13"], pb["w2"], pb["idx"], pb["probs"])[lo:hi]
    mine = KernelOptions(autotune="first") if rank == world - 1 else KernelOptions()
    for trusted in (False, True):
        out = ring_moe(*args, group=group, config=RingConfig(kernels=mine), trusted=trusted)
        assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)


SCENARIOS = [_configured_options_take_effect, _kernels_differ_across_ranks]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "scenario"), scenario_params(SCENARIOS, [2, 3]))
def test_ring_options_gloo(world, scenario, gloo_worlds):
    gloo_worlds.run(scenario, world, timeout=120)
