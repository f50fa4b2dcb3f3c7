"""relaymoe.linear_cross_entropy against the float64 oracle, on CPU (Triton in the interpreter).

The oracle is ``torch.nn.functional.cross_entropy(reduction="none")`` on the whole float64
logits, with Megatron's label smoothing ``a`` expressed as PyTorch's ``a * V / (V - 1)``; its
loss and its gradients into hidden and weight are compared, for an upstream gradient that is
non-uniform (the backward's recompute path) and uniform over the counted tokens with other values
on ignored ones (the fast path). At TP 2 and 3 (gloo, spawned ranks) each rank is checked against
a float64 model of Megatron's tensor-parallel semantics (its own logits' gradient; smoothing over
its shard), the sum of the hidden-gradient parts against the unsharded oracle, and at TP 2 against
Megatron's own ``vocab_parallel_cross_entropy``.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import relaymoe
import relaymoe.loss.autograd as loss_mod
import relaymoe.loss.passes as passes
from relaymoe import lossmodel
from relaymoe.loss import linear_cross_entropy
from relaymoe.lossmodel import default_chunk_tokens
from tests.fixtures import free_port, rel_err, run_spawned

IGNORE = -100
BOUND = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 2e-3}
IMPLS = ["torch", "triton"]


def _problem(seed, T, H, V, *, ignore_every=4):
    """float64 ``(hidden_TH, weight_VH, labels_T)``; every ``ignore_every``-th label ignored."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * (2.0 / H**0.5)
    y = torch.randint(0, V, (T,), generator=g)
    if ignore_every:
        y[::ignore_every] = IGNORE  # token 0 too: a "first token" shortcut would fail
    return h, w, y


def _upstream(T, y, kind, seed=0):
    """``nonuniform``: random; ``uniform``: one constant on counted tokens, junk (NaN included)
    on ignored ones, which must not leak into any gradient."""
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "nonuniform":
        return torch.rand(T, generator=g, dtype=torch.float64) + 0.5
    up = torch.full((T,), 0.37, dtype=torch.float64)
    junk = torch.rand(T, generator=g, dtype=torch.float64) * 5
    junk[::3] = float("nan")
    return torch.where(y == IGNORE, junk, up)


def _oracle(h, w, y, up, smoothing=0.0, ignore_index=IGNORE):
    """float64 loss and gradients on the full logits."""
    h = h.detach().double().clone().requires_grad_()
    w = w.detach().double().clone().requires_grad_()
    V = w.shape[0]
    ls = smoothing * V / (V - 1)  # Megatron's smoothing a == PyTorch's a * V / (V - 1)
    loss = F.cross_entropy(h @ w.T, y, reduction="none", ignore_index=ignore_index,
                           label_smoothing=ls)  # fmt: skip
    counted = y != ignore_index
    loss.backward(torch.where(counted, up, 0.0))  # the oracle's own ignored gradient is 0
    return loss.detach(), h.grad, w.grad


def _ours(h, w, y, up, dtype, **kw):
    h = h.detach().to(dtype, copy=True).requires_grad_()
    w = w.detach().to(dtype, copy=True).requires_grad_()
    loss = linear_cross_entropy(h, w, y, **kw)
    loss.backward(up.to(loss.dtype))
    return loss.detach(), h.grad, w.grad


def _check(got, ref, bound, what):
    for name, a, b in zip(("loss", "dhidden", "dweight"), got, ref, strict=True):
        assert a.shape == b.shape, (what, name, a.shape, b.shape)
        if b.numel():
            err = rel_err(a, b)
            assert err < bound, (what, name, err)


# ---------------------------------------------------------------------------------------------
# against the oracle
# ---------------------------------------------------------------------------------------------
CASES = [
    # (T, H, V, chunk_tokens)
    (37, 19, 53, 8),  # odd everything, several chunks, a short last one
    (13, 7, 11, 1),  # one-token chunks
    (29, 6, 31, 1000),  # one chunk larger than T
    (50, 33, 101, None),  # the default chunk
    (1, 5, 2, None),  # one token, two classes
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16],
                         ids=lambda d: str(d)[6:])  # fmt: skip
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_float64_oracle(case, smoothing, dtype, impl):
    T, H, V, chunk = case
    h, w, y = _problem(sum(case[:3]), T, H, V, ignore_every=4 if T > 1 else 0)
    # the oracle sees the inputs the dtype holds, and the logits rounded as Megatron's are
    h, w = h.to(dtype).double(), w.to(dtype).double()
    for kind in ("nonuniform", "uniform"):
        up = _upstream(T, y, kind)
        got = _ours(h, w, y, up, dtype, chunk_tokens=chunk, label_smoothing=smoothing, impl=impl)
        ref = _oracle(h, w, y, up, smoothing)
        assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert torch.equal(got[0][y == IGNORE], torch.zeros_like(got[0][y == IGNORE]))
        _check(got, ref, BOUND[dtype], kind)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=lambda d: str(d)[6:])
def test_triton_walks_the_vocabulary_in_tiles(dtype, monkeypatch):
    """Rows longer than one tile (the GPU case, Vl >> 4096): the online max/sum-exp rescales
    its running sums when a later tile holds a larger logit; the last tile is partial."""
    import relaymoe.kernels.cross_entropy as kernels

    monkeypatch.setattr(kernels, "_MAX_BLOCK_V", 16)
    h, w, y = _problem(2, 31, 9, 101)
    h, w = h.to(dtype).double(), w.to(dtype).double()
    for kind in ("nonuniform", "uniform"):
        up = _upstream(31, y, kind)
        got = _ours(h, w, y, up, dtype, chunk_tokens=8, label_smoothing=0.1, impl="triton")
        _check(got, _oracle(h, w, y, up, 0.1), BOUND[dtype], kind)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_ignored_and_empty(impl):
    h, w, y = _problem(3, 9, 5, 7)
    up = _upstream(9, y, "nonuniform")
    got = _ours(h, w, torch.full_like(y, IGNORE), up, torch.float64, chunk_tokens=4, impl=impl)
    for t in got:
        assert torch.equal(t, torch.zeros_like(t))
    got = _ours(h[:0], w, y[:0], up[:0], torch.float64, impl=impl)  # T = 0
    assert got[0].shape == (0,) and got[1].shape == (0, 5)
    assert torch.equal(got[2], torch.zeros_like(w))


@pytest.mark.parametrize("impl", IMPLS)
def test_custom_ignore_index_inside_the_vocabulary(impl):
    h, w, y = _problem(4, 21, 6, 9, ignore_every=0)
    y[::3] = 2  # class 2 is the ignored one
    up = _upstream(21, y, "nonuniform")
    got = _ours(h, w, y, up, torch.float64, chunk_tokens=5, ignore_index=2, impl=impl)
    _check(got, _oracle(h, w, y, up, ignore_index=2), 1e-12, "ignore_index=2")


# ---------------------------------------------------------------------------------------------
# which backward path runs, and what is skipped
# ---------------------------------------------------------------------------------------------
class _Calls:
    """Counts calls of functions of ``module`` (``relaymoe.loss.autograd`` by default)."""

    def __init__(self, monkeypatch, *names, module=loss_mod):
        self.n = dict.fromkeys(names, 0)
        for name in names:
            real = getattr(module, name)

            def spy(*a, _real=real, _name=name, **kw):
                self.n[_name] += 1
                return _real(*a, **kw)

            monkeypatch.setattr(module, name, spy)


@pytest.mark.parametrize("kind,recomputes", [("uniform", 0), ("nonuniform", 1)])
def test_backward_recomputes_only_for_a_nonuniform_gradient(kind, recomputes, monkeypatch):
    calls = _Calls(monkeypatch, "_recompute_wgrad")
    h, w, y = _problem(5, 23, 8, 17)
    up = _upstream(23, y, kind)
    got = _ours(h, w, y, up, torch.float64, chunk_tokens=6, impl="torch")
    assert calls.n["_recompute_wgrad"] == recomputes
    _check(got, _oracle(h, w, y, up), 1e-12, kind)


def test_eval_and_frozen_weight_skip_gradient_work(monkeypatch):
    calls = _Calls(monkeypatch, "chunk_grad", "accumulate_wgrad", module=passes)
    h, w, y = _problem(6, 19, 5, 13)
    ref = _oracle(h, w, y, _upstream(19, y, "nonuniform"))
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.no_grad():
        out = linear_cross_entropy(hr, wr, y, chunk_tokens=4, impl="torch")
    assert not out.requires_grad and calls.n == {"chunk_grad": 0, "accumulate_wgrad": 0}
    assert rel_err(out, ref[0]) < 1e-12
    out = linear_cross_entropy(h, w, y, chunk_tokens=4, impl="torch")  # nothing requires grad
    assert not out.requires_grad and calls.n["chunk_grad"] == 0
    up = _upstream(19, y, "nonuniform")
    got = _ours(h, w, y, up, torch.float64, chunk_tokens=4, impl="torch")
    calls.n = dict.fromkeys(calls.n, 0)
    hg = h.clone().requires_grad_()
    linear_cross_entropy(hg, w, y, chunk_tokens=4, impl="torch").backward(up)  # w frozen
    assert calls.n["accumulate_wgrad"] == 0 and calls.n["chunk_grad"] == 5
    assert torch.equal(hg.grad, got[1])


class _Largest(TorchFunctionMode):
    """The largest tensor any torch call returns inside the mode."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("impl", IMPLS)
def test_no_tensor_of_all_logits(impl):
    T, H, V, C = 96, 5, 97, 8
    h, w, y = _problem(7, T, H, V)
    h.requires_grad_()
    w.requires_grad_()
    with _Largest() as mode:
        linear_cross_entropy(h, w, y, chunk_tokens=C, impl=impl).backward(
            _upstream(T, y, "nonuniform")
        )
    assert mode.numel == max(C * V, V * H, T * H), mode.numel  # the chunk, dW, dh: never T*V


@pytest.mark.parametrize("impl", IMPLS)
def test_bitwise_deterministic(impl):
    h, w, y = _problem(8, 41, 12, 29)
    up = _upstream(41, y, "nonuniform")
    a = _ours(h, w, y, up, torch.float32, chunk_tokens=7, impl=impl, label_smoothing=0.05)
    b = _ours(h, w, y, up, torch.float32, chunk_tokens=7, impl=impl, label_smoothing=0.05)
    for x, z in zip(a, b, strict=True):
        assert torch.equal(x, z)


@pytest.mark.parametrize("impl", IMPLS)
def test_default_chunk_is_the_loss_models(monkeypatch, impl):
    """The op's default chunk is ``lossmodel.default_chunk_tokens`` for the call's mode, impl
    and dtype: the kept mode's for a plain call, the accumulate budget's with
    ``weight_grad_into`` (expected gradient or not). The accumulate budget is shrunk so that
    the modes differ at this size: 128 tokens of fp32 logits (8 bytes a logit on torch, 4 on
    Triton) against the kept mode's whole T."""
    T_, H_, V_ = 300, 4, 3000
    monkeypatch.setattr(lossmodel, "ACCUMULATE_CHUNK_BUDGET_BYTES", 128 * V_ * 8)
    seen = []
    real = loss_mod.make_setup
    monkeypatch.setattr(loss_mod, "make_setup", lambda *a: seen.append(real(*a)) or seen[-1])
    h, w, y = _problem(9, T_, H_, V_)
    h, w = h.float(), w.float()
    with torch.no_grad():
        linear_cross_entropy(h, w, y, impl=impl)
    acc = torch.zeros(V_, H_)
    for expected in (0.5, None):
        hr = h.clone().requires_grad_()
        linear_cross_entropy(hr, w, y, impl=impl, weight_grad_into=acc,
                             expected_grad=expected).sum().backward()  # fmt: skip
    accumulate = {"torch": 128, "triton": 256}[impl]
    assert [s.chunk for s in seen] == [T_, accumulate, accumulate]
    assert accumulate == default_chunk_tokens(T_, V_, wgrad="accumulate", impl=impl, act_bytes=4)
    assert T_ == default_chunk_tokens(T_, V_, impl=impl, act_bytes=4)


def test_exported_from_package():
    assert relaymoe.linear_cross_entropy is linear_cross_entropy


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def test_bad_inputs_name_the_value_and_the_fix():
    h, w, y = _problem(10, 6, 4, 5, ignore_every=0)
    bad = [
        (dict(hidden_TH=h[0]), r"2-D \(T, H\).*shape \(4,\)"),
        (dict(weight_VH=w.T), r"H=5 columns but hidden_TH has H=4.*transpose"),
        (dict(weight_VH=w[:0]), r"0 rows"),
        (dict(weight_VH=w.float()), r"float64.*float32.*share one"),
        (dict(labels_T=y[:5]), r"shape \(6,\).*\(5,\)"),
        (dict(labels_T=y.double()), r"integer tensor"),
        (dict(labels_T=torch.tensor([0, 1, 5, 2, 3, 4])), r"label 5 is outside \[0, 5\)"),
        (dict(labels_T=torch.tensor([0, -1, 1, 2, 3, 4])), r"label -1 .*ignore_index=-100"),
        (dict(chunk_tokens=0), r"chunk_tokens=0 must be a positive int"),
        (dict(chunk_tokens=2.5), r"chunk_tokens=2.5"),
        (dict(label_smoothing=1.0), r"label_smoothing=1.0 must be in \[0, 1\); 0 disables it"),
        (dict(label_smoothing=-0.1), r"label_smoothing=-0.1"),
        (dict(weight_VH=w[:1], labels_T=torch.zeros(6, dtype=torch.long), label_smoothing=0.1),
         r"Vl >= 2"),
        (dict(impl="cuda"), r"impl='cuda'"),
        (dict(tp_group=object()), r"not initialised"),
        (dict(hidden_TH=h.to(torch.float8_e4m3fn), weight_VH=w.to(torch.float8_e4m3fn)),
         r"float8_e4m3fn.*share one float dtype of float16"),
        (dict(hidden_TH=h.to(torch.complex128), weight_VH=w.to(torch.complex128)), r"complex"),
        (dict(labels_T=y > 2), r"integer tensor"),
        (dict(ignore_index=-100.0), r"ignore_index=-100.0 must be an int"),
        (dict(ignore_index=-(2**63) - 1), r"ignore_index=-9223372036854775809 is outside the "
         r"int64 range \[-9223372036854775808, 9223372036854775807\].*use a label"),
        (dict(ignore_index=2**63), r"ignore_index=9223372036854775808 is outside the int64"),
        (dict(ignore_index=2**63, validate=False), r"ignore_index=9223372036854775808"),
        (dict(label_smoothing="0.1"), r"label_smoothing='0.1' must be a number"),
    ]  # fmt: skip
    for kw, pattern in bad:
        args = dict(hidden_TH=h, weight_VH=w, labels_T=y) | kw
        hidden, weight, labels = args.pop("hidden_TH"), args.pop("weight_VH"), args.pop("labels_T")
        with pytest.raises(ValueError, match=pattern):
            linear_cross_entropy(hidden, weight, labels, **args)
    # without validation an out-of-range label is not checked (no host sync): the caller's word
    out = linear_cross_entropy(h, w, torch.tensor([0, 1, 5, 2, 3, 4]), validate=False)
    assert out.shape == (6,)


# ---------------------------------------------------------------------------------------------
# tensor parallel over gloo: spawned ranks, the unsharded oracle and Megatron's own function
# ---------------------------------------------------------------------------------------------
def _shard_oracle(h, w, y, up, smoothing, rank, world):
    """float64 rank ``rank``'s loss and its own gradient parts under Megatron's tensor-parallel
    semantics: the other shards' logits are constants (Megatron's backward differentiates this
    rank's logits only; the caller sums the hidden gradient over ranks), and label smoothing
    averages over this shard with ``smoothing * Vl / (Vl - 1)``."""
    Vl = w.shape[0] // world
    lo, hi = rank * Vl, (rank + 1) * Vl
    h = h.clone().requires_grad_()
    wl = w[lo:hi].clone().requires_grad_()
    z_all = (h @ w.T).detach()
    z_local = h @ wl.T
    z = torch.cat([z_all[:, :lo], z_local, z_all[:, hi:]], 1)
    counted = y != IGNORE
    lse = z.logsumexp(1)
    loss = lse - z.gather(1, torch.where(counted, y, 0)[:, None]).squeeze(1)
    if smoothing:
        s = smoothing * Vl / (Vl - 1)
        loss = (1 - s) * loss - s * (z_local.mean(1) - lse)
    loss = torch.where(counted, loss, 0.0)
    loss.backward(torch.where(counted, up, 0.0))
    return loss.detach(), h.grad, wl.grad


def _tp_case(rank, world, group, *, seed, T, H, Vl, chunk, smoothing, kind, impl, megatron):
    V = Vl * world
    h, w, y = _problem(seed, T, H, V)
    up = _upstream(T, y, kind)
    shard = slice(rank * Vl, (rank + 1) * Vl)
    hl, wl = h.clone().requires_grad_(), w[shard].clone().requires_grad_()
    loss = linear_cross_entropy(hl, wl, y, tp_group=group, chunk_tokens=chunk,
                                label_smoothing=smoothing, impl=impl)  # fmt: skip
    loss.backward(up)
    got = (loss.detach(), hl.grad, wl.grad)
    what = f"T={T} Vl={Vl} smoothing={smoothing} {kind} {impl}"
    _check(got, _shard_oracle(h, w, y, up, smoothing, rank, world), 1e-12, "shard " + what)
    dh = hl.grad.clone()
    dist.all_reduce(dh, group=group)  # what Megatron's column-parallel layer adds up
    if smoothing == 0:  # the unsharded problem
        ref_loss, ref_dh, ref_dw = _oracle(h, w, y, up)
        _check((loss.detach(), dh, wl.grad), (ref_loss, ref_dh, ref_dw[shard]), 1e-12, what)
    if not megatron:
        return
    # Megatron's vocab_parallel_cross_entropy (fp32 inside) on this rank's fp64 logits; it has
    # no ignore_index: ignored tokens take any label and a zero upstream gradient
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    counted = y != IGNORE
    hm, wm = h.clone().requires_grad_(), w[shard].clone().requires_grad_()
    mloss = vocab_parallel_cross_entropy(hm @ wm.T, torch.where(counted, y, 0), smoothing, group)
    mloss.backward(torch.where(counted, up, 0.0).float())
    mloss = torch.where(counted, mloss, 0.0)
    _check(got, (mloss, hm.grad, wm.grad), 2e-6, "megatron " + what)


def _tp_scenarios(rank, world, group):
    megatron = world == 2  # its import costs ~10 s a rank: once is enough
    for impl in IMPLS:
        for kind in ("uniform", "nonuniform"):
            for smoothing in (0.0, 0.1):
                _tp_case(rank, world, group, seed=11, T=23, H=9, Vl=7, chunk=5,
                         smoothing=smoothing, kind=kind, impl=impl, megatron=megatron)  # fmt: skip
    _tp_case(rank, world, group, seed=12, T=6, H=4, Vl=3, chunk=1, smoothing=0.0,
             kind="uniform", impl="torch", megatron=False)  # fmt: skip
    # zero tokens: no chunk, no collective, nothing hangs; then a normal call still agrees
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    h = torch.randn(0, 4, dtype=torch.float64, requires_grad=True)
    linear_cross_entropy(h, w, torch.zeros(0, dtype=torch.long), tp_group=group).sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    _tp_case(rank, world, group, seed=13, T=4, H=3, Vl=2, chunk=3, smoothing=0.1,
             kind="nonuniform", impl="torch", megatron=False)  # fmt: skip


def _tp_accumulate(rank, world, group):
    """The accumulate mode at TP > 1: each rank's shard gradient added into its accumulator
    (pre-filled), for the expected upstream gradient, another uniform one, and a non-uniform
    one, against the float64 model of Megatron's semantics."""
    Vl = 7
    h, w, y = _problem(14, 23, 9, Vl * world)
    shard = slice(rank * Vl, (rank + 1) * Vl)
    for expected, kind in ((0.37, "uniform"), (0.2, "uniform"), (0.37, "nonuniform")):
        up = _upstream(23, y, kind)
        start = torch.randn(Vl, 9, dtype=torch.float64)
        acc = start.clone()
        hl = h.clone().requires_grad_()
        loss = linear_cross_entropy(hl, w[shard], y, tp_group=group, chunk_tokens=5,
                                    weight_grad_into=acc, expected_grad=expected)  # fmt: skip
        loss.backward(up)
        got = (loss.detach(), hl.grad, acc - start)
        _check(got, _shard_oracle(h, w, y, up, 0.0, rank, world), 1e-12,
               f"accumulate {expected} {kind}")  # fmt: skip


def _tp_contract(rank, world, group):
    """Issue #32: ranks that break the tensor-parallel contract (vocabulary shards of different
    sizes, different T, chunk sizes or labels, a bad label on one rank) all raise the same
    ValueError naming the value per rank, before any chunk's collective; then a good call still
    agrees. The check is one all-reduce of a fixed-size matrix; validate=False skips it."""
    last = rank == world - 1
    g = torch.Generator().manual_seed(40)
    h = torch.randn(6, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 19 * world, (6,), generator=g)
    w = torch.randn(19, 4, generator=g, dtype=torch.float64)
    breaks = [
        (dict(weight=torch.cat([w, w[:1]]) if last else w), r"vocabulary shard size Vl.*\[19, "),
        (dict(hidden=torch.cat([h, h[:1]]) if last else h,
              labels=torch.cat([y, y[:1]]) if last else y), r"token count T.*\[6, "),
        (dict(chunk_tokens=2 if last else 3), r"chunk size"),
        (dict(labels=torch.where(torch.arange(6) == 4, 999, y) if last else y),
         rf"label 999 \(on rank {world - 1} of tp_group\) is outside \[0, {19 * world}\)"),
        (dict(labels=(y + 1) % (19 * world) if last else y), r"labels_T \(a checksum"),
    ]  # fmt: skip
    # issue #50: an argument that fails its own check on one rank raised there, and its peers
    # waited in the contract's all-reduce; now every rank raises that rank's message at once
    on_last = rf".* \(rank {world - 1} of tp_group; every rank of tp_group raises this\)$"
    breaks += [
        (dict(label_smoothing=1.0 if last else 0.0), r"label_smoothing=1.0 must be in \[0, 1\)"
         + on_last),
        (dict(chunk_tokens=0 if last else None), r"chunk_tokens=0 must be a positive int"
         + on_last),
        (dict(ignore_index=-(2**63) - 1 if last else -100), r"ignore_index=-9223372036854775809 "
         r"is outside the int64 range" + on_last),
        (dict(impl="fast" if last else "torch"), r"impl='fast'" + on_last),
        (dict(hidden=h.tolist() if last else h), r"hidden_TH must be a 2-D \(T, H\) tensor, got "
         r"list" + on_last),
    ]  # fmt: skip
    for change, match in breaks:
        args = dict(hidden=h, weight=w, labels=y, chunk_tokens=None, label_smoothing=0.0,
                    ignore_index=-100, impl="auto") | change  # fmt: skip
        start = time.monotonic()
        with pytest.raises(ValueError, match=match):
            linear_cross_entropy(args["hidden"], args["weight"], args["labels"], tp_group=group,
                                 chunk_tokens=args["chunk_tokens"], impl=args["impl"],
                                 label_smoothing=args["label_smoothing"],
                                 ignore_index=args["ignore_index"])  # fmt: skip
        assert time.monotonic() - start < 10, (match, time.monotonic() - start)
    calls = []
    real = dist.all_reduce

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    dist.all_reduce = counting
    try:
        for validate, extra in ((True, 1), (False, 0)):
            calls.clear()
            loss = linear_cross_entropy(h, w, y, tp_group=group, chunk_tokens=4,
                                        validate=validate)  # fmt: skip
            assert len(calls) == 2 * 2 + extra, (validate, len(calls))  # 2 chunks of 4 and 2
    finally:
        dist.all_reduce = real
    assert torch.isfinite(loss).all()


def _tp_worker(rank, world, port, outdir):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    result = "ok"
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
        group = dist.new_group(list(range(world)))  # an explicit group, not the default
        _tp_scenarios(rank, world, group)
        _tp_accumulate(rank, world, group)
        _tp_contract(rank, world, group)
        dist.destroy_process_group()
    except Exception:
        result = traceback.format_exc()
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_gloo(world, tmp_path):
    port = free_port()
    hung, codes = run_spawned(_tp_worker, lambda r: (r, world, port, str(tmp_path)), world, 240)
    assert not hung, f"ranks {hung} hung"
    for r in range(world):
        f = Path(tmp_path, f"rank{r}.json")
        assert f.exists(), f"rank {r} died (exit code {codes[r]})"
        assert json.loads(f.read_text()) == "ok", f"rank {r}:\n{json.loads(f.read_text())}"
