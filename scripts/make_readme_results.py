"""Generate the README "Results" section from the committed benchmark rows.

Reads every ``benchmarks/results/**/*.jsonl`` (files in path order, so dated folders are
chronological; a later row with the same identity replaces an earlier one) and writes markdown
tables between ``<!-- results:begin -->`` and ``<!-- results:end -->`` in README.md.

  python scripts/make_readme_results.py           # rewrite the section in place
  python scripts/make_readme_results.py --check   # exit 1 if README.md differs from the output

Tables: experts, ring, routing, e2e, memory model, scaling simulation (validation and
extrapolation). Columns are those of a fixed preference list that the rows actually carry, so a
benchmark that adds a key does not break the generator. Numbers are formatted deterministically.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"

# (bench, title, identity keys of a row, preferred columns)
TABLES = [
    (
        "experts",
        "Fused expert kernels vs naive vs liger (1 GPU, fwd+bwd of one MoE layer)",
        ("shape", "provider", "recompute", "dtype"),
        [
            "shape",
            "provider",
            "recompute",
            "ms_fwd_bwd",
            "ms_fwd",
            "tflops_fwd_bwd",
            "saved_for_bwd_MiB",
            "peak_over_inputs_MiB",
            "speedup_vs_naive",
            "speedup_vs_best",
        ],
    ),
    (
        "ring",
        "Ring vs all-to-all (EP over GPUs of one node)",
        ("shape", "provider", "ep", "transport", "overlap", "I"),
        [
            "shape",
            "ep",
            "provider",
            "transport",
            "overlap",
            "ms_fwd_bwd",
            "ms_fwd",
            "tflops_fwd_bwd",
            "peak_over_inputs_MiB",
            "hidden_pct",
            "speedup_vs_mcore",
        ],
    ),
    (
        "ablation",
        "Ablation: sequential ring -> + overlap -> + fused kernels",
        ("shape", "ep", "step", "variant"),
        ["shape", "ep", "step", "variant", "ms_fwd_bwd", "peak_over_inputs_MiB"],
    ),
    (
        "e2e",
        "GPT end to end (tiny Qwen3-style; Qwen3-30B-A3B-width slice), ring vs alltoall",
        ("provider", "shape", "ep", "dispatcher"),
        [
            "shape",
            "ep",
            "provider",
            "dispatcher",
            "steps",
            "final_loss",
            "max_abs_loss_diff",
            "max_abs_loss_diff_vs_other",
            "noise_max_abs_loss_diff",
            "tokens_per_s",
            "peak_MiB",
        ],
    ),
    (
        "loss",
        "Language-model loss (output layer + cross-entropy), fwd+bwd, one GPU",
        ("shape", "provider"),
        ["shape", "provider", "impl", "chunk_tokens", "ms_fwd_bwd", "peak_over_inputs_MiB"],
    ),
    (
        "max_seq",
        "Longest sequence that trains two steps (measured, full recompute; a search per row)",
        ("config", "provider", "max_seq"),
        [
            "config",
            "provider",
            "max_seq",
            "first_oom_seq",
            "bracket_open",
            "stop_reason",
            "predicted_max_seq",
        ],
    ),
    (
        "memory_model",
        "Memory model vs measured peak",
        ("config", "shape", "provider", "dispatcher", "ep"),
        [
            "config",
            "shape",
            "dispatcher",
            "provider",
            "ep",
            "measured_MiB",
            "predicted_MiB",
            "rel_err",
        ],
    ),
]
SIM_VALIDATION_COLS = ["scheme", "shape", "ep", "measured_ms", "predicted_ms", "rel_err", "fit"]
SIM_EXTRAP_COLS = [
    "shape",
    "ep",
    "gpus_per_node",
    "auto_mode",
    "ms_fwd_bwd",
    "speedup_vs_alltoall",
    "mem_reduction_vs_alltoall",
]


def load(results: Path) -> list[tuple[str, dict]]:
    """(relative path, row) for every row, files in sorted path order."""
    out = []
    for path in sorted(results.glob("**/*.jsonl")):
        base = ROOT if path.resolve().is_relative_to(ROOT) else results.parent
        rel = path.resolve().relative_to(base.resolve())
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                out.append((rel.as_posix(), row))
    return out


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v:
            return "nan"
        a = abs(v)
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    if isinstance(v, dict | list):
        return json.dumps(v, sort_keys=True)
    return str(v).replace("|", "\\|")


def table(rows: list[dict], preferred: list[str]) -> list[str]:
    cols = [c for c in preferred if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(" --- " for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
    return lines


def _dedupe(items: list[tuple[str, dict]], keys) -> tuple[list[dict], list[str]]:
    latest: dict = {}
    for src, r in items:
        ident = tuple(json.dumps(r.get(k), sort_keys=True) for k in keys)
        latest.pop(ident, None)  # re-insert: keeps the position of the latest measurement
        latest[ident] = (src, r)
    srcs = sorted({s for s, _ in latest.values()})
    return [r for _, r in latest.values()], srcs


def _provenance(rows: list[dict], srcs: list[str]) -> str:
    gpus = sorted({str(r.get("gpu")) for r in rows if r.get("gpu")})
    commits = sorted({str(r.get("commit")) for r in rows if r.get("commit")})
    parts = ["rows: " + ", ".join(f"`{s}`" for s in srcs)]
    if gpus:
        parts.append("GPU: " + ", ".join(gpus))
    if commits:
        parts.append("commit: " + ", ".join(f"`{c}`" for c in commits))
    cmds = sorted({str(r.get("command")) for r in rows if r.get("command")})
    if cmds:
        parts.append("command: " + "; ".join(f"`{c}`" for c in cmds))
    return "_" + " · ".join(parts) + "_"


def _with_speedups(items: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Competitor ms / row ms, against the rows of the same file and shape (the same run):
    ``speedup_vs_naive``, and ``speedup_vs_best`` (vs the faster of naive and liger) where both
    ran."""
    comp: dict[tuple, dict[str, float]] = {}
    for src, r in items:
        if r.get("provider") in ("naive", "liger") and isinstance(r.get("ms_fwd_bwd"), int | float):
            comp.setdefault((src, r.get("shape")), {})[r["provider"]] = r["ms_fwd_bwd"]
    out = []
    for src, r in items:
        base = comp.get((src, r.get("shape")), {})
        ms = r.get("ms_fwd_bwd")
        if base and isinstance(ms, int | float) and ms > 0 and r.get("provider") != "naive":
            extra = {}
            if "naive" in base:
                extra["speedup_vs_naive"] = round(base["naive"] / ms, 2)
            if r.get("provider") != "liger" and {"naive", "liger"} <= base.keys():
                extra["speedup_vs_best"] = round(min(base.values()) / ms, 2)
            r = {**r, **extra}
        out.append((src, r))
    return out


def routing_section(items: list[tuple[str, dict]]) -> list[str]:
    """Routing build: one line per (T, E, K, routing) at T=32768, plus a summary of all shapes."""
    rows, srcs = _dedupe(items, ("T", "E", "K", "routing", "provider"))
    grid: dict = {}
    graph: dict = {}  # device time of the Triton build from CUDA-graph replays, where measured
    for r in rows:
        key = (r.get("T"), r.get("E"), r.get("K"), r.get("routing"))
        grid.setdefault(key, {})[r.get("provider")] = r.get("us")
        if r.get("provider") == "relaymoe_triton" and r.get("us_graph"):
            graph[key] = r["us_graph"]
    ratios = [
        v["sort"] / v["relaymoe_triton"]
        for v in grid.values()
        if v.get("sort") and v.get("relaymoe_triton")
    ]
    shown = []
    for (t, e, k, routing), v in sorted(grid.items(), key=lambda kv: tuple(map(str, kv[0]))):
        if t != 32768 or not v.get("relaymoe_triton"):
            continue
        sort_us = v.get("sort")
        shown.append(
            {
                "T": t,
                "E": e,
                "K": k,
                "routing": routing,
                "triton_us": v.get("relaymoe_triton"),
                "triton_device_us": graph.get((t, e, k, routing)),
                "sort_us": sort_us,
                "torch_us": v.get("relaymoe_torch"),
                "speedup_vs_sort": sort_us / v["relaymoe_triton"] if sort_us else None,
            }
        )
    shown.sort(key=lambda r: (r["E"], r["K"], str(r["routing"])))
    cols = [
        "T",
        "E",
        "K",
        "routing",
        "triton_us",
        "triton_device_us",
        "sort_us",
        "torch_us",
        "speedup_vs_sort",
    ]
    out = ["### Routing-index build (Triton, atomic-free) vs sort-based", ""]
    if ratios:
        out += [
            f"Over all {len(ratios)} measured shapes (T 4k..2M, E 8..384, K 1..16, uniform and "
            f"skewed) the Triton build is {min(ratios):.2f}x to {max(ratios):.2f}x faster than the "
            "sort-based build (eager times, Python launch overhead included; `triton_device_us` "
            "is the build's device time from CUDA-graph replays where measured); T = 32768 shown:",
            "",
        ]
    return out + [*table(shown, cols), "", _provenance(rows, srcs), ""]


# Variants whose code is gone: their committed rows stay in benchmarks/results/ as history but
# no longer describe relaymoe, so the README leaves them out.
RETIRED = {
    ("experts", "relaymoe_fusedbwd"),  # single-kernel down backward, removed 2026-11-30
    # torch._grouped_mm weight gradients: the default since b43263e82f97 (rows: "relaymoe")
    ("experts", "relaymoe_wgradgmm"),
}


def generate(results: Path) -> str:
    items = [(s, r) for s, r in load(results) if (r.get("bench"), r.get("provider")) not in RETIRED]
    out = [""]
    any_table = False
    routing = [(s, r) for s, r in items if r.get("bench") == "routing"]
    if routing:
        out += routing_section(routing)
        any_table = True
    for bench, title, keys, cols in TABLES:
        sel = [(s, r) for s, r in items if r.get("bench") == bench]
        if bench == "experts":
            sel = _with_speedups(sel)
        if not sel:
            continue
        rows, srcs = _dedupe(sel, keys)
        out += [f"### {title}", "", *table(rows, cols), "", _provenance(rows, srcs), ""]
        any_table = True
    sim = [(s, r) for s, r in items if r.get("bench") == "scaling_sim"]
    val = [(s, r) for s, r in sim if r.get("kind") == "validation"]
    ext = [
        (s, r)
        for s, r in sim
        if r.get("kind") == "extrapolation" and r.get("provider") == "sim_ring_auto"
    ]
    if val or ext:
        out += ["### EP scaling by simulation (paper Fig. 10 analog)", ""]
        if val:
            rows, srcs = _dedupe(val, ("scheme", "provider", "shape", "ep"))
            out += ["Validation against measured rows:", "", *table(rows, SIM_VALIDATION_COLS), ""]
        if ext:
            rows, srcs = _dedupe(ext, ("shape", "ep", "gpus_per_node"))
            out += [
                "Extrapolation, ring (auto mode) vs all-to-all with the same expert kernels:",
                "",
                *table(rows, SIM_EXTRAP_COLS),
                "",
            ]
        cal = [r for _, r in sim if r.get("kind") == "calibration" and r.get("paper")]
        if cal:
            out += [f"Paper (reported, not simulated): {cal[-1]['paper'].get('source', '')}", ""]
        out += [_provenance([r for _, r in sim], sorted({s for s, _ in sim})), ""]
        any_table = True
    if not any_table:
        return "\n"  # nothing committed yet: an empty section
    return "\n".join(out)


def splice(readme: str, body: str) -> str:
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise ValueError(
            f"README must contain exactly one {BEGIN} and one {END} marker "
            f"(found {readme.count(BEGIN)} and {readme.count(END)}); add them where the "
            "Results section goes"
        )
    head, rest = readme.split(BEGIN, 1)
    mid, tail = rest.split(END, 1)
    return head + BEGIN + body + END + tail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    ap.add_argument("--results", default=str(ROOT / "benchmarks/results"))
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date")
    args = ap.parse_args(argv)
    readme_path = Path(args.readme)
    if not readme_path.is_file():
        print(f"make_readme_results: {readme_path} does not exist", file=sys.stderr)
        return 2
    old = readme_path.read_text()
    try:
        new = splice(old, generate(Path(args.results)))
    except ValueError as e:
        print(f"make_readme_results: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != old:
            diff = difflib.unified_diff(
                old.splitlines(), new.splitlines(), "README.md", "generated", lineterm=""
            )
            print("\n".join(list(diff)[:80]))
            print(
                "README results are out of date: run python scripts/make_readme_results.py",
                file=sys.stderr,
            )
            return 1
        print("README results are up to date")
        return 0
    if new != old:
        readme_path.write_text(new)
        print(f"updated {readme_path}")
    else:
        print(f"{readme_path} already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
