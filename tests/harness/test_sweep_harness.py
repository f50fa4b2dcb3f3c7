"""benchmarks/lab/sweep_kernels.py on a tiny problem under the Triton interpreter (fp32): every
variant runs, and each Triton configuration agrees with the grouped-GEMM reference (``err``), so
a device run cannot spend its time on a harness that breaks."""

from __future__ import annotations

import pytest
import torch

from benchmarks.lab import sweep_kernels
from relaymoe.kernels import interpret_mode
from tests.fixtures import use_env

pytestmark = pytest.mark.skipif(
    not interpret_mode() or not hasattr(torch, "_grouped_mm"),
    reason="runs the kernels under TRITON_INTERPRET=1 with torch's CPU grouped GEMM",
)


def test_sweep_rows_cover_every_variant_and_agree(monkeypatch):
    monkeypatch.setattr(sweep_kernels, "bench_ms", lambda fn, **_: (fn(), 1.0)[1])
    # 256-column chunks: two for H=264, the second 8 columns wide (H just past one chunk: the
    # interpreter's time grows with H's tiles)
    kernels = use_env(monkeypatch, RELAYMOE_PAIR_BUFFER_MIB="0").kernels
    # two configurations (the kernels' own tile edges are tested in tests/lib/test_kernels.py):
    # tiles as large as still cross the edges of H (264 = 8*32 + 8 = 4*64 + 8) or I (24)
    cfgs = [
        {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
        {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2},
    ]
    rows = sweep_kernels.sweep("tiny", cfgs, dims=(37, 5, 2, 264, 24), device="cpu",
                               dtype=torch.float32, kernels=kernels)  # fmt: skip
    assert not [r for r in rows if "error" in r]
    seen = {(r["kernel"], r["variant"]) for r in rows}
    variants = (
        "gmm",
        "gmm_gathers",
        "gmm_gemms",
        "gmm_copies",
        "triton_tma0",
        "triton_tma1",
        "triton_contiguous_tma1",
    )
    for k in ("dw2", "dw13"):
        for v in variants:
            assert (k, v) in seen, (k, v)
    chunked = [r for r in rows if r["variant"] == "gmm_gathers"]
    assert all(r["config"]["chunks"] == 2 for r in chunked)
    checked = [r for r in rows if r["variant"] != "gmm" and r["err"] is not None]
    assert len(checked) == 2 * (2 * len(cfgs) + 2)
    assert all(r["err"] < 1e-5 for r in checked), checked


def test_accumulate_sweep_adds_into_main_grad_in_every_variant(monkeypatch):
    """``--kernels accumulate``: each configuration, TMA off/on, adds the same weight gradient
    into the fp32 buffer (``err`` against c's start plus the grouped-GEMM product, experts in
    reverse order)."""
    monkeypatch.setattr(sweep_kernels, "bench_ms", lambda fn, **_: (fn(), 1.0)[1])
    cfg = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2}
    cfgs = [cfg, {**cfg, "PRELOAD_C": True}]  # the output tile read after the loop, or before
    rows = sweep_kernels.sweep_accumulate("tiny", 37, cfgs, tmas=("off", "on"), dims=(5, 2, 40, 24),
                                          device="cpu", dtype=torch.float32)  # fmt: skip
    assert not [r for r in rows if "error" in r], rows
    assert {(r["kernel"], r["variant"]) for r in rows} == {
        (k, f"accumulate_tma_{t}") for k in ("dw2", "dw13") for t in ("off", "on")
    }
    assert len(rows) == 8
    assert all(any(r["config"].get("PRELOAD_C") for r in rows if r["kernel"] == k)
               for k in ("dw2", "dw13"))  # fmt: skip
    assert all(r["err"] < 1e-5 for r in rows), rows


def test_row_sweep_runs_every_configuration(monkeypatch):
    monkeypatch.setattr(sweep_kernels, "bench_ms", lambda fn, **_: (fn(), 1.0)[1])
    cfgs = {
        k: [
            {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2},
            {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
        ]
        for k in ("up_swiglu", "down_bwd")
    }
    rows = sweep_kernels.sweep_rows("tiny", cfgs, dims=(37, 5, 2, 48, 24), device="cpu",
                                    dtype=torch.float32)  # fmt: skip
    assert [r["kernel"] for r in rows] == ["up_swiglu"] * 2 + ["down_bwd"] * 2
    assert all("error" not in r and r["err"] < 1e-5 for r in rows), rows


def test_combine_sweep_runs_every_configuration(monkeypatch):
    monkeypatch.setattr(sweep_kernels, "bench_ms", lambda fn, **_: (fn(), 1.0)[1])
    cfgs = [(16, 16, 4), (8, 32, 4), (32, 16, 4)]
    rows = sweep_kernels.sweep_combine("tiny", cfgs, dims=(37, 5, 3, 96, 24), device="cpu",
                                       dtype=torch.float32)  # fmt: skip
    assert [r["config"] for r in rows] == [list(c) for c in cfgs]
    assert all("error" not in r and r["err"] < 1e-6 for r in rows), rows
