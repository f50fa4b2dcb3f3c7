"""Where a profiled training step's GPU time goes: a torch.profiler chrome trace summarised into
rows (``bench_e2e.py --profile-steps``, the trace Megatron's ``--use-pytorch-profiler`` writes).

Per trace: the profiled steps' wall time (``ProfilerStep#N`` spans), the GPU's busy time (union of
its kernel and memcpy intervals, so overlapping streams count once) and so its idle fraction,
the kernel time by category (``CATEGORIES``: a first-match regex on the kernel name), the
``top`` kernels by time, and the GPU's idle gaps with the host events that overlap them
(``idle_host_ops``: what to look at when the GPU waits on the host). Pure Python on the trace
JSON: testable on CPU, run on the GPU machine where the trace is written (it is too large to
bring back).
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

__all__ = ["CATEGORIES", "category_of", "load_trace", "summarise", "summarise_file"]

# (category, regex on the lower-cased kernel name), first match wins
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("nccl", r"nccl"),
    ("relaymoe_experts", r"^_(up_swiglu|rows_gemm|gathered_gemm|swiglu|combine|wgrad|gather_reduce|"
                         r"pair|act_)|gathered_gemm_ws"),
    ("relaymoe_routing", r"^_(routing|count|scan|build_index|token_index|expert_)"),
    ("relaymoe_loss", r"^_(lce|linear_cross|ce_|cross_entropy)"),
    ("attention", r"flash|fmha|attn|sdpa|cudnn"),
    ("moe_permute_router", r"permute|unpermute|topk|router|moe_|sort|histogram|scatter|gather"),
    ("cross_entropy", r"cross_entropy|softmax|logsumexp|xentropy"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|matmul|cublas|sm90_|wgmma|grouped"),
    ("optimizer", r"adam|multi_tensor|l2norm|scale"),
    ("memcpy_memset", r"^memcpy|^memset"),
    ("elementwise_other", r"."),
)  # fmt: skip
_COMPILED = tuple((name, re.compile(rx)) for name, rx in CATEGORIES)
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def category_of(name: str) -> str:
    """The first ``CATEGORIES`` entry whose regex matches ``name`` (lower-cased)."""
    low = name.lower()
    for cat, rx in _COMPILED:
        if rx.search(low):
            return cat
    return "elementwise_other"


def load_trace(path: str | Path) -> dict:
    """A chrome trace from ``path`` (``.json`` or ``.json.gz``)."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        return json.load(f)


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


_HOST_CATS = {"cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver"}


def _gaps(busy: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of ``[lo, hi)`` that no span of ``busy`` covers, in order."""
    out, t = [], lo
    for a, b in sorted(busy):
        if b <= t:
            continue
        if a >= hi:
            break
        if a > t:
            out.append((t, a))
        t = max(t, b)
    if t < hi:
        out.append((t, hi))
    return out


def idle_host_ops(events: list[dict], gaps: list[tuple[float, float]], *, top: int) -> list:
    """What the host was inside while the GPU idled: per host event name (torch ops, Megatron's
    and relaymoe's annotations, CUDA runtime calls), the time its spans overlap ``gaps``. Nested
    spans each count (an optimizer step and the ops inside it both show), so read it as a
    profile's inclusive times, largest first; ``ProfilerStep`` itself is left out."""
    import bisect

    starts = [a for a, _ in gaps]
    by: dict[str, list[float]] = {}
    for e in events:
        name = str(e.get("name", "?"))
        if e.get("cat") not in _HOST_CATS or name.startswith("ProfilerStep#"):
            continue
        a, b = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        i = max(bisect.bisect_right(starts, a) - 1, 0)
        over = 0.0
        while i < len(gaps) and gaps[i][0] < b:
            over += max(0.0, min(b, gaps[i][1]) - max(a, gaps[i][0]))
            i += 1
        if over > 0:
            acc = by.setdefault(name, [0.0, 0.0])
            acc[0] += over
            acc[1] += 1
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": n[:160], "us": v[0], "calls": v[1]} for n, v in ranked]


# idle gaps by length (us): the GPU's own kernel-to-kernel step, short host work, the host
GAP_BUCKETS_US = (
    ("under_10us", 0.0, 10.0),
    ("10us_100us", 10.0, 100.0),
    ("100us_1ms", 100.0, 1000.0),
    ("1ms_and_over", 1000.0, float("inf")),
)


def summarise(trace: dict, *, top: int = 25) -> dict:
    """The summary of one trace (times in ms per profiled step): ``steps``, ``step_ms``,
    ``gpu_busy_ms``, ``gpu_busy_frac`` (the union of the GPU's kernel, memcpy and memset
    intervals over the steps' wall time) and ``gpu_idle_frac`` (one minus it), ``by_category``
    ``{cat: ms}``, ``top_kernels`` ``[{name, category, ms, calls}]``, ``cuda_graph_launches``
    (per step, over the ``ProfilerStep`` spans holding GPU events), ``gpu_idle_gaps`` and
    ``gpu_idle_max_gap_ms`` (the steps' intervals no GPU event covers), ``gpu_idle_ms_by_gap``
    (the idle time by gap length: gaps under 10 us are the GPU's own step from one kernel to
    the next, inside a CUDA graph too; gaps of a millisecond and more are the host's),
    ``gpu_events_per_step`` and ``calls_by_category`` (kernels, copies and sets a step: the
    count the short gaps scale with), ``idle_host_ops`` ``[{name, ms, calls}]``
    (``idle_host_ops``). GPU events outside those spans are left out;
    without ``ProfilerStep`` spans the whole trace is one step."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events
             if str(e.get("name", "")).startswith("ProfilerStep#")]  # fmt: skip
    gpu = [e for e in events if e.get("cat") in _GPU_CATS]
    if not steps and gpu:
        steps = [(min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu))]

    def step_of(e) -> int | None:
        return next((j for j, (a, b) in enumerate(steps) if a <= e["ts"] < b), None)

    # steps whose GPU work the trace holds (a schedule's wait and warm-up steps can leave
    # ProfilerStep spans without device events)
    busy_steps = {step_of(e) for e in gpu} - {None}
    steps = [s for j, s in enumerate(steps) if j in busy_steps]
    n = max(len(steps), 1)

    def inside(e) -> bool:
        return any(a <= e["ts"] < b for a, b in steps)

    gpu = [e for e in gpu if inside(e)]
    graph_launches = sum(1 for e in events if e.get("name") == "cudaGraphLaunch" and inside(e))
    by_name: dict[str, list[float]] = {}
    for e in gpu:
        by_name.setdefault(str(e.get("name", "?")), []).append(float(e["dur"]))
    by_cat: dict[str, float] = {}
    calls_by_cat: dict[str, int] = {}
    for name, durs in by_name.items():
        cat = category_of(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + sum(durs)
        calls_by_cat[cat] = calls_by_cat.get(cat, 0) + len(durs)
    step_us = sum(b - a for a, b in steps)
    busy_us = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
    gaps = [g for a, b in steps for g in _gaps(spans, a, b)]
    host = idle_host_ops(events, gaps, top=top)
    return {
        "steps": len(steps),
        "step_ms": step_us / n / 1e3,
        "gpu_busy_ms": busy_us / n / 1e3,
        "gpu_idle_frac": (1 - busy_us / step_us) if step_us > 0 else None,
        "gpu_busy_frac": (busy_us / step_us) if step_us > 0 else None,
        "kernel_ms": sum(sum(d) for d in by_name.values()) / n / 1e3,
        # kernels replayed from CUDA graphs may be missing from the trace: their launches
        "cuda_graph_launches": graph_launches / n,
        "by_category": {k: v / n / 1e3 for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {
                "name": name[:160],
                "category": category_of(name),
                "ms": sum(d) / n / 1e3,
                "calls": len(d) / n,
            }
            for name, d in ranked
        ],  # fmt: skip
        # the GPU's idle time: its gaps, and what the host was inside during them
        "gpu_idle_gaps": len(gaps) / n,
        "gpu_idle_max_gap_ms": max((b - a for a, b in gaps), default=0.0) / 1e3,
        "gpu_idle_ms_by_gap": {
            label: sum(b - a for a, b in gaps if lo <= b - a < hi) / n / 1e3
            for label, lo, hi in GAP_BUCKETS_US
        },
        "gpu_events_per_step": len(gpu) / n,
        "calls_by_category": {
            k: v / n for k, v in sorted(calls_by_cat.items(), key=lambda kv: -kv[1])
        },
        "idle_host_ops": [
            {"name": h["name"], "ms": h["us"] / n / 1e3, "calls": h["calls"] / n} for h in host
        ],
    }


def summarise_file(path: str | Path, *, top: int = 25) -> dict:
    """:func:`summarise` of the trace at ``path``."""
    return summarise(load_trace(path), top=top)


if __name__ == "__main__":  # python -m benchmarks.trace_summary TRACE.json[.gz]
    import sys

    for arg in sys.argv[1:]:
        print(json.dumps({"trace": arg, **summarise_file(arg)}, indent=1))
