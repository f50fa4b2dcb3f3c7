"""The routing-drift soak harness (benchmarks/soak.py, soak_pretrain.py) without a GPU."""

from __future__ import annotations

import pytest

from benchmarks import soak, soak_pretrain
from benchmarks.e2e import RunResult


def test_drift_is_a_triangle_wave_on_rank_zeros_experts():
    assert [soak_pretrain.drift(s, 8) for s in range(9)] == [0, 0.25, 0.5, 0.75, 1, 0.75, 0.5,
                                                             0.25, 0]  # fmt: skip
    assert soak_pretrain.drift_bias(0, 8, 2, 100, 12.0) == [0.0] * 8
    assert soak_pretrain.drift_bias(50, 8, 2, 100, 12.0) == [12.0] * 4 + [0.0] * 4
    assert soak_pretrain.drift_bias(25, 6, 3, 100, 4.0) == [2.0, 2.0] + [0.0] * 4


def _lines(allocs, ws=(0,)):
    return [{"step": s, "allocated_MiB": a, "workspace_bytes": ws[min(s, len(ws) - 1)]}
            for s, a in enumerate(allocs)]  # fmt: skip


def test_memory_stats_growth_past_warmup_and_collective_workspace():
    flat = {0: _lines([50, 100, 100, 100.5]), 1: _lines([60, 100, 100, 100])}
    got = soak.memory_stats(flat, warmup=1)
    assert got["peak_growth_pct"] == pytest.approx(0.5) and got["workspace_collective"]
    grew = {0: _lines([100, 100, 103]), 1: _lines([100, 100, 100])}
    assert soak.memory_stats(grew, warmup=1)["peak_growth_pct"] == pytest.approx(3.0)
    # rank 1 grew its workspace at step 1 alone: not collective
    apart = {0: _lines([1, 1, 1], ws=(0, 2, 2)), 1: _lines([1, 1, 1], ws=(0, 0, 2))}
    assert soak.memory_stats(apart, warmup=0)["workspace_collective"] is False
    together = {0: _lines([1, 1, 1], ws=(0, 2, 2)), 1: _lines([1, 1, 1], ws=(0, 2, 2))}
    got = soak.memory_stats(together, warmup=0)
    assert got["workspace_collective"] is True and got["workspace_bytes_final"] == 2
    short = {0: _lines([1, 1, 1]), 1: _lines([1, 1])}  # a rank that logged fewer steps
    assert soak.memory_stats(short, warmup=0)["workspace_collective"] is False


def _run(d, losses, rc=0):
    return RunResult(d, rc, steps=[{"loss": x} for x in losses], seconds=1.0)


def test_rows_say_ok_only_when_every_check_holds():
    steps = 4
    logs = {k: {0: _lines([1, 1, 1, 1]), 1: _lines([1, 1, 1, 1])} for k in ("ring", "alltoall")}
    results = {"ring": _run("ring", [5, 4, 3, 2]), "alltoall": _run("alltoall", [5, 4, 3.1, 2]),
               "alltoall_repeat": _run("alltoall", [5, 4.1, 3, 2])}  # fmt: skip
    rows = soak.soak_rows(results, logs, steps=steps, warmup=1, settings={"period": 2})
    assert [r["provider"] for r in rows] == ["relaymoe_ring", "mcore_alltoall"]
    assert all(r["ok"] and r["bench"] == "soak" and r["period"] == 2 for r in rows)
    assert rows[0]["max_abs_loss_diff_vs_other"] == pytest.approx(0.1)
    # the ring drifts away from alltoall by more than twice the noise: not ok
    results["ring"] = _run("ring", [5, 4, 3, 3])
    assert not any(r["ok"] for r in soak.soak_rows(results, logs, steps=steps, warmup=1,
                                                    settings={}))  # fmt: skip
    # memory growth past the limit, or a failed run
    results["ring"] = _run("ring", [5, 4, 3, 2])
    logs["ring"] = {0: _lines([1, 1, 1, 1.5]), 1: _lines([1, 1, 1, 1])}
    assert soak.soak_rows(results, logs, steps=steps, warmup=1, settings={})[0]["ok"] is False
    results["ring"] = _run("ring", [5, 4], rc=1)
    row = soak.soak_rows(results, logs, steps=steps, warmup=1, settings={})[0]
    assert row["ok"] is False and row["failure"] == "exit status 1"


def test_dry_run_prints_three_runs_with_one_difference(capsys):
    assert soak.main(["--dry-run", "--steps", "20", "--warmup", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    labels = [x for x in out if x.startswith("# ")]
    assert labels == ["# ring", "# alltoall", "# alltoall_repeat"]
    ring, a2a, rep = (out[out.index(x) + 1] for x in labels)
    assert a2a == rep and "--moe-token-dispatcher-type ring" in ring and "--train-iters 20" in ring
    with pytest.raises(SystemExit):
        soak.main(["--dry-run", "--steps", "10", "--warmup", "10"])
