"""The recorded hop bodies' cache (relaymoe/ring/hop_graphs.py) on CPU: its eager plumbing
(small tensors copied into static buffers, the weights and their gradients bound by address,
replayed, read back) gives the plain ring's results bitwise, a new routing is never replayed
stale, a weight updated in place is read as it is, entries are keyed by the hops' shapes and
bound addresses, and past the variant cap a hop falls back to copies."""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from unittest import mock

import pytest
import torch

from relaymoe.options import RingConfig
from relaymoe.ring import RingRuntime
from tests.fixtures import ring_problem, scenario_params

H, I = 8, 4  # tiny widths: the plumbing does not depend on them
MODES = ("expert", "token")
GRADS = ("out", "dx", "dprobs", "dw13", "dw2", "db13", "db2")


def _weights(rank, world, *, seed, tokens, El, K, bias=False, **_):
    """This rank's experts of the problem ``seed`` as fresh float32 tensors: ``w13``, ``w2``
    and with ``bias`` ``b13``, ``b2``."""
    pb = ring_problem(seed, tokens, El * world, K, H, I)
    e0, e1 = rank * El, (rank + 1) * El
    w = {"w13": pb["w13"][e0:e1].float(), "w2": pb["w2"][e0:e1].float()}
    if bias:
        g = torch.Generator().manual_seed(seed + 1000)
        w["b13"] = torch.randn(El * world, 2 * I, generator=g)[e0:e1].clone()
        w["b2"] = torch.randn(El * world, H, generator=g)[e0:e1].clone()
    return w


def _ring_step(rank, world, group, *, seed, tokens, El, K, mode, backend="torch", trusted=True,
               routing_seed=None, weights=None, bias=False):  # fmt: skip
    """ring_moe forward + backward on this rank's slice; returns (out, dx, dprobs, dw13, dw2)
    and the bias gradients when the experts have biases. ``routing_seed``: another routing over
    the same tokens. ``weights``: the experts to compute with (:func:`_weights`; the leaves
    share their storage, so the ring sees their address), default fresh ones of ``seed``."""
    from relaymoe.ring import ring_moe

    pb = ring_problem(seed, tokens, El * world, K, H, I)
    if routing_seed is not None:
        pb["idx"] = ring_problem(routing_seed, tokens, El * world, K, H, I)["idx"]
    if weights is None:
        weights = _weights(rank, world, seed=seed, tokens=tokens, El=El, K=K, bias=bias)
    lo, hi = sum(tokens[:rank]), sum(tokens[: rank + 1])
    x = pb["x"][lo:hi].float().requires_grad_()
    probs = pb["probs"][lo:hi].float().requires_grad_()
    w = {n: t.detach().requires_grad_() for n, t in weights.items()}
    # inside _capture_on(): its config and runtime
    config, runtime = (CAPTURE_ON, _ON[-1]) if _ON else (RingConfig(), None)
    out = ring_moe(x, w["w13"], w["w2"], pb["idx"][lo:hi], probs, group=group,
                   backend=backend, trusted=trusted, b13=w.get("b13"), b2=w.get("b2"),
                   config=config.replace(mode=mode), runtime=runtime)  # fmt: skip
    out.backward(pb["dy"][lo:hi].float())
    grads = [w[n].grad for n in ("w13", "w2", "b13", "b2") if n in w]
    return tuple(t.detach() for t in (out, x.grad, probs.grad, *grads))


def _same(a, b, what):
    assert len(a) == len(b), what
    for name, p, q in zip(GRADS, a, b, strict=False):
        assert p.dtype == q.dtype and torch.equal(p, q), f"{name} differs: {what}"


def _cache():
    """The eager-plumbing cache of the runtime of the enclosing :func:`_capture_on` block."""
    return _ON[-1].hop_graphs.get(("eager", torch.device("cpu")))


def _copied_names():
    return {k[0] for k in _cache().buffers}


CAPTURE_ON = RingConfig(capture_hops=True)
_ON: list = []  # the runtime of the enclosing _capture_on() block (this test file's)


@contextlib.contextmanager
def _capture_on():
    """The ring steps inside run with ``RingConfig(capture_hops=True)`` and one fresh runtime
    (its hop-graph cache: ``_cache()``); outside, eagerly, each call with a runtime of its own."""
    _ON.append(RingRuntime())
    try:
        yield
    finally:
        _ON.pop()


@contextlib.contextmanager
def _returned_names():
    """The names of what every hop body run through a cache inside the block returned (cloned
    out of the graphs' pool after each replay)."""
    from relaymoe.ring.hop_graphs import HopGraphs

    names, run = set(), HopGraphs.run

    def spy(self, *args, **kwargs):
        made = run(self, *args, **kwargs)
        names.update(made)
        return made

    HopGraphs.run = spy
    try:
        yield names
    finally:
        HopGraphs.run = run


def _captured_equals_eager(rank, world, group):
    """Option on (CPU: the eager plumbing) vs off, bitwise, both ring modes, with and without
    biases; two steps of different routing over the same weights run the same hops (no new
    shape, an entry per set of bound addresses), each giving its own eager result, and nothing
    bound is copied or returned."""
    from relaymoe.ring.hop_graphs import BOUND

    tok = {"expert": [6] * world, "token": [5, 3, 4, 2][:world]}
    for mode in MODES:
        for bias in (False, True):
            kw = dict(seed=11, tokens=tok[mode], El=2, K=2, mode=mode)
            w = _weights(rank, world, **kw, bias=bias)
            plain1 = _ring_step(rank, world, group, **kw, weights=w)
            plain2 = _ring_step(rank, world, group, **kw, weights=w, routing_seed=12)
            assert not torch.equal(plain1[0], plain2[0])  # the two routings differ
            with _capture_on(), _returned_names() as made:
                got1 = _ring_step(rank, world, group, **kw, weights=w)
                n = len(_cache().variants)
                # a forward and a backward hop per visiting partition; expert mode without fc2
                # bias: one hop of each direction for every range (range_window), an entry per
                # set of slots it binds (forward: the weights' slot; backward: hop 0, then odd
                # and even hops into the trail scratch)
                shared = mode == "expert" and not bias and world > 1
                assert n == (2 if shared else 2 * world), n
                entries = min(world, 2) + min(world, 3) if shared else 2 * world
                assert len(_cache().entries) == entries, len(_cache().entries)
                got2 = _ring_step(rank, world, group, **kw, weights=w, routing_seed=12)
                assert len(_cache().variants) == n  # the same hops, replayed with new routing
                assert not _copied_names() & BOUND, _copied_names()
            assert not made & BOUND, made  # the weight gradients are added into, not returned
            what = f"{mode} bias={bias} rank {rank}"
            _same(got1, plain1, f"{what} step 1")
            _same(got2, plain2, f"{what} step 2 (new routing)")


def _update(weights):
    """An optimizer's step stand-in: every tensor changed in place."""
    for t in weights.values():
        t.mul_(0.5).add_(0.25)


def _inplace_update_is_read(rank, world, group):
    """The weights updated in place between two steps (an optimizer's step: the same address):
    the captured second step computes with the new values, bitwise as eager."""
    for mode in MODES:
        kw = dict(seed=13, tokens=[5] * world, El=2, K=2, mode=mode)
        w = _weights(rank, world, **kw, bias=True)
        first = {n: t.clone() for n, t in w.items()}

        plain1 = _ring_step(rank, world, group, **kw, weights=w)
        _update(w)
        plain2 = _ring_step(rank, world, group, **kw, weights=w)
        assert not torch.equal(plain1[0], plain2[0])
        for n, t in w.items():
            t.copy_(first[n])
        with _capture_on():
            got1 = _ring_step(rank, world, group, **kw, weights=w)
            _update(w)
            got2 = _ring_step(rank, world, group, **kw, weights=w)
        _same(got1, plain1, f"{mode} before the update, rank {rank}")
        _same(got2, plain2, f"{mode} after the in-place update, rank {rank}")


SMALL_CAP = 3  # the variant cap of the cap's own test (the default would take 258 steps)


def _variant_cap_falls_back_to_copies(rank, world, group):
    """Fresh weights every step (new addresses: the CPU entries keep the old tensors, so none
    recurs): each of the first ``max_variants`` steps records an entry per hop, the next one a
    copied entry per hop (the weights then in static buffers), and from then on the entries stop
    growing; every step equals eager."""
    from relaymoe.ring import hop_graphs

    for mode in MODES:
        kw = dict(seed=17, tokens=[4] * world, El=2, K=2, mode=mode)
        plain = _ring_step(rank, world, group, **kw)
        counts = []
        with mock.patch.object(hop_graphs, "MAX_VARIANTS", SMALL_CAP), _capture_on():
            cap = SMALL_CAP
            for step in range(cap + 2):
                _same(_ring_step(rank, world, group, **kw), plain, f"{mode} step {step}")
                counts.append(len(_cache().entries))
            n = len(_cache().variants)
            assert cap == _cache().max_variants and max(_cache().variants.values()) <= cap
            assert counts[-1] == counts[-2], counts  # the entries stop growing
            if world == 1:  # the weights are the caller's: a new address every step
                assert set(_cache().variants.values()) == {cap}
                assert counts == [n * (i + 1) for i in range(cap + 1)] + [n * (cap + 1)], counts
                assert {"w13", "w2"} <= _copied_names()


LAYERS = 12  # more than the variant cap once was (8): a model's layers each bind their own


def _layers_replay_their_own_entries(rank, world, group):
    """A model of ``LAYERS`` MoE layers, each with its own experts (persistent tensors, as a
    model's parameters), run for two steps: every layer's hops record entries of their own
    (the weights' addresses, one per layer) under the default variant cap, none falls back to
    copying the weights, and every layer of every step equals eager bitwise."""
    for mode in MODES:
        kws = [dict(seed=40 + j, tokens=[4] * world, El=2, K=2, mode=mode) for j in range(LAYERS)]
        ws = [_weights(rank, world, **kw) for kw in kws]
        pairs = list(zip(kws, ws, strict=True))
        plain = [_ring_step(rank, world, group, **kw, weights=w) for kw, w in pairs]
        with _capture_on():
            for step in range(2):
                for j, (kw, w) in enumerate(pairs):
                    got = _ring_step(rank, world, group, **kw, weights=w)
                    _same(got, plain[j], f"{mode} step {step} layer {j}")
            assert not {"w13", "w2"} & _copied_names(), f"{mode}: weights fell back to copies"
            assert max(_cache().variants.values()) >= LAYERS  # one entry a layer at least


def _entries_keyed_by_shape(rank, world, group):
    """Another T builds new hops; the first shape again reuses its own (a new entry of its
    hops where its bound addresses are new, no new hop)."""
    kw = dict(El=2, K=2, mode="expert")
    with _capture_on():
        _ring_step(rank, world, group, seed=3, tokens=[4] * world, **kw)
        n = len(_cache().variants)
        _ring_step(rank, world, group, seed=4, tokens=[7] * world, **kw)
        m = len(_cache().variants)
        assert m == 2 * n, (n, m)
        want = _ring_step(rank, world, group, seed=5, tokens=[4] * world, **kw)
        assert len(_cache().variants) == m
    _same(want, _ring_step(rank, world, group, seed=5, tokens=[4] * world, **kw), "reused")


def _refused_runs_eagerly(rank, world, group):
    """An untrusted call's hops have exact pair counts (host integers of the step): capture is
    refused for it, and it runs (and computes) as without the option."""
    kw = dict(seed=6, tokens=[5] * world, El=1, K=1, mode="token", trusted=False)
    plain = _ring_step(rank, world, group, **kw)
    with _capture_on():
        got = _ring_step(rank, world, group, **kw)
        assert _cache() is None or not _cache().entries
    _same(got, plain, "refused")


def _triton_plumbing(rank, world, group):
    """The Triton hop kernels (interpreter) through the same plumbing."""
    from relaymoe.kernels import triton_available

    if not triton_available():
        return
    for mode in MODES:
        kw = dict(seed=8, tokens=[4] * world, El=1, K=1, mode=mode, backend="triton")
        plain = _ring_step(rank, world, group, **kw)
        with _capture_on():
            got = _ring_step(rank, world, group, **kw)
        _same(got, plain, f"triton {mode}")


def _cache_bytes_match_cost_model(rank, world, group):
    """``cost.captured_hop_bytes`` is the bytes of the static buffers a training step leaves in
    the cache, both modes, any world: the copied tensors only, none of the weights, biases or
    their gradients (bound)."""
    from relaymoe import cost
    from relaymoe.ring.hop_graphs import BOUND

    T, El, K = 6, 2, 2
    for bias in (True, False):  # without fc2 bias expert forward copies its range's offsets
        d = cost.Dims(T=T, H=H, I=I, El=El, K=K, R=world, b=4, pb=4, b13=bias, b2=bias)
        for mode in MODES:
            with _capture_on():
                _ring_step(rank, world, group, seed=21, tokens=[T] * world, El=El, K=K,
                           mode=mode, bias=bias)  # fmt: skip
                assert _cache().static_bytes() == cost.captured_hop_bytes(mode, d), (mode, bias)
                assert not _copied_names() & BOUND, _copied_names()


SCENARIOS = [_captured_equals_eager, _inplace_update_is_read, _variant_cap_falls_back_to_copies,
             _layers_replay_their_own_entries, _entries_keyed_by_shape, _refused_runs_eagerly,
             _triton_plumbing, _cache_bytes_match_cost_model]  # fmt: skip


@pytest.mark.parametrize(("world", "scenario"), scenario_params(SCENARIOS, [1, 2]))
def test_capture_hops_gloo(world, scenario, gloo_worlds):
    gloo_worlds.run(scenario, world, timeout=120)


# ---------------------------------------------------------------------------------------------
# the cache itself
# ---------------------------------------------------------------------------------------------
def test_cache_copies_inputs_reads_inouts_and_clones_what_it_made():
    from relaymoe.ring.hop_graphs import EagerReplay, HopGraphs

    graphs = HopGraphs(EagerReplay())
    calls = []

    def body(t):
        calls.append(t)
        t["acc"].add_(t["a"] * 2)
        return {"made": t["a"] + 1}

    a, acc = torch.arange(3.0), torch.ones(3)
    made = graphs.run(("k",), body, {"a": a}, {"acc": acc})
    assert torch.equal(acc, torch.tensor([1.0, 3.0, 5.0]))
    assert torch.equal(made["made"], a + 1)
    a2 = torch.tensor([5.0, 6.0, 7.0])
    made2 = graphs.run(("k",), body, {"a": a2}, {"acc": acc})
    assert len(graphs.entries) == 1  # same key and shapes: reused
    assert torch.equal(acc, torch.tensor([11.0, 15.0, 19.0]))  # the new input was copied in
    assert torch.equal(made2["made"], a2 + 1) and torch.equal(made["made"], a + 1)
    assert calls[0] is calls[1]  # the body ran on the cache's static buffers both times
    assert calls[0]["a"] is not a and calls[0]["a"] is not a2
    graphs.run(("k",), body, {"a": torch.zeros(4)}, {"acc": torch.zeros(4)})
    assert len(graphs.entries) == 2  # another shape: another entry
    assert graphs.static_bytes() == 4 * (3 + 3 + 4 + 4)
    with pytest.raises(ValueError, match="both inputs and inouts"):
        graphs.run(("k",), body, {"a": a}, {"a": acc})


def test_bound_tensors_are_the_live_ones_keyed_by_address(caplog):
    """A bound tensor reaches the body as itself (no buffer, no copy), an in-place update is
    read, a new address records a new entry up to ``max_variants``, past that a copied entry
    (logged once), and a bound in-out is added into once despite the warm-up runs."""
    from relaymoe.ring.hop_graphs import EagerReplay, HopGraphs

    caplog.set_level(logging.INFO, logger="relaymoe.ring")
    graphs = HopGraphs(EagerReplay(warmup=2), max_variants=2)
    seen = []

    def body(t):
        seen.append(t)
        t["acc"].add_(t["a"] * t["w"])
        t["g"].add_(t["a"])

    a, acc, g = torch.arange(1.0, 4.0), torch.zeros(3), torch.zeros(3)

    def run(w):
        acc.zero_(), g.zero_()  # in place: g keeps its address
        graphs.run(("bind", "test"), body, {"a": a, "w": w}, {"acc": acc, "g": g}, {"w", "g"})
        assert torch.equal(acc, a * w) and torch.equal(g, a)  # g: once, not once a run
        return seen[-1]

    w = torch.tensor([1.0, 2.0, 3.0])
    t = run(w)
    assert t["w"] is w and t["g"] is g and t["a"] is not a and t["acc"] is not acc
    assert graphs.static_bytes() == 4 * (3 + 3)  # a and acc: nothing of w or g
    w.mul_(10)  # an optimizer's step: the same address
    assert run(w)["w"] is w and len(graphs.entries) == 1
    others = [w * 2, w * 3, w * 4]  # new addresses
    assert run(others[0])["w"] is others[0] and len(graphs.entries) == 2
    assert run(others[1])["w"] is not others[1] and len(graphs.entries) == 3  # past the cap
    assert graphs.static_bytes() == 4 * 3 * 4  # the copied entry's w and g buffers as well
    run(others[2])
    assert run(w)["w"] is w  # a recorded address replays its own entry
    assert len(graphs.entries) == 3 and list(graphs.variants.values()) == [2]
    logged = [r.getMessage() for r in caplog.records if "max_variants=2" in r.getMessage()]
    assert len(logged) == 1 and "bind test hop's ['g', 'w']" in logged[0], logged
    with pytest.raises(ValueError, match="max_variants"):
        HopGraphs(EagerReplay(), max_variants=-1)


def test_cache_keeps_no_bound_tensor_alive():
    """With a backend that keeps what a CUDA graph keeps (nothing of the dict it was recorded
    on), the cache itself holds no reference to a bound tensor (its snapshot included)."""
    from relaymoe.ring.hop_graphs import BOUND, HopGraphs

    class Graphless:
        name, warmup = "graphless", 1

        def record(self, body, static, device):
            for _ in range(self.warmup):
                body(static)
            return lambda: {}

    def body(t):
        t["dw13"].add_(t["w13"] * t["x"])

    graphs = HopGraphs(Graphless())
    w13, dw13 = torch.ones(3), torch.zeros(3)
    refs = [weakref.ref(w13), weakref.ref(dw13)]
    graphs.run(("hop", "bwd"), body, {"w13": w13, "x": torch.ones(3)}, {"dw13": dw13}, BOUND)
    assert torch.equal(dw13, torch.zeros(3))  # the warm-up's add undone; the replay adds nothing
    del w13, dw13
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(graphs.entries) == 1 and graphs.static_bytes() == 4 * 3  # x only


def test_refusal_names_exact_pair_counts_and_the_torch_backend():
    from relaymoe.ring.hop_graphs import refusal
    from relaymoe.ring.plan import RingProblem

    problem = RingProblem(rank=0, world_size=2, num_local_experts=2, hidden=H, ffn=I, topk=2,
                       dtype=torch.bfloat16, prob_dtype=torch.float32, tokens=(4, 4),
                       mode="expert", transport="nccl", needs_grad=True, pairs=None)  # fmt: skip
    assert refusal(problem, "torch", torch.device("cpu")) is None  # the eager plumbing
    assert "torch hop backend" in refusal(problem, "torch", torch.device("cuda"))
    counted = RingProblem(**{**problem.__dict__, "pairs": ((3, 5), (4, 4))})
    why = refusal(counted, "triton", torch.device("cuda"))
    assert "exact host integers" in why and "trusted=True" in why


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------
def test_captured_hop_bytes_by_hand():
    import dataclasses

    from relaymoe import cost

    d = cost.Dims(T=10, H=8, I=4, El=2, K=2, R=4, b=2, pb=4, gb=4)  # E = 8, P = 20
    index = 12 * 20 + 8 * 9
    tokens = 2 * 10 * 8 * 2 + 10 * 2 * 4  # x and out (or dy and dx), probs (or dprobs)
    ids = 10 * 2 * 4  # token mode's visiting ids
    window = 8 * (2 + 1)  # expert forward's range offsets (no fc2 bias: one hop for all ranges)
    assert cost.captured_hop_bytes("expert", d) == 2 * tokens + index + window
    assert cost.captured_hop_bytes("expert", d, training=False) == tokens + index + window
    biased = dataclasses.replace(d, b2=True)  # with fc2 bias: one recorded hop per range
    assert cost.captured_hop_bytes("expert", biased) == 2 * tokens + index
    one_e = dataclasses.replace(d, R=1)  # a world of one (E = 2): one range, no window
    assert cost.captured_hop_bytes("expert", one_e) == 2 * tokens + 12 * 20 + 8 * 3
    # token mode's index is built into one buffer (four ALIGN-aligned arrays: 256 B each here)
    packed = 256 + 256 + 256 + 4 * 20
    one = dataclasses.replace(d, R=1)  # a world of one: token mode copies its own tokens
    assert cost.captured_hop_bytes("token", one) == 2 * tokens + packed + ids
    assert cost.captured_hop_bytes("token", one, training=False) == tokens + ids  # no index in
    # a ring: the visiting partition and the trail are slot views, bound; the index is copied
    assert cost.captured_hop_bytes("token", d) == packed
    assert cost.captured_hop_bytes("token", d, training=False) == 0
    assert cost.captured_hop_bytes("alltoall", d) == 0
    # the weights and their gradients are bound, not copied: the experts' widths do not count
    wide = dataclasses.replace(biased, I=400, gb=2, b13=True)
    assert cost.captured_hop_bytes("expert", wide) == cost.captured_hop_bytes("expert", biased)


def test_stage_peak_counts_captured_hop_buffers_once_per_gpu():
    from relaymoe import cost
    from relaymoe.planner import memory as mm
    from relaymoe.planner import stage_peak
    from tests.fixtures import small_config

    cfg = small_config().replace(relaymoe={"mode": "expert", "transport": "nccl"})
    off, on = stage_peak(cfg, 0, "ring"), stage_peak(cfg, 0, "ring", capture_hops=True)
    want = cost.captured_hop_bytes("expert", mm.shapes(cfg).dims())
    assert off.terms["captured_hop_buffers"] == 0
    assert on.terms["captured_hop_buffers"] == want > 0
    assert on.total - off.total == want


def test_capture_hops_flag_is_a_switch_of_the_ring_config():
    import argparse

    from relaymoe.megatron import settings
    from relaymoe.megatron.patches import add_relaymoe_args

    assert RingConfig().capture_hops is False  # off by default
    parser = add_relaymoe_args(argparse.ArgumentParser())
    assert parser.parse_args([]).relaymoe_capture_hops is None  # the base config's value
    on = parser.parse_args(["--relaymoe-capture-hops"])
    assert settings.ring_config_from_args(on).capture_hops is True
    assert settings.ring_config_from_args(parser.parse_args([])).capture_hops is False
