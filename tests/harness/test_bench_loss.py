"""benchmarks/bench_loss.py in its tiny CPU mode: every provider's row (Liger's skipped without
CUDA), the error fields against Megatron and the fp32 reference, no process group left."""

from __future__ import annotations

import json

import torch.distributed as dist


def test_bench_loss_smoke(tmp_path, capsys):
    from benchmarks import bench_loss

    out = tmp_path / "loss.jsonl"
    args = ["--smoke", "--out", str(out), "--providers", *bench_loss.PROVIDERS]
    assert bench_loss.main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["provider"] for r in rows} == {*bench_loss.RELAYMOE, "megatron"}
    assert "liger skipped: needs CUDA" in capsys.readouterr().out
    for r in rows:
        assert r["bench"] == "loss" and r["shape"] == "smoke" and r["ms_fwd_bwd"] > 0
        assert r["err_dweight_fp32"] < 1e-2 and r["transient_MiB"] is None  # no CUDA: no memory
        if r["provider"] != "megatron":
            assert r["err_dweight"] < bench_loss.AGREE_BOUND
    by = {r["provider"]: r for r in rows}
    assert by["relaymoe_accumulate_miss"]["expected_grad"] == "0.8x"
    assert by["relaymoe_accumulate"]["wgrad"] == "accumulate"
    assert by["relaymoe_accumulate_noguess"]["wgrad"] == "recompute"
    assert not dist.is_initialized()  # the harness leaves no process group behind


def test_the_proposed_chunk_keeps_the_transient_within_512_mib():
    from benchmarks import bench_loss
    from relaymoe.lossmodel import fused_loss_bytes

    c = bench_loss.fit_chunk(151936)
    assert c == 1664
    model = fused_loss_bytes(65536, 4096, 151936, chunk_tokens=c, wgrad="accumulate",
                             impl="triton")  # fmt: skip
    assert model.transient <= (512 - bench_loss.FIT_MARGIN_MiB) * 2**20
    wider = fused_loss_bytes(65536, 4096, 151936, chunk_tokens=c + 128, wgrad="accumulate",
                             impl="triton")  # fmt: skip
    assert wider.transient > (512 - bench_loss.FIT_MARGIN_MiB) * 2**20
