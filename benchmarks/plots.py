"""PNG figures from benchmark rows (paper figure analogs); each skipped when its rows are absent.

  fig9_seq_scaling.png       latency and peak memory vs tokens per GPU (bench: ring)
  fig10_scaling_sim.png      simulated speedup / memory reduction vs EP, paper ratios alongside
  fig16_routing_crossover.png expert vs token vs auto ring over T, one panel per I (bench: ring)
  fig17_ablation.png         sequential ring -> + overlap -> + fused kernels (bench: ablation)
  fig18_loss.png             loss curves ring vs alltoall (bench: e2e)
  memory_model.png           planner prediction vs measured peak (bench: memory_model)

Usage: ``python benchmarks/plots.py [--out DIR]`` draws the runs ``benchmarks/results/CURRENT.json``
lists (newest run last, so its rows win; default ``--out docs/plots``, the README's figures);
``python benchmarks/plots.py --results DIR --out DIR`` draws the rows of DIR/**/*.jsonl instead
(a fresh run's own folder).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _tokens(row: dict) -> int | None:
    from benchmarks.sim.calibrate import shape_of

    s = shape_of(row)
    return s.T if s is not None else None


def _base(shape: str) -> str:
    return re.sub(r"_T\d+k?$", "", shape)


def _num(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _save(plt, fig, path: Path) -> str:
    """Lay ``fig`` out, write it to ``path`` (the README's resolution) and close it; its path."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _tokens_axes(ax, ylabel: str) -> None:
    """A panel over tokens per GPU: log2 x axis, light grid."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per GPU")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def fig_seq_scaling(rows, out: Path) -> str | None:
    rows = [r for r in rows if r.get("bench") == "ring" and _num(r.get("ms_fwd_bwd"))]
    series = defaultdict(dict)  # (base shape, provider, EP) -> {T: row}
    for r in rows:
        T = _tokens(r)
        if T is not None and r.get("overlap", True) is not False:
            series[(_base(str(r.get("shape"))), r["provider"], int(r.get("ep") or 1))][T] = r
    series = {k: v for k, v in series.items() if len(v) >= 2}
    if not series:
        return None
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for (base, prov, ep), pts in sorted(series.items()):
        Ts = sorted(pts)
        label = f"{prov} EP={ep} ({base})"
        a1.plot(Ts, [pts[t]["ms_fwd_bwd"] for t in Ts], "o-", label=label)
        peaks = [pts[t].get("peak_over_inputs_MiB") for t in Ts]
        if all(_num(p) for p in peaks):
            a2.plot(Ts, peaks, "o-", label=label)
    _tokens_axes(a1, "fwd+bwd ms")
    _tokens_axes(a2, "peak over inputs MiB")
    a1.legend(fontsize=7)
    fig.suptitle("MoE layer vs sequence length (paper Fig. 9 analog)")
    return _save(plt, fig, out / "fig9_seq_scaling.png")


def fig_routing_crossover(rows, out: Path) -> str | None:
    modes = ("relaymoe_ring_expert", "relaymoe_ring_token", "relaymoe_ring_auto")
    rows = [
        r
        for r in rows
        if r.get("bench") == "ring"
        and r.get("provider") in modes
        and _num(r.get("ms_fwd_bwd"))
        and r.get("overlap", True) is not False
    ]
    from benchmarks.sim.calibrate import shape_of

    panels = defaultdict(lambda: defaultdict(dict))  # (I, EP) -> provider -> T -> ms
    for r in rows:
        s = shape_of(r)
        if s is not None:
            panels[(s.I, int(r.get("ep") or 1))][r["provider"]][s.T] = r["ms_fwd_bwd"]
    panels = {i: p for i, p in panels.items() if sum(len(v) for v in p.values()) >= 3}
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, ((I, ep), provs) in zip(axes[0], sorted(panels.items()), strict=True):
        for prov, pts in sorted(provs.items()):
            Ts = sorted(pts)
            ax.plot(Ts, [pts[t] for t in Ts], "o-", label=prov.replace("relaymoe_ring_", ""))
        _tokens_axes(ax, "fwd+bwd ms")
        ax.set_title(f"I = {I}, EP = {ep}")
        ax.legend()
    fig.suptitle("Ring routing mode crossover (paper Fig. 16 analog)")
    return _save(plt, fig, out / "fig16_routing_crossover.png")


def fig_ablation(rows, out: Path) -> str | None:
    rows = [r for r in rows if r.get("bench") == "ablation" and _num(r.get("ms_fwd_bwd"))]
    if not rows:
        return None
    latest = {}
    for r in rows:  # last row per step wins (a rerun appends)
        latest[(r.get("step", 0), r.get("variant", r.get("provider")))] = r
    bars = [latest[k] for k in sorted(latest, key=lambda k: (k[0], str(k[1])))]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [str(r.get("variant", r.get("provider"))) for r in bars]
    vals = [r["ms_fwd_bwd"] for r in bars]
    b = ax.bar(range(len(vals)), vals, color="tab:blue")
    ax.bar_label(b, fmt="%.1f")
    ax.set_xticks(range(len(vals)), labels, rotation=15, fontsize=8)
    ax.set_ylabel("fwd+bwd ms")
    shape = bars[0].get("shape", "")
    ax.set_title(f"Ring ablation, {shape} EP={bars[0].get('ep', 1)} (paper Fig. 17 analog)")
    return _save(plt, fig, out / "fig17_ablation.png")


def _loss_series(rows):
    """provider -> (steps, losses) from rows with a ``losses`` list or per-step ``loss`` rows."""
    series = {}
    per_step = defaultdict(dict)
    for r in rows:
        if r.get("bench") != "e2e":
            continue
        prov = str(r.get("provider", r.get("dispatcher", "?")))
        if isinstance(r.get("losses"), list) and r["losses"]:
            series[prov] = (list(range(1, len(r["losses"]) + 1)), r["losses"])
        elif _num(r.get("loss")) and _num(r.get("step")):
            per_step[prov][r["step"]] = r["loss"]
    for prov, pts in per_step.items():
        if prov not in series and len(pts) >= 2:
            steps = sorted(pts)
            series[prov] = (steps, [pts[s] for s in steps])
    return series


def fig_loss(rows, out: Path) -> str | None:
    series = _loss_series(rows)
    if not series:
        return None
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for prov, (steps, losses) in sorted(series.items()):
        a1.plot(steps, losses, label=prov, lw=1)
    a1.set_xlabel("step")
    a1.set_ylabel("loss")
    a1.legend()
    a1.grid(alpha=0.3)
    ring = next((p for p in series if "ring" in p), None)
    base = next((p for p in series if "alltoall" in p), None)
    if ring and base:
        r, b = dict(zip(*series[ring], strict=True)), dict(zip(*series[base], strict=True))
        common = sorted(set(r) & set(b))
        a2.plot(common, [r[s] - b[s] for s in common], lw=1)
        a2.set_title(f"{ring} - {base}")
        a2.set_xlabel("step")
        a2.grid(alpha=0.3)
    else:
        a2.set_axis_off()
    shapes = sorted({str(r.get("shape")) for r in rows if r.get("bench") == "e2e"
                     and isinstance(r.get("losses"), list) and r["losses"]})  # fmt: skip
    last = next((str(r.get("shape")) for r in reversed(rows) if r.get("bench") == "e2e"
                 and isinstance(r.get("losses"), list) and r["losses"]), None)  # fmt: skip
    where = f", {last}" if last and len(shapes) > 1 else (f", {shapes[0]}" if shapes else "")
    fig.suptitle(f"Loss parity, ring vs alltoall (paper Fig. 18 analog{where})")
    return _save(plt, fig, out / "fig18_loss.png")


def fig_scaling_sim(rows, out: Path) -> str | None:
    """Speedup of the ring (auto mode) over all-to-all vs EP, one panel per node size, both
    schedules (two-level solid, flat dotted; rows without ``schedule`` are flat ones), and the
    memory reduction, which the schedule does not change."""
    rows = [
        r
        for r in rows
        if r.get("bench") == "scaling_sim"
        and r.get("kind") == "extrapolation"
        and r.get("provider") == "sim_ring_auto"
    ]
    if not rows:
        return None
    from benchmarks.scaling_sim import PAPER as paper

    plt = _plt()
    series = defaultdict(dict)  # (gpus per node, shape, schedule) -> {ep: row}
    for r in rows:
        series[(r["gpus_per_node"], r["shape"], r.get("schedule", "flat"))][r["ep"]] = r
    nodes = sorted({k[0] for k in series}, reverse=True)
    shapes = sorted({k[1] for k in series})
    color = {s: f"C{i}" for i, s in enumerate(shapes)}
    fig, axes = plt.subplots(1, len(nodes) + 1, figsize=(5.2 * (len(nodes) + 1), 4.6))
    style = {"two_level": "o-", "flat": "s:"}
    for ax, g in zip(axes, nodes, strict=False):
        for (gg, shape, sched), pts in sorted(series.items()):
            if gg != g:
                continue
            eps = sorted(pts)
            ys = [pts[e]["speedup_vs_alltoall"] for e in eps]
            ax.plot(eps, ys, style.get(sched, "x--"), color=color[shape], label=f"{shape} {sched}")
        if g == 4:  # the paper's machine: 4 H100 per node, flat ring
            ps = paper["speedup_K16"]
            ax.plot(list(map(int, ps)), list(ps.values()), "k*", ms=14, label="paper K16")
        ax.set_title(f"speedup vs all-to-all, {g} GPUs per node", fontsize=9)
    mem = axes[-1]
    g0 = nodes[0]
    for (gg, shape, sched), pts in sorted(series.items()):
        if gg == g0 and sched == "flat":
            eps = sorted(pts)
            ys = [pts[e]["mem_reduction_vs_alltoall"] for e in eps]
            mem.plot(eps, ys, "o-", color=color[shape], label=shape)
    pm = paper["mem_reduction_avg"]
    mem.plot(list(map(int, pm)), list(pm.values()), "k*", ms=14, label="paper avg (reported)")
    pk = paper["mem_reduction_K16"]
    mem.plot(list(map(int, pk)), list(pk.values()), "kX", ms=11, label="paper K16 (reported)")
    mem.set_title("MoE peak memory reduction (either schedule)", fontsize=9)
    for a in axes:
        a.set_xscale("log", base=2)
        a.set_xticks([8, 16, 32, 64], ["8", "16", "32", "64"])
        a.set_xlabel("EP")
        a.axhline(1.0, color="gray", lw=0.8)
        a.grid(alpha=0.3)
        a.legend(fontsize=5.5, ncol=2, loc="upper left" if a is mem else "lower left")
    axes[0].set_ylabel("ratio")
    fig.suptitle(
        "EP scaling by simulation (not measured): ring (auto), two-level (solid) and flat "
        "(dotted) schedule, vs all-to-all (paper Fig. 10 analog)",
        fontsize=10,
    )
    return _save(plt, fig, out / "fig10_scaling_sim.png")


def fig_memory_model(rows, out: Path) -> str | None:
    pts = []
    for r in rows:
        if r.get("bench") != "memory_model":
            continue
        pred = next((r[k] for k in ("predicted_MiB", "model_MiB") if _num(r.get(k))), None)
        meas = next((r[k] for k in ("measured_MiB", "peak_MiB") if _num(r.get(k))), None)
        if pred is not None and meas is not None:
            pts.append((meas, pred, str(r.get("config", r.get("shape", "")))))
    if not pts:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts])
    hi = max(max(p[0], p[1]) for p in pts) * 1.1
    ax.plot([0, hi], [0, hi], "k-", lw=0.8)
    ax.fill_between([0, hi], [0, 0.9 * hi], [0, 1.1 * hi], color="gray", alpha=0.15, label="±10%")
    ax.set_xlabel("measured peak MiB")
    ax.set_ylabel("predicted peak MiB")
    ax.legend()
    ax.set_title("Memory model vs measurement")
    return _save(plt, fig, out / "memory_model.png")


FIGURES = {
    "fig9_seq_scaling": fig_seq_scaling,
    "fig10_scaling_sim": fig_scaling_sim,
    "fig16_routing_crossover": fig_routing_crossover,
    "fig17_ablation": fig_ablation,
    "fig18_loss": fig_loss,
    "memory_model": fig_memory_model,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=None, help="a folder of rows (default: CURRENT runs)")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: docs/plots, or "
                    "--results when given)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.results:
        from benchmarks.sim.calibrate import load_rows

        rows = load_rows(str(Path(args.results) / "**/*.jsonl"))
        what = args.results
    else:
        from benchmarks.runs import current_rows

        rows = [r.data for r in current_rows()]
        what = "the CURRENT.json runs"
    out = Path(args.out or args.results or ROOT / "docs" / "plots")
    out.mkdir(parents=True, exist_ok=True)
    print(f"[plots] {len(rows)} rows from {what}")
    made = 0
    for name, fn in FIGURES.items():
        path = fn(rows, out)
        if path:
            made += 1
            print(f"[plots] wrote {path}")
        else:
            print(f"[plots] skip {name}: its rows are missing")
    print(f"[plots] {made} figure(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
