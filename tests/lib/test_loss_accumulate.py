"""The accumulate mode of ``relaymoe.linear_cross_entropy`` (``weight_grad_into``,
``expected_grad``) against the float64 oracle, on CPU (Triton in the interpreter).

Every case runs three micro-batches into one accumulator that starts non-zero (gradient
accumulation), with ignored tokens, and compares the accumulator's growth with the sum of the
oracle's weight gradients, and each loss and hidden gradient with the oracle's. The upstream
gradient is the expected one (a float, a device tensor, within the tolerance), differs from it
uniformly (the correction), is far from it (the forward's part taken back), is not uniform, or
there is no expectation (the backward computes it), or a useless one (zero, NaN). Which backward
passes run is counted. Then the accumulators' dtypes, a retained graph's second backward,
forwards in flight, the ledger's refusals of a forward whose backward never runs, second-order
gradients, and the argument checks. The tensor-parallel case is in
``tests/lib/test_linear_cross_entropy.py`` (its gloo worlds).
"""

from __future__ import annotations

import pytest
import torch

import relaymoe.loss.accumulate as acc_mod
import relaymoe.loss.passes as passes
from relaymoe.loss import check_settled, linear_cross_entropy, reset_ledger
from tests.fixtures import rel_err
from tests.lib.test_linear_cross_entropy import IGNORE, _oracle, _problem

T, H, V, CHUNK = 37, 19, 53, 8  # five chunks, the last short
C = 0.37  # the uniform upstream gradient
# kind: (expected_grad, upstream kind, backward passes over the chunks)
KINDS = {
    "equal": (C, "uniform", 0),
    "equal_tensor": (torch.tensor(C, dtype=torch.float64), "uniform", 0),
    "within_tolerance": (C * (1 + 3e-7), "uniform", 0),
    "differs": (0.25, "uniform", 1),
    "far": (3.0, "uniform", 2),
    "nonuniform": (1.0, "nonuniform", 1),
    "none": (None, "uniform", 1),
    "zero_tensor": (torch.tensor(0.0), "uniform", 1),
    "nan_tensor": (torch.tensor(float("nan")), "nonuniform", 1),
}
BOUND = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _up(y, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "nonuniform":
        up = torch.rand(y.shape[0], generator=g, dtype=torch.float64) + 0.5
    else:
        up = torch.full((y.shape[0],), C, dtype=torch.float64)
    return torch.where(y == IGNORE, float("nan"), up)  # junk on ignored tokens must not leak


class _Passes:
    """Counts the accumulate mode's backward passes over the chunks."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = acc_mod.backward_chunks

        def spy(*a, **k):
            self.n += 1
            return real(*a, **k)

        monkeypatch.setattr(acc_mod, "backward_chunks", spy)


def _micro_batches(dtype, acc_dtype, kind, impl, monkeypatch, *, n=3):
    """Runs ``n`` micro-batches into one pre-filled accumulator; returns what to compare and the
    passes each backward ran."""
    expected, up_kind, _ = KINDS[kind]
    counter = _Passes(monkeypatch)
    w64 = _problem(1, T, H, V)[1].to(dtype).double()
    start = torch.randn(V, H, generator=torch.Generator().manual_seed(3)).to(acc_dtype)
    acc = start.clone()
    want_dw, got, runs = torch.zeros(V, H, dtype=torch.float64), [], []
    for k in range(n):
        h64, _, y = _problem(10 + k, T, H, V)
        h64 = h64.to(dtype).double()
        up = _up(y, up_kind, seed=k)
        h = h64.to(dtype).requires_grad_()
        before = counter.n
        loss = linear_cross_entropy(h, w64.to(dtype), y, chunk_tokens=CHUNK, impl=impl,
                                    weight_grad_into=acc, expected_grad=expected)  # fmt: skip
        loss.backward(up.to(loss.dtype))
        runs.append(counter.n - before)
        ref = _oracle(h64, w64, y, up)
        got.append((loss.detach(), h.grad, ref))
        want_dw += ref[2]
    check_settled(acc)
    return (acc.double() - start.double()), want_dw, got, runs


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_accumulates_the_oracles_weight_gradient(kind, impl, monkeypatch):
    dw, want_dw, got, runs = _micro_batches(torch.float32, torch.float32, kind, impl, monkeypatch)
    assert runs == [KINDS[kind][2]] * 3, runs
    assert rel_err(dw, want_dw) < BOUND[torch.float32], rel_err(dw, want_dw)
    for loss, dh, (ref_loss, ref_dh, _) in got:
        assert rel_err(loss, ref_loss) < BOUND[torch.float32]
        assert rel_err(dh, ref_dh) < BOUND[torch.float32], rel_err(dh, ref_dh)


@pytest.mark.parametrize(
    "dtype,acc_dtype,impl",
    [
        (torch.float64, torch.float64, "torch"),
        (torch.float16, torch.float32, "torch"),
        (torch.float16, torch.float32, "triton"),
        (torch.bfloat16, torch.bfloat16, "torch"),  # the weight's dtype (rounds every chunk)
        (torch.bfloat16, torch.float32, "torch"),
    ],
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_accumulator_dtypes(dtype, acc_dtype, impl, monkeypatch):
    # a half accumulator rounds at every addition: a far guess's added and taken-back part
    # costs it more than its bound (documented), so it runs the other two
    kinds = ("equal", "differs") if acc_dtype == torch.bfloat16 else ("equal", "differs", "far")
    for kind in kinds:
        dw, want_dw, got, _ = _micro_batches(dtype, acc_dtype, kind, impl, monkeypatch, n=2)
        bound = BOUND[dtype]
        assert rel_err(dw, want_dw) < bound, (kind, rel_err(dw, want_dw))
        for _, dh, (_, ref_dh, _) in got:
            assert rel_err(dh, ref_dh) < bound, (kind, rel_err(dh, ref_dh))


def test_the_expected_case_adds_exactly_what_the_default_mode_computes():
    """With the expected gradient, the accumulator receives the default mode's weight gradient
    up to the order of one rounding: the expectation scales the logits gradient before its one
    rounding, as the default mode scales its fp32 ``dW_unit`` after."""
    h, w, y = _problem(4, T, H, V)
    h, w = h.float(), w.float()
    up = _up(y, "uniform", 0).float()
    hd, wd = h.clone().requires_grad_(), w.clone().requires_grad_()
    linear_cross_entropy(hd, wd, y, chunk_tokens=CHUNK).backward(up)
    acc = torch.zeros(V, H)
    ha = h.clone().requires_grad_()
    linear_cross_entropy(ha, w, y, chunk_tokens=CHUNK, weight_grad_into=acc,
                         expected_grad=C).backward(up)  # fmt: skip
    assert rel_err(acc, wd.grad) < 1e-6 and rel_err(ha.grad, hd.grad) < 1e-6


def test_weight_requiring_grad_gets_none_and_eval_leaves_the_accumulator():
    h, w, y = _problem(5, T, H, V)
    acc = torch.zeros(V, H, dtype=torch.float64)
    wr = w.clone().requires_grad_()
    loss = linear_cross_entropy(h, wr, y, weight_grad_into=acc, expected_grad=C)  # h frozen
    loss.backward(_up(y, "uniform", 0))
    assert wr.grad is None and rel_err(acc, _oracle(h, w, y, _up(y, "uniform", 0))[2]) < 1e-12
    before = acc.clone()
    linear_cross_entropy(h, w, y, weight_grad_into=acc, expected_grad=C)  # nothing needs grad
    with torch.no_grad():
        linear_cross_entropy(h, wr, y, weight_grad_into=acc, expected_grad=C)
    assert torch.equal(acc, before)
    check_settled(acc)


def test_retained_graph_and_forwards_in_flight():
    """A retained graph's second backward adds its gradient again (the first settled the
    forward's part); a pipeline's forwards in flight settle in any order."""
    h, w, y = _problem(6, T, H, V)
    up = _up(y, "uniform", 0)
    ref = _oracle(h, w, y, up)
    for expected in (C, 0.2, None):
        acc = torch.zeros(V, H, dtype=torch.float64)
        hr = h.clone().requires_grad_()
        loss = linear_cross_entropy(hr, w, y, chunk_tokens=CHUNK, weight_grad_into=acc,
                                    expected_grad=expected)  # fmt: skip
        loss.backward(up, retain_graph=True)
        loss.backward(up)
        assert rel_err(acc, 2 * ref[2]) < 1e-12 and rel_err(hr.grad, 2 * ref[1]) < 1e-12
    acc = torch.zeros(V, H, dtype=torch.float64)
    hr = h.clone().requires_grad_()
    losses = [linear_cross_entropy(hr, w, y, weight_grad_into=acc, expected_grad=C).sum()
              for _ in range(3)]  # fmt: skip
    with pytest.raises(RuntimeError, match="3 forward.*backward has not run"):
        check_settled(acc)
    for loss in reversed(losses):
        loss.backward()
    check_settled(acc)
    assert rel_err(acc, 3 * _oracle(h, w, y, torch.ones(T, dtype=torch.float64))[2]) < 1e-12


def test_a_forward_whose_backward_never_runs_is_refused(monkeypatch):
    h, w, y = _problem(7, T, H, V)
    hr = h.clone().requires_grad_()
    acc = torch.zeros(V, H, dtype=torch.float64)
    call = dict(weight_grad_into=acc, expected_grad=C, chunk_tokens=CHUNK)
    never = "1 forward.*their backward never ran.*reset_ledger"
    linear_cross_entropy(hr, w, y, **call)  # dropped: a forward for logging under grad mode
    for refused in (lambda: check_settled(acc), lambda: linear_cross_entropy(hr, w, y, **call)):
        with pytest.raises(RuntimeError, match=never):
            refused()
    reset_ledger(acc)
    linear_cross_entropy(hr, w, y, **call).sum().backward()  # after the reset: works
    check_settled(acc)
    # a forward that raises after its first addition
    real, seen = passes.chunk_grad, []

    def failing(*a, **k):
        seen.append(1)
        if len(seen) == 2:
            raise MemoryError("chunk 2")
        return real(*a, **k)

    monkeypatch.setattr(passes, "chunk_grad", failing)
    with pytest.raises(MemoryError):
        linear_cross_entropy(hr, w, y, **call)
    monkeypatch.setattr(passes, "chunk_grad", real)
    with pytest.raises(RuntimeError, match=never):
        linear_cross_entropy(hr, w, y, **call)
    reset_ledger(acc)
    # second order refused; the dropped contribution is then refused too
    loss = linear_cross_entropy(hr, w, y, **call)
    with pytest.raises(NotImplementedError, match="create_graph=True"):
        torch.autograd.grad(loss.sum(), hr, create_graph=True)
    del loss
    with pytest.raises(RuntimeError, match=never):
        check_settled(acc)
    # without an expectation nothing is added in the forward: dropping it is harmless
    reset_ledger(acc)
    linear_cross_entropy(hr, w, y, weight_grad_into=acc)
    check_settled(acc)


def test_bad_accumulate_arguments_name_the_value_and_the_fix():
    h, w, y = _problem(8, 6, 4, 5, ignore_every=0)
    acc = torch.zeros(5, 4, dtype=torch.float64)
    bad = [
        (dict(expected_grad=1.0), r"expected_grad=float was given without weight_grad_into"),
        (dict(weight_grad_into=acc[:4]), r"weight's shape \(5, 4\), got shape \(4, 4\)"),
        (dict(weight_grad_into=acc.half()), r"float16 on cpu; it must be float32 or the weight"),
        (dict(weight_grad_into=acc.clone().requires_grad_()), r"outside autograd"),
        (dict(weight_grad_into=torch.zeros(4, 5, dtype=torch.float64).t()), r"contiguous"),
        (dict(weight_grad_into=w), r"the weight itself"),
        (dict(weight_grad_into=acc, expected_grad=0.0), r"expected_grad=0.0 must be finite and "
         r"non-zero.*pass None"),
        (dict(weight_grad_into=acc, expected_grad=float("inf")), r"expected_grad=inf"),
        (dict(weight_grad_into=acc, expected_grad=True), r"expected_grad=True must be a Python "
         r"float"),
        (dict(weight_grad_into=acc, expected_grad=torch.ones(2)), r"0-dim floating tensor, got "
         r"shape \(2,\)"),
        (dict(weight_grad_into=acc, expected_grad=torch.tensor(1)), r"0-dim floating tensor"),
    ]  # fmt: skip
    for kw, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            linear_cross_entropy(h, w, y, **kw)


def test_the_loss_model_of_each_mode():
    """``relaymoe.lossmodel.fused_loss_bytes``: what each mode keeps, returns and adds (issue
    #53's shape: the default mode's transient holds the fp32 dW, the accumulate mode's one
    chunk)."""
    from relaymoe.lossmodel import fused_loss_bytes

    T_, H_, V_, C_, MB = 65536, 4096, 151936, 2304, 2**20
    chunk, dh, dw32, dw = C_ * V_ * 2, T_ * H_ * 2, V_ * H_ * 4, V_ * H_ * 2
    kept = fused_loss_bytes(T_, H_, V_, chunk_tokens=C_, impl="triton")
    assert (kept.chunk, kept.dhidden, kept.dweight) == (chunk, dh, dw32)
    assert kept.total == chunk + dh + dw32  # the forward's peak, what the planner counts
    assert kept.peak == dh + dw32 + dh + dw  # the backward: kept + returned gradients
    assert kept.transient == dh + dw32 + dw and round(kept.transient / MB) == 4073
    acc = fused_loss_bytes(T_, H_, V_, chunk_tokens=C_, impl="triton", wgrad="accumulate")
    assert (acc.dweight, acc.total, acc.transient) == (0, chunk + dh, chunk)
    rec = fused_loss_bytes(T_, H_, V_, chunk_tokens=C_, impl="triton", wgrad="recompute")
    assert (rec.total, rec.peak, rec.transient) == (chunk, chunk + dh, chunk)
    assert fused_loss_bytes(T_, H_, V_, chunk_tokens=C_).chunk == C_ * V_ * 6  # torch path
    with pytest.raises(ValueError, match="wgrad='fp32'; use one of"):
        fused_loss_bytes(T_, H_, V_, wgrad="fp32")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_guess_equals_the_recompute_bitwise(dtype):
    """A forward whose guess is exact adds the same bits into the accumulator (and returns the
    same hidden gradient) as the mode without a guess, which computes everything in the
    backward: what keeps a captured step (no guess, ``relaymoe/megatron/fused_loss.py``)
    bitwise equal to the eager one."""
    gen = torch.Generator().manual_seed(0)
    t, h, v = 300, 32, 257
    hid = torch.randn(t, h, generator=gen).to(dtype)
    w = (torch.randn(v, h, generator=gen) * 0.1).to(dtype)
    y = torch.randint(0, v, (t,), generator=gen)
    y[::7] = -100
    g = torch.tensor(1.0) / (y != -100).sum().float() / 16
    prefill = torch.randn(v, h, generator=gen)
    got = []
    for expected in (g, None):
        hh, ww = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
        acc = prefill.clone()
        kw = {"weight_grad_into": acc, "impl": "torch", "chunk_tokens": 128}
        if expected is not None:
            kw["expected_grad"] = expected
        loss = linear_cross_entropy(hh, ww, y, **kw)
        (loss * torch.where(y != -100, g, 0.0)).sum().backward()
        got.append((acc, hh.grad))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
