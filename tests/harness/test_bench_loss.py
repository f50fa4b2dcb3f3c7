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


def test_relaymoe_providers_run_the_librarys_default_chunk():
    """Each relaymoe provider runs ``lossmodel.default_chunk_tokens`` for its mode (the impl on
    this CPU: torch): the accumulate modes within the 512 MiB budget, the default mode its
    own; no provider of another chunk."""
    import torch

    from benchmarks import bench_loss
    from relaymoe.lossmodel import default_chunk_tokens

    tokens, vocab = 65536, 151936
    labels = torch.zeros(tokens, dtype=torch.long)
    mask = torch.ones(tokens, dtype=torch.bool)
    made, _ = bench_loss.make_providers(bench_loss.RELAYMOE, labels, mask, tokens, vocab,
                                    torch.bfloat16)  # fmt: skip
    chunks = {k: p.chunk_tokens for k, p in made.items()}
    assert chunks == {
        "relaymoe": 2304,
        "relaymoe_torchimpl": 2304,
        "relaymoe_accumulate": 512,
        "relaymoe_accumulate_miss": 512,
        "relaymoe_accumulate_noguess": 512,
    }
    assert bench_loss.TRANSIENT_BUDGET_MiB == 512
    assert chunks["relaymoe_accumulate"] == default_chunk_tokens(
        tokens, vocab, wgrad="accumulate", impl="torch")  # fmt: skip
