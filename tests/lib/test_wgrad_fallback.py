"""relaymoe's torch stand-in for apex's ``fused_weight_gradient_mlp_cuda``: the accumulation
against float64, its refusal, apex winning when present, and megatron-core's own
``ColumnParallelLinear`` training with ``gradient_accumulation_fusion=True`` through it."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
import torch

from relaymoe.megatron import wgrad_fallback
from tests.fixtures import MEGATRON_CPU_PRELUDE, run_python

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_accumulates_grad_output_t_times_input(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 11, generator=g).to(dtype)  # (tokens, in)
    dy = torch.randn(37, 5, generator=g).to(dtype)[:, :]  # (tokens, out)
    main = torch.randn(5, 11, generator=g)  # fp32, prefilled: earlier micro-batches
    want = main.double() + dy.double().t() @ x.double()
    fn = wgrad_fallback.wgrad_gemm_accum_fp32
    fn(x, dy, main)
    tol = 1e-2 if dtype == torch.float16 else 1e-5
    assert (main.double() - want).abs().max().item() < tol


def test_strided_operands_and_half_main_grad():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(11, 40, generator=g).t()  # (40, 11), transposed layout
    dy = torch.randn(40, 10, generator=g)[:, ::2]  # (40, 5), strided columns
    main = torch.zeros(5, 11, dtype=torch.float16)
    wgrad_fallback.wgrad_gemm_accum_fp16(x.half(), dy.half(), main)
    want = dy.double().t() @ x.double()
    assert (main.double() - want).abs().max().item() < 5e-2


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"main_grad of shape \(4, 11\)"):
        wgrad_fallback.wgrad_gemm_accum_fp32(torch.ones(3, 11), torch.ones(3, 5), torch.ones(4, 11))


def test_apex_wins_when_present(monkeypatch):
    real = types.ModuleType(wgrad_fallback.MODULE)
    monkeypatch.setitem(sys.modules, wgrad_fallback.MODULE, real)
    assert wgrad_fallback.install() is False
    assert sys.modules[wgrad_fallback.MODULE] is real


SCRIPT = (
    MEGATRON_CPU_PRELUDE
    + """
from relaymoe.megatron import wgrad_fallback
import megatron.core.tensor_parallel.layers as L  # imported first: the fallback patches it
assert wgrad_fallback.install()
from megatron.core import parallel_state
parallel_state.initialize_model_parallel()
from tests.fixtures import tiny_transformer_config
cfg = tiny_transformer_config(moe=False, gradient_accumulation_fusion=True,
                              params_dtype=torch.float32)
lin = L.ColumnParallelLinear(16, 24, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                             gather_output=False)
w = lin.weight
torch.manual_seed(0)
prefill = torch.randn(24, 16)
w.main_grad = prefill.clone()
w.grad_added_to_main_grad = False
want = prefill.double()
for _ in range(2):  # two micro-batches accumulate
    x = torch.randn(5, 2, 16, requires_grad=True)
    out, _ = lin(x)
    g = torch.randn_like(out)
    out.backward(g)
    want += g.reshape(-1, 24).double().t() @ x.detach().reshape(-1, 16).double()
err = (w.main_grad.double() - want).abs().max().item()
assert err < 1e-4, err
assert w.grad_added_to_main_grad is True
print("OK")
"""
)


def test_megatron_linear_accumulates_into_main_grad_through_the_fallback():
    """In a process of its own (the fallback installs itself into ``sys.modules``), started like
    the worlds' ranks (``run_python``: Megatron imported before the script runs, as the script
    imports megatron-core's layers before installing the fallback)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = run_python(["-c", SCRIPT], cwd=ROOT, timeout=300, env=env)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
