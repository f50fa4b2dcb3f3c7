"""Drive the simulator with measured numbers and check it against measured rows.

Takes benchmark rows (by default those of the runs ``benchmarks/results/CURRENT.json`` lists,
see ``benchmarks/runs.py``; format in ``benchmarks/README.md``):

* ``bench: experts``, provider ``relaymoe`` (1 GPU): the grouped-GEMM peak throughput, forward
  from ``ms_fwd`` and backward from ``ms_fwd_bwd - ms_fwd``, corrected for the pairs per expert.
* ``bench: ring`` rows that carry ``link_GBps`` (P2P bandwidth measured alone) or
  ``hop_MB`` and ``hop_transfer_ms``: the intra-node bandwidth.
* megatron-core rows (provider ``mcore*``): the per-expert cost of ``SequentialMLP``
  (least squares over the rows: ``ms = a * El + flops / thr + all-to-all``).

Validation predicts each measured row whose scheme it models (``ring_expert``, ``ring_token``,
their non-overlapped versions, the same-kernel ``alltoall``, ``mcore_alltoall``) and reports the
relative error; rows used for a fit are flagged ``fit: true`` (in-sample).
"""

from __future__ import annotations

import glob
import json
import math
import re
import statistics
from dataclasses import replace
from pathlib import Path

from benchmarks.sim.alltoall import alltoall_seconds, simulate_alltoall
from benchmarks.sim.batched import simulate_node_batched
from benchmarks.sim.model import Cluster, ComputeModel, MoEShape
from benchmarks.sim.ring import simulate_ring

QWEN3 = {"E": 128, "K": 8, "H": 2048, "I": 768}
NAMED_SHAPES = {
    "moeblaze_conf3": {"T": 65536, "E": 16, "K": 4, "H": 1024, "I": 4096},
    "moeblaze_conf4": {"T": 32768, "E": 16, "K": 4, "H": 2048, "I": 8192},
}
_KEY_ALIASES = {
    "T": ("T", "tokens", "num_tokens"),
    "E": ("E", "experts", "num_experts"),
    "K": ("K", "topk"),
    "H": ("H", "hidden", "hidden_size"),
    "I": ("I", "ffn", "ffn_hidden_size", "moe_ffn_hidden_size"),
}


def load_rows(patterns) -> list[dict]:
    """JSON objects of every ``.jsonl`` file matching ``patterns`` (bad lines skipped)."""
    if isinstance(patterns, str | Path):
        patterns = [patterns]
    rows, seen = [], set()
    for pat in patterns:
        for path in sorted(glob.glob(str(pat), recursive=True)):
            real = str(Path(path).resolve())
            if real in seen:  # overlapping patterns: read each file once
                continue
            seen.add(real)
            with open(path) as f:
                for line in f:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(obj, dict):
                        obj.setdefault("_file", path)
                        rows.append(obj)
    return rows


_IDENTITY = ("bench", "provider", "variant", "shape", "ep", "recompute", "mode", "transport",
             "overlap", "kind", "host_wait")  # fmt: skip


def latest_rows(rows: list[dict]) -> list[dict]:
    """One row per measurement identity (bench, provider, shape, ep, mode, ...): the last one in
    ``rows``' order. Load older results first: the model then describes the code that was
    measured last, not a median over kernels that have since changed."""
    latest: dict = {}
    for r in rows:
        ident = tuple(json.dumps(r.get(k), sort_keys=True) for k in _IDENTITY)
        latest.pop(ident, None)
        latest[ident] = r
    return list(latest.values())


def shape_of(row: dict) -> MoEShape | None:
    """The MoE shape of a row: explicit T/E/K/H/I keys, else the shape name (None if unknown)."""
    name = str(row.get("shape", ""))
    dims = {}
    base = None
    m = re.match(r"^qwen3_30b_a3b_T(\d+)k(?:_I(\d+))?", name)
    if m:
        base = {**QWEN3, "T": int(m.group(1)) * 1024}
        if m.group(2):  # the crossover's expert width variants, e.g. ..._T16k_I2048
            base["I"] = int(m.group(2))
    elif name in NAMED_SHAPES:
        base = dict(NAMED_SHAPES[name])
    for key, aliases in _KEY_ALIASES.items():
        for a in aliases:
            if isinstance(row.get(a), int):
                dims[key] = row[a]
                break
        else:
            if base is not None:
                dims[key] = base[key]
    if len(dims) < 5:
        return None
    return MoEShape(name=name or "custom", **dims)


def scheme_of(row: dict) -> str | None:
    """Which simulated scheme a measured row corresponds to (None: not modelled: among them
    rows with the host waiting once per pass, RELAYMOE_RING_HOST_WAIT=pass, and any schedule
    but the flat one: the two-level one forced at one GPU per node repeats the flat ring's rows
    at EP 2, and node-batched rounds are another schedule)."""
    if row.get("host_wait") == "pass" or row.get("schedule", "flat") != "flat":
        return None
    prov = str(row.get("provider", ""))
    if prov.startswith("mcore") and "alltoall" in prov or prov == "mcore":
        return "mcore_alltoall"
    if prov.startswith("relaymoe") and "alltoall" in prov:
        return "alltoall"
    m = re.match(r"^relaymoe_ring_(expert|token)(.*)$", prov)
    if m:
        seq = row.get("overlap") is False or any(
            s in m.group(2) for s in ("nooverlap", "no_overlap", "sequential")
        )
        if "naive" in m.group(2) or "unfused" in m.group(2):
            return None
        return f"ring_{m.group(1)}" + ("_sequential" if seq else "")
    return None


NODE_BATCHED_SCHEME = "ring_expert_node_batched"


def _one_node_batched(row: dict) -> str | None:
    """Node-batched rows that the simulator can predict, for validation only (never fitted):
    one node, all the EP group's GPUs on it (``gpus_per_node == ep``). A row forced to fewer GPUs
    a node on a one-node machine runs its column ring over NVLink, which a cluster of several
    nodes does not describe."""
    if row.get("schedule") != "node_batched" or row.get("host_wait") == "pass":
        return None
    if not str(row.get("provider", "")).startswith("relaymoe_ring_expert"):
        return None
    return NODE_BATCHED_SCHEME if row.get("gpus_per_node") == _ep(row) else None


def _ep(row: dict) -> int:
    try:
        return int(row.get("ep") or 1)
    except (TypeError, ValueError):
        return 1


def calibrate(rows: list[dict], base: ComputeModel | None = None) -> tuple[ComputeModel, dict]:
    """A ComputeModel and intra-node link numbers from rows; ``notes`` say where each came from."""
    cm = base or ComputeModel()
    notes: dict = {}
    fwd, bwd, widths = [], [], []
    for r in rows:
        if r.get("bench") != "experts" or r.get("provider") != "relaymoe" or _ep(r) != 1:
            continue
        if r.get("activation", "swiglu") != "swiglu":  # the simulator models SwiGLU layers
            continue
        s = shape_of(r)
        ms, msf = r.get("ms_fwd_bwd"), r.get("ms_fwd")
        if s is None or not isinstance(ms, int | float) or ms <= 0:
            continue
        rec = r.get("recompute", "act") == "fc1"
        eff = cm.efficiency(s.pairs / s.E)
        if isinstance(msf, int | float) and 0 < msf < ms:
            fwd.append(s.flops_fwd(s.pairs) / (msf * 1e-3) / eff / 1e12)
            bwd.append(s.flops_bwd(s.pairs, recompute=rec) / ((ms - msf) * 1e-3) / eff / 1e12)
        else:
            tot = s.flops_fwd(s.pairs) + s.flops_bwd(s.pairs, recompute=rec)
            fwd.append(tot / (ms * 1e-3) / eff / 1e12)
            bwd.append(fwd[-1])
        widths.append(float(s.I))
    if len(set(widths)) >= 2:
        cm, notes["compute"] = _fit_width(cm, widths, fwd, bwd)
    elif fwd:
        cm = replace(
            cm, peak_tflops_fwd=statistics.median(fwd), peak_tflops_bwd=statistics.median(bwd)
        )
        notes["compute"] = f"median of {len(fwd)} relaymoe expert rows"
    else:
        notes["compute"] = "default (no relaymoe expert rows)"
    link = []
    for r in rows:
        if r.get("bench") != "ring":
            continue
        if isinstance(r.get("link_GBps"), int | float):
            link.append(float(r["link_GBps"]))
        else:
            # bench_ring's timeline: forward hops, copy-engine transport (the intra-node link)
            mb, t = (
                r.get("fwd_hop_MB", r.get("hop_MB")),
                r.get("fwd_hop_transfer_ms", r.get("hop_transfer_ms")),
            )
            if r.get("transport", "copy_engine") != "copy_engine":
                continue
            if isinstance(mb, int | float) and isinstance(t, int | float) and t > 0 and mb > 100:
                link.append(mb * 1e6 / (t * 1e-3) / 1e9)
    notes["intra_GBps"] = statistics.median(link) if link else None
    notes["link"] = f"median of {len(link)} ring rows" if link else "default (373 GB/s)"
    cm, fit_note = fit_sequential_mlp(rows, cm)
    notes["mcore"] = fit_note
    cm, notes["launch"] = fit_hop_overhead(rows, cm, notes["intra_GBps"])
    return cm, notes


def _fit_width(cm: ComputeModel, widths, fwd, bwd) -> tuple[ComputeModel, str]:
    """``log peak = log peak_ref + width_exp * log(I / width_ref)``, one exponent shared by the
    forward and backward series (least squares on logs), each series its own intercept."""
    ref = cm.width_ref
    xs = [math.log(w / ref) for w in widths]
    num = den = 0.0
    for ys in (fwd, bwd):
        ly = [math.log(y) for y in ys]
        mx, my = statistics.fmean(xs), statistics.fmean(ly)
        num += sum((x - mx) * (y - my) for x, y in zip(xs, ly, strict=True))
        den += sum((x - mx) ** 2 for x in xs)
    b = num / den if den > 0 else 0.0

    def at_ref(ys):
        return math.exp(statistics.fmean(math.log(y) - b * x for x, y in zip(xs, ys, strict=True)))

    cm = replace(cm, peak_tflops_fwd=at_ref(fwd), peak_tflops_bwd=at_ref(bwd), width_exp=b)
    note = (f"fit on {len(fwd)} relaymoe expert rows of widths {sorted(set(map(int, widths)))}: "
            f"throughput x (I/{ref:.0f})^{b:.3f}")  # fmt: skip
    return cm, note


SMALL_T = 4096  # rows at or below this many tokens per GPU calibrate the per-hop overhead


def fit_hop_overhead(rows: list[dict], cm: ComputeModel, intra_GBps) -> tuple[ComputeModel, str]:
    """Per-hop fixed cost (launches, index slices, host work) from the smallest-T ring rows.

    At a few thousand tokens per GPU a hop's GEMMs take well under a millisecond and the fixed
    cost dominates; the larger-T rows then validate the model out of sample.
    """
    small = [
        r
        for r in rows
        if (scheme_of(r) or "").startswith("ring")
        and (s := shape_of(r)) is not None
        and s.T <= SMALL_T
        and isinstance(r.get("ms_fwd_bwd"), int | float)
    ]
    if not small:
        return cm, f"default {cm.launch_us:.0f} us per hop (no ring rows at T <= {SMALL_T})"

    def sq_err(launch_us: float) -> float:
        trial = replace(cm, launch_us=launch_us)
        pred = validate(small, trial, intra_GBps=intra_GBps)
        return sum(v["rel_err"] ** 2 for v in pred)

    best = min((sq_err(u), u) for u in range(0, 4001, 25))[1]
    note = f"fit on {len(small)} ring rows at T <= {SMALL_T}: {best} us per hop"
    return replace(cm, launch_us=float(best)), note


def fit_sequential_mlp(rows: list[dict], cm: ComputeModel) -> tuple[ComputeModel, str]:
    """Least squares of ``ms - a2a = a * El + flops * u`` over megatron-core rows (u = 1/thr)."""
    pts = []
    for r in rows:
        if scheme_of(r) != "mcore_alltoall":
            continue
        s, ms = shape_of(r), r.get("ms_fwd_bwd")
        if s is None or not isinstance(ms, int | float):
            continue
        ep = _ep(r)
        cl = Cluster(ep=ep, gpus_per_node=max(ep, 1))
        a2a = 4 * alltoall_seconds(s, cl, s.H * s.dtype_bytes) * 1e3
        flops = s.flops_fwd(s.pairs) + s.flops_bwd(s.pairs, recompute=False)
        pts.append((s.E / ep, flops / 1e12, ms - a2a))
    if len(pts) < 2:
        return cm, "no fit (fewer than 2 megatron-core rows)"
    sxx = sum(x * x for x, _, _ in pts)
    syy = sum(y * y for _, y, _ in pts)
    sxy = sum(x * y for x, y, _ in pts)
    sxz = sum(x * z for x, _, z in pts)
    syz = sum(y * z for _, y, z in pts)
    det = sxx * syy - sxy * sxy
    if abs(det) < 1e-12:
        return cm, "no fit (degenerate rows)"
    a = (sxz * syy - syz * sxy) / det
    u = (sxx * syz - sxy * sxz) / det  # ms per TFLOP
    if a <= 0 or u <= 0:
        return cm, f"no fit (non-physical a={a:.3g} ms/expert, u={u:.3g} ms/TFLOP)"
    cm = replace(cm, seq_mlp_ms_per_expert=a, seq_mlp_tflops=1e3 / u)
    return cm, f"fit on {len(pts)} rows: {a:.3f} ms per local expert, {1e3 / u:.0f} TFLOP/s"


def simulate(scheme: str, shape: MoEShape, cluster: Cluster, cm: ComputeModel):  # -> SimResult
    if scheme.startswith("ring_"):
        mode = scheme.split("_")[1]
        return simulate_ring(shape, cluster, cm, mode, overlap=not scheme.endswith("_sequential"))
    if scheme == "alltoall":
        return simulate_alltoall(shape, cluster, cm, experts="fused")
    if scheme == "mcore_alltoall":
        return simulate_alltoall(shape, cluster, cm, experts="sequential_mlp")
    raise ValueError(f"scheme={scheme!r} is not simulated")


def validate(rows: list[dict], cm: ComputeModel, *, intra_GBps: float | None = None) -> list[dict]:
    """Predicted vs measured ms_fwd_bwd for every row the simulator models (EP <= node size)."""
    out = []
    for r in rows:
        scheme = scheme_of(r) or _one_node_batched(r)
        s = shape_of(r)
        ms = r.get("ms_fwd_bwd")
        if scheme is None or s is None or not isinstance(ms, int | float) or ms <= 0:
            continue
        ep = _ep(r)
        if s.E % ep:
            continue
        kw = {"intra_GBps": intra_GBps} if intra_GBps else {}
        if scheme.startswith("ring") and r.get("transport") == "nccl":
            kw["hide_intra"] = Cluster.__dataclass_fields__["hide_inter"].default
        cl = Cluster(ep=ep, gpus_per_node=ep, **kw)
        if scheme == NODE_BATCHED_SCHEME:
            pred = simulate_node_batched(s, cl, cm)
        else:
            pred = simulate(scheme, s, cl, cm)
        err = pred.ms_fwd_bwd / ms - 1.0
        out.append(
            {
                "scheme": scheme,
                "provider": r.get("provider"),
                "shape": r.get("shape"),
                "ep": ep,
                "measured_ms": ms,
                "predicted_ms": round(pred.ms_fwd_bwd, 3),
                "rel_err": round(err, 4),
                "fit": scheme == "mcore_alltoall"
                or (scheme.startswith("ring") and scheme != NODE_BATCHED_SCHEME and s.T <= SMALL_T),
                "measured_peak_MiB": r.get("peak_over_inputs_MiB"),
                "predicted_peak_MiB": round(pred.peak_MiB, 1),
            }
        )
    return out


def summarize_errors(validation: list[dict]) -> dict:
    errs = [abs(v["rel_err"]) for v in validation if not v["fit"]]
    fit = [abs(v["rel_err"]) for v in validation if v["fit"]]
    return {
        "n_predicted": len(errs),
        "max_abs_err": max(errs) if errs else math.nan,
        "n_fit": len(fit),
        "max_abs_err_fit": max(fit) if fit else math.nan,
    }
