"""moe_experts' input contract (issue #32): every input gives the oracle's answer or a clear
``ValueError`` at call time. One test per reported case, on both backends where both apply (the
Triton backend under ``TRITON_INTERPRET=1``); the random sweep is ``test_property_inputs.py``."""

from __future__ import annotations

import pytest
import torch

import relaymoe.expert_inputs as inputs_mod
from relaymoe.experts import moe_experts
from relaymoe.reference import moe_experts_reference
from relaymoe.routing import build_routing_index
from tests.fixtures import assert_close, random_problem

F32 = torch.float32


def _triton_runs() -> bool:
    from relaymoe.kernels import interpret_mode, triton_available

    return triton_available() and interpret_mode()


_NO_TRITON = "the Triton backend runs on CPU under TRITON_INTERPRET=1"
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not _triton_runs(), reason=_NO_TRITON)),
]


def _problem(seed=0, T=23, H=12, I=10, E=4, K=2, dtype=F32, kind="uniform"):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    x, w13, w2, idx, probs = random_problem(T, H, I, E, K, gen=g, kind=kind)
    dy = torch.randn(T, H, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (x, w13, w2)] + [idx, probs.to(dtype), dy.to(dtype)]


def _oracle(x, w13, w2, idx, probs, dy):
    ins = [t.detach().double().requires_grad_() for t in (x, w13, w2, probs)]
    y = moe_experts_reference(ins[0], ins[1], ins[2], idx, ins[3])
    y.backward(dy.double())
    return y.detach(), [t.grad for t in ins]


def _run(x, w13, w2, idx, probs, dy, **kw):
    ins = [t.detach().requires_grad_() for t in (x, w13, w2, probs)]  # keeps the strides
    y = moe_experts(ins[0], ins[1], ins[2], idx, ins[3], **kw)
    y.backward(dy)
    return y.detach(), [t.grad for t in ins]


def _check(got, ref, tol=2e-5):
    (y, grads), (y_ref, grads_ref) = got, ref
    assert_close("out", y, y_ref, tol)
    for name, a, b in zip(("dx", "dw13", "dw2", "dprobs"), grads, grads_ref, strict=True):
        assert_close(name, a, b, tol)


def _col_major(t):
    return t.t().contiguous().t()


# --- 1. a column-major x -----------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_column_major_x_matches_the_oracle(backend):
    x, w13, w2, idx, probs, dy = _problem(1)
    xt = _col_major(x)
    assert not xt.is_contiguous() and xt.stride() == (1, x.shape[0])
    ref = _oracle(x, w13, w2, idx, probs, dy)
    _check(_run(xt, w13, w2, idx, probs, dy, backend=backend), ref)
    _check(_run(xt, w13, w2, idx, probs, _col_major(dy), backend=backend), ref)  # and dy


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_argument_transposed_or_strided(backend):
    x, w13, w2, idx, probs, dy = _problem(2, kind="empty")
    ref = _oracle(x, w13, w2, idx, probs, dy)
    strided = dict(
        x=torch.zeros(x.shape[0], 2 * x.shape[1])[:, ::2].copy_(x),
        w13=w13.transpose(1, 2).contiguous().transpose(1, 2),
        w2=w2.transpose(0, 2).contiguous().transpose(0, 2),
        idx=_col_major(idx),
        probs=_col_major(probs),
        dy=torch.zeros(dy.shape[0], 3 * dy.shape[1])[:, 1::3].copy_(dy),
    )
    got = _run(strided["x"], strided["w13"], strided["w2"], strided["idx"], strided["probs"],
               strided["dy"], backend=backend)  # fmt: skip
    _check(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_blocks_of_wider_tensors_are_read_in_place(backend):
    """x and dy as blocks of wider buffers (unit column stride, a longer row stride, an odd
    offset): the kernels read them through their row stride, without a copy."""
    x, w13, w2, idx, probs, dy = _problem(22, H=12)
    T, H = x.shape
    xb = torch.zeros(T, H + 5)[:, 1 : H + 1].copy_(x)
    dyb = torch.zeros(T, H + 3)[:, 3 : H + 3].copy_(dy)
    _check(_run(xb, w13, w2, idx, probs, dyb, backend=backend),
           _oracle(x, w13, w2, idx, probs, dy))  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_inputs(backend):
    """Stride-0 inputs (every token the same row, every expert the same weights)."""
    x, w13, w2, idx, probs, dy = _problem(3)
    x = x[:1].expand_as(x)
    w13 = w13[:1].expand_as(w13)
    dy = dy[:1].expand_as(dy)
    _check(_run(x, w13, w2, idx, probs, dy, backend=backend), _oracle(x, w13, w2, idx, probs, dy))


# --- 2. a non-contiguous out ----------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["column_major", "column_strided", "block_of_wider"])
def test_out_in_any_layout_is_accumulated_into(backend, layout):
    x, w13, w2, idx, probs, dy = _problem(4)
    T, H = x.shape
    start = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    if layout == "column_major":
        out = _col_major(start)
    elif layout == "column_strided":
        out = torch.zeros(T, 2 * H)[:, ::2].copy_(start)
    else:
        out = torch.zeros(T, H + 3)[:, 1 : H + 1].copy_(start)
    y_ref, grads_ref = _oracle(x, w13, w2, idx, probs, dy)
    y, grads = _run(x, w13, w2, idx, probs, dy, out=out, backend=backend)
    assert_close("out", out, start.double() + y_ref, 2e-5)
    assert_close("returned", y, start.double() + y_ref, 2e-5)
    for name, a, b in zip(("dx", "dw13", "dw2", "dprobs"), grads, grads_ref, strict=True):
        assert_close(name, a, b, 2e-5)  # a view out: the gradients reach x, w13, w2, probs


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_view_of_a_buffer_that_requires_grad(backend):
    """``out`` a view of a non-leaf: the upstream gradient flows to the buffer's history and
    every input gets its own gradient."""
    x, w13, w2, idx, probs, dy = _problem(6)
    base = torch.randn(x.shape[0], 2 * x.shape[1], requires_grad=True)
    buf = base * 2.0
    y_ref, grads_ref = _oracle(x, w13, w2, idx, probs, dy)
    ins = [t.detach().requires_grad_() for t in (x, w13, w2, probs)]
    out = buf[:, ::2]
    moe_experts(ins[0], ins[1], ins[2], idx, ins[3], out=out, backend=backend)
    upstream = torch.zeros(buf.shape)
    upstream[:, ::2] = dy  # the columns out covers
    buf.backward(upstream)
    for name, a, b in zip(("dx", "dw13", "dw2", "dprobs"), (t.grad for t in ins), grads_ref,
                          strict=True):  # fmt: skip
        assert_close(name, a, b, 2e-5)
    assert torch.equal(base.grad, 2 * upstream)  # the buffer's own history: d(2*base) = 2


# --- 3. float64 on the Triton backend ----------------------------------------------------------
def test_float64_on_triton_is_refused_and_auto_keeps_it():
    x, w13, w2, idx, probs, dy = _problem(7, dtype=torch.float64)
    if _triton_runs():
        with pytest.raises(ValueError, match=r"backend='triton'.*float64.*backend='torch'"):
            moe_experts(x, w13, w2, idx, probs, backend="triton")
    y, grads = _run(x, w13, w2, idx, probs, dy, backend="auto")
    assert y.dtype == torch.float64
    _check((y, grads), _oracle(x, w13, w2, idx, probs, dy), tol=1e-12)


# --- 4. integer, bool, complex inputs -----------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_non_float_inputs_are_refused(backend, dtype):
    x, w13, w2, idx, probs, _ = _problem(8)
    conv = (lambda t: t > 0) if dtype == torch.bool else (lambda t: t.to(dtype))
    with pytest.raises(ValueError, match=rf"x has dtype {dtype}.*cast x, w13 and w2"):
        moe_experts(conv(x), conv(w13), conv(w2), idx, probs, backend=backend)
    with pytest.raises(ValueError, match=rf"topk_probs has dtype {dtype}"):
        moe_experts(x, w13, w2, idx, conv(probs), backend=backend)
    if dtype in (torch.bool, torch.complex64):
        with pytest.raises(ValueError, match="topk_idx must hold integer expert ids"):
            moe_experts(x, w13, w2, conv(idx), probs, backend=backend)


def test_float8_is_refused():
    x, w13, w2, idx, probs, _ = _problem(9)
    f8 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        moe_experts(x.to(f8), w13.to(f8), w2.to(f8), idx, probs, backend="torch")


# --- 7. a prebuilt index -----------------------------------------------------------------------
def test_index_of_another_routing_is_refused():
    x, w13, w2, idx, probs, _ = _problem(10)
    other = torch.roll(idx, 1, 0)
    assert not torch.equal(other, idx)
    with pytest.raises(ValueError, match="index holds another routing than topk_idx"):
        moe_experts(x, w13, w2, idx, probs, index=build_routing_index(other, 4), backend="torch")


def test_index_built_from_topk_idx_is_checked_without_device_work(monkeypatch):
    x, w13, w2, idx, probs, dy = _problem(11)
    index = build_routing_index(idx, 4)

    def no_compare(*a, **k):
        raise AssertionError("the index of this very tensor was compared on the device")

    monkeypatch.setattr(inputs_mod.torch, "equal", no_compare)
    y = moe_experts(x, w13, w2, idx, probs, index=index, backend="torch")
    monkeypatch.undo()
    assert_close("out", y, _oracle(x, w13, w2, idx, probs, dy)[0], 2e-5)


def test_index_of_a_copy_passes_and_of_a_modified_tensor_is_refused():
    x, w13, w2, idx, probs, dy = _problem(12)
    index = build_routing_index(idx.clone(), 4)  # another tensor, the same ids: compared
    y = moe_experts(x, w13, w2, idx, probs, index=index, backend="torch")
    assert_close("out", y, _oracle(x, w13, w2, idx, probs, dy)[0], 2e-5)
    index = build_routing_index(idx, 4)
    idx[0] = idx[0].flip(0) if idx.shape[1] > 1 else (idx[0] + 1) % 4  # in place, after
    with pytest.raises(ValueError, match="another routing"):
        moe_experts(x, w13, w2, idx, probs, index=index, backend="torch")


def test_index_argument_checks():
    x, w13, w2, idx, probs, _ = _problem(13)
    with pytest.raises(ValueError, match="index must be a RoutingIndex"):
        moe_experts(x, w13, w2, idx, probs, index=idx, backend="torch")
    with pytest.raises(ValueError, match=r"built for \(T, K\)"):
        moe_experts(x, w13, w2, idx, probs, index=build_routing_index(idx[:-1], 4))


# --- 8. a column-major topk_probs on the torch backend -----------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_column_major_probs(backend):
    x, w13, w2, idx, probs, dy = _problem(14, K=3)
    got = _run(x, w13, w2, idx, _col_major(probs), dy, backend=backend)
    _check(got, _oracle(x, w13, w2, idx, probs, dy))


# --- 9. backend="triton" where Triton cannot run -----------------------------------------------
def test_triton_without_the_interpreter_on_cpu(monkeypatch):
    import relaymoe.kernels as kernels

    monkeypatch.setattr(kernels, "interpret_mode", lambda: False)
    x, w13, w2, idx, probs, _ = _problem(15)
    with pytest.raises(ValueError, match=r"needs Triton and a CUDA device.*TRITON_INTERPRET=1"):
        moe_experts(x, w13, w2, idx, probs, backend="triton")
    with pytest.raises(ValueError, match="backend must be"):
        moe_experts(x, w13, w2, idx, probs, backend="cuda")


# --- 10. per-expert weight lists ---------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_per_expert_lists(backend):
    x, w13, w2, idx, probs, dy = _problem(16, kind="empty")
    y_ref, (dx_r, dw13_r, dw2_r, dp_r) = _oracle(x, w13, w2, idx, probs, dy)
    l13 = [w.clone().requires_grad_() for w in w13]
    l2 = [w.clone().requires_grad_() for w in w2]
    xl, pl = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y = moe_experts(xl, l13, tuple(l2), idx, pl, backend=backend)
    y.backward(dy)
    assert_close("out", y, y_ref, 2e-5)
    assert_close("dx", xl.grad, dx_r, 2e-5)
    assert_close("dprobs", pl.grad, dp_r, 2e-5)
    for e in range(4):
        assert_close(f"dw13[{e}]", l13[e].grad, dw13_r[e], 2e-5)
        assert_close(f"dw2[{e}]", l2[e].grad, dw2_r[e], 2e-5)
    with pytest.raises(ValueError, match="elements of w13 must be 2-D with one shape"):
        moe_experts(x, [w13[0], w13[1][:, :-1]], w2[:2], idx, probs)
    with pytest.raises(ValueError, match="w13 is an empty list"):
        moe_experts(x, [], w2, idx, probs)
    with pytest.raises(ValueError, match="w2 must be a tensor"):
        moe_experts(x, w13, "w2", idx, probs)


# --- out: the buffers it may not be --------------------------------------------------------------
def test_bad_out_buffers():
    x, w13, w2, idx, probs, _ = _problem(17)
    cases = [
        (torch.zeros(1, x.shape[1]).expand_as(x), "expanded tensor"),
        (x, "shares memory with x"),
        (torch.zeros_like(x, requires_grad=True), "leaf tensor that requires grad"),
        (torch.zeros_like(x, dtype=torch.float64), "out must be a"),
        (torch.zeros(x.shape[0] + 1, x.shape[1]), "out must be a"),
        ([0.0], "out must be a tensor"),
    ]
    for out, match in cases:
        with pytest.raises(ValueError, match=match):
            moe_experts(x, w13, w2, idx, probs, out=out, backend="torch")


def test_other_bad_arguments():
    x, w13, w2, idx, probs, _ = _problem(18)
    meta = torch.empty(w13.shape, device="meta")
    with pytest.raises(ValueError, match="different devices"):
        moe_experts(x, meta, w2, idx, probs)
    with pytest.raises(ValueError, match="x must be a torch.Tensor"):
        moe_experts(x.tolist(), w13, w2, idx, probs)
    with pytest.raises(ValueError, match="expert_range must be a pair of ints"):
        moe_experts(x, w13, w2, idx, probs, index=build_routing_index(idx, 4),
                    expert_range=(0.0, 4.0))  # fmt: skip
    with pytest.raises(ValueError, match="repeats an expert id"):
        moe_experts(x, w13, w2, torch.zeros_like(idx), probs)
    index = build_routing_index(idx, 4)  # any integer type names a range
    a = moe_experts(x, w13[1:3], w2[1:3], idx, probs, index=index,
                    expert_range=(torch.tensor(1), torch.tensor(3)))  # fmt: skip
    b = moe_experts(x, w13[1:3], w2[1:3], idx, probs, index=index, expert_range=[1, 3])
    assert torch.equal(a, b)


def test_contiguous_inputs_are_not_copied(monkeypatch):
    """The contiguous path pays nothing new: no ``.contiguous()`` copy of any input."""
    x, w13, w2, idx, probs, dy = _problem(19)
    copies = []
    real = torch.Tensor.contiguous

    def counting(self, *a, **k):
        if not self.is_contiguous(*a, **k):
            copies.append(tuple(self.shape))
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "contiguous", counting)
    for backend in ["torch"] + (["triton"] if _triton_runs() else []):
        _run(x, w13, w2, idx, probs, dy, backend=backend)
    assert not copies, copies


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H, I", [(0, 3), (4, 0)])  # noqa: E741
def test_zero_width_hidden_or_ffn(backend, H, I):  # noqa: E741
    x, w13, w2, idx, probs, dy = _problem(20, T=5, H=H, I=I, E=3)
    _check(_run(x, w13, w2, idx, probs, dy, backend=backend), _oracle(x, w13, w2, idx, probs, dy))


def test_ring_moe_refuses_a_hop_backend_that_cannot_run(monkeypatch):
    """ring_moe checks the hop backend in its agreement (an error code every rank raises):
    float64 on Triton, Triton on a CPU without the interpreter."""
    import relaymoe.kernels as kernels
    from relaymoe.ring import ring_moe

    x, w13, w2, idx, probs, _ = _problem(21, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"invalid input on rank 0: backend='triton'.*float64"):
        if not _triton_runs():
            monkeypatch.setattr(kernels, "interpret_mode", lambda: True)
            monkeypatch.setattr(kernels, "triton_available", lambda: True)
        ring_moe(x, w13, w2, idx, probs, backend="triton")
    monkeypatch.setattr(kernels, "interpret_mode", lambda: False)
    with pytest.raises(ValueError, match=r"rank 0: backend='triton' needs Triton and a CUDA"):
        ring_moe(x.float(), w13.float(), w2.float(), idx, probs.float(), backend="triton")
    y = ring_moe(x, w13, w2, idx.to(torch.uint32), probs, backend="auto")  # float64 kept
    assert y.dtype == torch.float64
