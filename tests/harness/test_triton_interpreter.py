"""tests/triton_interpreter.py, the suite's caches of the Triton interpreter's bookkeeping: with
them a kernel computes bitwise what the interpreter as shipped computes, with a fraction of the
patching and without the overflow sanitizer's recomputation that nothing reads (its comparisons
are counted); on a Triton they were not written for they change nothing."""

from __future__ import annotations

import torch

from relaymoe.kernels import interpret_mode
from tests import triton_interpreter
from tests.fixtures import random_problem


def _run():
    """Forward and backward of the fused experts on the Triton kernels (odd sizes, an empty
    expert): every tensor they produce."""
    from relaymoe.experts import moe_experts

    x, w13, w2, idx, probs = (
        v.float() if v.is_floating_point() else v
        for v in random_problem(19, 24, 12, 5, 2, gen=torch.Generator().manual_seed(3),
                                kind="empty")
    )  # fmt: skip
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, probs)]
    out = moe_experts(leaves[0], leaves[1], leaves[2], idx, leaves[3], backend="triton")
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)))
    return [out.detach(), *(t.grad for t in leaves)]


def test_cached_interpreter_computes_what_the_shipped_one_does(monkeypatch):
    import inspect

    import triton.runtime.interpreter as interp
    from triton.language.semantic import TritonSemantic

    if not triton_interpreter.supported():  # another Triton: nothing installed, nothing changed
        assert not triton_interpreter.install() and not triton_interpreter._installed
        return
    assert interpret_mode()
    looks = []  # the interpreter's look for builtins to patch (most of its bookkeeping's time)
    real = inspect.getmembers
    monkeypatch.setattr(inspect, "getmembers", lambda *a: (looks.append(1), real(*a))[1])
    # `<=` of two tensors: the kernels' own, and the sanitizer's range check of every integer op
    compares = []
    real_le = TritonSemantic.less_equal
    monkeypatch.setattr(TritonSemantic, "less_equal",
                        lambda *a: (compares.append(1), real_le(*a))[1])  # fmt: skip
    assert triton_interpreter.install()  # the conftest's, or now
    cached = _run()
    n_cached, le_cached = len(looks), len(compares)
    triton_interpreter.uninstall()
    try:
        assert interp._patch_lang.__module__ == interp.__name__  # as shipped
        looks.clear()
        compares.clear()
        shipped = _run()
    finally:
        assert triton_interpreter.install()
    assert all(torch.equal(a, b) for a, b in zip(cached, shipped, strict=True))
    assert 10 * n_cached < len(looks), (n_cached, len(looks))
    assert 2 * le_cached < len(compares), (le_cached, len(compares))
