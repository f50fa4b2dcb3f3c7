"""benchmarks/bench_loss.py in its tiny CPU mode: both providers' rows, no process group left."""

from __future__ import annotations

import json

import torch.distributed as dist


def test_bench_loss_smoke(tmp_path):
    from benchmarks import bench_loss

    out = tmp_path / "loss.jsonl"
    assert bench_loss.main(["--smoke", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["provider"] for r in rows} == {"relaymoe", "megatron"}
    for r in rows:
        assert r["bench"] == "loss" and r["shape"] == "smoke" and r["ms_fwd_bwd"] > 0
    assert not dist.is_initialized()  # the harness leaves no process group behind
