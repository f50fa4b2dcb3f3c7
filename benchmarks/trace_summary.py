"""Where a profiled training step's GPU time goes: a torch.profiler chrome trace summarised into
rows (``bench_e2e.py --profile-steps``, the trace Megatron's ``--use-pytorch-profiler`` writes).

Per trace: the profiled steps' wall time (``ProfilerStep#N`` spans), the GPU's busy time (union of
its kernel and memcpy intervals, so overlapping streams count once) and so its idle fraction,
the kernel time by category (``CATEGORIES``: a first-match regex on the kernel name) and the
``top`` kernels by time. Pure Python on the trace JSON: testable on CPU, run on the GPU machine
where the trace is written (it is too large to bring back).
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


def summarise(trace: dict, *, top: int = 25) -> dict:
    """The summary of one trace (times in ms per profiled step): ``steps``, ``step_ms``,
    ``gpu_busy_ms``, ``gpu_busy_frac`` (the union of the GPU's kernel, memcpy and memset
    intervals over the steps' wall time) and ``gpu_idle_frac`` (one minus it), ``by_category``
    ``{cat: ms}``, ``top_kernels`` ``[{name, category, ms, calls}]``, ``cuda_graph_launches``
    (per step, over the ``ProfilerStep`` spans holding GPU events). GPU events outside those
    spans are left out; without ``ProfilerStep`` spans the whole trace is one step."""
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
    for name, durs in by_name.items():
        cat = category_of(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + sum(durs)
    step_us = sum(b - a for a, b in steps)
    busy_us = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
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
    }


def summarise_file(path: str | Path, *, top: int = 25) -> dict:
    """:func:`summarise` of the trace at ``path``."""
    return summarise(load_trace(path), top=top)


if __name__ == "__main__":  # python -m benchmarks.trace_summary TRACE.json[.gz]
    import sys

    for arg in sys.argv[1:]:
        print(json.dumps({"trace": arg, **summarise_file(arg)}, indent=1))
