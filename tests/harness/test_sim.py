"""Invariants of the EP-scaling simulator (benchmarks.sim): pure Python, fast."""

from __future__ import annotations

import itertools
import json

import pytest

from benchmarks.sim import (
    Cluster,
    ComputeModel,
    MoEShape,
    hop_payloads,
    simulate_alltoall,
    simulate_node_batched,
    simulate_pass,
    simulate_ring,
)
from benchmarks.sim.calibrate import (
    calibrate,
    latest_rows,
    load_rows,
    scheme_of,
    shape_of,
    validate,
)

CM = ComputeModel()
QWEN = MoEShape("qwen3", T=32768, E=128, K=8, H=2048, I=768)


@pytest.mark.parametrize("mode", ["expert", "token"])
@pytest.mark.parametrize("ep,gpn", [(2, 2), (4, 4), (8, 4), (16, 8), (64, 8)])
def test_overlap_never_slower_than_sequential(mode, ep, gpn):
    """A schedule property: without contention (transfers fully hidden) overlapping is never
    slower. With the measured contention a rank that receives over a slow link pays
    ``(1 - hide) * min(compute, transfer)`` on every hop, so overlap may lose, by at most that
    per hop (e.g. expert mode over inter-node hops at ep 16 and 64)."""
    for T in (1024, 32768, 98304):
        s = QWEN.with_tokens(T)
        free = Cluster(ep=ep, gpus_per_node=gpn, hide_intra=1.0, hide_inter=1.0)
        ov = simulate_ring(s, free, CM, mode, overlap=True)
        seq = simulate_ring(s, free, CM, mode, overlap=False)
        assert ov.ms_fwd <= seq.ms_fwd + 1e-9
        assert ov.ms_bwd <= seq.ms_bwd + 1e-9
        cl = Cluster(ep=ep, gpus_per_node=gpn)
        fwd, bwd = hop_payloads(s, ep, CM, mode)
        for hop, attr in ((fwd, "ms_fwd"), (bwd, "ms_bwd")):
            x = max(cl.link_seconds(r, hop.lead_bytes + hop.trail_bytes) for r in range(ep))
            penalty_s = ep * (1.0 - min(cl.hide_intra, cl.hide_inter)) * min(hop.compute_s, x)
            ov = getattr(simulate_ring(s, cl, CM, mode, overlap=True), attr)
            seq = getattr(simulate_ring(s, cl, CM, mode, overlap=False), attr)
            assert ov <= seq + penalty_s * 1e3 + 1e-9, (attr, ov, seq, penalty_s)


def test_pass_bounds_compute_and_transfer():
    cl = Cluster(ep=4, gpus_per_node=4, hide_intra=1.0)
    fwd, _ = hop_payloads(QWEN, 4, CM, "expert")
    p = simulate_pass(cl, fwd, overlap=True)
    x = cl.link_seconds(0, fwd.lead_bytes)
    # at least every hop's compute; at most sequential compute + transfer per hop
    assert p.seconds >= 4 * fwd.compute_s - 1e-12
    assert p.seconds <= 4 * fwd.compute_s + 3 * x + 1e-12
    # fully hidden transfer shorter than compute: the pass is compute plus the first wait only
    if x < fwd.compute_s:
        assert p.seconds == pytest.approx(4 * fwd.compute_s, rel=1e-9)


def test_slow_link_dominates_when_transfer_exceeds_compute():
    cl = Cluster(ep=4, gpus_per_node=4, intra_GBps=1.0)  # 1 GB/s: transfer-bound
    fwd, _ = hop_payloads(QWEN, 4, CM, "expert")
    p = simulate_pass(cl, fwd, overlap=True)
    x = cl.link_seconds(0, fwd.lead_bytes)
    assert p.seconds >= 3 * x + fwd.compute_s - 1e-12


def test_ring_expert_volume_per_hop_independent_of_tokens():
    for ep in (2, 8, 64):
        vols = {
            hop_payloads(QWEN.with_tokens(T), ep, CM, "expert")[0].lead_bytes
            for T in (512, 4096, 98304)
        }
        bwd = {
            hop_payloads(QWEN.with_tokens(T), ep, CM, "expert")[1].trail_bytes
            for T in (512, 4096, 98304)
        }
        assert len(vols) == 1 and len(bwd) == 1
        assert vols.pop() == QWEN.E // ep * 3 * QWEN.H * QWEN.I * 2
    # token mode grows with T
    a = hop_payloads(QWEN.with_tokens(1024), 8, CM, "token")[0].lead_bytes
    b = hop_payloads(QWEN.with_tokens(2048), 8, CM, "token")[0].lead_bytes
    assert b == pytest.approx(2 * a)


def test_alltoall_volume_and_time_grow_with_k():
    cl = Cluster(ep=16, gpus_per_node=8)
    prev = None
    for K in (1, 2, 4, 8, 16):
        s = MoEShape("k", T=8192, E=128, K=K, H=2048, I=768)
        r = simulate_alltoall(s, cl, CM)
        if prev is not None:
            assert r.bytes_per_rank == pytest.approx(2 * prev.bytes_per_rank)
            assert r.extra["a2a_ms"] > prev.extra["a2a_ms"]
        prev = r
    # ring expert volume does not depend on K
    v = {
        simulate_ring(MoEShape("k", 8192, 128, K, 2048, 768), cl, CM).bytes_per_rank
        for K in (1, 8, 16)
    }
    assert len(v) == 1


def test_ep1_has_no_transfer():
    cl = Cluster(ep=1, gpus_per_node=1)
    for mode in ("expert", "token"):
        r = simulate_ring(QWEN, cl, CM, mode)
        assert r.bytes_per_rank == 0
        assert r.ms_fwd_bwd == pytest.approx(r.compute_ms)
    a = simulate_alltoall(QWEN, cl, CM)
    assert a.bytes_per_rank == 0 and a.extra["a2a_ms"] == 0


def test_inter_node_slower_than_intra_node():
    s = QWEN.with_tokens(98304)
    one = simulate_ring(s, Cluster(ep=8, gpus_per_node=8), CM)
    two = simulate_ring(s, Cluster(ep=8, gpus_per_node=4), CM)
    assert two.ms_fwd_bwd > one.ms_fwd_bwd
    assert Cluster(ep=8, gpus_per_node=4).hop_is_inter(3)
    assert Cluster(ep=8, gpus_per_node=4).hop_is_inter(7)  # wrap-around
    assert not Cluster(ep=8, gpus_per_node=4).hop_is_inter(4)


def test_ring_memory_below_alltoall_for_k_ge_2_and_falls_with_ep():
    s = QWEN.with_tokens(98304)
    prev = None
    for ep in (2, 8, 64):
        r = simulate_ring(s, Cluster(ep=ep, gpus_per_node=8 if ep > 8 else ep), CM)
        a = simulate_alltoall(s, Cluster(ep=ep, gpus_per_node=8 if ep > 8 else ep), CM)
        assert r.peak_MiB < a.peak_MiB
        if prev is not None:
            assert r.peak_MiB < prev
        prev = r.peak_MiB


def test_bad_inputs_raise_with_the_fix():
    with pytest.raises(ValueError, match="gpus_per_node"):
        Cluster(ep=12, gpus_per_node=8)
    with pytest.raises(ValueError, match="ep=3"):
        simulate_ring(QWEN, Cluster(ep=3, gpus_per_node=3), CM)
    with pytest.raises(ValueError, match="K=9"):
        MoEShape("x", T=8, E=8, K=9, H=8, I=8)
    with pytest.raises(ValueError, match="mode="):
        simulate_ring(QWEN, Cluster(ep=2, gpus_per_node=2), CM, "tokens")
    with pytest.raises(ValueError, match="hide_intra"):
        Cluster(ep=2, gpus_per_node=2, hide_intra=1.5)


def test_calibrate_and_validate_from_rows(tmp_path):
    # a fake expert row at exactly the default throughput: calibration must give it back
    s = QWEN
    ep1 = simulate_ring(s, Cluster(ep=1, gpus_per_node=1), CM, recompute=False)
    rows = [
        {
            "bench": "experts",
            "provider": "relaymoe",
            "shape": "qwen3_30b_a3b_T32k",
            "ms_fwd": ep1.ms_fwd,
            "ms_fwd_bwd": ep1.ms_fwd_bwd,
        },
        {
            "bench": "ring",
            "provider": "relaymoe_ring_expert",
            "shape": "qwen3_30b_a3b_T32k",
            "ep": 2,
            "ms_fwd_bwd": 40.0,
            "link_GBps": 300.0,
        },
        {
            "bench": "ring",
            "provider": "relaymoe_ring_expert_nooverlap",
            "shape": "qwen3_30b_a3b_T32k",
            "ep": 2,
            "ms_fwd_bwd": 50.0,
        },
    ]
    p = tmp_path / "sub" / "x.jsonl"
    p.parent.mkdir()
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    loaded = load_rows(str(tmp_path / "**/*.jsonl"))
    assert len(loaded) == 3
    cm, notes = calibrate(loaded)
    # launch overhead is absorbed into the fitted throughput, hence the loose tolerance
    assert cm.peak_tflops_fwd == pytest.approx(CM.peak_tflops_fwd, rel=0.05)
    assert notes["intra_GBps"] == 300.0
    val = validate(loaded, cm, intra_GBps=notes["intra_GBps"])
    assert [v["scheme"] for v in val] == ["ring_expert", "ring_expert_sequential"]
    assert all(v["ep"] == 2 for v in val)
    assert val[0]["predicted_ms"] < val[1]["predicted_ms"]
    # node-batched rows: predicted (never fitted) where the row's node holds the whole EP group
    nb = {"bench": "ring", "provider": "relaymoe_ring_expert_nccl_nb_g2", "ep": 2,
          "shape": "qwen3_30b_a3b_T4k", "ms_fwd_bwd": 11.0, "schedule": "node_batched",
          "transport": "nccl"}  # fmt: skip
    forced = {**nb, "provider": "relaymoe_ring_expert_nccl_nb_g1"}
    cm2, _ = calibrate([*loaded, {**nb, "gpus_per_node": 2}, {**forced, "gpus_per_node": 1}])
    assert cm2 == cm  # not fitted
    got = validate([{**nb, "gpus_per_node": 2}, {**forced, "gpus_per_node": 1}], cm)
    assert [(v["scheme"], v["provider"], v["fit"]) for v in got] == [
        ("ring_expert_node_batched", nb["provider"], False)
    ]
    hide = Cluster.__dataclass_fields__["hide_inter"].default  # NCCL rows, as validate does
    want = simulate_node_batched(shape_of(nb), Cluster(ep=2, gpus_per_node=2, hide_intra=hide), cm)
    assert got[0]["predicted_ms"] == round(want.ms_fwd_bwd, 3)


def test_node_batched_peak_counts_what_a_round_holds():
    from benchmarks.sim.memory import node_batched_peak_bytes, ring_peak_bytes
    from relaymoe import cost

    shape = MoEShape("qwen3_30b_a3b_T4k", T=4096, E=128, K=8, H=2048, I=768)
    d = shape.dims(2)
    W = d.W * d.b  # gradients in the weights' dtype here (gb == b)
    resident = 2 * d.T * d.H * d.b
    # one node of 2 (measured on 2x H200: 3,488.6 MiB): the home accumulator, the gathered
    # experts and their fresh gradients (2W each), the one received share; the intermediates
    # are freed before the reduce-scatter
    index = cost.ROUTING_INDEX_BYTES_PER_PAIR * d.P  # the own tokens' routing index
    assert node_batched_peak_bytes(shape, 2, 2) == resident + W * (1 + 2 + 2 + 1) + index
    assert round(node_batched_peak_bytes(shape, 2, 2) / 2**20) == 3488
    assert node_batched_peak_bytes(shape, 2, 1) == ring_peak_bytes(shape, 2, "expert", "nccl")
    # over several nodes the column ring's two transfer slots come on top
    d8 = shape.dims(8)
    W8 = d8.W * d8.b
    slots = 2 * cost.slot_capacity("expert", d8)
    index8 = cost.ROUTING_INDEX_BYTES_PER_PAIR * d8.P
    assert node_batched_peak_bytes(shape, 8, 2) == 2 * d8.T * d8.H * d8.b + slots + W8 * 6 + index8
    r = simulate_node_batched(shape, Cluster(ep=2, gpus_per_node=2), CM)
    assert r.peak_MiB == node_batched_peak_bytes(shape, 2, 2) / 2**20


def test_row_parsing():
    assert shape_of({"shape": "qwen3_30b_a3b_T64k"}).T == 65536
    assert shape_of({"shape": "moeblaze_conf4"}).I == 8192
    assert shape_of({"shape": "mystery"}) is None
    assert shape_of({"shape": "mystery", "T": 4, "E": 4, "K": 2, "H": 8, "I": 8}).K == 2
    assert scheme_of({"provider": "mcore_alltoall_sequentialmlp"}) == "mcore_alltoall"
    assert scheme_of({"provider": "relaymoe_ring_token", "overlap": False}) == (
        "ring_token_sequential"
    )
    assert scheme_of({"provider": "relaymoe_alltoall"}) == "alltoall"
    assert scheme_of({"provider": "liger"}) is None
    # the model describes the host waits that cost nothing measurable (off, lag: the default)
    # and the flat order it calibrates on
    ring = {"provider": "relaymoe_ring_expert_copy_engine", "host_wait": "off"}
    assert scheme_of(ring) == "ring_expert"
    assert scheme_of({**ring, "host_wait": "lag"}) == "ring_expert"
    assert scheme_of({**ring, "host_wait": "pass"}) is None
    assert scheme_of({**ring, "schedule": "two_level"}) is None
    assert scheme_of({**ring, "schedule": "node_batched"}) is None
    assert scheme_of({**ring, "schedule": "flat"}) == "ring_expert"


def test_latest_row_of_each_measurement_counts():
    old = {"bench": "experts", "provider": "relaymoe", "shape": "s", "recompute": "act", "ms": 2}
    other = {**old, "recompute": "fc1", "ms": 3}
    new = {**old, "ms": 1}
    assert latest_rows([old, other, new]) == [other, new]
    assert latest_rows([new, old]) == [old]  # order is the caller's: oldest first


def test_width_dependence_is_fitted_from_expert_rows_of_several_widths():
    # no host term: the expert rows calibrate device throughput (one layer call, host hidden)
    truth = ComputeModel(peak_tflops_fwd=500.0, peak_tflops_bwd=400.0, width_exp=0.1,
                         launch_us=0.0)  # fmt: skip
    rows = []
    for name in ("qwen3_30b_a3b_T32k", "moeblaze_conf3", "moeblaze_conf4"):
        s = shape_of({"shape": name})
        f = truth.seconds(s.flops_fwd(s.pairs), s.pairs, s.E, bwd=False, width=s.I)
        b = truth.seconds(s.flops_bwd(s.pairs, recompute=False), s.pairs, s.E, bwd=True,
                          width=s.I)  # fmt: skip
        row = {"bench": "experts", "provider": "relaymoe", "shape": name, "ep": 1}
        rows.append({**row, "recompute": "act", "ms_fwd": f * 1e3, "ms_fwd_bwd": (f + b) * 1e3})
    cm, notes = calibrate(rows)
    assert cm.width_exp == pytest.approx(0.1, abs=1e-6), notes["compute"]
    assert cm.peak_tflops_fwd == pytest.approx(500.0, rel=1e-6)
    assert cm.peak_tflops_bwd == pytest.approx(400.0, rel=1e-6)
    one_width, _ = calibrate(rows[:1])
    assert one_width.width_exp == 0.0  # a single width says nothing about the dependence


def test_simulator_and_its_calibration_import_no_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import benchmarks.sim, benchmarks.sim.calibrate, benchmarks.runs\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_time_model_fit_recovers_a_known_model():
    """Rows made by a known TimeModel: the refit from the package defaults predicts them within
    1%, and the rows it must leave out (EP=1, no overlap, other code) are left out."""
    import dataclasses

    from benchmarks import fit_time_model as ftm
    from relaymoe import cost as cm

    truth = dataclasses.replace(
        cm.DEFAULT_TIME_MODEL, expert_tflops=420e12, hop_fixed_s=1.5e-3, alltoall_fixed_s=5e-3
    )
    rows = []
    for t in (4, 8, 16, 32, 64):
        for mode, transport in (("expert", "copy_engine"), ("token", "copy_engine"),
                                ("token", "nccl"), ("alltoall", "nccl")):  # fmt: skip
            d = cm.Dims(T=t * 1024, H=2048, I=768, El=64, K=8, R=2, b=2, pb=4)
            s = cm.step_seconds(mode, d, transport=transport, model=truth)
            rows.append({"bench": "ring", "provider": f"p_{mode}_{transport}", "ep": 2,
                         "shape": f"qwen3_30b_a3b_T{t}k", "mode": mode, "transport": transport,
                         "ms_fwd_bwd": s * 1e3})  # fmt: skip
    skipped = [{**rows[0], "provider": "p_at_1991b42"}, {**rows[0], "provider": "q", "ep": 1},
               {**rows[0], "provider": "r", "overlap": False}]  # fmt: skip
    pts = ftm.points(rows + skipped)
    assert len(pts) == len(rows)
    before = max(abs(e) for e in ftm.log_errors(cm.DEFAULT_TIME_MODEL, pts))
    after = max(abs(e) for e in ftm.log_errors(ftm.fit(pts), pts))
    assert before > 0.05 and after < 0.01, (before, after)
    with pytest.raises(ValueError, match="nothing to fit"):
        ftm.fit([])


def test_captured_hop_fit_is_the_pass_host_time_per_hop():
    """``captured_hop_fixed_s`` from library rows: the geometric mean of host_us_per_pass / hops
    (the squared log loss of ``hops * h``), refused and eager rows left out of it."""
    import math

    from benchmarks import fit_time_model as ftm

    def row(path, ep, host, **kw):
        hop = None if host is None else host / ep / 2
        return {"bench": "hop_cost", "capture_path": path, "ep": ep, "hops": ep,
                "host_us_per_pass": host, "host_us_per_hop": hop, **kw}  # fmt: skip

    rows = [row("library", 2, 400.0), row("library", 8, 6400.0), row("eager", 2, 3000.0),
            row("library", 2, None, capture_error="refused"),
            {"bench": "ring", "ep": 2}]  # fmt: skip
    f = ftm.captured_hop_fit(rows)
    assert f["rows"] == 2
    assert f["captured_hop_fixed_s"] == pytest.approx(math.sqrt(200e-6 * 800e-6))
    assert f["by_ep"] == {2: pytest.approx(200e-6), 8: pytest.approx(800e-6)}
    assert f["eager_hop_fixed_s"] == pytest.approx(1500e-6)
    assert f["hop_range_s"] == pytest.approx(250e-6)  # the hop ranges' median, 100 and 400 us
    assert ftm.captured_hop_fit(rows, ep=8)["captured_hop_fixed_s"] == pytest.approx(800e-6)
    with pytest.raises(ValueError, match="nothing to fit"):
        ftm.captured_hop_fit(rows[2:])


# -- two-level schedule (issue #18) ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["expert", "token"])
def test_two_level_is_flat_in_one_node_or_one_gpu_per_node(mode):
    for ep, gpn in ((8, 8), (4, 8), (8, 1)):
        cl = Cluster(ep=ep, gpus_per_node=gpn)
        for ov in (True, False):
            a = simulate_ring(QWEN, cl, CM, mode, overlap=ov, schedule="flat")
            b = simulate_ring(QWEN, cl, CM, mode, overlap=ov, schedule="two_level")
            assert (a.ms_fwd, a.ms_bwd, a.bytes_per_rank) == (b.ms_fwd, b.ms_bwd, b.bytes_per_rank)


@pytest.mark.parametrize("mode", ["expert", "token"])
def test_two_level_never_slower_across_nodes_same_bytes(mode):
    """The same hops and compute in another order: never slower, and each rank sends the same
    bytes (the lead R-1 times, the trail R times)."""
    for (ep, gpn), T in itertools.product(((8, 4), (16, 8), (16, 4), (32, 8), (64, 8)),
                                          (4096, 98304)):  # fmt: skip
        s = QWEN.with_tokens(T)
        cl = Cluster(ep=ep, gpus_per_node=gpn)
        flat = simulate_ring(s, cl, CM, mode, schedule="flat")
        two = simulate_ring(s, cl, CM, mode, schedule="two_level")
        assert two.ms_fwd <= flat.ms_fwd * (1 + 1e-9) and two.ms_bwd <= flat.ms_bwd * (1 + 1e-9)
        assert two.bytes_per_rank == pytest.approx(flat.bytes_per_rank)
        assert two.extra["schedule"] == "two_level"


def test_two_level_link_bound_pass_by_hand():
    """No compute, no latency, no contention: a pass is its transfers. Expert forward over 2
    nodes of 2: flat sends 3 leads, each hop over a NIC (3 x = 3 slow hops); two-level sends
    intra, inter, intra (2 fast + 1 slow), both with every hop's links in parallel."""
    cl = Cluster(ep=4, gpus_per_node=2, intra_GBps=100.0, inter_GBps=10.0, intra_latency_us=0.0,
                 inter_latency_us=0.0, hide_intra=1.0, hide_inter=1.0)  # fmt: skip
    from benchmarks.sim.ring import HopPayload

    hop = HopPayload(lead_bytes=1e9, trail_bytes=0.0, compute_s=0.0, acc_s=0.0)
    assert simulate_pass(cl, hop, schedule="flat").seconds == pytest.approx(3 * 0.1)
    assert simulate_pass(cl, hop, schedule="two_level").seconds == pytest.approx(0.01 + 0.1 + 0.01)
    with pytest.raises(ValueError, match="schedule="):
        simulate_pass(cl, hop, schedule="ring")


def test_sim_links_come_from_the_cost_model():
    from relaymoe import cost

    cl = Cluster(ep=16, gpus_per_node=8)
    assert cl.intra_GBps * 1e9 == cost.NVLINK_BYTES_PER_S == 394e9
    assert cl.inter_GBps * 1e9 == pytest.approx(cost.INTER_NODE_BYTES_PER_S) == 45e9
    assert cl.is_inter(7, 15) and not cl.is_inter(8, 15)
    # a flat ring across nodes cannot use the copy engine: NCCL's hidden share inside nodes too
    assert cl.link_hide(0, 1, copy_engine=False) == cl.hide_inter
    assert cl.link_hide(0, 1) == cl.hide_intra


def test_scaling_sim_rows_carry_the_schedule():
    from benchmarks.scaling_sim import extrapolate

    rows = extrapolate(CM, variants=("E128_K8",), eps=(8, 16, 64), gpus_per_node=(4, 8))
    a2a = [r for r in rows if r["provider"] == "sim_alltoall"]
    ring = [r for r in rows if r["provider"] != "sim_alltoall"]
    assert len(a2a) == 6 and all("schedule" not in r for r in a2a)
    assert {r["schedule"] for r in ring} == {"flat", "two_level", "node_batched"}
    batched = [r for r in ring if r["schedule"] == "node_batched"]
    assert len(batched) == 6 and {r["provider"] for r in batched} == {"sim_ring_expert"}
    ring = [r for r in ring if r["schedule"] != "node_batched"]
    assert len(ring) == 6 * 2 * 3  # points x schedules x (expert, token, auto)
    by = {(r["provider"], r["ep"], r["gpus_per_node"], r["schedule"]): r for r in ring}
    for r in batched:  # across nodes one hop per node beats the ring's hop per rank
        flat = by[("sim_ring_expert", r["ep"], r["gpus_per_node"], "flat")]
        assert r["speedup_vs_flat"] == pytest.approx(flat["ms_fwd_bwd"] / r["ms_fwd_bwd"], 1e-2)
        if r["ep"] > r["gpus_per_node"]:
            assert r["speedup_vs_flat"] > 1.0, r
    for (prov, ep, g, sched), r in by.items():
        if sched == "flat":
            assert "speedup_vs_flat" not in r
            continue
        flat = by[(prov, ep, g, "flat")]
        assert set(r) == set(flat) | {"speedup_vs_flat"}
        assert r["speedup_vs_flat"] == pytest.approx(flat["ms_fwd_bwd"] / r["ms_fwd_bwd"], 1e-2)
        assert r["speedup_vs_flat"] >= 1.0
        if ep <= g:
            assert r["ms_fwd_bwd"] == flat["ms_fwd_bwd"]


def test_a_hops_host_and_device_time_add_in_quadrature():
    """Neither hides the other fully when they are of one size (relaymoe.cost.TimeModel):
    3 ms of host and 4 ms of device make a 5 ms hop; either alone is itself."""
    cm = ComputeModel(peak_tflops_fwd=1.0, peak_tflops_bwd=1.0, m_half=0.0, launch_us=3000.0)
    assert cm.seconds(4e9, pairs=10, experts=1, bwd=False) == pytest.approx(5e-3)
    assert cm.seconds(4e9, pairs=10, experts=1, bwd=True) == pytest.approx(5e-3)
    assert ComputeModel(peak_tflops_fwd=1.0, m_half=0.0, launch_us=0.0).seconds(
        4e9, pairs=10, experts=1, bwd=False
    ) == pytest.approx(4e-3)


def test_node_batched_pays_the_hop_cost_once_a_node():
    """The node-batched rounds' claim: with compute and links made free, a pass costs one fixed
    hop cost per node (N = EP / G), not per rank; inside one node, one round."""
    from benchmarks.sim import simulate_node_batched

    shape = MoEShape(name="s", T=4096, E=64, K=4, H=256, I=128)
    cm = ComputeModel(peak_tflops_fwd=1e9, peak_tflops_bwd=1e9, launch_us=1000.0, hbm_GBps=1e12)
    for ep, g in ((16, 8), (32, 8), (16, 4), (8, 8), (4, 1)):
        cl = Cluster(ep=ep, gpus_per_node=g, intra_GBps=1e9, inter_GBps=1e9, intra_latency_us=0.0,
                     inter_latency_us=0.0)  # fmt: skip
        r = simulate_node_batched(shape, cl, cm)
        assert r.ms_fwd == pytest.approx(max(ep // g, 1) * 1.0, rel=1e-3), (ep, g)
        assert r.ms_bwd == pytest.approx(max(ep // g, 1) * 1.0, rel=1e-3), (ep, g)
        assert r.extra["schedule"] == "node_batched"
