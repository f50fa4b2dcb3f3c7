"""Megatron's gradient-accumulation fusion with the ring's experts (``relaymoe/megatron/
main_grad.py`` and the dispatcher).

A ring ``MoELayer`` (local spec, built through ``register()``, in gloo worlds of 1 and 2 ranks)
whose expert weights carry ``main_grad`` and ``grad_added_to_main_grad`` as Megatron's DDP gives
them (attached by hand: DDP's buffers need CUDA), with DDP's hook on every expert weight,
trains two micro-batches:

* ``gradient_accumulation_fusion`` on, ``main_grad`` in reverse expert order per projection (a
  TEGroupedMLP's under DDP; the weights themselves stay in expert order: the kernel writes
  through a negative expert stride) and interleaved (SequentialMLP's: the fallback): the ring
  adds into ``main_grad``, the weights are marked, their ``.grad`` is the hook's ``None``;
* the flag off (``main_grad`` attached): the plain path, the hook adds ``.grad``.

Each ends with ``main_grad`` equal to its prefill plus the gradients a plain layer (no
``main_grad``) accumulates in ``.grad``. Beside it, on the host alone: which parameters fuse
(flag, ``main_grad``, Megatron-FSDP) and the dummies (marks, zeros for ``zero_out_wgrad``, one
shared buffer handed out as aliases).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.fixtures import (
    assert_close,
    attach_main_grads,
    ddp_main_grad_hooks,
    scenario_params,
)

CASES = ("plain", "reversed", "interleaved", "flag_off")


def _attach_main_grads(fc1, fc2, layout: str, seed: int) -> list[torch.Tensor]:
    """``main_grad`` of each parameter in DDP's reverse registration order: ``"reversed"`` as a
    TEGroupedMLP registers (fc1s, then fc2s), else as a SequentialMLP does (fc1 and fc2 of each
    expert in turn); prefilled, the mark False. Returns the prefills."""
    pairs = [p for a, b in zip(fc1, fc2, strict=True) for p in (a, b)]
    registered = fc1 + fc2 if layout == "reversed" else pairs
    attach_main_grads(registered[::-1], torch.Generator().manual_seed(seed))
    return [p.main_grad.clone() for p in fc1 + fc2]


def _ring_layer_adds_into_main_grad(rank, world, group):
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from relaymoe.megatron.expert_weights import expert_param_lists, expert_weights_layout
    from tests.lib.test_megatron_layer import (
        _done,
        _init,
        build_layer,
        global_weights,
        load_weights,
        make_config,
    )

    _init(rank, world)
    el, ep_rank = 8 // world, ps.get_expert_model_parallel_rank()
    w = global_weights(make_config("ring", world), seed=3)
    g = torch.Generator().manual_seed(10 + rank)
    batches = [(torch.randn(5 + rank, 2, 16, generator=g), torch.randn(5 + rank, 2, 16,
                generator=g)) for _ in range(2)]  # fmt: skip
    grads = {}
    for case in CASES:
        fused = case in ("reversed", "interleaved")
        # register() (in _init) lets megatron-core build with the flag where apex is missing
        cfg = make_config("ring", world, gradient_accumulation_fusion=fused)
        layer = build_layer(cfg, ProcessGroupCollection.use_mpu_process_groups())
        load_weights(layer, w, ep_rank * el, el)
        assert expert_weights_layout(layer.experts) == ("forward", "forward")
        fc1, fc2 = expert_param_lists(layer.experts)
        keep, start = [], None
        if case != "plain":
            start = _attach_main_grads(fc1, fc2, case, seed=rank)
            ddp_main_grad_hooks(fc1 + fc2, keep)
        for x, dy in batches:
            out, _ = layer(x.requires_grad_(True))
            (out * dy).sum().backward()
        tag = f"[world {world} rank {rank} {case}]"
        if case == "plain":
            grads[case] = [p.grad.clone() for p in fc1 + fc2]
            continue
        for j, p in enumerate(fc1 + fc2):
            assert p.grad is None, f"{tag} param {j}: a gradient stayed in .grad"
            assert p.grad_added_to_main_grad is fused, f"{tag} param {j}: mark"
            assert_close(f"{tag} main_grad {j}", p.main_grad - start[j], grads["plain"][j], 1e-5)
    _done()


@pytest.mark.slow
@pytest.mark.parametrize(("world", "scenario"),
                         scenario_params([_ring_layer_adds_into_main_grad], [1, 2]))  # fmt: skip
def test_ring_moe_layer_with_gradient_accumulation_fusion(world, scenario, gloo_worlds):
    gloo_worlds.run(scenario, world, timeout=300)


def test_which_experts_fuse():
    """On with the flag and a ``main_grad`` on every expert weight; off without the flag,
    with one weight lacking it (DDP has not wrapped the model), or for Megatron-FSDP."""
    from relaymoe.megatron.main_grad import fused_main_grads

    def params(n, **attrs):
        ps = [torch.nn.Parameter(torch.zeros(2, 3)) for _ in range(n)]
        for p in ps:
            p.main_grad = torch.zeros(2, 3)
            for k, v in attrs.items():
                setattr(p, k, v)
        return ps

    on, off = SimpleNamespace(gradient_accumulation_fusion=True), SimpleNamespace()
    fc1, fc2 = params(2), params(2)
    got = fused_main_grads(on, fc1, fc2)
    assert [t is p.main_grad for t, p in zip(got.w13 + got.w2, fc1 + fc2, strict=True)] == [
        True
    ] * 4
    assert fused_main_grads(off, fc1, fc2) is None
    fc2[1].main_grad = None
    assert fused_main_grads(on, fc1, fc2) is None
    assert fused_main_grads(on, params(2, __fsdp_param__=True), params(2)) is None


def test_handed_back_marks_and_gives_shared_dummies():
    """Each marked weight gets a fresh alias of one buffer per shape (autograd takes it as
    ``.grad`` without a copy), zeros where ``zero_out_wgrad``; a weight without the mark
    attribute (no DDP) gets None."""
    from relaymoe.megatron.main_grad import handed_back

    a, b = torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(2, 3))
    c, d = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    for p in (a, b, c):
        p.grad_added_to_main_grad = False
    c.zero_out_wgrad = True
    ga, gb, gc, gd = handed_back([a, b, c, d])
    assert a.grad_added_to_main_grad and b.grad_added_to_main_grad and c.grad_added_to_main_grad
    assert gd is None and not hasattr(d, "grad_added_to_main_grad")
    assert ga is not gb and ga.data_ptr() == gb.data_ptr()  # aliases of one buffer
    assert ga.shape == a.shape and ga.dtype == a.dtype and not ga.requires_grad
    assert torch.equal(gc, torch.zeros(4))
