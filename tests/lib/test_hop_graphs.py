"""The recorded hop bodies' cache (relaymoe/ring/hop_graphs.py) on CPU: its eager plumbing
(static buffers copied into, replayed, read back) gives the plain ring's results bitwise, a new
routing is never replayed stale, and entries are keyed by the hops' shapes."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures import ring_problem, scenario_params

H, I = 8, 4  # tiny widths: the plumbing does not depend on them


def _ring_step(rank, world, group, *, seed, tokens, El, K, mode, backend="torch", trusted=True,
               routing_seed=None):  # fmt: skip
    """ring_moe forward + backward on this rank's slice; returns (out, dx, dprobs, dw13, dw2).
    ``routing_seed``: another routing over the same tokens and weights."""
    from relaymoe.ring import ring_moe

    pb = ring_problem(seed, tokens, El * world, K, H, I)
    if routing_seed is not None:
        pb["idx"] = ring_problem(routing_seed, tokens, El * world, K, H, I)["idx"]
    lo, hi = sum(tokens[:rank]), sum(tokens[: rank + 1])
    e0, e1 = rank * El, (rank + 1) * El
    dt = torch.float32
    x = pb["x"][lo:hi].to(dt).requires_grad_()
    probs = pb["probs"][lo:hi].to(dt).requires_grad_()
    w13 = pb["w13"][e0:e1].to(dt).requires_grad_()
    w2 = pb["w2"][e0:e1].to(dt).requires_grad_()
    out = ring_moe(x, w13, w2, pb["idx"][lo:hi], probs, group=group, mode=mode,
                   backend=backend, trusted=trusted)  # fmt: skip
    out.backward(pb["dy"][lo:hi].to(dt))
    return tuple(t.detach() for t in (out, x.grad, probs.grad, w13.grad, w2.grad))


def _same(a, b, what):
    for name, p, q in zip(("out", "dx", "dprobs", "dw13", "dw2"), a, b, strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q), f"{name} differs: {what}"


def _cache():
    from relaymoe.ring import hop_graphs

    return hop_graphs.caches().get(("eager", torch.device("cpu")))


def _capture_on():
    from relaymoe import options

    return options.installed(options.defaults().replace(capture_hops=True))


def _captured_equals_eager(rank, world, group):
    """Option on (CPU: the eager plumbing) vs off, bitwise, both ring modes; two steps of
    different routing through the same entries each give their own eager result."""
    tok = {"expert": [6] * world, "token": [5, 3, 4, 2][:world]}
    for mode in ("expert", "token"):
        kw = dict(seed=11, tokens=tok[mode], El=2, K=2, mode=mode)
        plain1 = _ring_step(rank, world, group, **kw)
        plain2 = _ring_step(rank, world, group, **kw, routing_seed=12)
        assert not torch.equal(plain1[0], plain2[0])  # the two routings differ
        with _capture_on():
            got1 = _ring_step(rank, world, group, **kw)
            n = len(_cache().entries)
            if mode == "expert":  # a forward and a backward entry per visiting expert range
                assert n == 2 * world, n
            got2 = _ring_step(rank, world, group, **kw, routing_seed=12)
            assert len(_cache().entries) == n  # the same entries, replayed with new routing
        _same(got1, plain1, f"{mode} step 1 rank {rank}")
        _same(got2, plain2, f"{mode} step 2 (new routing) rank {rank}")


def _entries_keyed_by_shape(rank, world, group):
    """Another T builds new entries; the first shape again reuses its own."""
    kw = dict(El=2, K=2, mode="expert")
    with _capture_on():
        _ring_step(rank, world, group, seed=3, tokens=[4] * world, **kw)
        n = len(_cache().entries)
        _ring_step(rank, world, group, seed=4, tokens=[7] * world, **kw)
        m = len(_cache().entries)
        assert m == 2 * n, (n, m)
        want = _ring_step(rank, world, group, seed=5, tokens=[4] * world, **kw)
        assert len(_cache().entries) == m
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
    for mode in ("expert", "token"):
        kw = dict(seed=8, tokens=[4] * world, El=1, K=1, mode=mode, backend="triton")
        plain = _ring_step(rank, world, group, **kw)
        with _capture_on():
            got = _ring_step(rank, world, group, **kw)
        _same(got, plain, f"triton {mode}")


def _cache_bytes_match_cost_model(rank, world, group):
    """``cost.captured_hop_bytes`` is the bytes of the static buffers a training step leaves in
    the cache (expert mode; token mode from two ranks on: a world of one's single hop returns
    its weight gradients, it does not add into static ones)."""
    from relaymoe import cost

    T, El, K = 6, 2, 2
    d = cost.Dims(T=T, H=H, I=I, El=El, K=K, R=world, b=4, pb=4)
    for mode in ("expert", "token") if world > 1 else ("expert",):
        with _capture_on():
            _ring_step(rank, world, group, seed=21, tokens=[T] * world, El=El, K=K, mode=mode)
            assert _cache().static_bytes() == cost.captured_hop_bytes(mode, d), mode


SCENARIOS = [_captured_equals_eager, _entries_keyed_by_shape, _refused_runs_eagerly,
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


def test_refusal_names_exact_pair_counts_and_the_torch_backend():
    from relaymoe.ring.agree import RingProblem
    from relaymoe.ring.hop_graphs import refusal

    prob = RingProblem(rank=0, world_size=2, num_local_experts=2, hidden=H, ffn=I, topk=2,
                       dtype=torch.bfloat16, prob_dtype=torch.float32, tokens=(4, 4),
                       mode="expert", transport="nccl", needs_grad=True, pairs=None)  # fmt: skip
    assert refusal(prob, "torch", torch.device("cpu")) is None  # the eager plumbing
    assert "torch hop backend" in refusal(prob, "torch", torch.device("cuda"))
    counted = RingProblem(**{**prob.__dict__, "pairs": ((3, 5), (4, 4))})
    why = refusal(counted, "triton", torch.device("cuda"))
    assert "exact host integers" in why and "trusted=True" in why


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------
def test_captured_hop_bytes_by_hand():
    from relaymoe import cost

    d = cost.Dims(T=10, H=8, I=4, El=2, K=2, R=4, b=2, pb=4, gb=4)  # E = 8, P = 20
    W = 2 * (8 * 8 + 8 * 4)  # El * (J*H + H*I), J = 2I
    index = 12 * 20 + 8 * 9
    fwd = 2 * 10 * 8 * 2 + 10 * 2 * 4 + index + W * 2  # x, out, probs, index, weights
    bwd = 2 * 10 * 8 * 2 + 10 * 2 * 4 + W * 4  # dy, dx, dprobs, weight gradients
    assert cost.captured_hop_bytes("expert", d) == fwd + bwd
    assert cost.captured_hop_bytes("expert", d, training=False) == fwd
    assert cost.captured_hop_bytes("token", d) == fwd + bwd + 10 * 2 * 4  # the visiting ids
    assert cost.captured_hop_bytes("alltoall", d) == 0


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


def test_capture_hops_flag_is_a_switch_of_the_process_options():
    import argparse

    from relaymoe.megatron import settings
    from relaymoe.megatron.patches import add_relaymoe_args
    from relaymoe.options import RingOptions

    assert RingOptions().capture_hops is False  # off by default
    parser = add_relaymoe_args(argparse.ArgumentParser())
    assert parser.parse_args([]).relaymoe_capture_hops is None  # the process's value
    on = parser.parse_args(["--relaymoe-capture-hops"])
    assert settings.args_settings(on).capture_hops is True
    assert settings.args_settings(parser.parse_args([])).capture_hops is False
