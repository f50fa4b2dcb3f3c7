"""benchmarks/lab/step_prediction.py on synthetic hop_cost rows: the prediction is the sum its
docstring states (measured GPU time of the passes plus the cost model's exposed transfer, the
host floor beside it), a pass without a usable row is an error naming it, and the script writes
its rows."""

from __future__ import annotations

import json

import pytest

from benchmarks.lab import step_prediction as sp
from relaymoe import cost as cm

QWEN = dict(H=2048, I=768, E=128, K=8)
# capture path -> (mode, direction) -> (gpu_us_per_hop, gpu_us_per_pass, host_us_per_pass)
TIMES = {
    "eager": {("expert", "fwd"): (400.0, 1000.0, 1300.0),
              ("expert", "bwd"): (2000.0, 4300.0, 3000.0),
              ("token", "fwd"): (500.0, 1010.0, 2100.0),
              ("token", "bwd"): (1500.0, 3050.0, 2800.0)},
    "library": {("expert", "fwd"): (450.0, 1200.0, 1000.0),
                ("expert", "bwd"): (1900.0, 4000.0, 1500.0),
                ("token", "fwd"): (480.0, 1000.0, 1700.0),
                ("token", "bwd"): (1600.0, 3400.0, 1600.0)},
}  # fmt: skip


def rows(ep: int = 2, tokens: int = 4096) -> list[dict]:
    out = []
    for path, times in TIMES.items():
        for (mode, direction), (gpu_hop, gpu_pass, host_pass) in times.items():
            out.append({"bench": "hop_cost", "mode": mode, "direction": direction, "ep": ep,
                        "tokens": tokens, "hops": ep, "capture_path": path, **QWEN,
                        "dtype": "bfloat16", "grad_dtype": "bfloat16", "gpu_us_per_hop": gpu_hop,
                        "gpu_us_per_pass": gpu_pass, "host_us_per_pass": host_pass,
                        "span_us_per_pass": gpu_pass + 100.0, "host_us_per_hop": 1.0,
                        "capture_error": None, "commit": "abc123",
                        "command": "hop_cost"})  # fmt: skip
    return out


def exposed_by_hand(mode: str, direction: str, hop_us: float) -> float:
    """The exposed transfer of one pass at R=2, microseconds, written out: hop 0 sends the lead,
    hop 1 the trail, each under one hop's compute; the trail's return home is not hidden."""
    m = cm.DEFAULT_TIME_MODEL
    T, H, K, b, pb = 4096, 2048, 8, 2, 2
    if mode == "expert":
        W = 64 * (2 * 768 * 2048 + 2048 * 768)
        lead, trail = W * b, (W * b if direction == "bwd" else 0)
    elif direction == "fwd":
        lead, trail = T * H * b + T * K * (4 + pb), T * H * b
    else:
        lead, trail = 2 * T * H * b + T * K * pb, T * H * b + T * K * pb
    c = hop_us * 1e-6

    def hidden(n):
        x = n / m.link_bytes_per_s
        return max(x - m.hide * c, (1 - m.hide) * x)

    return (hidden(lead) + hidden(trail) + trail / m.link_bytes_per_s) * 1e6


@pytest.mark.parametrize("mode", ["expert", "token"])
@pytest.mark.parametrize("path", ["eager", "library"])
def test_prediction_is_the_stated_sum(mode, path):
    p = sp.predict(sp.index(rows()), mode, path, 2, 4096)
    t = {d: TIMES[path][(mode, d)] for d in ("fwd", "bwd")}
    gpu_hops = sum(2 * g for g, _, _ in t.values())
    gpu_other = sum(gp - 2 * g for g, gp, _ in t.values())
    exposed = sum(exposed_by_hand(mode, d, g) for d, (g, _, _) in t.items())
    host = sum(h for _, _, h in t.values())
    assert p["gpu_hops_ms"] == pytest.approx(gpu_hops / 1e3, abs=1e-3)
    assert p["gpu_other_ms"] == pytest.approx(gpu_other / 1e3, abs=1e-3)
    assert p["exposed_transfer_ms"] == pytest.approx(exposed / 1e3, abs=1e-3)
    assert p["predicted_ms"] == pytest.approx((gpu_hops + gpu_other + exposed) / 1e3, abs=2e-3)
    assert p["host_floor_ms"] == pytest.approx(host / 1e3, abs=1e-3)
    assert p["host_bound"] == (host / 1e3 > p["predicted_ms"])
    aware = sum(max(h, gp + exposed_by_hand(mode, d, g)) for d, (g, gp, h) in t.items())
    assert p["predicted_host_aware_ms"] == pytest.approx(aware / 1e3, abs=1e-3)
    assert p["span_ms"] == pytest.approx((sum(gp for _, gp, _ in t.values()) + 200) / 1e3)
    assert p["target_ms"] == sp.TARGET_MS and p["commit"] == "abc123"
    # the expert forward's lead is mostly exposed (604 MB against 0.4 ms), token mode's hidden
    assert (exposed > 1000) == (mode == "expert")


def test_a_missing_or_refused_pass_is_named():
    base = rows()
    drop = [r for r in base if (r["mode"], r["direction"], r["capture_path"])
            != ("token", "bwd", "library")]  # fmt: skip
    with pytest.raises(sp.MissingRows, match="mode=token direction=bwd ep=2 tokens=4096 "
                                             "capture_path=library"):  # fmt: skip
        sp.predictions(sp.index(drop))
    refused = [dict(r, capture_error="refused (hop_graphs.refusal): exact pairs")
               if r["capture_path"] == "library" else r for r in base]  # fmt: skip
    with pytest.raises(sp.MissingRows, match="measured nothing: refused"):
        sp.predictions(sp.index(refused))
    lacking = [{k: v for k, v in r.items() if k != "gpu_us_per_pass"} for r in base]
    with pytest.raises(sp.MissingRows, match="lacks gpu_us_per_pass"):
        sp.predictions(sp.index(lacking))


def test_all_skips_incomplete_and_multi_node_grids():
    extra = [r for r in rows(ep=4, tokens=8192) if r["capture_path"] == "eager"]
    many = rows(ep=16, tokens=4096)
    preds, notes = sp.predictions(sp.index(rows() + extra + many), every=True)
    got = {(p["ep"], p["tokens"], p["mode"], p["capture_path"]) for p in preds}
    assert (4, 8192, "token", "eager") in got and (4, 8192, "token", "library") not in got
    assert not any(ep == 16 for ep, *_ in got)
    assert any("capture_path=library" in n for n in notes) and any("ep=16" in n for n in notes)


def test_script_writes_its_rows_and_the_measured_gap(tmp_path, capsys):
    src, ring, out = tmp_path / "hop.jsonl", tmp_path / "ring.jsonl", tmp_path / "pred.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    ring.write_text(json.dumps({"bench": "ring", "provider": "relaymoe_ring_token", "ep": 2,
                                "shape": "qwen3_30b_a3b_T4k", "ms_fwd_bwd": 9.0,
                                "commit": "def456"}) + "\n")  # fmt: skip
    argv = ["--rows", str(src), "--ring-rows", str(ring), "--out", str(out)]
    assert sp.main(argv) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == 4 and all(r["bench"] == "step_prediction" for r in got)
    assert all(r["commit"] == "abc123" and r["command"].endswith(" ".join(argv)) for r in got)
    by = {(r["mode"], r["capture_path"]): r for r in got}
    eager, lib = by[("token", "eager")], by[("token", "library")]
    assert eager["eager_gap_ms"] == pytest.approx(9.0 - eager["predicted_ms"], abs=1e-3)
    assert lib["predicted_plus_gap_ms"] == pytest.approx(
        lib["predicted_ms"] + eager["eager_gap_ms"], abs=1e-3
    )
    assert "measured_eager_ms" not in by[("expert", "eager")]  # no expert ring row given
    capsys.readouterr()
    missing = tmp_path / "few.jsonl"
    missing.write_text(json.dumps(rows()[0]) + "\n")
    assert sp.main(["--rows", str(missing), "--ring-rows", "none"]) == 2
    assert "no hop_cost row for mode=expert direction=bwd" in capsys.readouterr().err
