"""The regeneration harness of the shipped kernel configurations (benchmarks/tune_kernels.py):
its shapes, the winners it reads from the autotuners' caches, and the table it merges, which the
library reads (relaymoe/kernels/tuned.py, tested in tests/lib/test_tuned_configs.py)."""

from __future__ import annotations

import json

import pytest
import torch

from relaymoe.kernels import grouped, tuned
from tests.lib.test_tuned_configs import CFG


def test_tune_harness_shapes_winners_and_merge(monkeypatch, tmp_path):
    import triton

    from benchmarks import tune_kernels as tk

    got = tk.shapes(["qwen3_30b_a3b"], [1, 2, 3, 16])
    assert [(s["ep"], s["El"]) for s in got] == [(1, 128), (2, 64), (16, 8)]  # 3 does not divide
    assert {(s["H"], s["I"], s["K"]) for s in got} == {(2048, 768, 8)}
    assert tk.parse_extra("H2048,I2048,E64,K8; H256,I128,E4,K2") == [
        dict(config="extra", ep=1, H=2048, I=2048, El=64, K=8),
        dict(config="extra", ep=1, H=256, I=128, El=4, K=2)]  # fmt: skip
    with pytest.raises(SystemExit, match="H<int>,I<int>,E<int>,K<int>"):
        tk.parse_extra("H2048,I2048,E64")
    # the autotuners' caches: key values, then the tensor dtypes Triton appends
    cfg = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4)
    for tuner in (grouped.up.up_tuned, grouped.weight_grads.wgrad_tuned):
        monkeypatch.setattr(tuner, "cache", {})
    monkeypatch.setattr(grouped.rows.rows_tuned, "cache", {
        (768, 2048, 64, True, "torch.bfloat16", "torch.bfloat16", "torch.int32"): cfg})  # fmt: skip
    found = tk.winners()
    b = tuned.bucket({"N": 768, "K": 2048, "n_experts": 64, "A_GATHER": True}, torch.bfloat16)
    assert found == {"rows_gemm": {b: {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64,
                                       "num_warps": 4, "num_stages": 4}}}  # fmt: skip
    old = {"version": 1, "gpus": {"NVIDIA H100 80GB HBM3": {"wgrad": {"x": CFG}},
                                  "NVIDIA H200": {"rows_gemm": {"y": CFG}}}}  # fmt: skip
    new = tk.merge(old, "NVIDIA H200", found, {"commit": "abc"})
    assert new["gpus"]["NVIDIA H100 80GB HBM3"] == {"wgrad": {"x": CFG}}  # other GPUs stay
    assert set(new["gpus"]["NVIDIA H200"]["rows_gemm"]) == {"y", b}
    assert new["provenance"]["NVIDIA H200"] == {"commit": "abc"}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(new))
    tuned.load_table.cache_clear()
    assert tuned.load_table(str(path)) == new  # what the harness writes, the library reads
    tuned.load_table.cache_clear()
