"""Every expert MLP kind with and without biases on the GPU: the Triton backend in bf16 against
the float64 oracle at the qwen3 widths (H=2048, I=768, E=16, K=8, T=4096), the output and every
gradient, with the Gluon kernels on (the default: SwiGLU without bias takes the Gluon
up-projection, everything takes the Gluon dy-gather of the backward) and off, and the
``torch._grouped_mm`` path (``rows_gather="copy"``).

Skipped without CUDA. The oracle reads the bf16 values the kernels read (upcast to float64), so
the bound measures the kernels' own rounding, not the inputs': from the original float64 values
a kink (relu at 0, the clamp at +-limit) sees about 1 in 1000 elements of h on its other side,
and a gradient that jumps there (relu's 0 -> 1) moves by a few percent (simulated: about 4% of
dh at these widths). Bound 1e-2 (CONTRIBUTING.md's bf16 bound) everywhere but for a clamped
activation's h-side gradients (dx, dw13, db13): its backward recomputes the activation from h
stored in bf16, whose spacing near the limit 7 is 2^-5, so values within half of it flip between
clamped and passed (simulated: about 4% of dh, dw13, db13 and dx); ``CLAMP_BOUND`` (twice
that) holds those. Configs pinned
(``RELAYMOE_AUTOTUNE=0``), as in ``test_kernels_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from relaymoe.activation import SWIGLU
from relaymoe.experts import moe_experts
from relaymoe.kernels import select
from relaymoe.options import KernelOptions
from relaymoe.reference import moe_experts_reference
from tests.fixtures import (
    BIASES,
    EXPERT_ACTIVATIONS,
    expert_activation,
    random_routing,
    rel_err,
    use_env,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BF16_BOUND = 1e-2
CLAMP_BOUND = 8e-2
SHAPE = (4096, 2048, 768, 16, 8)  # T, H, I, E, K: a qwen3-30b-a3b layer's widths
PARAMS = ("x", "w13", "w2", "probs", "b13", "b2")


def _problem(name: str, bias: str, seed: int) -> dict:
    """``tests.fixtures.activation_problem``'s problem drawn on the GPU (at these widths the
    host's generator is slow), its float values rounded to bf16 once: ``x``, ``w13`` (E, J, H),
    ``w2``, ``probs``, ``b13`` / ``b2`` (None unless ``bias`` names them), ``dy``; ``idx``;
    ``act``. With a clamp the pre-activations have a standard deviation of about the limit."""
    act = expert_activation(name)
    t, h, i, e, k = SHAPE
    rows = act.fc1_rows(i)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = {"generator": gen, "dtype": torch.float64, "device": "cuda"}
    pb = dict(
        x=torch.randn(t, h, **kw),
        w13=torch.randn(e, rows, h, **kw) / h**0.5 * (act.limit or 1.0),
        w2=torch.randn(e, h, i, **kw) / i**0.5,
        probs=torch.rand(t, k, **kw),
        b13=0.5 * torch.randn(e, rows, **kw) if bias in ("b13", "both") else None,
        b2=0.5 * torch.randn(e, h, **kw) if bias in ("b2", "both") else None,
        dy=torch.randn(t, h, **kw),
    )
    pb = {n: None if v is None else v.to(torch.bfloat16) for n, v in pb.items()}
    pb["idx"] = random_routing(t, e, k, gen=torch.Generator().manual_seed(seed)).cuda()
    pb["act"] = act
    return pb


def _run(fn, pb, dtype, **kw) -> dict:
    """Output and gradients of ``fn`` on ``pb``'s values cast to ``dtype``."""
    leaves = {n: pb[n].to(dtype).clone().requires_grad_() for n in PARAMS if pb[n] is not None}
    out = fn(leaves["x"], leaves["w13"], leaves["w2"], pb["idx"], leaves["probs"],
             activation=pb["act"], b13=leaves.get("b13"), b2=leaves.get("b2"), **kw)  # fmt: skip
    out.backward(pb["dy"].to(dtype))
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def _assert_matches_oracle(pb, **kw) -> None:
    got = _run(lambda *a, **k: moe_experts(*a, backend="triton", **kw, **k), pb, torch.bfloat16)
    ref = _run(moe_experts_reference, pb, torch.float64)
    assert got.keys() == ref.keys()
    for name in ref:
        clamp_side = pb["act"].limit is not None and name in ("dx", "dw13", "db13")
        bound = CLAMP_BOUND if clamp_side else BF16_BOUND
        assert torch.isfinite(got[name]).all(), name
        assert rel_err(got[name], ref[name]) < bound, (name, rel_err(got[name], ref[name]))


COMBOS = [(name, bias) for name in EXPERT_ACTIVATIONS for bias in BIASES]


@pytest.mark.parametrize("gluon", ["auto", "off"])
@pytest.mark.parametrize("name, bias", COMBOS, ids=[f"{n}-{b}" for n, b in COMBOS])
def test_bf16_matches_float64_oracle(name, bias, gluon, monkeypatch):
    """Each activation x bias, with ``gather_ws`` on (default) and off; the recompute mode
    alternates between the combos."""
    config = use_env(monkeypatch, RELAYMOE_AUTOTUNE="0")
    i = COMBOS.index((name, bias))
    pb = _problem(name, bias, seed=300 + i)
    kernels = config.replace(kernels={"gather_ws": gluon}).kernels
    _assert_matches_oracle(pb, recompute="act" if i % 2 else "fc1", kernels=kernels)


@pytest.mark.parametrize("recompute", ["act", "fc1"])
@pytest.mark.parametrize("name", ["geglu", "gelu", "clamped_swiglu", "squared_relu"])
def test_rows_gather_copy_matches_oracle(name, recompute, monkeypatch):
    """h made by ``torch._grouped_mm`` over one gathered copy, the fc1 bias and the activation
    in the memory pass (in the forward and the fc1 recompute), both biases given."""
    config = use_env(monkeypatch, RELAYMOE_AUTOTUNE="0")
    pb = _problem(name, "both", seed=400 + len(name))
    kernels = config.replace(kernels={"rows_gather": "copy"}).kernels
    _assert_matches_oracle(pb, recompute=recompute, kernels=kernels)


def test_gluon_up_projection_takes_swiglu_without_bias_only():
    """On sm90 the Gluon up-projection takes SwiGLU without bias (and h alone for a gated fc1
    without bias); any other activation, or a bias, goes to the Triton kernel."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on sm90")
    x = torch.zeros(64, 256, dtype=torch.bfloat16, device="cuda")
    w13 = torch.zeros(2, 128, 256, dtype=torch.bfloat16, device="cuda")
    h = torch.zeros(64, 128, dtype=torch.bfloat16, device="cuda")
    a = torch.zeros(64, 64, dtype=torch.bfloat16, device="cuda")
    b13 = torch.zeros(2, 128, dtype=torch.bfloat16, device="cuda")
    k = KernelOptions()
    module, _ = select.gather_ws_module()
    assert select.gather_ws_for("up_swiglu", x, w13, h, a, k=k, activation=SWIGLU) is module
    geglu = expert_activation("geglu")
    assert select.gather_ws_for("up_swiglu", x, w13, h, None, k=k, activation=geglu) is module
    assert select.gather_ws_for("up_swiglu", x, w13, h, a, k=k, activation=geglu) is None
    assert select.gather_ws_for("up_swiglu", x, w13, h, a, k=k, bias=b13) is None
