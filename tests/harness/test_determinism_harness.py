"""The GPU determinism harness (benchmarks/determinism.py, issue #17 item 6) on CPU: what makes a
row ok, and the digests it reads (the digest itself: tests/lib/test_pretrain_digest.py)."""

from __future__ import annotations

import json

from benchmarks import determinism as det
from benchmarks.e2e import RunResult


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
