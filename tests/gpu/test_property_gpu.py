"""The GPU twin of ``tests/lib/test_property_inputs.py``: the same random layouts, dtypes and shapes
on CUDA, bf16 included, through the compiled Triton kernels (``moe_experts``, the loss's row
kernels), the ring on one GPU and, with two GPUs, over NCCL. Each case matches the float64
oracle within its dtype's bound or raises a ``ValueError`` from relaymoe.

Skipped without CUDA; run by ``scripts/gpu_suite.sh``. Kernels pinned to their first config
(``RELAYMOE_AUTOTUNE=0``, read into the ``KernelOptions`` every case is passed): correctness
does not depend on it, and tuning every shape would compile for minutes.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures import run_scenarios, use_env
from tests.lib import property_inputs as P

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture
def first_config(monkeypatch):
    """The ``KernelOptions`` of ``RELAYMOE_AUTOTUNE=0``: each kernel's first config."""
    return use_env(monkeypatch, RELAYMOE_AUTOTUNE="0").kernels


def _first_config_kernels():
    """The same, in a spawned rank (no fixture there): what the environment's entry point would
    hand down with ``RELAYMOE_AUTOTUNE=0``."""
    from relaymoe.options import from_env

    return from_env({"RELAYMOE_AUTOTUNE": "0"}).kernels


# (backend, dtypes, cases). The compiled Triton kernels one float dtype a test: on a cold cache
# each case's layouts, dtypes and sizes of 1 are new specializations (2-50 s a case at first,
# 1x H100), and 200 Triton cases of every dtype in one test outlasted 500 s. A dtype a test
# names the dtype that fails; 50 cases each hold 33 valid ones and 17 refusals.
MOE_DRAWS = [
    ("triton", (torch.bfloat16,), 50),
    ("triton", (torch.float16,), 50),
    ("triton", (torch.float32,), 50),
    ("torch", P.FLOATS, 200),
]


@pytest.mark.parametrize(("backend", "dtypes", "n"), MOE_DRAWS,
                         ids=[f"{b}-{'-'.join(map(str, d)) if len(d) == 1 else 'all'}"
                              for b, d, _ in MOE_DRAWS])  # fmt: skip
def test_moe_experts_cuda(backend, dtypes, n, first_config):
    cases = P.moe_cases(n, seed=21, backends=(backend,), dtypes=dtypes)
    tally = P.tally_cases(lambda c: P.run_moe_case(c, "cuda", kernels=first_config), cases)
    assert tally["valid"] >= n // 3 and tally["refused"] >= n // 20, tally


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_linear_cross_entropy_cuda(impl):
    n = 150
    cases = P.loss_cases(n, seed=22, impls=(impl,))
    tally = P.tally_cases(lambda c: P.run_loss_case(c, "cuda"), cases)
    assert tally["valid"] >= n // 2 and tally["refused"] >= n // 20, tally


def test_ring_moe_one_gpu(first_config):
    n = 40
    cases = P.ring_cases(n, seed=23, world=1, backends=("auto", "triton"))
    tally = P.tally_cases(
        lambda c: P.run_ring_case(c, 0, 1, None, device="cuda", kernels=first_config), cases
    )
    assert tally["valid"] >= n // 3, tally


def _ring_nccl(rank, world, group):
    cases = P.ring_cases(24, seed=24, world=world, backends=("auto", "triton"))
    kernels = _first_config_kernels()
    tally = P.tally_cases(
        lambda c: P.run_ring_case(c, rank, world, group, device=f"cuda:{rank}", kernels=kernels),
        cases,
    )
    assert tally["valid"] >= len(cases) // 3, tally


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ring_moe_nccl_two_gpus():
    run_scenarios([_ring_nccl], 2, timeout=600, backend="nccl")
