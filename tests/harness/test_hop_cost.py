"""benchmarks/hop_cost.py on CPU: the script writes its rows end to end, and each hop of the
emulated rank computes its own slice (the float64 oracle of the full layer, per hop)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import hop_cost as hc
from benchmarks.common import rel_err
from relaymoe.kernels import interpret_mode
from relaymoe.reference import moe_experts_reference

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("bench", "mode", "direction", "ep", "tokens", "experts_per_hop", "pairs_per_hop",
          "host_us_per_hop", "gpu_us_per_hop", "launches_per_hop", "idle_frac", "captured",
          "commit", "gpu", "torch", "triton")  # fmt: skip


def test_hop_cost_script_writes_its_rows(tmp_path):
    out = tmp_path / "rows.jsonl"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hop_cost.py"), "--tiny", "--captured",
         "--backend", "torch", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES=""),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # EP {2, 4} x T {16} x {expert, token} x {fwd, bwd} x {eager, captured}
    assert len(rows) == 16
    seen = set()
    for r in rows:
        assert all(f in r for f in FIELDS), sorted(set(FIELDS) - set(r))
        assert r["bench"] == "hop_cost" and r["gpu"] == "cpu" and r["commit"]
        assert r["experts_per_hop"] == r["E"] // r["ep"] and r["hops"] == r["ep"]
        if r["mode"] == "expert":  # rank 0's T*K pairs over the EP slices, one a hop
            assert r["pairs_per_hop"] == r["tokens"] * r["K"] / r["ep"]
        assert (
            0
            < r["pairs_per_hop"]
            <= r["pair_bound"]
            == r["tokens"] * min(r["K"], r["E"] // r["ep"])
        )
        if r["captured"]:  # no CUDA graph on CPU: said so, not measured
            assert r["capture_error"] == "CUDA graphs need a CUDA device"
            assert r["host_us_per_hop"] is None
        else:
            assert r["host_us_per_hop"] > 0 and r["host_us_per_pass"] >= r["host_us_per_hop"]
            assert r["gpu_us_per_hop"] is None and r["launches_per_hop"] is None  # no GPU
        seen.add((r["mode"], r["direction"], r["ep"], r["captured"]))
    assert len(seen) == 16


def _oracle(x, w13, w2, idx, probs, dy):
    """float64 out and gradients (x, probs, w13, w2) of the whole layer."""
    leaves = [t.detach().double().requires_grad_() for t in (x, probs, w13, w2)]
    xd, pd, w13d, w2d = leaves
    out = moe_experts_reference(xd, w13d, w2d, idx.long(), pd)
    out.backward(dy.double())
    return out.detach(), *(t.grad for t in leaves)


def _close(got, want, what, tol=1e-4):
    err = rel_err(got, want) if want.abs().max() > 0 else got.abs().max().item()
    assert err < tol, f"{what}: relative error {err:.3g}"


# The Triton hop primitives (the GPU's) under the interpreter where it is on, at the EP whose
# hops hold two experts each; the torch backend at EP 2 (cheap).
CHECKS = [("expert", 2, "torch"), ("token", 2, "torch")]
CHECKS += [(m, 4, "triton" if interpret_mode() else "torch") for m in ("expert", "token")]


@pytest.mark.parametrize("mode,ep,backend", CHECKS)
def test_each_hop_computes_its_slice(mode, ep, backend):
    """Rank 0 of an EP-rank ring, its peers emulated (``hop_cost.Emulated`` delivers each
    partition and keeps each trail the rank sends): expert mode, the hops add up to the whole
    layer (out, dx, dprobs) and hop h's weight-gradient trail is the full layer's gradient of
    partition h's slice of experts; token mode, hop h's output (and dx, dprobs) trail is the
    layer of partition h's tokens through rank 0's own experts alone, and the local weight
    gradients sum every partition's."""
    case = hc.Case(mode, ep, 16, **hc.TINY, dtype=torch.float32, device="cpu", backend=backend)
    got = hc.hop_outputs(case, seed=1)
    data, prob, El = got["data"], got["prob"], case.El
    w13, w2 = data["w13"], data["w2"]
    if mode == "expert":
        m = data["parts"][0]
        out, dx, dprobs, dw13, dw2 = _oracle(m["x"], w13, w2, m["idx"], m["probs"], m["dy"])
        _close(got["out"], out, "out (the sum of the hops)")
        _close(got["dx"], dx, "dx")
        _close(got["dprobs"], dprobs, "dprobs")
        assert sorted(got["bwd_trails"]) == list(range(ep))
        for p, buf in got["bwd_trails"].items():
            v = hc.trail_views(case, prob, "bwd", buf)
            s = slice(p * El, (p + 1) * El)
            _close(v["dw13"], dw13[s], f"hop of partition {p}: dw13")
            _close(v["dw2"], dw2[s], f"hop of partition {p}: dw2")
        _close(got["grads"]["w13"], dw13[:El], "the own experts' dw13 returned home")
        # the captured hop (--captured): hop 1's body alone, partition R-1's slice
        p = ep - 1
        sl = ((m["idx"] >= p * El) & (m["idx"] < (p + 1) * El)).to(m["probs"].dtype)
        out, dx, dprobs, dw13, dw2 = _oracle(m["x"], w13, w2, m["idx"], m["probs"] * sl, m["dy"])
        body = _body_once(got["ring"], "fwd")
        _close(body["out"], out, "hop body: out")
        body = _body_once(got["ring"], "bwd")
        _close(body["dx"], dx, "hop body: dx")
        _close(body["dprobs"], dprobs * sl, "hop body: dprobs")
        _close(body["dw13"], dw13[p * El : (p + 1) * El], "hop body: dw13")
        return
    sum13, sum2 = torch.zeros_like(w13[:El], dtype=torch.float64), 0.0
    assert sorted(got["fwd_trails"]) == sorted(got["bwd_trails"]) == list(range(ep))
    for s, part in enumerate(data["parts"]):
        own = (part["idx"] < El).to(part["probs"].dtype)  # rank 0 owns experts [0, El)
        probs = part["probs"] * own
        out, dx, dprobs, dw13, dw2 = _oracle(part["x"], w13, w2, part["idx"], probs, part["dy"])
        fwd = hc.trail_views(case, prob, "fwd", got["fwd_trails"][s])
        bwd = hc.trail_views(case, prob, "bwd", got["bwd_trails"][s])
        _close(fwd["out"], out, f"hop of partition {s}: out")
        _close(bwd["dx"], dx, f"hop of partition {s}: dx")
        _close(bwd["dprobs"], dprobs * own, f"hop of partition {s}: dprobs")
        assert torch.all(bwd["dprobs"][own == 0] == 0)  # other ranks' pairs untouched
        assert dw13[El:].abs().max() == 0  # the oracle's own-experts restriction
        sum13, sum2 = sum13 + dw13[:El], sum2 + dw2[:El]
    _close(got["out"], hc.trail_views(case, prob, "fwd", got["fwd_trails"][0])["out"], "out")
    _close(got["grads"]["w13"], sum13, "local dw13 (every partition's)")
    _close(got["grads"]["w2"], sum2, "local dw2 (every partition's)")
    # the captured hop (--captured): hop 1's body alone, partition R-1's tokens
    p = ep - 1
    body = _body_once(got["ring"], "fwd")
    _close(body["out"], hc.trail_views(case, prob, "fwd", got["fwd_trails"][p])["out"], "body out")
    body = _body_once(got["ring"], "bwd")
    bwd = hc.trail_views(case, prob, "bwd", got["bwd_trails"][p])
    _close(body["dx"], bwd["dx"], "hop body: dx")
    _close(body["dprobs"], bwd["dprobs"], "hop body: dprobs")
    part = data["parts"][p]
    own = (part["idx"] < El).to(part["probs"].dtype)
    _, _, _, dw13, _ = _oracle(part["x"], w13, w2, part["idx"], part["probs"] * own, part["dy"])
    _close(body["dw13"], dw13[:El], "hop body: dw13")


def _body_once(ring, direction):
    """``hop_cost.hop_body``'s buffers after one eager call (what a graph replay computes)."""
    body, outs = hc.hop_body(ring, direction)
    body()
    return outs


def test_replay_fields_from_profiler_events():
    """The captured row's fields from profiled replays (the code the CPU run never reaches,
    since CPU has no CUDA graph): two replays of two kernels each, one overlap inside a
    replay, graph launches counted from the host events."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(kind, name, a, b):
        return SimpleNamespace(device_type=kind, name=name,
                               time_range=SimpleNamespace(start=a, end=b))  # fmt: skip

    cuda, cpu = DeviceType.CUDA, DeviceType.CPU
    events = [ev(cpu, "cudaGraphLaunch", 0, 2), ev(cuda, "k1", 10, 40), ev(cuda, "k2", 30, 60),
              ev(cpu, "cudaGraphLaunch", 100, 102), ev(cuda, "k1", 110, 140),
              ev(cuda, "k2", 140, 170), ev(cpu, "aten::zero_", 0, 1)]  # fmt: skip
    f = hc.replay_fields(events, k=2, span=80.0)
    assert f["gpu_us_per_hop"] == 60.0  # (30 + 30 + 30 + 30) / 2
    assert f["kernels_per_hop"] == 2.0 and f["launches_per_hop"] == 1.0
    assert f["idle_frac"] == round(1 - 55.0 / 80.0, 3)  # busy (50 + 60) / 2 over the span
    assert f["gpu_attrib"] == "graph"
    none = hc.replay_fields([ev(cpu, "cudaGraphLaunch", 0, 1)], k=1, span=80.0)
    assert none["gpu_us_per_hop"] == 80.0 and none["gpu_attrib"] == "events"
    assert none["idle_frac"] == 0.0
