"""The GPU determinism harness (benchmarks/determinism.py, issue #17 item 6) and the pretrain
entry point's weight digest, on CPU: what makes a row ok, and what the digest can tell apart."""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks import determinism as det
from benchmarks.e2e import RunResult
from relaymoe.megatron.pretrain import _extra_args, weights_digest


def _modules(seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return [torch.nn.Linear(5, 3).to(torch.bfloat16), torch.nn.Sequential(torch.nn.Linear(3, 2))]


def test_weights_digest_sees_one_bit_a_dtype_and_the_order():
    ref, count = weights_digest(_modules())
    assert count == 4 and ref == weights_digest(_modules())[0]  # same values, same digest
    mods = _modules()
    with torch.no_grad():
        flat = mods[0].weight.view(torch.int16).view(-1)
        flat[3] ^= 1  # one bit of one bf16 weight
    assert weights_digest(mods)[0] != ref
    mods = _modules()
    mods[1].float().double()  # same values, another dtype
    assert weights_digest(mods)[0] != ref
    assert weights_digest(list(reversed(_modules())))[0] != ref


def test_pretrain_parses_the_digest_flag():
    a = _extra_args(argparse.ArgumentParser()).parse_args(
        ["--relaymoe-report", "r.jsonl", "--relaymoe-weights-digest"]
    )
    assert a.relaymoe_report == "r.jsonl" and a.relaymoe_weights_digest is True


def _run(losses, rc=0):
    steps = [{"loss": x} for x in losses]
    return RunResult("ring", rc, steps=steps, label="r", seconds=10.0, command="torchrun x")


def test_row_ok_only_when_every_loss_and_every_rank_digest_match():
    loss = [2.0 - 0.01 * i for i in range(20)]
    same = ({0: "a", 1: "b"}, {0: "a", 1: "b"})
    kw = dict(steps=20, gpus=2, transport="nccl", settings={"seed": 1})
    row = det.determinism_row(_run(loss), _run(loss), same, **kw)
    assert row["ok"] and row["losses_identical"] and row["weights_identical"]
    assert row["max_abs_loss_diff"] == 0.0 and row["bench"] == "determinism"
    off = loss[:7] + [loss[7] + 2**-20] + loss[8:]
    row = det.determinism_row(_run(loss), _run(off), same, **kw)
    assert not row["ok"] and not row["losses_identical"] and row["weights_identical"]
    row = det.determinism_row(_run(loss), _run(loss), ({0: "a", 1: "b"}, {0: "a", 1: "c"}), **kw)
    assert not row["ok"] and not row["weights_identical"]
    row = det.determinism_row(_run(loss), _run(loss), ({0: "a"}, {0: "a"}), **kw)
    assert not row["ok"] and "digests from 1 and 1 of 2 ranks" in row["failure"]
    row = det.determinism_row(_run(loss), _run(loss[:12], rc=1), same, **kw)
    assert not row["ok"] and "exit status 1" in row["failure"] and row["steps"] == 12


def test_digests_are_read_per_rank(tmp_path):
    report = tmp_path / "steps.jsonl"
    for r, h in ((0, "x"), (1, "y")):
        (tmp_path / f"steps.jsonl.weights.rank{r}.json").write_text(
            json.dumps({"step": 20, "rank": r, "sha256": h, "parameters": 9})
        )
    assert det.read_digests(report) == {0: "x", 1: "y"}


def test_dry_run_asks_each_transport_for_digests(capsys):
    assert det.main(["--dry-run", "--transports", "nccl"]) == 0
    out = capsys.readouterr().out
    assert "--relaymoe-transport nccl" in out and "--relaymoe-weights-digest" in out
    assert "--moe-token-dispatcher-type ring" in out
