"""benchmarks/lab/hop_cost.py on CPU: the script writes its rows end to end (eager, hop_graph and
library rows: the library's recorded hops, its CPU stand-in, bitwise the eager pass), each hop of
the emulated rank computes its own slice (the float64 oracle of the full layer, per hop), and
the profiler fields give a replayed graph's kernels to the hop that launched it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.common import rel_err
from benchmarks.lab import hop_cost as hc
from benchmarks.lab import hop_library
from relaymoe.kernels import interpret_mode
from relaymoe.reference import moe_experts_reference
from relaymoe.ring.hop_graphs import EagerReplay, HopGraphs

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "benchmarks" / "lab"
FIELDS = ("bench", "mode", "direction", "ep", "tokens", "experts_per_hop", "pairs_per_hop",
          "host_us_per_hop", "gpu_us_per_hop", "launches_per_hop", "idle_frac", "captured",
          "commit", "gpu", "torch", "triton")  # fmt: skip


def test_hop_cost_script_writes_its_rows(tmp_path):
    out = tmp_path / "rows.jsonl"
    p = subprocess.run(
        [sys.executable, str(LAB / "hop_cost.py"), "--tiny", "--captured",
         "--library", "--backend", "torch", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES=""),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # EP {2, 4} x T {16} x {expert, token} x {fwd, bwd} x {eager, hop_graph, library}
    assert len(rows) == 24
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
        path = r["capture_path"]
        assert r["captured"] == (path != "eager")
        if path == "library":  # measured, not refused: the CPU stand-in takes every call
            assert r["capture_error"] is None, r["capture_error"]
        if path == "hop_graph":  # no CUDA graph on CPU: said so, not measured
            assert r["capture_error"] == "CUDA graphs need a CUDA device"
            assert r["host_us_per_hop"] is None
        else:
            assert r["host_us_per_hop"] > 0 and r["host_us_per_pass"] >= r["host_us_per_hop"]
            # the thread's CPU time of the same hops: positive, and no more than their wall time
            # (a little slack for the two clocks' reads)
            assert 0 < r["host_cpu_us_per_hop"] <= r["host_us_per_hop"] * 1.05 + 5
            assert r["gpu_us_per_hop"] is None and r["launches_per_hop"] is None  # no GPU
        if path == "library":  # the library's pass through its cache (the CPU stand-in)
            assert r["capture_backend"] == "eager"
            # recorded before timing: expert mode one entry per expert range; token mode one
            # per set of slot addresses its hops see (the visiting partition and the trail are
            # bound: hop 0, then odd and even hops), all adding into zeroed weight gradients
            # (expert mode: every range through one body, range_window: forward one entry per
            # slot, backward per set of slots: hop 0, odd and even hops)
            want = {("expert", "fwd"): min(r["ep"], 2), ("expert", "bwd"): min(r["ep"], 3)}.get(
                (r["mode"], r["direction"]), min(r["ep"], 3)
            )
            assert r["graphs"] == want
            # static buffers: what is copied (token forward's ring binds all it can)
            if (r["mode"], r["direction"]) != ("token", "fwd"):
                assert r["static_bytes"] > 0
            # the CPU stand-in keeps what it recorded with alive, so per-pass buffers (the
            # backward's weight-gradient accumulators, token mode's trail scratch) never recur
            # at one address here: their entries grow to HopGraphs' variant cap, then copy.
            # Expert forward binds only the persistent weight slots.
            if (r["mode"], r["direction"]) == ("expert", "fwd"):
                assert r["graphs_recorded_timed"] == 0
            else:
                assert r["graphs_held"] <= want * (HopGraphs(EagerReplay()).max_variants + 2)
            # a replayed pass's outputs against the eager pass's: results, and every trail
            assert r["capture_bitwise"] is True and r["capture_max_abs_diff"] == 0.0
            assert r["capture_diff_at"] is None
            R = r["ep"]  # out | dx, dprobs, two grads and each hop's trail (two tensors) | out,
            # each partition's routing index (four arrays) and trail | the same as expert bwd
            compared = {"expert": {"fwd": 1, "bwd": 4 + 2 * R},
                        "token": {"fwd": 1 + 5 * R, "bwd": 4 + 2 * R}}  # fmt: skip
            assert r["capture_compared"] == compared[r["mode"]][r["direction"]]
        seen.add((r["mode"], r["direction"], r["ep"], path))
    assert len(seen) == 24


def _oracle(x, w13, w2, idx, probs, dy):
    """float64 out and gradients (x, probs, w13, w2) of the whole layer."""
    leaves = [t.detach().double().requires_grad_() for t in (x, probs, w13, w2)]
    xd, pd, w13d, w2d = leaves
    out = moe_experts_reference(xd, w13d, w2d, idx.long(), pd)
    out.backward(dy.double())
    return out.detach(), *(t.grad for t in leaves)


TOL = {"cpu": 1e-4, "cuda": 1e-2}  # fp32 on CUDA: the Triton kernels' dots use TF32


def _close(got, want, what, tol=None):
    tol = TOL[got.device.type] if tol is None else tol
    err = rel_err(got, want) if want.abs().max() > 0 else got.abs().max().item()
    assert err < tol, f"{what}: relative error {err:.3g}"


# The Triton hop primitives (the GPU's) under the interpreter where it is on, at the EP whose
# hops hold two experts each; the torch backend at EP 2 (cheap). On a GPU (the GPU suite runs
# this file's cuda cases) the Triton backend at EP 2 and 4: the executor's streams and events
# order each emulated transfer (on the communication stream) with the hops that read it.
CHECKS = [("cpu", "expert", 2, "torch"), ("cpu", "token", 2, "torch")]
CHECKS += [("cpu", m, 4, "triton" if interpret_mode() else "torch") for m in ("expert", "token")]
_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
CHECKS += [pytest.param("cuda", m, ep, "triton", marks=_GPU)
           for m in ("expert", "token") for ep in (2, 4)]  # fmt: skip


@pytest.mark.parametrize("device,mode,ep,backend", CHECKS)
def test_each_hop_computes_its_slice(device, mode, ep, backend):
    """Rank 0 of an EP-rank ring, its peers emulated (``hop_cost.Emulated`` delivers each
    partition and keeps each trail the rank sends): expert mode, the hops add up to the whole
    layer (out, dx, dprobs) and hop h's weight-gradient trail is the full layer's gradient of
    partition h's slice of experts; token mode, hop h's output (and dx, dprobs) trail is the
    layer of partition h's tokens through rank 0's own experts alone, and the local weight
    gradients sum every partition's."""
    dims = hc.TINY if device == "cpu" else dict(H=128, I=64, E=8, K=2)
    case = hc.Case(mode, ep, 16 if device == "cpu" else 96, **dims, dtype=torch.float32,
                   device=device, backend=backend)  # fmt: skip
    got = hc.hop_outputs(case, seed=1)
    data, problem, El = got["data"], got["problem"], case.El
    w13, w2 = data["w13"], data["w2"]
    if mode == "expert":
        m = data["parts"][0]
        out, dx, dprobs, dw13, dw2 = _oracle(m["x"], w13, w2, m["idx"], m["probs"], m["dy"])
        _close(got["out"], out, "out (the sum of the hops)")
        _close(got["dx"], dx, "dx")
        _close(got["dprobs"], dprobs, "dprobs")
        assert sorted(got["bwd_trails"]) == list(range(ep))
        for p, buf in got["bwd_trails"].items():
            v = hc.trail_views(case, problem, "bwd", buf)
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
        fwd = hc.trail_views(case, problem, "fwd", got["fwd_trails"][s])
        bwd = hc.trail_views(case, problem, "bwd", got["bwd_trails"][s])
        _close(fwd["out"], out, f"hop of partition {s}: out")
        _close(bwd["dx"], dx, f"hop of partition {s}: dx")
        _close(bwd["dprobs"], dprobs * own, f"hop of partition {s}: dprobs")
        assert torch.all(bwd["dprobs"][own == 0] == 0)  # other ranks' pairs untouched
        assert dw13[El:].abs().max() == 0  # the oracle's own-experts restriction
        sum13, sum2 = sum13 + dw13[:El], sum2 + dw2[:El]
    _close(got["out"], hc.trail_views(case, problem, "fwd", got["fwd_trails"][0])["out"], "out")
    _close(got["grads"]["w13"], sum13, "local dw13 (every partition's)")
    _close(got["grads"]["w2"], sum2, "local dw2 (every partition's)")
    # the captured hop (--captured): hop 1's body alone, partition R-1's tokens
    p = ep - 1
    body = _body_once(got["ring"], "fwd")
    _close(
        body["out"], hc.trail_views(case, problem, "fwd", got["fwd_trails"][p])["out"], "body out"
    )
    body = _body_once(got["ring"], "bwd")
    bwd = hc.trail_views(case, problem, "bwd", got["bwd_trails"][p])
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


def test_rows_merge_timed_and_profiled_halves():
    """A row's timed half (no profiler ran before it) and its profiled half: the timed fields
    win, the idle shares come from the profiler's busy time against each span (a pass after a
    sync, and passes issued back to back), and a profiled half that failed is named."""
    timed = {"host_us_per_hop": 40.0, "span_us_per_pass": 200.0,
             "span_us_per_pass_chained": 160.0, "capture_error": None}  # fmt: skip
    prof = {"host_us_per_hop": 90.0, "busy_us_per_pass": 150.0, "gpu_us_per_hop": 70.0}
    row = hc.merged(timed, prof)
    assert row["host_us_per_hop"] == 40.0 and row["gpu_us_per_hop"] == 70.0
    assert row["idle_frac"] == 0.25 and row["idle_frac_chained"] == round(1 - 150 / 160, 3)
    assert "profile_error" not in row
    failed = hc.merged(timed, {"capture_error": "RuntimeError: x"})
    assert failed["profile_error"] == "RuntimeError: x" and failed["capture_error"] is None
    assert "idle_frac" not in failed  # no busy time: no idle share
    assert (
        hc.idle_fields({"busy_us_per_pass": 300.0, "span_us_per_pass": 200.0})["idle_frac"] == 0.0
    )  # clipped: the profiler's intervals can outlast the events' span


def _ev(kind, name, a, b, *, id=0, kernels=()):  # noqa: A002 (the profiler's name)
    """A profiler event as ``hop_cost.pass_fields`` reads it."""
    from types import SimpleNamespace

    return SimpleNamespace(device_type=kind, name=name, id=id, kernels=list(kernels),
                           time_range=SimpleNamespace(start=a, end=b))  # fmt: skip


def _k(us):
    from types import SimpleNamespace

    return SimpleNamespace(duration=us)


HOP = "relaymoe.expert.fwd.hop"


def _pass_events(link: str):
    """One pass of two hops, each a copy (an eager kernel, 10 us) and a graph replay (two
    kernels, 30 us each) launched inside the hop, and a pack kernel (5 us) before the hops.
    ``link``: how the profiler linked device work to its launch: ``"op"`` (a host op's
    ``kernels``, the graphs' included), ``"op-eager"`` (the eager kernels only), ``"id"`` (the
    runtime call's correlation id only), ``"none"``."""
    from torch.autograd import DeviceType

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    eager = link.startswith("op")
    ev = [_ev(cpu, "aten::copy_", 0, 2, kernels=[_k(5)] if eager else []),
          _ev(cpu, "cudaLaunchKernel", 1, 2, id=1), _ev(cuda, "pack", 100, 105, id=1)]  # fmt: skip
    for h, t in enumerate((10, 50)):
        c = 10 + 10 * h  # correlation ids: the copy's launch c, the graph launch c + 1
        ev += [
            _ev(cpu, HOP, t, t + 30),
            _ev(cpu, "aten::copy_", t + 1, t + 5, kernels=[_k(10)] if eager else []),
            _ev(cpu, "cudaLaunchKernel", t + 2, t + 4, id=c),
            _ev(cpu, "cudaGraphLaunch", t + 10, t + 20, id=c + 1),
            _ev(cpu, "replay", t + 9, t + 21, kernels=[_k(30), _k(30)] if link == "op" else []),
            _ev(cuda, "copy", 200 + 100 * h, 210 + 100 * h, id=c),
            _ev(cuda, "g1", 210 + 100 * h, 240 + 100 * h, id=c + 1),
            _ev(cuda, "g2", 240 + 100 * h, 270 + 100 * h, id=c + 1),
        ]  # fmt: skip
    if link in ("op", "op-eager", "none"):  # the correlation ids are not the runtime calls'
        for e in ev:
            if e.device_type == cuda:
                e.id = 1000 + e.id
    return ev


@pytest.mark.parametrize("link,attrib", [("op", "hop"), ("id", "launch"),
                                         ("op-eager", "hop+graphs")])  # fmt: skip
def test_pass_fields_give_graph_kernels_to_their_hops(link, attrib):
    """The library row's profiler fields: a replay's kernels belong to the hop that launched
    the graph, however the profiler links them (the host op, the runtime call's correlation id,
    or not at all while every graph launch is inside a hop); the pack before the hops is not a
    hop's."""
    f = hc.pass_fields(_pass_events(link), n=1, hop_name=HOP, hops=2)
    assert f["gpu_attrib"] == attrib
    assert f["gpu_us_per_hop"] == 70.0  # the copy (10) and the graph's two kernels (30 + 30)
    assert f["kernels_per_hop"] == 3.0 and f["gpu_us_per_pass"] == 145.0
    assert f["launches_per_hop"] == 2.0 and f["graph_launches_per_hop"] == 1.0
    assert f["launches_per_pass"] == 5.0 and f["hops_profiled"] == 2
    # device time a pass by kernel: two hops' graph kernels and copies, the pack before them
    by_kernel = f["gpu_us_per_pass_by_kernel"]
    assert by_kernel["g1"] == by_kernel["g2"] == 60.0 and by_kernel["copy"] == 20.0
    assert sum(by_kernel.values()) == f["gpu_us_per_pass"]


def test_pass_fields_without_a_link_fall_back_to_the_pass():
    """A graph launched outside every hop and nothing linked: the pass's device time over its
    hops, said so."""
    from torch.autograd import DeviceType

    ev = _pass_events("none") + [_ev(DeviceType.CPU, "cudaGraphLaunch", 90, 91, id=99)]
    f = hc.pass_fields(ev, n=1, hop_name=HOP, hops=2)
    assert f["gpu_attrib"] == "pass" and f["gpu_us_per_hop"] == 72.5  # 145 / 2


def test_library_compare_is_bitwise():
    """The library row's comparison: one ulp apart is not bitwise (the diff says where), a
    missing output is a difference, equal outputs are bitwise."""
    a = {"out": torch.ones(4), "idx": torch.arange(3, dtype=torch.int32)}
    same = hop_library.compared(a, {k: v.clone() for k, v in a.items()})
    assert same == {"capture_max_abs_diff": 0.0, "capture_bitwise": True,
                    "capture_diff_at": None, "capture_compared": 2}  # fmt: skip
    b = dict(a, out=torch.nextafter(a["out"], torch.full((4,), 2.0)))
    d = hop_library.compared(a, b)
    assert d["capture_bitwise"] is False and d["capture_diff_at"] == "out"
    assert 0 < d["capture_max_abs_diff"] < 1e-6
    assert hop_library.compared(a, {"out": a["out"]})["capture_bitwise"] is False


@pytest.mark.parametrize("mode", ["expert", "token"])
def test_library_outputs_are_each_hops_own(mode):
    """What the library row compares (``hop_library.outputs``: every arriving trail zeros) is
    the same for two eager passes with a pass between them that leaves its trails in the
    slots, and holds each hop's trail."""
    case = hc.Case(mode, 4, 16, **hc.TINY, dtype=torch.float32, device="cpu", backend="torch")
    ring = hc.Ring(case)
    for direction in hc.DIRECTIONS:
        ring.run(direction)
        first = hop_library.outputs(ring, direction, hc.trail_views)
        ring.run(direction)
        again = hop_library.outputs(ring, direction, hc.trail_views)
        assert hop_library.compared(first, again)["capture_bitwise"], direction
        if (mode, direction) != ("expert", "fwd"):
            assert {k.split(".")[0] for k in first if k.startswith("trail")} == {
                f"trail{p}" for p in range(case.ep)
            }


def test_dry_run_names_the_library_refusals(capsys):
    """The plan of the full grid says which cases the library's capture refuses (exact pair
    counts: the bound's pair buffers over the budget, T 32k at EP 2 and 8) and the budget that
    would size them from the bound; ``needed_mib`` is the library's own test."""
    assert hc.main(["--dry-run", "--library"]) == 0
    lines = capsys.readouterr().out.splitlines()
    refused = [ln for ln in lines if "library: refused" in ln]
    assert len(refused) == 4 and all("T  32768" in ln and ">= 768" in ln for ln in refused)
    assert all(" EP  64 " not in ln for ln in refused)
    assert "RELAYMOE_PAIR_BUFFER_MIB=768" in lines[-1]
    from relaymoe.ring.agreement import _bounded

    for ep in hc.FULL["ep"]:
        for T in hc.FULL["tokens"]:
            c = hc.Case("expert", ep, T, **hc.QWEN3, dtype=torch.bfloat16, device="cuda",
                        backend="triton")  # fmt: skip
            problem = hc.agreed_problem(c, None)
            for mib in (512, hop_library.needed_mib(c) - 1, hop_library.needed_mib(c)):
                want = _bounded(dataclasses.replace(problem, pair_buffer_mib=mib))
                assert want == (hop_library.needed_mib(c) <= mib), (ep, T, mib)


def test_chain_gaps_from_device_events():
    """benchmarks/lab/chain_gaps.py's gap accounting: overlapping device ops count once, a gap is
    the time between one op's end (the latest so far) and the next op's start."""
    from torch.autograd import DeviceType

    from benchmarks.lab.chain_gaps import gaps

    cuda = DeviceType.CUDA
    events = [_ev(cuda, "a", 0, 10), _ev(cuda, "b", 5, 20), _ev(cuda, "c", 23, 30),
              _ev(cuda, "d", 130, 140), _ev(DeviceType.CPU, "host", 0, 200)]  # fmt: skip
    g = gaps(events, passes=1, top=2)
    assert g["busy_us_per_pass"] == 37.0 and g["span_us_per_pass"] == 140.0
    assert g["gaps_per_pass"] == 2.0 and g["idle_frac"] == round(1 - 37 / 140, 3)
    assert g["top_gaps"][0] == {"us": 100.0, "after": "c", "before": "d"}
    assert g["top_gaps"][1] == {"us": 3.0, "after": "b", "before": "c"}
    assert g["gap_us_per_pass_by_size"]["2-5"] == 3.0
    assert g["gap_us_per_pass_by_size"]["100-inf"] == 100.0


def test_hop_host_profile_parts_time_named_parts_inside_hops(tmp_path):
    """hop_host_profile --parts on CPU: each named part wrapped and timed inside the hops' ranges
    only, each no longer than the hops' own time; the compute callback holds the cache's run."""
    out = tmp_path / "parts.jsonl"
    p = subprocess.run(
        [sys.executable, str(LAB / "hop_host_profile.py"), "--tiny", "--ep", "2",
         "--tokens", "16", "--modes", "token", "--passes", "1", "--parts", "--no-cprofile",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES=""),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["direction"] for r in rows] == ["fwd", "bwd"]
    for r in rows:
        parts, calls, hop = r["parts"], r["parts_calls"], r["host_us_per_hop_timed"]
        for name in ("executor.start", "executor.wait", "graphs.run", "compute.token"):
            assert calls[name] == 1.0, (name, calls)  # once a hop
        assert all(0 < v <= hop for v in parts.values()), (parts, hop)
        assert parts["graphs.run"] <= parts["compute.token"]


def test_baseline_tree_adds_the_kernel_field_to_an_old_hop_cost():
    """benchmarks/lab/baseline_tree.py: an old hop_cost's pass row gains the per-kernel field
    (and the function, defined before the script's main guard runs it); a source that has it
    stays as it is; an unknown one is refused."""
    from benchmarks.lab import baseline_tree

    old = ("def pass_fields(events, n, hop_name, hops):\n    dev = [e for e in events]\n"
           "    hop_ranges = []\n    return {\n        " + baseline_tree.ANCHOR
           + "\n    }\n\n\nif __name__ == \"__main__\":\n"
           "    ROW = pass_fields([], 1, \"hop\", 2)\n")  # fmt: skip
    new = baseline_tree.with_kernel_times(old)
    ns: dict = {"__name__": "__main__"}
    exec(compile(new, "old_hop_cost", "exec"), ns)  # as `python hop_cost.py` runs it
    assert ns["ROW"] == {"hops_profiled": 0, "gpu_us_per_pass_by_kernel": {}}
    assert baseline_tree.with_kernel_times(new) == new
    with pytest.raises(ValueError, match="no single pass row"):
        baseline_tree.with_kernel_times("def pass_fields(): return {}\n")
