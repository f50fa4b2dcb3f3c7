"""The ring inside a whole-step CUDA graph (relaymoe/ring/hop_graphs.py), on CPU over gloo.

A captured call is simulated by telling the ring its stream is being captured
(``capturing`` patched to True in ``relaymoe.ring.engine`` and ``faults``, where the ring asks
it). Then, at worlds 1-4, in expert and token mode, on the Triton hop kernels (interpreter,
fp32): after one eager call of the same shapes, the captured forward and backward read nothing
on the host
(``tests.host_sync``: no ``.item()``/``.tolist()``/``.cpu()``/``nonzero``/... from relaymoe's
code), enter no collective but the hops' P2P, and give the eager call's results bitwise, which
are the float64 oracle's within fp32 rounding, for uniform, skewed (empty experts) and
all-to-one-expert routing and with a rank of zero tokens (every case at worlds 1-3, the skewed
one and the one with a rank of zero tokens at world 4 too: ``CASES``). The pair-buffer budget
is 0 MiB there, so an eager call that is not ``capturable`` would read exact pair counts on the
host: the captured path must size from the bound instead. The eager and the captured call share one
``RingRuntime`` (the captured one reuses the eager one's agreement there, as a dispatcher's
calls do). What a captured call cannot do is refused by name on every rank: among it, a call
with no runtime, or with a runtime no eager call agreed in.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from tests.fixtures import oracle, rel_err, ring_problem, scenario_params
from tests.host_sync import HostRead, no_host_reads

H, I = 12, 4  # one partial interpreter tile (see tests/lib/test_ring_dist.py)
MODES = ("expert", "token")


@contextlib.contextmanager
def _captured():
    """The ring believes its stream is being captured; any collective but P2P fails."""

    def no_collective(*a, **k):
        raise AssertionError("a collective ran inside a captured ring call")

    with (
        mock.patch("relaymoe.ring.engine.capturing", return_value=True),
        mock.patch("relaymoe.ring.faults.capturing", return_value=True),
        mock.patch("torch.distributed.all_reduce", no_collective),
        mock.patch("torch.distributed.all_gather", no_collective),
        mock.patch("torch.distributed.all_to_all_single", no_collective),
    ):
        yield


def _config(**kernel_fields):
    from relaymoe.options import RingConfig

    return RingConfig().replace(kernels=kernel_fields)


def _slice(pb, rank, tokens):
    lo, hi = sum(tokens[:rank]), sum(tokens[: rank + 1])
    return lo, hi


def _step(rank, world, group, pb, tokens, El, *, mode, runtime, config=None, capturable=True,
          trusted=True):  # fmt: skip
    """ring_moe forward + backward of this rank's slice (fp32 leaves) with ``runtime`` and
    ``config`` (None: the defaults) in ``mode``; returns the output and the gradients of x,
    probs and this rank's w13, w2."""
    from relaymoe.options import RingConfig
    from relaymoe.ring import ring_moe

    lo, hi = _slice(pb, rank, tokens)
    e0, e1 = rank * El, (rank + 1) * El
    x = pb["x"][lo:hi].float().requires_grad_()
    probs = pb["probs"][lo:hi].float().requires_grad_()
    w13 = pb["w13"][e0:e1].float().requires_grad_()
    w2 = pb["w2"][e0:e1].float().requires_grad_()
    config = (RingConfig() if config is None else config).replace(mode=mode)
    out = ring_moe(x, w13, w2, pb["idx"][lo:hi], probs, group=group, backend="triton",
                   trusted=trusted, capturable=capturable, config=config,
                   runtime=runtime)  # fmt: skip
    out.backward(pb["dy"][lo:hi].float())
    return tuple(t.detach() for t in (out, x.grad, probs.grad, w13.grad, w2.grad))


# (tokens per rank as a function of the world, El, K, route, the worlds it runs at). Every case
# runs at worlds 1-3; at world 4, whose interpreted hops cost the most, the two that change
# most with the world: empty experts with idle ranks, and a rank of no token.
CASES = [
    (lambda w: [5] * w, 2, 2, "uniform", (1, 2, 3)),
    # experts K+1.. get no token: empty experts, idle ranks
    (lambda w: [6] * w, 4, 2, "skew", (1, 2, 3, 4)),
    (lambda w: [4] * w, 2, 2, "one", (1, 2, 3)),  # every token's first pick is the last expert
    # a rank of no token; K=1 gives every rank a signature no case before had (the trusted
    # contract: every rank changes its signature in the same call)
    (lambda w: [0] + [5] * (w - 1) if w > 1 else [3], 2, 1, "uniform", (1, 2, 3, 4)),
]


def _captured_equals_eager_without_host_reads(rank, world, group):
    from relaymoe.kernels import triton_available
    from relaymoe.ring import RingRuntime

    if not triton_available():
        pytest.skip("needs triton")
    config = _config(pair_buffer_mib=0)  # a plain eager call would count pairs on the host
    runtime = RingRuntime(group)  # the eager and the captured calls' (a dispatcher's)
    for c, (tok, El, K, route, worlds) in enumerate(CASES):
        if world not in worlds:
            continue
        tokens = tok(world)
        pb = ring_problem(100 + c, tokens, El * world, K, H, I, route=route)
        ref = oracle(pb)
        for mode in MODES:
            kw = dict(mode=mode, config=config, runtime=runtime)
            eager = _step(rank, world, group, pb, tokens, El, **kw)
            with _captured(), no_host_reads():
                got = _step(rank, world, group, pb, tokens, El, **kw)
            what = f"case {c} {route} {mode} tokens {tokens}"
            for name, a, b in zip(("out", "dx", "dprobs", "dw13", "dw2"), got, eager,
                                  strict=True):  # fmt: skip
                assert torch.equal(a, b), f"{name} captured != eager: {what}"
            lo, hi = _slice(pb, rank, tokens)
            e0, e1 = rank * El, (rank + 1) * El
            want = (ref["out"][lo:hi], ref["dx"][lo:hi], ref["dprobs"][lo:hi],
                    ref["dw13"][e0:e1], ref["dw2"][e0:e1])  # fmt: skip
            for name, a, b in zip(("out", "dx", "dprobs", "dw13", "dw2"), got, want,
                                  strict=True):  # fmt: skip
                if b.numel() and b.norm() > 0:
                    assert rel_err(a, b) < 1e-4, f"{name} vs the oracle: {what}"


def _captured_refusals(rank, world, group):
    """Refused by name, on every rank: an untrusted call, a signature no eager call agreed (in
    the call's runtime), no runtime, RingConfig.agree='every_call', an agreed all-to-all, and
    capturable with mode alltoall."""
    from relaymoe.options import RingConfig
    from relaymoe.ring import RingRuntime, ring_moe

    tokens, El, K = [4] * world, 1, 1
    pb = ring_problem(7, tokens, El * world, K, H, I)
    lo, hi = _slice(pb, rank, tokens)
    x = pb["x"][lo:hi].float()
    w13, w2 = pb["w13"][rank : rank + 1].float(), pb["w2"][rank : rank + 1].float()
    runtime = RingRuntime(group)
    call = dict(group=group, backend="triton", capturable=True, runtime=runtime)
    inputs = (x, w13, w2, pb["idx"][lo:hi], pb["probs"][lo:hi].float())

    def refused(match, **kw):
        with _captured(), pytest.raises(ValueError, match=match):
            ring_moe(*inputs, **{**call, **kw})

    expert, token, alltoall = (RingConfig(mode=m) for m in ("expert", "token", "alltoall"))
    refused("trusted=False", trusted=False)
    refused("before any eager call", trusted=True, config=token)  # this signature: never eager
    refused("agree='every_call'", trusted=True, config=RingConfig(agree="every_call"))
    ring_moe(*inputs, trusted=True, config=expert, **call)  # eager: agreed in `runtime`
    refused("without a runtime", trusted=True, config=expert, runtime=None)
    refused("before any eager call", trusted=True, config=expert, runtime=RingRuntime(group))
    with _captured():  # the runtime the eager call agreed in: runs
        ring_moe(*inputs, trusted=True, config=expert, **call)
    with pytest.raises(ValueError, match="alltoall"):  # eager, agreed on every rank
        ring_moe(*inputs, config=alltoall, trusted=True, **call)
    if world > 1:  # a world of one has no all-to-all to agree on
        plain = dict(group=group, backend="triton", config=alltoall, trusted=True,
                     runtime=runtime)  # fmt: skip
        ring_moe(*inputs, **plain)
        with _captured(), pytest.raises(ValueError, match="agreed mode is 'alltoall'"):
            ring_moe(*inputs, **plain)


def _capturable_auto_keeps_ring_modes(rank, world, group):
    """``capturable=True``: auto picks among the ring modes where it would pick the all-to-all
    (few tokens, many ranks), the same on every rank."""
    from relaymoe.ring import resolved_problem

    tokens, El, K = [2] * world, 1, 1
    pb = ring_problem(9, tokens, El * world, K, H, I)
    lo, hi = _slice(pb, rank, tokens)
    w13, w2 = pb["w13"][rank : rank + 1].float(), pb["w2"][rank : rank + 1].float()
    args = (pb["x"][lo:hi].float(), w13, w2, pb["idx"][lo:hi], pb["probs"][lo:hi].float())
    plain = resolved_problem(*args, group=group)
    ring = resolved_problem(*args, group=group, capturable=True)
    if world > 1:
        assert plain.mode == "alltoall", plain.mode  # the premise: auto picks it here
    assert ring.mode in ("expert", "token"), ring.mode


SCENARIOS = [_captured_equals_eager_without_host_reads, _captured_refusals,
             _capturable_auto_keeps_ring_modes]  # fmt: skip


WORLDS = (1, 2, 3, 4)


def test_every_case_runs_at_world_three_and_every_world_runs_both_modes():
    """What the case table promises: each routing case at world 3 and at a world of two or
    more, and every world of ``WORLDS`` running cases (each in both modes)."""
    assert all(3 in worlds for *_, worlds in CASES)
    assert all(any(w >= 2 for w in worlds) for *_, worlds in CASES)
    assert all(any(w in worlds for *_, worlds in CASES) for w in WORLDS)
    assert MODES == ("expert", "token")


@pytest.mark.parametrize(("world", "scenario"), scenario_params(SCENARIOS, WORLDS))
def test_ring_capture_gloo(world, scenario, gloo_worlds):
    gloo_worlds.run(scenario, world, timeout=300)


def test_guard_sees_a_library_host_read_and_lets_others_through():
    """The guard itself: a read made by relaymoe's code raises, one made here does not."""
    from relaymoe.ring.agreement import pair_counts
    from relaymoe.ring.plan import RingProblem

    t = torch.ones(3)
    with no_host_reads():
        assert t.sum().item() == 3.0  # this file's read: not the library's
    problem = RingProblem(0, 1, 2, 4, 4, 1, torch.float32, torch.float32, (3,), "expert", "local",
                       True, None)  # fmt: skip
    with no_host_reads(), pytest.raises(HostRead, match="tolist"):
        pair_counts(torch.zeros(3, 1, dtype=torch.int32), problem, None)
