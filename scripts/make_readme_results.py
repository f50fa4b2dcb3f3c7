"""Generate the README's headline table and docs/RESULTS.md from the current result runs.

Reads the runs ``benchmarks/results/CURRENT.json`` lists (``benchmarks/runs.py``: one folder per
run with a ``manifest.json``) and writes markdown between ``<!-- results:begin -->`` and
``<!-- results:end -->``: a short headline table in README.md, every table in docs/RESULTS.md.

  python scripts/make_readme_results.py           # rewrite both sections in place
  python scripts/make_readme_results.py --check   # exit 1 if either file differs from the output

Only clean measurements get in: a run whose manifest does not say its tree was clean, or a row
whose ``commit`` is unknown, ``-dirty``, ``-uncommitted`` or not its manifest's, stops the
generator with an error naming the file and the row (exit 2). When two rows share a table's
identity keys, the one of the newer run (manifest ``date`` then ``order``) is shown; within a run,
the later file in path order, then the later line. The scaling simulation's tables come from the
newest run that has simulation rows only (its rows are one calibration). Columns are those of a
preference list that the rows carry, so a benchmark that adds a key does not break the generator;
numbers are formatted deterministically.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.runs import ResultsError, current_rows  # noqa: E402

BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"

# (bench, title, identity keys of a row, preferred columns)
TABLES = [
    (
        "experts",
        "Fused expert kernels vs naive vs liger (1 GPU, fwd+bwd of one MoE layer)",
        # an fp8 row's weight gradients: in fp8 (over K-major columns or pair rows) or in bf16
        ("shape", "provider", "recompute", "dtype", "fp8", "fp8_wgrad", "fp8_wgrad_layout"),
        ["shape", "provider", "fp8", "fp8_wgrad", "fp8_wgrad_layout", "recompute", "grads",
         "ms_fwd_bwd", "ms_fwd", "tflops_fwd_bwd", "saved_for_bwd_MiB", "peak_over_inputs_MiB",
         "speedup_vs_naive", "speedup_vs_best"],
    ),
    (
        "ring",
        "Ring vs all-to-all (EP over GPUs of one node)",
        ("shape", "provider", "ep", "transport", "overlap", "I", "host_wait"),
        ["shape", "ep", "provider", "transport", "overlap", "host_wait", "ms_fwd_bwd", "ms_fwd",
         "tflops_fwd_bwd", "peak_over_inputs_MiB", "hidden_pct", "speedup_vs_mcore"],
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
        ("provider", "shape", "ep", "dispatcher", "fp8_format", "fp8_recipe"),
        ["shape", "ep", "provider", "dispatcher", "transformer_impl", "fp8_format", "fp8_recipe",
         "steps", "final_loss", "max_abs_loss_diff",
         "max_abs_loss_diff_vs_other", "noise_max_abs_loss_diff", "tokens_per_s", "peak_MiB"],
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
        ("config", "provider", "transformer_impl", "recompute_policy", "memory_cap_gpu",
         "alloc_conf", "max_seq"),
        ["config", "provider", "transformer_impl", "recompute_policy", "memory_cap_gpu",
         "alloc_conf", "max_seq", "first_oom_seq",
         "bracket_open", "stop_reason", "predicted_max_seq", "peak_MiB_at_max_seq",
         "planner_peak_at_max_seq_MiB"],
    ),
    (
        "numerics",
        "Numerics at scale: relative error against the float64 oracle, bf16, torch path, gloo "
        "(one seed shown per row; weight-gradient accumulators `grad_accum`: param = bf16, fp32; "
        "`-`: rows from before the option, bf16)",
        ("ep", "routing", "grad_accum", "mode"),
        ["ep", "routing", "grad_accum", "mode", "shape", "seed", "rel_err_out", "rel_err_dx",
         "rel_err_dw13", "rel_err_dw2"],
    ),
    (
        "fault",
        "A peer that dies or stalls: time until every survivor raised RingPeerError",
        ("case", "mode", "transport", "backend", "ep", "host_wait", "schedule", "gpus_per_node"),
        ["case", "mode", "transport", "backend", "ep", "host_wait", "schedule", "gpus_per_node",
         "timeout_s", "detected_s", "ok"],
    ),
    (
        "host_wait",
        "What the ring's host wait costs a Megatron run (RELAYMOE_RING_HOST_WAIT, values "
        "interleaved)",
        ("shape", "host_wait", "repeat"),
        ["shape", "host_wait", "repeat", "steps", "tokens_per_s", "peak_MiB", "final_loss"],
    ),
    (
        "determinism",
        "GPU determinism: two identical 20-step ring runs, bitwise",
        ("config", "mode", "transport"),
        ["config", "mode", "transport", "steps", "losses_identical", "weights_identical",
         "max_abs_loss_diff", "ok"],
    ),
    (
        "soak",
        "Routing-drift soak: 1,000 Megatron steps, routing uniform -> skewed -> back",
        ("config", "provider", "ring_mode", "ring_transport"),
        ["config", "provider", "ring_mode", "ring_transport", "steps", "peak_growth_pct",
         "workspace_collective", "max_abs_loss_diff_vs_other", "noise_max_abs_loss_diff", "ok"],
    ),
    (
        "memory_model",
        "Memory model vs measured peak",
        ("config", "shape", "provider", "dispatcher", "ep"),
        ["config", "shape", "dispatcher", "provider", "ep", "measured_MiB", "predicted_MiB",
         "rel_err"],
    ),
]  # fmt: skip
SIM_VALIDATION_COLS = ["scheme", "shape", "ep", "measured_ms", "predicted_ms", "rel_err", "fit"]
SIM_SCHEDULE_COLS = ["shape", "ep", "gpus_per_node", "schedule", "ms_fwd_bwd", "speedup_vs_flat",
                     "speedup_vs_alltoall", "peak_MiB"]  # fmt: skip
SIM_EXTRAP_COLS = ["shape", "ep", "gpus_per_node", "auto_mode", "ms_fwd_bwd",
                   "speedup_vs_alltoall", "mem_reduction_vs_alltoall"]  # fmt: skip
ROUTING_COLS = ["T", "E", "K", "routing", "triton_us", "triton_device_us", "sort_us", "torch_us",
                "speedup_vs_sort"]  # fmt: skip

# Variants whose code is gone: their committed rows stay in their runs as history but no longer
# describe relaymoe, so the tables leave them out.
RETIRED = {
    ("experts", "relaymoe_fusedbwd"),  # single-kernel down backward, removed 2026-11-30
    # torch._grouped_mm weight gradients: the default since b43263e82f97 (rows: "relaymoe")
    ("experts", "relaymoe_wgradgmm"),
}

# Rows that do not measure what their table says: determinism and soak rows without the ring
# mode (session 9's runs) ran mode "auto", which at tiny_qwen3's 2,048 tokens a rank picks the
# all-to-all mode, so no ring hop ran. Kept in their runs as history.
NEEDS_KEY = {"determinism": "mode", "soak": "ring_mode"}

# The README's headline: (what, bench, relaymoe row, baseline row, value key). Rows match on
# every key given; the newest matching row counts.
_QWEN_T32K = {"shape": "qwen3_30b_a3b_T32k", "ep": 2}
# The anchor first (issue #31): megatron-core as its users run it, TransformerEngine with
# TEGroupedMLP and its MoE fusions (``mcore_alltoall_te``, ``te_grouped``); these lines appear
# once such rows are in the current runs. The rows against megatron-core without TE (its
# SequentialMLP experts, one expert after another) stay, labelled as such.
_SEQ_MLP = "megatron-core without TE: SequentialMLP experts"
HEADLINE = [
    ("GPT training, tokens/s (Qwen3-width 4-layer slice, sequence 4k, 1 GPU; baseline "
     "megatron-core with TE: TEGroupedMLP, fused permute and router, fused cross-entropy, and "
     "the CUDA graphs its sweep kept; the faster of its two runs)", "e2e",
     {"shape": "qwen3_slice_s4k_te", "provider": "relaymoe_ring"},
     {"shape": "qwen3_slice_s4k_te", "provider": "mcore_alltoall_te"}, "tokens_per_s"),
    ("GPT training with gradient accumulation, tokens/s (the slice, sequence 4k, global batch "
     "16, 1 GPU; the ring dropless under megatron-core's full_iteration CUDA graph; baseline "
     "megatron-core with TE at its best, dropless, as above)", "e2e",
     {"shape": "qwen3_slice_s4k_gbs16_te", "provider": "relaymoe_ring_graphed"},
     {"shape": "qwen3_slice_s4k_gbs16_te", "provider": "mcore_alltoall_te"}, "tokens_per_s"),
    ("GPT training, tokens/s (the slice with Qwen3's 152k vocabulary, sequence 4k, 1 GPU, ring + "
     "fused loss; baseline as above, without CUDA graphs: megatron-core refuses them under this "
     "shape's full recompute)", "e2e",
     {"shape": "qwen3_slice_v152k_s4k_fused_loss_te", "provider": "relaymoe_ring"},
     {"shape": "qwen3_slice_v152k_s4k_fused_loss_te", "provider": "mcore_alltoall_te"},
     "tokens_per_s"),
    ("MoE experts fwd+bwd, ms (Qwen3-30B-A3B widths, 32k tokens, 1 GPU; baseline megatron-core's "
     "TE permute + TEGroupedMLP + unpermute)", "experts",
     {"shape": "qwen3_30b_a3b_T32k", "provider": "relaymoe", "recompute": "act"},
     {"shape": "qwen3_30b_a3b_T32k", "provider": "te_grouped"}, "ms_fwd_bwd"),
    (f"MoE layer fwd+bwd, ms (Qwen3-30B-A3B widths, 32k tokens per GPU, EP=2; baseline "
     f"{_SEQ_MLP})", "ring",
     {**_QWEN_T32K, "provider": "relaymoe_ring_auto"},
     {**_QWEN_T32K, "provider": "mcore_alltoall"}, "ms_fwd_bwd"),
    ("MoE layer peak memory over inputs, MiB (same)", "ring",
     {**_QWEN_T32K, "provider": "relaymoe_ring_auto"},
     {**_QWEN_T32K, "provider": "mcore_alltoall"}, "peak_over_inputs_MiB"),
    (f"GPT training, tokens/s (Qwen3-width 4-layer slice, sequence 4k, EP=2; baseline "
     f"{_SEQ_MLP})", "e2e",
     {"shape": "qwen3_slice_s4k", "provider": "relaymoe_ring"},
     {"shape": "qwen3_slice_s4k", "provider": "mcore_alltoall"}, "tokens_per_s"),
    ("GPT training, tokens/s (same, sequence 16k)", "e2e",
     {"shape": "qwen3_slice_s16k", "provider": "relaymoe_ring"},
     {"shape": "qwen3_slice_s16k", "provider": "mcore_alltoall"}, "tokens_per_s"),
    ("Output layer + cross-entropy fwd+bwd, ms (64k tokens, vocabulary 152k)", "loss",
     {"shape": "T64k", "provider": "relaymoe"}, {"shape": "T64k", "provider": "megatron"},
     "ms_fwd_bwd"),
    ("Output layer + cross-entropy peak over inputs, MiB (same)", "loss",
     {"shape": "T64k", "provider": "relaymoe"}, {"shape": "T64k", "provider": "megatron"},
     "peak_over_inputs_MiB"),
]  # fmt: skip
MAX_SEQ_HEADLINE = ("relaymoe_ring_fused_loss", "mcore_alltoall")
MAX_SEQ_RING_ALONE = "relaymoe_ring"  # the same run's ring without the fused loss


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
    """One row per identity: the last in ``items`` (the newest run's), at the position of its
    newest measurement; and the sources of the rows kept."""
    latest: dict = {}
    for src, r in items:
        ident = tuple(json.dumps(r.get(k), sort_keys=True) for k in keys)
        latest.pop(ident, None)
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


def _tokens(t) -> str:
    if not isinstance(t, int):
        return str(t)
    if t >= 1 << 20 and t % (1 << 20) == 0:
        return f"{t >> 20}M"
    if t >= 1024 and t % 1024 == 0:
        return f"{t >> 10}k"
    return str(t)


def _span(vals, show=str) -> str:
    vals = sorted({v for v in vals if isinstance(v, int)})
    if not vals:
        return "?"
    return show(vals[0]) if len(vals) == 1 else f"{show(vals[0])}..{show(vals[-1])}"


def routing_section(items: list[tuple[str, dict]]) -> list[str]:
    """Routing build: one line per (E, K, routing) at the shown T, plus a summary of all shapes."""
    rows, srcs = _dedupe(items, ("T", "E", "K", "routing", "provider"))
    grid: dict = {}
    graph: dict = {}  # device time of the Triton build from CUDA-graph replays, where measured
    for r in rows:
        key = (r.get("T"), r.get("E"), r.get("K"), r.get("routing"))
        grid.setdefault(key, {})[r.get("provider")] = r.get("us")
        if r.get("provider") == "relaymoe_triton" and r.get("us_graph"):
            graph[key] = r["us_graph"]
    measured = {k: v for k, v in grid.items() if v.get("sort") and v.get("relaymoe_triton")}
    ratios = [v["sort"] / v["relaymoe_triton"] for v in measured.values()]
    ts = {k[0] for k in grid if isinstance(k[0], int)}
    show_t = 32768 if 32768 in ts else max(ts, default=None)
    shown = []
    for (t, e, k, routing), v in grid.items():
        if t != show_t or not v.get("relaymoe_triton"):
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
    out = ["### Routing-index build (Triton, atomic-free) vs sort-based", ""]
    if ratios:
        keys = list(measured)
        out += [
            f"Over all {len(ratios)} measured shapes (T {_span([k[0] for k in keys], _tokens)}, "
            f"E {_span([k[1] for k in keys])}, K {_span([k[2] for k in keys])}; "
            f"{', '.join(sorted({str(k[3]) for k in keys}))} routing) the Triton build is "
            f"{min(ratios):.2f}x to {max(ratios):.2f}x faster than the sort-based build (eager "
            "times, Python launch overhead included; `triton_device_us` is the build's device "
            f"time from CUDA-graph replays where measured); T = {show_t} shown:",
            "",
        ]
    return out + [*table(shown, ROUTING_COLS), "", _provenance(rows, srcs), ""]


def sim_section(sim: list[tuple[str, dict, str]]) -> list[str]:
    """The newest run's simulation rows only: validation and extrapolation tables."""
    newest = sim[-1][2]
    sim = [(s, r) for s, r, run in sim if run == newest]
    val = [(s, r) for s, r in sim if r.get("kind") == "validation"]
    ext = [
        (s, r)
        for s, r in sim
        if r.get("kind") == "extrapolation" and r.get("provider") == "sim_ring_auto"
    ]
    out = ["### EP scaling by simulation (paper Fig. 10 analog)", ""]
    if val:
        rows, _ = _dedupe(val, ("scheme", "provider", "shape", "ep"))
        out += ["Validation against measured rows:", "", *table(rows, SIM_VALIDATION_COLS), ""]
    if ext:
        rows, _ = _dedupe(ext, ("shape", "ep", "gpus_per_node"))
        out += ["Extrapolation, ring (auto mode) vs all-to-all with the same expert kernels:", "",
                *table(rows, SIM_EXTRAP_COLS), ""]  # fmt: skip
    sched = [
        (s, r)
        for s, r in sim
        if r.get("kind") == "extrapolation" and r.get("provider") == "sim_ring_expert"
        and r.get("shape") == "E128_K8"
    ]  # fmt: skip
    if sched:
        rows, _ = _dedupe(sched, ("shape", "ep", "gpus_per_node", "schedule"))
        rows.sort(key=lambda r: (r["gpus_per_node"], r["ep"], str(r.get("schedule"))))
        title = ("Expert ring by schedule (E128 K8; `node_batched`: one hop per node over the "
                 "node's experts, by name only):")  # fmt: skip
        out += [title, "", *table(rows, SIM_SCHEDULE_COLS), ""]
    cal = [r for _, r in sim if r.get("kind") == "calibration" and r.get("paper")]
    if cal:
        out += [f"Paper (reported, not simulated): {cal[-1]['paper'].get('source', '')}", ""]
    return out + [_provenance([r for _, r in sim], sorted({s for s, _ in sim})), ""]


def full_tables(items: list[tuple[str, dict, str]]) -> str:
    """docs/RESULTS.md's generated section: every table the rows fill."""
    items = [(s, r, run) for s, r, run in items
             if (r.get("bench"), r.get("provider")) not in RETIRED
             and NEEDS_KEY.get(r.get("bench"), "bench") in r]  # fmt: skip
    out = [""]
    routing = [(s, r) for s, r, _ in items if r.get("bench") == "routing"]
    if routing:
        out += routing_section(routing)
    for bench, title, keys, cols in TABLES:
        sel = [(s, r) for s, r, _ in items if r.get("bench") == bench]
        if bench == "experts":
            # rows before session 12 carry no ``grads``: their steps added into the previous
            # step's .grad (benchmarks/README.md); the table compares SwiGLU layers (rows of
            # another ``--activation`` have no competitor rows and are left out)
            sel = [(s, r) for s, r in sel if r.get("activation", "swiglu") == "swiglu"]
            sel = _with_speedups([(s, r if "grads" in r else {**r, "grads": "accumulated"})
                                  for s, r in sel])  # fmt: skip
        if sel:
            rows, srcs = _dedupe(sel, keys)
            out += [f"### {title}", "", *table(rows, cols), "", _provenance(rows, srcs), ""]
    sim = [x for x in items if x[1].get("bench") == "scaling_sim"]
    if sim:
        out += sim_section(sim)
    return "\n".join(out) if len(out) > 1 else "\n"


def _newest_pair(items, bench: str, mine: dict, base: dict, key: str):
    """The newest ``(mine, base)`` pair of rows of ``bench`` (each a ``(source, row)``) that
    come from one run folder (one device call: one machine start, one commit) and both carry
    ``key``; None if no run holds both. A ratio of rows from two machine starts would mix the
    machines' drift into the comparison."""
    for s, r, _ in reversed(items):
        if r.get("bench") != bench or not isinstance(r.get(key), int | float):
            continue
        if _newest([(s, r, _)], bench, mine) is None:
            continue
        run = os.path.dirname(s)
        same_run = [it for it in items if os.path.dirname(it[0]) == run]
        b = _newest(same_run, bench, base)
        if b and b[1].get(key):
            return (s, r), b
    return None


def _newest(items, bench: str, match: dict):
    """The newest (source, row) of ``bench`` whose keys equal ``match``'s, or None. Rows of an
    expert activation other than SwiGLU (``bench_experts.py --activation``) have no competitor
    rows: they never stand for a headline's row; nor do fp8 rows (the headline compares bf16
    with bf16; fp8 rows have their own table lines)."""
    hit = None
    for s, r, _ in items:
        if r.get("activation", "swiglu") != "swiglu" or r.get("fp8"):
            continue
        if r.get("bench") == bench and all(r.get(k) == v for k, v in match.items()):
            hit = (s, r)
    return hit


def _num(v) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return "-"
    if isinstance(v, int) or abs(v) >= 1000:
        return f"{v:,.0f}"
    return fmt(float(v))


def _ratio(x: float) -> str:
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def _card(*rows: dict) -> str:
    """The GPU model the rows ran on ("NVIDIA H100 80GB HBM3" -> "H100"), one name per row."""
    names = []
    for r in rows:
        g = str(r.get("gpu") or "?")
        short = next((w for w in g.replace("NVIDIA", "").split() if w[:1] in "HABL"), g)
        if short not in names:
            names.append(short)
    return " / ".join(names)


def headline(items: list[tuple[str, dict, str]]) -> str:
    """README.md's generated section: relaymoe vs the Megatron baseline, the newest pair of rows
    of one run for each line."""
    lines, srcs, commits = [], set(), set()
    for what, bench, mine, base, key in HEADLINE:
        pair = _newest_pair(items, bench, mine, base, key)
        if pair is None:
            continue
        a, b = pair
        base_v = b[1][key]
        if key == "tokens_per_s" and b[1].get("repeat_tokens_per_s"):
            base_v = max(base_v, b[1]["repeat_tokens_per_s"])  # the anchor's faster run
        ratio = a[1][key] / base_v
        card = _card(a[1], b[1])
        lines.append(f"| {what} | {card} | {_num(a[1][key])} | {_num(base_v)} | {_ratio(ratio)} |")
        for s, r in (a, b):
            srcs.add(s)
            commits.add(str(r.get("commit")))
    # Longest sequence: the newest whole-GPU (uncapped) alltoall row and the ring + fused-loss
    # rows of the same run folder, so that both come from one commit and one allocator setting.
    base = _newest(items, "max_seq", {"provider": MAX_SEQ_HEADLINE[1], "memory_cap_gpu": None})
    if base and base[1].get("max_seq"):
        run = os.path.dirname(base[0])
        ours = [
            (s, r)
            for s, r, _ in items
            if r.get("bench") == "max_seq" and os.path.dirname(s) == run
            and r.get("provider") == MAX_SEQ_HEADLINE[0] and r.get("memory_cap_gpu") is None
            and r.get("max_seq")
        ]  # fmt: skip
        if ours:
            s_best, best = max(ours, key=lambda x: x[1]["max_seq"])
            b = base[1]
            oom = b.get("first_oom_seq")
            base_txt = _num(b["max_seq"]) + (f" (out of memory at {_num(oom)})" if oom else "")
            lower = ">= " if best.get("bracket_open") else ""
            alone = _ring_alone_note(items, run, b)
            lines.append(
                f"| Longest sequence that trains, tokens (`{best.get('config', '')}`, EP=2, ring + "
                f"fused loss vs alltoall{alone[0]}) | {_card(best, b)} | {lower}"
                f"{_num(best['max_seq'])} | {base_txt} | "
                f"{lower}{_ratio(best['max_seq'] / b['max_seq'])} |"
            )
            for s, r in ((s_best, best), base, *alone[1:]):
                srcs.add(s)
                commits.add(str(r.get("commit")))
    if not lines:
        return "\n"
    head = ["", "| measurement | GPU | relaymoe | Megatron baseline | relaymoe / baseline |",
            "| --- | --- | --- | --- | --- |"]  # fmt: skip
    tail = ["", "_rows: " + ", ".join(f"`{s}`" for s in sorted(srcs)) + " · commit: "
            + ", ".join(f"`{c}`" for c in sorted(commits)) + "_", ""]  # fmt: skip
    return "\n".join(head + lines + tail)


def _ring_alone_note(items, run: str, base: dict) -> tuple:
    """(text, *(source, row)) for the longest-sequence line: the same run's ring row without
    the fused loss, which says how much of the gain is the ring's and how much the loss's (the
    fused loss works with megatron-core's dispatchers too); ("",) without such a row."""
    rows = [
        (s, r)
        for s, r, _ in items
        if r.get("bench") == "max_seq" and os.path.dirname(s) == run
        and r.get("provider") == MAX_SEQ_RING_ALONE and r.get("memory_cap_gpu") is None
        and r.get("max_seq")
    ]  # fmt: skip
    if not rows:
        return ("",)
    src, ring = max(rows, key=lambda x: x[1]["max_seq"])
    gain = ring["max_seq"] / base["max_seq"]
    why = (
        "the gain is the fused loss's, which alltoall can use too"
        if gain < 1.05
        else f"the ring alone {_ratio(gain)}"
    )
    return (f"; the ring without the fused loss: {_num(ring['max_seq'])}, {why}", (src, ring))


def splice(text: str, body: str, name: str) -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(
            f"{name} must contain exactly one {BEGIN} and one {END} marker "
            f"(found {text.count(BEGIN)} and {text.count(END)}); add them where the generated "
            "section goes"
        )
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + BEGIN + body + END + tail


def _items(results: Path) -> list[tuple[str, dict, str]]:
    return [(r.source, r.data, r.run.name) for r in current_rows(results)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    ap.add_argument("--results-doc", default=str(ROOT / "docs" / "RESULTS.md"))
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--check", action="store_true", help="exit 1 if a file is out of date")
    args = ap.parse_args(argv)
    paths = {"headline": Path(args.readme), "tables": Path(args.results_doc)}
    for p in paths.values():
        if not p.is_file():
            print(f"make_readme_results: {p} does not exist", file=sys.stderr)
            return 2
    try:
        items = _items(Path(args.results))
        bodies = {"headline": headline(items), "tables": full_tables(items)}
        new = {k: splice(p.read_text(), bodies[k], p.name) for k, p in paths.items()}
    except (ValueError, ResultsError) as e:
        print(f"make_readme_results: {e}", file=sys.stderr)
        return 2
    stale = [k for k, p in paths.items() if new[k] != p.read_text()]
    if args.check:
        for k in stale:
            old = paths[k].read_text()
            diff = difflib.unified_diff(old.splitlines(), new[k].splitlines(), paths[k].name,
                                        "generated", lineterm="")  # fmt: skip
            print("\n".join(list(diff)[:80]))
        if stale:
            names = ", ".join(paths[k].name for k in stale)
            print(f"{names}: results are out of date: run python scripts/make_readme_results.py",
                  file=sys.stderr)  # fmt: skip
            return 1
        print("README.md and docs/RESULTS.md results are up to date")
        return 0
    for k, p in paths.items():
        if k in stale:
            p.write_text(new[k])
            print(f"updated {p}")
        else:
            print(f"{p} already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
