"""Recorded hop bodies on one GPU (relaymoe/ring/hop_graphs.py, ``RingOptions.capture_hops``):
the replayed ring equals the eager one bitwise, forward and backward, expert and token mode, for
two steps of different routing through the same graphs, and a replayed step adds no host sync.

World of one (no process group), qwen3-like widths (H 2048, I 768, K 8, SwiGLU, bf16) at small
T, the Triton backend, trusted calls (pair buffers from the bound).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

H, I, K, E = 2048, 768, 8, 16
T = 256


def _inputs(seed: int, routing_seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(T, H, generator=g, device=dev).to(dt)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=dev) * H**-0.5).to(dt)
    w2 = (torch.randn(E, H, I, generator=g, device=dev) * I**-0.5).to(dt)
    probs = torch.softmax(torch.randn(T, K, generator=g, device=dev), -1)
    dy = torch.randn(T, H, generator=g, device=dev).to(dt)
    r = torch.Generator(device="cuda").manual_seed(routing_seed)
    idx = torch.rand(T, E, generator=r, device=dev).topk(K, dim=1).indices
    return x, w13, w2, idx, probs, dy


def _step(mode, inputs, *, sync_check=False):
    """One trusted forward + backward; returns (out, dx, dprobs, dw13, dw2)."""
    from relaymoe.ring import ring_moe

    x, w13, w2, idx, probs, dy = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2, probs)]
    if sync_check:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        out = ring_moe(leaves[0], leaves[1], leaves[2], idx, leaves[3], mode=mode,
                       backend="triton", trusted=True)  # fmt: skip
        out.backward(dy)
    finally:
        if sync_check:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    xg, w13g, w2g, pg = (t.grad for t in leaves)
    return out.detach(), xg, pg, w13g, w2g


def _capture_on():
    from relaymoe import options

    return options.installed(options.defaults().replace(capture_hops=True))


@pytest.mark.parametrize("mode", ["expert", "token"])
def test_replayed_hops_equal_eager_bitwise_for_two_routings(mode):
    from relaymoe.ring import hop_graphs

    steps = [_inputs(0, 1), _inputs(0, 2)]  # same tokens and weights, another routing
    eager = [_step(mode, s) for s in steps]
    eager.append(_step(mode, steps[0]))
    for a, b in zip(eager[0], eager[2], strict=True):  # the eager ring is deterministic
        assert torch.equal(a, b)
    assert not torch.equal(eager[0][0], eager[1][0])
    with _capture_on():
        got = [_step(mode, s) for s in steps]
        cache = hop_graphs.caches()[("cuda_graph", torch.device("cuda", 0))]
        n = len(cache.entries)
        assert n >= 2  # a forward and a backward graph at least
        got.append(_step(mode, steps[0]))  # replayed again: the first routing once more
        assert len(cache.entries) == n
    names = ("out", "dx", "dprobs", "dw13", "dw2")
    for step, (want, have) in enumerate(zip([eager[0], eager[1], eager[0]], got, strict=True)):
        for name, a, b in zip(names, want, have, strict=True):
            assert torch.equal(a, b), f"{mode} step {step}: {name} differs from eager"


@pytest.mark.parametrize("mode", ["expert", "token"])
def test_replayed_step_adds_no_host_sync(mode):
    """``set_sync_debug_mode("error")`` around a step whose hops replay recorded graphs: the
    eager step must pass it first (else the check says nothing about capture; skip then)."""
    first, second = _inputs(0, 3), _inputs(0, 4)
    _step(mode, first)  # the trusted agreement of this signature (one host sync), cached
    try:
        _step(mode, first, sync_check=True)
    except RuntimeError as err:
        pytest.skip(f"the eager trusted step already syncs the host: {err}")
    with _capture_on():
        _step(mode, first)  # records the graphs (recording itself synchronises)
        _step(mode, second, sync_check=True)
