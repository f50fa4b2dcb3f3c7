"""Every expert MLP Megatron builds, through the ring dispatcher, against megatron-core's own.

The cases of ``tests/lib/test_megatron_layer.py`` (a ring ``MoELayer`` at EP = world against
megatron-core's allgather ``MoELayer`` holding every expert, on the union of the ranks' tokens;
outputs and every gradient in fp32) for the expert MLPs beyond bias-free SwiGLU: GELU without
gating (megatron-core's default MoE) with and without biases, squared ReLU, GeGLU, ReGLU, the
tanh GELUs, GPT-OSS's clamped quick-GeGLU with biases, and Megatron's fused SwiGLU and
quick-GeGLU kernels (``bias_activation_fusion``; run eagerly here: torch.compile is off in the
spawned ranks). The reference is Megatron computing its own experts, so each case checks that
``activation_map.py`` names the function Megatron computes and that the experts' biases reach
the ring with Megatron's semantics (fc2's bias scaled by the probability, no bias added twice).

Each runs with the stand-in ring of ``test_megatron_layer.py`` (the float64-capable oracle over
all-gathered tokens, isolating the Megatron side) and with relaymoe's own ``ring_moe``, skipped
while that has no ``activation`` keyword. Then the checkpoint interchange of GELU experts with
biases: identical keys and sharding, a checkpoint moving alltoall -> ring -> alltoall unchanged
(the ring uses Megatron's parameters as they are).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from tests.lib.test_megatron_layer import (
    STANDIN_SEEN,
    _done,
    _init,
    ring_impl,
    run_checkpoint_interchange,
    run_equivalence,
)

pytestmark = pytest.mark.slow


def cases() -> list[dict]:
    """The expert MLPs (Megatron's functions imported in the spawned rank), each with ``ring``:
    the activation the dispatcher must pass to the ring (None: ring_moe's default, SwiGLU)."""
    from megatron.core.activations import fast_gelu, squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer.utils import erf_gelu

    plain = dict(gated_linear_unit=False)
    bias = dict(add_bias_linear=True)
    clamped = "clamped_swiglu(alpha=1.702,limit=0.5,offset=1.0)"
    return [
        dict(name="gelu (megatron-core's default MoE)", seed=21, ring="gelu",
             config=dict(**plain, activation_func=F.gelu)),
        dict(name="gelu+bias", seed=22, ring="gelu",
             config=dict(**plain, **bias, activation_func=F.gelu)),
        dict(name="gelu+shared (no bias: Megatron's shared experts have none)", seed=33,
             ring="gelu", config=dict(**plain, activation_func=F.gelu,
                                      moe_shared_expert_intermediate_size=12)),
        dict(name="squared_relu+bias", seed=23, ring="squared_relu",
             config=dict(**plain, **bias, activation_func=squared_relu)),
        dict(name="fast_gelu (tanh)", seed=24, ring="gelu_tanh",
             config=dict(**plain, activation_func=fast_gelu)),
        dict(name="erf_gelu", seed=25, ring="gelu",
             config=dict(**plain, activation_func=erf_gelu)),
        dict(name="silu, not gated", seed=26, ring="silu",
             config=dict(**plain, activation_func=F.silu)),
        dict(name="geglu+bias", seed=27, ring="geglu",
             config=dict(**bias, activation_func=F.gelu)),
        dict(name="reglu+bias", seed=28, ring="reglu",
             config=dict(**bias, activation_func=F.relu)),
        # GPT-OSS's experts; a clamp of 0.5 so that it bites on both halves
        dict(name="clamped quick_geglu+offset+bias (GPT-OSS)", seed=29, ring=clamped,
             config=dict(**bias, activation_func=quick_gelu, activation_func_clamp_value=0.5,
                         glu_linear_offset=1.0, moe_router_topk=2)),
        # Megatron's fused kernels (SequentialMLP: the bias passed beside fc1's output)
        # (SequentialMLP's fused SwiGLU refuses biases: NotImplementedError in Megatron)
        dict(name="fused swiglu", seed=30, ring=None,
             config=dict(activation_func=F.silu, bias_activation_fusion=True)),
        dict(name="fused quick_geglu+offset+bias", seed=31, ring="swiglu(alpha=1.702,offset=1.0)",
             config=dict(**bias, activation_func=quick_gelu, glu_linear_offset=1.0,
                         bias_activation_fusion=True)),
        dict(name="fused clamped quick_geglu, no bias", seed=32, ring=clamped,
             config=dict(activation_func=quick_gelu, activation_func_clamp_value=0.5,
                         glu_linear_offset=1.0, bias_activation_fusion=True)),
    ]  # fmt: skip


def _worker(rank, world, impl):
    _init(rank, world)
    torch._dynamo.config.disable = True  # Megatron's jit-fused activations run eagerly here
    seen = len(STANDIN_SEEN)
    with ring_impl(impl):
        for case in cases():
            run_equivalence(rank, world, case, real=impl == "ring")
        if impl == "standin":
            calls = dict(zip([c["name"] for c in cases()], STANDIN_SEEN[seen:], strict=True))
            # what the dispatcher passed: the case's activation, and b13 and b2 exactly where
            # the experts have biases
            want = {}
            for c in cases():
                has_bias = c["config"].get("add_bias_linear", False)
                want[c["name"]] = (c["ring"], has_bias, has_bias)
            assert {n: (str(a) if a else None, b1, b2) for n, (a, b1, b2) in calls.items()} == want
            run_checkpoint_interchange(rank, world, gated_linear_unit=False,
                                       activation_func=F.gelu, add_bias_linear=True,
                                       moe_shared_expert_intermediate_size=None)  # fmt: skip
    _done()


def standin(rank, world, group):
    _worker(rank, world, "standin")


def ring(rank, world, group):
    _worker(rank, world, "ring")


def _ring_computes_every_expert_mlp() -> bool:
    from relaymoe.ring import ring_moe

    return "activation" in inspect.signature(ring_moe).parameters


def _params(sizes):
    return [pytest.param(size, id=str(size), marks=pytest.mark.xdist_group(f"{__name__}-w{size}"))
            for size in sizes]  # fmt: skip


@pytest.mark.parametrize("world", _params([1, 2]))
def test_expert_mlps_with_standin_ring_and_checkpoint_interchange(world, gloo_worlds):
    """The Megatron side: the activation and the biases the dispatcher hands the ring."""
    gloo_worlds.run(standin, world, timeout=420)


@pytest.mark.skipif(
    not _ring_computes_every_expert_mlp(),
    reason="relaymoe.ring.ring_moe has no activation= keyword yet (bias-free SwiGLU only)",
)
@pytest.mark.parametrize("world", _params([1, 2]))
def test_expert_mlps_through_the_ring(world, gloo_worlds):
    """End to end: relaymoe.ring.ring_moe computes each of them as megatron-core does."""
    gloo_worlds.run(ring, world, timeout=420)
