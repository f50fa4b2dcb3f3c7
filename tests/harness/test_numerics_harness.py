"""benchmarks/numerics.py: the ring's error against the float64 oracle over spawned gloo worlds.

One world of 2 with tiny shapes (seconds): in fp64 every mode matches the oracle to rounding
(so the harness slices, gathers and orders ranks, experts and gradients right), in bf16 every
error sits at bf16's level (so the dtype really is bf16 and the oracle really is float64); the
written rows carry the keys of issue #17 and the commit. Plus the error and summary arithmetic.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import numerics as nm

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"bench", "ep", "mode", "dtype", "routing", "shape", "seed", "commit", "command",
            "date", "relaymoe_tree", *(f"rel_err_{m}" for m in nm.METRICS)}  # fmt: skip


def test_errors_of_known_perturbations():
    g = torch.Generator().manual_seed(0)
    ref = {k: torch.randn(5, 7, generator=g, dtype=torch.float64) for k in ("out", "dx", "dprobs")}
    ref["dw13"] = torch.randn(2, 6, 7, generator=g, dtype=torch.float64)
    ref["dw2"] = torch.randn(2, 7, 3, generator=g, dtype=torch.float64)
    got = {k: v * (1 + 1e-3) for k, v in ref.items()}
    got["dw2"] = ref["dw2"].clone()  # exact: dw mixes 1e-3 on w13 with 0 on w2
    err = nm.errors(got, ref)
    for k in ("out", "dx", "dprobs", "dw13"):
        assert err[f"rel_err_{k}"] == pytest.approx(1e-3, rel=1e-9)
    assert err["rel_err_dw2"] == 0
    n13, n2 = ref["dw13"].norm(), ref["dw2"].norm()
    want = 1e-3 * n13 / (n13**2 + n2**2).sqrt()
    assert err["rel_err_dw"] == pytest.approx(want.item(), rel=1e-9)
    got["dx"][0, 0] = math.nan
    assert nm.errors(got, ref)["rel_err_dx"] == math.inf


def test_summary_means_and_ratio_flag():
    def row(mode, seed, scale):
        return dict(ep=4, routing="uniform", dtype="bf16", mode=mode, seed=seed,
                    **{f"rel_err_{m}": scale * (1 + seed) for m in nm.METRICS})  # fmt: skip

    rows = [row("alltoall", 0, 1.0), row("alltoall", 1, 1.0), row("expert", 0, 1.5),
            row("expert", 1, 1.5), row("token", 0, 2.5), row("one_device", 0, 1.0)]  # fmt: skip
    means, ratios = nm.summarize(rows)
    by = {m["mode"]: m for m in means}
    assert by["alltoall"]["dw"] == pytest.approx(1.5) and by["alltoall"]["seeds"] == 2
    rat = {r["mode"]: r for r in ratios}
    assert set(rat) == {"expert/alltoall", "token/alltoall"}  # one_device is not a ring mode
    assert rat["expert/alltoall"]["dw"] == pytest.approx(1.5) and rat["expert/alltoall"]["ok"]
    # token: one seed of 2.5 against the mean 1.5 of the all-to-all's two
    assert rat["token/alltoall"]["max_grad_ratio"] == pytest.approx(2.5 / 1.5)
    rows.append(row("token", 1, 4.0))  # mean (2.5 + 8) / 2 = 5.25 vs 1.5: past 2x
    assert not {r["mode"]: r for r in nm.summarize(rows)[1]}["token/alltoall"]["ok"]


def test_bad_routing_and_topk_are_refused():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="'zipf'"):
        nm.routing_ids(g, 4, 8, 2, "zipf")
    with pytest.raises(ValueError, match="topk=9 exceeds the 8 experts"):
        nm.routing_ids(g, 4, 8, 9, "uniform")


@pytest.mark.slow
def test_world_of_two_against_the_oracle(tmp_path):
    out = tmp_path / "numerics.jsonl"
    rows = nm.main(["--smoke", "--dtypes", "fp64", "bf16", "--out", str(out)])
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == rows
    modes = {*nm.MODES, "one_device"}
    # 2 routings x 1 seed x 2 dtypes x 4 modes, every row with the keys
    assert len(rows) == 16 and {r["mode"] for r in rows} == modes
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["bench"] == "numerics" and r["ep"] == 2 and r["E"] == 4
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert {r["commit"] for r in rows} == {head}
    assert {r["relaymoe_tree"] for r in rows} <= {"clean", "dirty"}
    for r in rows:
        errs = {m: r[f"rel_err_{m}"] for m in nm.METRICS}
        if r["dtype"] == "fp64":  # a wrong slice, rank order or expert order is O(1) here
            assert max(errs.values()) < 1e-12, (r["mode"], r["routing"], errs)
        else:  # bf16 rounding, not fp32's and not garbage
            assert all(1e-4 < e < 2e-2 for e in errs.values()), (r["mode"], r["routing"], errs)
            assert r["prob_dtype"] == "float32"
