"""EP scaling beyond the machine by simulation (RelayMoE paper Fig. 10 analog).

1. Calibrate the simulator (``benchmarks.sim``) from measured rows (by default those of the runs
   ``benchmarks/results/CURRENT.json`` lists, then any ``--rows`` globs, e.g. a fresh run's):
   grouped-GEMM throughput from ``bench: experts`` relaymoe rows, P2P bandwidth from
   ``bench: ring`` rows, the megatron-core expert cost from mcore rows.
2. Validate: predict every measured EP=1 / EP=2 row the simulator models and report the error
   (target: within 15%).
3. Extrapolate: ring (expert, token, auto) in both schedules (``schedule``: ``flat``, one ring
   over the group; ``two_level``, rings inside the nodes joined by one hop per node crossing on
   every GPU's NIC at once), and the expert ring's ``node_batched`` rounds (one hop per node over
   the node's experts, ``benchmarks/sim/batched.py``), vs all-to-all with the same expert
   kernels, EP 8..64, 4 or 8 GPUs per
   node (NVLink inside a node, one 400 Gb/s NIC per GPU between nodes: ``relaymoe.cost``'s
   link constants), for Qwen3-style layers like the paper's Table 3 (E128 K8 H2048 I768 and its
   K/E/I variants), 12 x 8192 tokens per GPU as in the paper's EP-scaling study.

Rows: ``bench: scaling_sim`` with ``kind: validation``, ``calibration`` or ``extrapolation``;
ring extrapolation rows carry ``schedule``, two-level ones also ``speedup_vs_flat`` (flat time /
two-level time of the same mode; in one node both orders are the same).
Usage: ``python benchmarks/scaling_sim.py [--quick] [--out PATH] [--rows GLOB ...] [--no-current]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Paper §4.2 (Fig. 10 text), reported ratios to plot alongside the simulation.
PAPER = {
    "speedup_K16": {8: 2.5, 64: 5.0},
    "mem_reduction_avg": {8: 3.8, 64: 7.6},
    "mem_reduction_K16": {64: 13.4},
    "source": "RelayMoE §4.2: K16 speedup ~2.5x at EP=8 to ~5x at EP=64; MoE peak memory "
    "reduction 3.8x avg at EP=8, 7.6x at EP=64, 13.4x for K16",
}
TOKENS_PER_GPU = 12 * 8192
BASE = {"E": 128, "K": 8, "H": 2048, "I": 768}
VARIANTS = {
    "E128_K8": {},
    "E128_K4": {"K": 4},
    "E128_K16": {"K": 16},
    "E64_K8": {"E": 64},
    "E256_K8": {"E": 256},
    "E128_K8_I2048": {"I": 2048},
}
QUICK_VARIANTS = ("E128_K8", "E128_K16", "E128_K4")


def extrapolate(cm, *, variants, eps, gpus_per_node, intra_GBps=None):
    from benchmarks.sim import (
        Cluster,
        MoEShape,
        simulate_alltoall,
        simulate_node_batched,
        simulate_ring,
    )
    from relaymoe.options import NODE_BATCHED, SCHEDULES

    rows = []
    for name in variants:
        dims = {**BASE, **VARIANTS[name]}
        shape = MoEShape(name=name, T=TOKENS_PER_GPU, **dims)
        for g in gpus_per_node:
            for ep in eps:
                if shape.E % ep:
                    continue
                kw = {"intra_GBps": intra_GBps} if intra_GBps else {}
                cl = Cluster(ep=ep, gpus_per_node=g, **kw)
                a2a = simulate_alltoall(shape, cl, cm)
                common = {"bench": "scaling_sim", "kind": "extrapolation", "shape": name,
                          "T": shape.T, **dims, "ep": ep, "gpus_per_node": g}  # fmt: skip
                rows.append({**common, "provider": "sim_alltoall", **_times(a2a, a2a)})
                flat = {}
                for sched in SCHEDULES:
                    res = {
                        m: simulate_ring(shape, cl, cm, m, schedule=sched)
                        for m in ("expert", "token")
                    }
                    # auto: the smaller forward per-hop volume (what mode="auto" picks)
                    auto = min(res, key=lambda m: res[m].extra["hop_lead_MB_fwd"])
                    res["auto"] = res[auto]
                    for m, r in res.items():
                        row = {**common, "provider": f"sim_ring_{m}", "schedule": sched,
                               **_times(r, a2a)}  # fmt: skip
                        if m == "auto":
                            row["auto_mode"] = auto
                        if sched == "flat":
                            flat[m] = r
                        else:
                            row["speedup_vs_flat"] = round(flat[m].ms_fwd_bwd / r.ms_fwd_bwd, 3)
                        rows.append(row)
                # expert mode only, asked for by name (relaymoe/ring/expert_mode.py)
                nb = simulate_node_batched(shape, cl, cm)
                rows.append({**common, "provider": "sim_ring_expert", "schedule": NODE_BATCHED,
                             **_times(nb, a2a),
                             "speedup_vs_flat": round(flat["expert"].ms_fwd_bwd / nb.ms_fwd_bwd,
                                                      3)})  # fmt: skip
    return rows


def _times(r, a2a) -> dict:
    return {
        "ms_fwd_bwd": round(r.ms_fwd_bwd, 3),
        "ms_fwd": round(r.ms_fwd, 3),
        "peak_MiB": round(r.peak_MiB, 1),
        "GB_sent_per_rank": round(r.bytes_per_rank / 1e9, 3),
        "speedup_vs_alltoall": round(a2a.ms_fwd_bwd / r.ms_fwd_bwd, 3),
        "mem_reduction_vs_alltoall": round(a2a.peak_MiB / r.peak_MiB, 3),
    }


def _links(intra_GBps) -> dict:
    """The link rates the extrapolation ran with, and where each comes from."""
    from benchmarks.sim.model import DEFAULT_INTER_GBPS, DEFAULT_INTRA_GBPS
    from relaymoe.cost import NIC_BYTES_PER_S, NIC_EFFICIENCY

    return {
        "intra_GBps": round(intra_GBps or DEFAULT_INTRA_GBPS, 1),
        "intra_source": "the measured ring rows' copy-engine hops (calibration)"
        if intra_GBps
        else f"NVLink {DEFAULT_INTRA_GBPS:.0f} GB/s one way, measured on 2x H200",
        "inter_GBps": round(DEFAULT_INTER_GBPS, 1),
        "inter_source": f"assumption: one 400 Gb/s NIC per GPU (8 per node, the H100 reference) "
        f"= {NIC_BYTES_PER_S / 1e9:.0f} GB/s at {NIC_EFFICIENCY:.0%} efficiency",
    }


def main(argv=None) -> int:
    from benchmarks.sim.calibrate import (
        calibrate,
        latest_rows,
        load_rows,
        summarize_errors,
        validate,
    )

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three configs, 8 GPUs per node")
    ap.add_argument(
        "--out",
        default=str(ROOT / "benchmarks/results/scaling_sim.jsonl"),
        help="rows file (default: a scratch file at the results root; a run writes into its "
        "own folder)",
    )
    ap.add_argument(
        "--rows",
        nargs="*",
        default=[],
        help="more measured rows (globs, oldest first) after the CURRENT runs' rows: the last "
        "row of each measurement identity counts",
    )
    ap.add_argument("--no-current", action="store_true", help="calibrate on the --rows globs only")
    args = ap.parse_args(argv)

    out = Path(args.out).resolve()
    measured = []
    if not args.no_current:
        from benchmarks.runs import current_rows

        measured = [{**r.data, "_file": str(r.run.path / r.file)} for r in current_rows()]
    measured += load_rows(args.rows) if args.rows else []
    if not measured:
        ap.error("no measured rows: CURRENT.json lists no run and no --rows matched")
    rows = latest_rows(
        [
            r
            for r in measured
            if r.get("bench") != "scaling_sim" and Path(r["_file"]).resolve() != out
        ]
    )
    cm, notes = calibrate(rows)
    print(f"[scaling_sim] {len(rows)} measured rows; calibration: {notes}")
    print(
        f"[scaling_sim] compute peak fwd {cm.peak_tflops_fwd:.0f} / bwd {cm.peak_tflops_bwd:.0f}"
        f" TFLOP/s (m_half {cm.m_half:.0f} pairs/expert)"
    )

    from benchmarks.common import JsonlWriter, print_table

    writer = JsonlWriter(out)
    val = validate(rows, cm, intra_GBps=notes["intra_GBps"])
    for v in val:
        writer.write({"bench": "scaling_sim", "kind": "validation", **v})
    summ = summarize_errors(val)
    writer.write(
        {
            "bench": "scaling_sim",
            "kind": "calibration",
            "peak_tflops_fwd": round(cm.peak_tflops_fwd, 1),
            "peak_tflops_bwd": round(cm.peak_tflops_bwd, 1),
            "m_half": cm.m_half,
            "intra_GBps": notes["intra_GBps"],
            "links": _links(notes["intra_GBps"]),
            "seq_mlp_ms_per_expert": round(cm.seq_mlp_ms_per_expert, 4),
            "notes": notes,
            **summ,
            "paper": PAPER,
        }
    )
    if val:
        print("[scaling_sim] validation (fit: in-sample rows of a fitted scheme)")
        print_table(val, ["scheme", "shape", "ep", "measured_ms", "predicted_ms", "rel_err", "fit"])
        print(f"[scaling_sim] max |error| predicted rows: {summ['max_abs_err']:.1%} (target 15%)")

    variants = QUICK_VARIANTS if args.quick else tuple(VARIANTS)
    gpn = (8,) if args.quick else (4, 8)
    ext = extrapolate(
        cm,
        variants=variants,
        eps=(8, 16, 32, 64),
        gpus_per_node=gpn,
        intra_GBps=notes["intra_GBps"],
    )
    for r in ext:
        writer.write(r)
    print_table(
        [r for r in ext if r["provider"] in ("sim_ring_auto",)],
        [
            "shape",
            "ep",
            "gpus_per_node",
            "schedule",
            "auto_mode",
            "ms_fwd_bwd",
            "speedup_vs_alltoall",
            "speedup_vs_flat",
            "mem_reduction_vs_alltoall",
        ],
    )
    print(f"[scaling_sim] paper: {PAPER['source']}")
    print(f"[scaling_sim] wrote {len(writer.rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
