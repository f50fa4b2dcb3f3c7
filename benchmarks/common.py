"""Shared benchmark plumbing: timing, memory accounting, profiler helpers and JSON result rows.

Row format (one JSON object per line in a run folder's ``*.jsonl``, ``benchmarks/README.md``):
``bench``, ``provider``, ``shape``, ``ep``, ``ms_fwd_bwd``,
``ms_fwd``, ``tflops_fwd_bwd``, ``saved_for_bwd_MiB``, ``peak_over_inputs_MiB``, and where/how:
``gpu``, ``commit``, ``torch``, ``triton``, ``command``. Benchmarks may add keys.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

MiB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[1]


def moe_flops_fwd_bwd(tokens: int, topk: int, hidden: int, ffn: int,
                      fc1_rows: int | None = None) -> float:  # fmt: skip
    """FLOPs of one MoE layer forward+backward: 3 x the forward's 2*T*K*H*(J + I), J the fc1
    rows of one expert (``fc1_rows``; default 2*I, a gated activation such as SwiGLU: 18*T*K*H*I;
    I for a non-gated one: 12*T*K*H*I)."""
    rows = 2 * ffn if fc1_rows is None else fc1_rows
    return 6.0 * tokens * topk * hidden * (rows + ffn)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``||got - ref|| / ||ref||`` (Frobenius, in float64); inf for a non-finite ``got``."""
    got, ref = got.double(), ref.double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def torch_norm_impl() -> str:
    """The planner's ``normalization_impl`` of megatron-core's torch norm fallback with this
    torch: ``torch`` where RMSNorm is torch's fused kernel (``aten::_fused_rms_norm``, used on
    CUDA), ``torch_composite`` otherwise (``relaymoe.planner.memory``)."""
    return "torch" if hasattr(torch.ops.aten, "_fused_rms_norm") else "torch_composite"


def commit() -> str:
    env = os.environ.get("RELAYMOE_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:  # not a checkout (e.g. copied tree on the device machine)
        return "unknown"


def environment(gpu: str | None = None) -> dict:
    """Where and how a row was measured; ``gpu`` given: that name, and CUDA is not touched (a
    harness whose GPUs belong to its child processes)."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # triton is optional for the plain-torch providers
        triton_version = None
    if gpu is None:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "gpu": gpu,
        "commit": commit(),
        "torch": torch.__version__,
        "triton": triton_version,
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "date": _dt.date.today().isoformat(),
    }


def bench_ms(fn: Callable[[], object], *, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds of ``fn`` on CUDA (``triton.testing.do_bench``), wall clock on CPU."""
    if torch.cuda.is_available():
        import triton.testing

        return float(
            triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        )
    import statistics
    import time

    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class JsonlWriter:
    """Appends rows (with the environment keys) to a .jsonl file and echoes a short line."""

    def __init__(self, path: str | os.PathLike, *, env: dict | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.env = env if env is not None else environment()
        self.rows: list[dict] = []

    def write(self, row: dict) -> dict:
        full = {**row, **{k: v for k, v in self.env.items() if k not in row}}
        self.rows.append(full)
        with self.path.open("a") as f:
            f.write(json.dumps(full, sort_keys=False) + "\n")
        return full


def gpu_writer(tool: str, stem: str, out: str | None) -> JsonlWriter | None:
    """The JSONL writer of a GPU-only harness (``out``, else
    ``benchmarks/results/<stem>_<date>.jsonl``), or None after saying that ``tool`` needs CUDA."""
    if not torch.cuda.is_available():
        print(f"{tool} needs CUDA")
        return None
    env = environment()
    return JsonlWriter(out or f"benchmarks/results/{stem}_{env['date']}.jsonl", env=env)


def print_table(rows: Iterable[dict], columns: list[str]) -> None:
    """Plain fixed-width table (the device tool returns only the output's tail)."""
    rows = list(rows)
    widths = [max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def busy_us(intervals, exclude=()) -> float:
    """Length of the union of ``(name, start_us, end_us)`` intervals, names containing any of
    ``exclude`` left out (NCCL kernels that spin while a peer is late count as idle)."""
    spans = sorted((a, b) for n, a, b in intervals if not any(x in n for x in exclude))
    total, cur_a, cur_b = 0.0, None, None
    for a, b in spans:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + (cur_b - cur_a if cur_b is not None else 0.0)


def host_syncs(fn) -> dict[str, int]:
    """Synchronizing CUDA calls of one ``fn()`` (torch's sync debug mode), counted by the
    innermost relaymoe (or benchmark) frame that issued them."""
    import traceback
    import warnings

    found: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        # torch's text for a sync; turning the mode on raises another warning, not a sync
        if "called a synchronizing CUDA operation" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if "relaymoe" in f.filename and f.filename != __file__]
        if ours:
            f = ours[-1]
            where = f"{f.filename.split('relaymoe')[-1]}:{f.lineno} ({(f.line or '').strip()[:60]})"
        else:  # no relaymoe frame: the last frames, outermost first
            where = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in stack[-4:])
        found[where] = found.get(where, 0) + 1

    with warnings.catch_warnings():  # restores showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return found
