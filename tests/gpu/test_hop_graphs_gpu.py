"""Recorded hop bodies on one GPU (relaymoe/ring/hop_graphs.py, ``RingConfig.capture_hops``):
the replayed ring equals the eager one bitwise, forward and backward, expert and token mode, for
two steps of different routing through the same hops; weights updated in place between two
replayed steps are read at their address (bitwise eager again); the cache's static buffers hold
no weights or weight gradients (bound by address); and a replayed step adds no host sync.

World of one (no process group), qwen3-like widths (H 2048, I 768, K 8, SwiGLU, bf16) at small
T, the Triton backend, trusted calls (pair buffers from the bound). Each test keeps one
``RingRuntime`` for its eager and its captured steps (the agreements and the recorded hops live
there) and passes ``RingConfig(capture_hops=True)`` to the captured ones.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

H, I, K, E = 2048, 768, 8, 16
T = 256
NAMES = ("out", "dx", "dprobs", "dw13", "dw2")


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


def _leaves(inputs):
    """Fresh (x, w13, w2, probs) leaves of ``inputs``: a model's parameters when kept."""
    x, w13, w2, _, probs, _ = inputs
    return [t.detach().clone().requires_grad_() for t in (x, w13, w2, probs)]


def _runtime():
    """A test's ``RingRuntime`` (world of one): every step of the test runs on it."""
    from relaymoe.ring import RingRuntime

    return RingRuntime()


def _step(mode, inputs, runtime, *, capture=False, leaves=None, sync_check=False):
    """One trusted forward + backward on ``runtime``; returns host copies of (out, dx, dprobs,
    dw13, dw2). ``capture``: the call's ``RingConfig.capture_hops`` (its hops recorded and
    replayed through ``runtime``'s cache). ``leaves``: the (x, w13, w2, probs) to compute with,
    kept by the caller (their gradients are taken and reset, as an optimizer's
    ``zero_grad(set_to_none=True)``); default fresh ones. Nothing of the step stays on the GPU,
    so the next step of the same shapes meets the same caching-allocator state."""
    from relaymoe.options import RingConfig
    from relaymoe.ring import ring_moe

    _, _, _, idx, _, dy = inputs
    leaves = _leaves(inputs) if leaves is None else leaves
    if sync_check:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        config = RingConfig(mode=mode, capture_hops=capture)
        out = ring_moe(leaves[0], leaves[1], leaves[2], idx, leaves[3], backend="triton",
                       trusted=True, config=config, runtime=runtime)  # fmt: skip
        out.backward(dy)
    finally:
        if sync_check:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    xg, w13g, w2g, pg = (t.grad for t in leaves)
    for t in leaves:
        t.grad = None
    return tuple(t.detach().cpu() for t in (out, xg, pg, w13g, w2g))


def _cache(runtime):
    """``runtime``'s recorded hops on the GPU (``RingRuntime.hop_graphs``: CUDA graphs, device
    0)."""
    return runtime.hop_graphs[("cuda_graph", torch.device("cuda", 0))]


def _steady(mode, inputs, leaves, runtime):
    """Captured steps of ``leaves`` on ``runtime`` (results dropped) until one records no entry:
    every bound tensor then sits where it sat the step before, so steps of the same shapes
    replay. Bounded: each hop records at most ``max_variants`` entries of bound addresses and
    one copied entry. Returns the cache."""
    _step(mode, inputs, runtime, capture=True, leaves=leaves)
    cache = _cache(runtime)
    n = len(cache.entries)
    for _ in range(len(cache.variants) * cache.max_variants + 2):
        _step(mode, inputs, runtime, capture=True, leaves=leaves)
        if len(cache.entries) == n:
            return cache
        n = len(cache.entries)
    pytest.fail(f"{mode}: the recorded hops still grow ({n} entries)")


def _same(want, have, what):
    for name, a, b in zip(NAMES, want, have, strict=True):
        assert torch.equal(a, b), f"{what}: {name} differs from eager"


@pytest.mark.parametrize("mode", ["expert", "token"])
def test_replayed_hops_equal_eager_bitwise_for_two_routings(mode):
    steps = [_inputs(0, 1), _inputs(0, 2)]  # same tokens and weights, another routing
    rt = _runtime()
    eager = [_step(mode, s, rt) for s in steps]
    eager.append(_step(mode, steps[0], rt))
    for a, b in zip(eager[0], eager[2], strict=True):  # the eager ring is deterministic
        assert torch.equal(a, b)
    assert not torch.equal(eager[0][0], eager[1][0])
    assert not rt.hop_graphs  # eager steps record nothing
    got = [_step(mode, s, rt, capture=True) for s in steps]
    cache = _cache(rt)
    hops = len(cache.variants)
    assert hops == 2  # a forward and a backward hop (world of one)
    got.append(_step(mode, steps[0], rt, capture=True))  # replayed: the first routing once more
    assert len(cache.variants) == hops  # no new hop (an entry per set of bound addresses)
    for step, (want, have) in enumerate(zip([eager[0], eager[1], eager[0]], got, strict=True)):
        _same(want, have, f"{mode} step {step}")


@pytest.mark.parametrize("mode", ["expert", "token"])
def test_weights_updated_in_place_between_replays_equal_eager(mode):
    """An optimizer's step between two steps changes the weights in place (their address
    unchanged): both steps replay recorded graphs, the second reads the new weights."""
    first, second = _inputs(0, 5), _inputs(0, 6)
    g = torch.Generator(device="cuda").manual_seed(7)
    deltas = [torch.randn(w.shape, generator=g, device="cuda").to(w.dtype) * 1e-2
              for w in first[1:3]]  # fmt: skip

    def update(leaves):
        with torch.no_grad():
            leaves[1].add_(deltas[0])
            leaves[2].add_(deltas[1])

    rt = _runtime()
    kept = _leaves(first)
    want1 = _step(mode, first, rt, leaves=kept)
    update(kept)
    want2 = _step(mode, second, rt, leaves=kept)
    assert not torch.equal(want1[0], want2[0])
    kept = _leaves(first)
    cache = _steady(mode, first, kept, rt)
    n = len(cache.entries)
    ptrs = [t.data_ptr() for t in kept]
    got1 = _step(mode, first, rt, capture=True, leaves=kept)
    update(kept)
    got2 = _step(mode, second, rt, capture=True, leaves=kept)
    assert [t.data_ptr() for t in kept] == ptrs
    assert len(cache.entries) == n  # both steps replayed: nothing recorded after the update
    _same(want1, got1, f"{mode} before the update")
    _same(want2, got2, f"{mode} after the in-place update")


@pytest.mark.parametrize("mode", ["expert", "token"])
def test_static_buffers_exclude_the_weights(mode):
    """The cache copies the tokens, probabilities and routing arrays only: the weights and
    their gradients are bound (no buffer), and its bytes are ``cost.captured_hop_bytes``."""
    from relaymoe import cost
    from relaymoe.ring.hop_graphs import BOUND

    inputs = _inputs(0, 8)
    cache = _steady(mode, inputs, _leaves(inputs), _runtime())
    names = {k[0] for k in cache.buffers}
    assert not names & BOUND, sorted(names)
    d = cost.Dims(T=T, H=H, I=I, El=E, K=K, R=1, b=2, pb=4)
    assert cache.static_bytes() == cost.captured_hop_bytes(mode, d)
    weights = inputs[1].nbytes + inputs[2].nbytes
    assert cache.static_bytes() < weights // 10, (cache.static_bytes(), weights)


@pytest.mark.parametrize("mode", ["expert", "token"])
def test_replayed_step_adds_no_host_sync(mode):
    """``set_sync_debug_mode("error")`` around a step whose hops replay recorded graphs: the
    eager step must pass it first (else the check says nothing about capture; skip then). The
    weights are kept across steps (a model's) and the recorded hops steady first, so the
    checked step replays: a recording synchronises."""
    first, second = _inputs(0, 3), _inputs(0, 4)
    rt = _runtime()
    _step(mode, first, rt)  # the trusted agreement of this signature (one host sync), kept in rt
    try:
        _step(mode, first, rt, sync_check=True)
    except RuntimeError as err:
        pytest.skip(f"the eager trusted step already syncs the host: {err}")
    kept = _leaves(first)
    _steady(mode, first, kept, rt)  # records the graphs (recording itself synchronises)
    _step(mode, second, rt, capture=True, leaves=kept, sync_check=True)


LAYERS = 10  # more than the cache's variant cap once was (8)
STEPS = 4


@pytest.mark.parametrize("mode", ["expert", "token"])
def test_layers_reach_a_steady_replay_equal_to_eager(mode):
    """A model of ``LAYERS`` MoE layers, each with its own experts, trained ``STEPS`` steps (an
    in-place SGD update of every layer's weights after each): every layer of every step equals
    eager bitwise; the recorded entries stop growing once the steps' allocations repeat (the
    last step records nothing) and no layer's weights fall back to copies. The layers share one
    runtime (as layers handed one ``runtime=`` do): its one cache holds every layer's
    entries."""
    layers = [_inputs(10 + j, 50 + j) for j in range(LAYERS)]

    def train(capture: bool):
        rt = _runtime()
        kept = [_leaves(inp) for inp in layers]
        got, counts = [], []
        for _ in range(STEPS):
            step = []
            for inp, leaves in zip(layers, kept, strict=True):
                res = _step(mode, inp, rt, capture=capture, leaves=leaves)
                with torch.no_grad():  # the weights' gradients: res[3], res[4] (host copies)
                    leaves[1].sub_(1e-2 * res[3].to(leaves[1].device))
                    leaves[2].sub_(1e-2 * res[4].to(leaves[2].device))
                step.append(res)
            got.append(step)
            if capture:
                counts.append(len(_cache(rt).entries))
        names = {k[0] for k in _cache(rt).buffers} if capture else set()
        return got, counts, names

    want, _, _ = train(False)
    have, counts, names = train(True)
    for s in range(STEPS):
        for j in range(LAYERS):
            _same(want[s][j], have[s][j], f"{mode} step {s} layer {j}")
    assert counts[-1] == counts[-2], f"{mode}: entries after each step {counts}"
    assert counts[0] >= LAYERS, counts  # each layer its own entries
    assert not names & {"w13", "w2"}, f"{mode}: weights fell back to copies ({sorted(names)})"
