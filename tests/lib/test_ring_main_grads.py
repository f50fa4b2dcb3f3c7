"""``ring_moe(main_grads=)``: the expert weight gradients added into a caller's accumulators
(Megatron's ``main_grad`` under ``gradient_accumulation_fusion``; ``relaymoe/ring/main_grads.py``).

Accumulators prefilled with random values (gradient accumulation over micro-batches) end equal
to the prefill plus the float64 oracle's weight gradients of two micro-batches, in every mode
(expert, token, all-to-all), for accumulators in expert order, in reverse expert order (DDP's
layout), interleaved (SequentialMLP under DDP: the fallback) and as one tensor, with weights
whose rows compute in either order; the path each takes is checked (in place, in reverse, or the
fallback). What autograd gets for the weights is ``finish``'s (dummies, parameters marked) or
nothing; the biases keep their returned gradients. A simulated DDP hook
(``if not p.grad_added_to_main_grad: p.main_grad.add_(p.grad)``) ends with the same
``main_grad`` fused and unfused. Over gloo worlds of 2-4 ranks: a rank of zero tokens and
experts with no token, every mode, the gradients added at home in expert mode. A captured call
(``tests/lib/test_ring_capture.py``'s simulation) with the accumulators reads nothing on the
host and adds what the eager call adds, bitwise. Bad accumulators are refused by name.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from relaymoe.options import RingConfig
from tests.fixtures import (
    back_to_back,
    ddp_main_grad_hooks,
    oracle,
    rehome,
    rel_err,
    ring_problem,
    scenario_params,
)

H, I = 12, 4  # J = 8: one partial interpreter tile
MODES = ("expert", "token", "alltoall")
LAYOUTS = ("forward", "reversed", "interleaved", "tensor")


def _problem(seed, tokens, E, K=2, route="uniform"):
    """Two micro-batches of one model: the second ``ring_problem`` takes the first's weights."""
    first = ring_problem(seed, tokens, E, K, H, I, route=route)
    second = ring_problem(seed + 50, tokens, E, K, H, I, route=route)
    second.update(w13=first["w13"], w2=first["w2"])
    return first, second


def _weights(w13, w2, form, dtype):
    """This rank's experts as leaves: ``"separate"`` per-expert tensors (the ring computes on a
    stack in expert order), ``"reversed"`` per-expert views back to back in reverse expert order
    (DDP's param buffer: the ring computes in reverse row order), ``"tensor"``."""
    if form == "tensor":
        return w13.to(dtype).clone().requires_grad_(), w2.to(dtype).clone().requires_grad_()
    fc1 = [torch.nn.Parameter(w.to(dtype).clone()) for w in w13]
    fc2 = [torch.nn.Parameter(w.to(dtype).clone()) for w in w2]
    if form == "reversed":
        rehome((fc1 + fc2)[::-1])
    return fc1, fc2


def _targets(El, layout, dtype, seed):
    """Prefilled accumulators of w13 and w2 in ``layout`` (``LAYOUTS``): per-expert views of one
    buffer in expert order, in reverse expert order (fc1s then fc2s, TEGroupedMLP under DDP), or
    interleaved fc1/fc2 per expert (SequentialMLP under DDP: no list back to back); or one
    tensor each. Returns ``(t13, t2)``."""
    g = torch.Generator().manual_seed(seed)
    t13 = [torch.randn(2 * I, H, generator=g, dtype=torch.float64).to(dtype) for _ in range(El)]
    t2 = [torch.randn(H, I, generator=g, dtype=torch.float64).to(dtype) for _ in range(El)]
    if layout == "tensor":
        return torch.stack(t13), torch.stack(t2)
    order = {
        "forward": t13 + t2,
        "reversed": (t13 + t2)[::-1],
        "interleaved": [t for a, b in zip(t13, t2, strict=True) for t in (a, b)],
    }[layout]
    views = dict(zip(map(id, order), back_to_back(order), strict=True))
    return [views[id(t)] for t in t13], [views[id(t)] for t in t2]


def _stacked(t):
    return torch.stack(list(t)) if isinstance(t, (list, tuple)) else t.clone()


def _marking_finish(weights):
    """Megatron's protocol (``relaymoe/megatron/main_grad.py``) without Megatron: mark each
    weight and give it a zero dummy."""
    out = []
    for w in weights:
        w.grad_added_to_main_grad = True
        out.append(torch.zeros_like(w))
    return out


class _Paths:
    """Records what ``direct_targets`` answered in each pass that asked (None: the fallback;
    else whether the rows were reversed)."""

    def __init__(self):
        from relaymoe.ring import main_grads

        self.real, self.seen = main_grads.direct_targets, []

    def __call__(self, *args):
        got = self.real(*args)
        self.seen.append(None if got is None else ("reversed" if got[1] else "in_place"))
        return got


def _run(pbs, rank, world, group, *, mode, form, layout, backend, dtype, finish=None,
         slices=None, config=None):  # fmt: skip
    """Two micro-batches of ``ring_moe`` with ``main_grads`` on this rank's slice; returns the
    accumulators' totals minus their prefill (stacked, expert order), the weights, and the
    paths taken."""
    from relaymoe.ring import MainGrads, ring_moe

    rows, experts = slices
    pb = pbs[0]
    El = experts.stop - experts.start
    w13, w2 = _weights(pb["w13"][experts], pb["w2"][experts], form, dtype)
    t13, t2 = _targets(El, layout, dtype, seed=rank + 7)
    start = (_stacked(t13), _stacked(t2))
    paths = _Paths()
    with mock.patch("relaymoe.ring.expert_mode.direct_targets", paths), mock.patch(
        "relaymoe.ring.token_mode.direct_targets", paths
    ):  # fmt: skip
        for p in pbs:
            out = ring_moe(p["x"][rows].to(dtype), w13, w2, p["idx"][rows],
                           p["probs"][rows].to(dtype), group=group, backend=backend,
                           config=(config or RingConfig()).replace(mode=mode),
                           main_grads=MainGrads(t13, t2, finish))  # fmt: skip
            out.backward(p["dy"][rows].to(dtype))
    got = (_stacked(t13) - start[0], _stacked(t2) - start[1])
    return got, (w13, w2), paths.seen


def _want_path(mode, world, form, layout):
    """The path a pass should take (``_Paths``' records): expert mode over a ring adds at home
    (no record); interleaved accumulators fall back; a span in the other order than the
    computed rows is written in reverse."""
    if mode == "expert" and world > 1:
        return []
    if layout == "interleaved":
        return [None]
    rows = "reversed" if form == "reversed" else "forward"
    target = "reversed" if layout == "reversed" else "forward"
    return ["in_place" if rows == target else "reversed"]


def _check(tag, got, pbs, experts, tol):
    refs = [oracle(p) for p in pbs]
    for j, name in enumerate(("dw13", "dw2")):
        want = sum(r[name][experts] for r in refs)
        err = rel_err(got[j], want)
        assert err < tol, f"{tag} {name}: {err}"


def _world_of_one(backend, dtype, tol, combos):
    pbs = _problem(3, [9], 4, route="skew")  # experts 3.. get no token
    for mode, form, layout in combos:
        tag = f"{backend} {mode} weights {form} targets {layout}"
        got, ws, seen = _run(pbs, 0, 1, None, mode=mode, form=form, layout=layout,
                             backend=backend, dtype=dtype, finish=_marking_finish,
                             slices=(slice(0, 9), slice(0, 4)))  # fmt: skip
        _check(tag, got, pbs, slice(0, 4), tol)
        assert seen == _want_path(mode, 1, form, layout) * 2, (tag, seen)
        for w in ws if form == "tensor" else ws[0] + ws[1]:  # finish's dummies, the marks
            assert w.grad_added_to_main_grad is True, tag
            assert w.grad is not None and torch.equal(w.grad, torch.zeros_like(w)), tag


@pytest.mark.parametrize("mode", MODES)
def test_world_of_one_every_layout_torch_float64(mode):
    """Every weight form and accumulator layout (the in-place, reversed and fallback paths)."""
    combos = [(mode, form, layout) for form in ("separate", "reversed", "tensor")
              for layout in LAYOUTS]  # fmt: skip
    _world_of_one("torch", torch.float64, 1e-12, combos)


def test_world_of_one_triton_float32_in_place_and_reversed():
    """The Triton weight-gradient kernel adding into fp32 accumulators in place and through a
    negative expert stride (weights and accumulators in opposite orders), expert and token
    mode."""
    from relaymoe.kernels import triton_available

    if not triton_available():
        pytest.skip("needs triton")
    combos = [(m, f, "reversed") for m in ("expert", "token") for f in ("separate", "reversed")]
    _world_of_one("triton", torch.float32, 1e-5, combos)


def test_recorded_hops_add_into_the_accumulators():
    """``capture_hops`` (the CPU's eager replay of recorded hops): the accumulators are bound by
    address and added into by every replay, warm-up runs undone; token and expert mode, two
    micro-batches through the same recorded hops."""
    from relaymoe.kernels import triton_available
    from relaymoe.ring import MainGrads, RingRuntime, ring_moe

    if not triton_available():
        pytest.skip("needs triton")
    pbs = _problem(12, [9], 4)
    config = RingConfig(capture_hops=True)
    for mode in ("expert", "token"):
        runtime = RingRuntime()
        fc1, fc2 = _weights(pbs[0]["w13"], pbs[0]["w2"], "separate", torch.float32)
        t13, t2 = _targets(4, "reversed", torch.float32, seed=3)
        start = (_stacked(t13), _stacked(t2))
        for p in pbs:
            call = dict(backend="triton", trusted=True, runtime=runtime,
                        config=config.replace(mode=mode),
                        main_grads=MainGrads(t13, t2))  # fmt: skip
            out = ring_moe(p["x"].float(), fc1, fc2, p["idx"], p["probs"].float(), **call)
            out.backward(p["dy"].float())
        assert runtime.hop_graphs, f"{mode}: no hop was recorded"
        got = (_stacked(t13) - start[0], _stacked(t2) - start[1])
        _check(f"recorded {mode}", got, pbs, slice(0, 4), 1e-5)


def test_without_finish_autograd_gets_nothing_and_the_biases_keep_their_gradients():
    """``finish=None``: no gradient reaches the weights; the fc1/fc2 biases' gradients are
    returned (as without accumulators), equal to the oracle's."""
    from relaymoe.reference import moe_experts_reference
    from relaymoe.ring import MainGrads, ring_moe

    pb = ring_problem(5, [7], 3, 2, H, I)
    g = torch.Generator().manual_seed(1)
    b13 = torch.randn(3, 2 * I, generator=g, dtype=torch.float64)
    b2 = torch.randn(3, H, generator=g, dtype=torch.float64)
    leaves = {k: v.clone().requires_grad_() for k, v in
              dict(w13=pb["w13"], w2=pb["w2"], b13=b13, b2=b2).items()}  # fmt: skip
    ref = moe_experts_reference(pb["x"], leaves["w13"], leaves["w2"], pb["idx"], pb["probs"],
                                activation="geglu", b13=leaves["b13"], b2=leaves["b2"])  # fmt: skip
    ref.backward(pb["dy"])
    for mode in MODES:
        ws = {k: [t.detach().clone().requires_grad_() for t in v] for k, v in
              dict(w13=pb["w13"], w2=pb["w2"], b13=b13, b2=b2).items()}  # fmt: skip
        t13, t2 = torch.zeros_like(pb["w13"]), torch.zeros_like(pb["w2"])
        out = ring_moe(pb["x"], ws["w13"], ws["w2"], pb["idx"], pb["probs"], backend="torch",
                       activation="geglu", b13=ws["b13"], b2=ws["b2"],
                       config=RingConfig(mode=mode), main_grads=MainGrads(t13, t2))  # fmt: skip
        out.backward(pb["dy"])
        assert all(w.grad is None for w in ws["w13"] + ws["w2"]), mode
        assert rel_err(t13, leaves["w13"].grad) < 1e-12 and rel_err(t2, leaves["w2"].grad) < 1e-12
        for k in ("b13", "b2"):
            assert rel_err(torch.stack([b.grad for b in ws[k]]), leaves[k].grad) < 1e-12, mode


@pytest.mark.parametrize("mode", MODES)
def test_simulated_ddp_hook_gives_the_unfused_main_grad(mode):
    """Per-expert parameters with ``main_grad`` (reverse order, as DDP) and DDP's hook: with the
    accumulators and Megatron's finish the hook adds nothing and ``main_grad`` ends as the
    unfused run's, where the hook adds every returned gradient."""
    from relaymoe.ring import MainGrads, ring_moe

    pbs = _problem(8, [10], 4, K=3)
    result = {}
    for fused in (False, True):
        fc1, fc2 = _weights(pbs[0]["w13"], pbs[0]["w2"], "reversed", torch.float64)
        t13, t2 = _targets(4, "reversed", torch.float64, seed=2)
        keep = []
        for p, t in zip(fc1 + fc2, list(t13) + list(t2), strict=True):
            p.main_grad, p.grad_added_to_main_grad = t, False
        ddp_main_grad_hooks(fc1 + fc2, keep)
        for pb in pbs:
            main = MainGrads(t13, t2, _marking_finish) if fused else None
            out = ring_moe(pb["x"], fc1, fc2, pb["idx"], pb["probs"], backend="torch",
                           config=RingConfig(mode=mode), main_grads=main)  # fmt: skip
            out.backward(pb["dy"])
            assert all(p.grad is None for p in fc1 + fc2)
            assert all(p.grad_added_to_main_grad is fused for p in fc1 + fc2)
            for p in fc1 + fc2:
                p.grad_added_to_main_grad = False  # DDP's zero_grad_buffer (marks only)
        result[fused] = (_stacked(t13), _stacked(t2))
    for a, b in zip(result[True], result[False], strict=True):
        assert rel_err(a, b) < 1e-14, mode


def test_bad_accumulators_are_refused_by_name():
    from relaymoe.ring import MainGrads, ring_moe

    pb = ring_problem(2, [4], 2, 1, H, I)
    args = (pb["x"], pb["w13"], pb["w2"], pb["idx"], pb["probs"])
    ok13, ok2 = torch.zeros_like(pb["w13"]), torch.zeros_like(pb["w2"])
    bad = [
        ((ok13, ok2[:1]), r"main_grads.w2 must be a \(2, 12, 4\) tensor or 2 tensors \(12, 4\)"),
        ((list(ok13)[:1], ok2), r"main_grads.w13 must be a \(2, 8, 12\) tensor or 2 tensors"),
        ((ok13.int(), ok2), "main_grads.w13 is torch.int32"),
    ]
    for (a, b), match in bad:
        with pytest.raises(ValueError, match=match):
            ring_moe(*args, backend="torch", main_grads=MainGrads(a, b))
    with pytest.raises(ValueError, match="must be a relaymoe.ring.MainGrads"):
        ring_moe(*args, backend="torch", main_grads=(ok13, ok2))
    w13, w2 = pb["w13"].clone().requires_grad_(), pb["w2"].clone().requires_grad_()
    out = ring_moe(pb["x"], w13, w2, pb["idx"], pb["probs"], backend="torch",
                   main_grads=MainGrads(ok13, ok2, finish=lambda ws: [None]))  # fmt: skip
    with pytest.raises(ValueError, match="finish returned 1 gradients for 2 weights"):
        out.backward(pb["dy"])


# ---------------------------------------------------------------------------- gloo worlds
def _slices(rank, tokens, El):
    lo = sum(tokens[:rank])
    return slice(lo, lo + tokens[rank]), slice(rank * El, (rank + 1) * El)


def _every_mode_over_the_ring(rank, world, group):
    """A rank of no tokens, experts of no tokens (skew), each mode with a forward, reversed and
    interleaved layout in turn; expert mode adds at home, token and all-to-all in place; on an
    even world, node-batched rounds of two ranks a node too (added at home)."""
    El, tokens = 2, [0] + [5] * (world - 1)
    pbs = _problem(20 + world, tokens, El * world, route="skew")
    slices = _slices(rank, tokens, El)
    runs = [(mode, form, LAYOUTS[(j + rank) % 3] if form == "reversed" else "tensor", None)
            for j, mode in enumerate(MODES) for form in ("reversed", "tensor")]  # fmt: skip
    if world % 2 == 0:
        batched = RingConfig(schedule="node_batched", gpus_per_node=2)
        runs.append(("expert", "reversed", LAYOUTS[rank % 3], batched))
    for mode, form, layout, config in runs:
        schedule = config and config.schedule
        tag = f"w{world} rank {rank} {mode} {schedule} weights {form} targets {layout}"
        got, _, seen = _run(pbs, rank, world, group, mode=mode, form=form, layout=layout,
                            backend="torch", dtype=torch.float64, slices=slices,
                            config=config)  # fmt: skip
        _check(tag, got, pbs, slices[1], 1e-12)
        assert seen == _want_path(mode, world, form, layout) * 2, (tag, seen)


def _bad_accumulators_on_one_rank_raise_on_every_rank(rank, world, group):
    """The last rank's accumulators do not fit: every rank raises naming it, before any P2P."""
    from relaymoe.ring import MainGrads, ring_moe

    pb = ring_problem(30, [3] * world, world, 1, H, I)
    rows, experts = _slices(rank, [3] * world, 1)
    w13, w2 = pb["w13"][experts].clone(), pb["w2"][experts].clone()
    bad = MainGrads(torch.zeros_like(w13), torch.zeros(1, H, I + 1, dtype=torch.float64))
    main = bad if rank == world - 1 else None
    with pytest.raises(ValueError, match=f"invalid input on rank {world - 1}: main_grads"):
        ring_moe(pb["x"][rows], w13, w2, pb["idx"][rows], pb["probs"][rows], group=group,
                 backend="torch", main_grads=main)  # fmt: skip


def _captured_with_accumulators_reads_nothing_on_the_host(rank, world, group):
    """Fusion on under the simulated capture (test_ring_capture.py's): no host read, no
    collective, and the accumulators gain what an eager call adds, bitwise."""
    from relaymoe.kernels import triton_available
    from relaymoe.ring import MainGrads, RingRuntime, ring_moe
    from tests.host_sync import no_host_reads
    from tests.lib.test_ring_capture import _captured

    if not triton_available():
        pytest.skip("needs triton")
    El, tokens = 2, [4] * world
    pb = ring_problem(40, tokens, El * world, 2, H, I, route="skew")
    rows, experts = _slices(rank, tokens, El)
    runtime = RingRuntime(group)
    config = RingConfig().replace(kernels={"pair_buffer_mib": 0})
    for mode in ("expert", "token"):
        fc1, fc2 = _weights(pb["w13"][experts], pb["w2"][experts], "reversed", torch.float32)
        added = []
        for captured in (False, True):
            t13, t2 = _targets(El, "reversed", torch.float32, seed=rank)
            start = (_stacked(t13), _stacked(t2))
            call = dict(group=group, backend="triton", trusted=True, capturable=True,
                        runtime=runtime, config=config.replace(mode=mode),
                        main_grads=MainGrads(t13, t2))  # fmt: skip
            args = (pb["x"][rows].float(), fc1, fc2, pb["idx"][rows], pb["probs"][rows].float())
            if captured:
                with _captured(), no_host_reads():
                    ring_moe(*args, **call).backward(pb["dy"][rows].float())
            else:
                ring_moe(*args, **call).backward(pb["dy"][rows].float())
            added.append((_stacked(t13) - start[0], _stacked(t2) - start[1]))
        for a, b in zip(*added, strict=True):
            assert torch.equal(a, b), f"{mode}: captured != eager"
        _check(f"captured {mode}", added[1], [pb], experts, 1e-4)


SCENARIOS = (
    _every_mode_over_the_ring,
    _bad_accumulators_on_one_rank_raise_on_every_rank,
    _captured_with_accumulators_reads_nothing_on_the_host,
)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "scenario"), scenario_params(SCENARIOS[:2], [2, 3, 4]))
def test_main_grads_over_gloo(world, scenario, gloo_worlds):
    gloo_worlds.run(scenario, world, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "scenario"), scenario_params(SCENARIOS[2:], [1, 2]))
def test_main_grads_captured_over_gloo(world, scenario, gloo_worlds):
    gloo_worlds.run(scenario, world, timeout=300)
