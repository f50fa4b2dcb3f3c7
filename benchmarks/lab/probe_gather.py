"""What the gathered up-projection pays for its gather (issue #15): one shape, one process.

Times, at one shape (default qwen3 T32k, bf16):
- ``up_swiglu`` (Triton) and ``gather_ws.up_swiglu`` (Gluon) reading x through the routing index
  (``rows=gathered``), and the same kernels over a pre-gathered, expert-sorted copy of x with
  an identity index (``rows=sorted``: the same arithmetic, sequential rows);
- ``torch._grouped_mm`` over the sorted copy (h only, CUTLASS), the contiguous reference;
- the Gluon kernel storing a alone (``out=a``) against h and a (``out=h+a``), the epilogue's share.
Rows ``bench: gather_probe`` (``kernel``, ``rows``, ``out``, ``config``, ``ms``, ``tflops``).

    PYTHONPATH=. python3 benchmarks/lab/probe_gather.py [--shape qwen3_30b_a3b_T32k] [--out F.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_experts import SHAPES  # noqa: E402
from benchmarks.common import bench_ms, gpu_writer, print_table  # noqa: E402


def _triton_up(*args) -> None:
    """grouped.up_swiglu on its Triton kernel (``gather_ws="off"``): with the default the
    launcher takes the Gluon kernel on sm90."""
    from relaymoe.kernels import grouped
    from relaymoe.options import KernelOptions

    grouped.up_swiglu(*args, kernels=KernelOptions(gather_ws="off"))


def probe(shape: str, ws_configs: list[dict], dtype=torch.bfloat16) -> list[dict]:
    from benchmarks.lab.sweep_kernels import routed_pairs
    from relaymoe.kernels import gather_ws

    num_tokens, num_experts, topk, hidden, ffn = SHAPES[shape]
    gen, offs, idx_P, prob_P = routed_pairs(SHAPES[shape], "cuda", dtype)
    n_pairs = num_tokens * topk
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * ffn, hidden, device="cuda", generator=gen)
           * hidden**-0.5).to(dtype)  # fmt: skip
    x_sorted = x.index_select(0, idx_P.long())  # (P, H), rows in expert order
    ident = torch.arange(n_pairs, device="cuda", dtype=idx_P.dtype)
    h, a = x.new_empty(n_pairs, 2 * ffn), x.new_empty(n_pairs, ffn)
    flops = 2.0 * n_pairs * hidden * 2 * ffn
    ends = (offs[1:] - offs[0]).to(torch.int32)
    rows = []

    def add(kernel, rows_kind, out, config, fn):
        row = {"kernel": kernel, "rows": rows_kind, "out": out, "config": config}
        try:
            fn()
            ms = bench_ms(fn, warmup_ms=25, rep_ms=100)
            row.update(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))
        except Exception as exc:
            row["error"] = repr(exc)[:300]
        print(row, flush=True)
        rows.append(row)

    for kind, xx, ii in (("gathered", x, idx_P), ("sorted", x_sorted, ident)):
        add("triton", kind, "h+a", None,
            lambda xx=xx, ii=ii: _triton_up(xx, w13, ii, offs, prob_P, h, a))  # fmt: skip
        for cfg in ws_configs:
            add("gluon_ws", kind, "h+a", cfg,
                lambda xx=xx, ii=ii, c=cfg: gather_ws.up_swiglu(
                    xx, w13, ii, offs, prob_P, h, a, config=c))  # fmt: skip
        add("gluon_ws", kind, "a", ws_configs[0],
            lambda xx=xx, ii=ii, c=ws_configs[0]: gather_ws.up_swiglu(
                xx, w13, ii, offs, prob_P, None, a, config=c))  # fmt: skip
    w13_t = w13.transpose(1, 2)
    add("torch_grouped_mm", "sorted", "h", None,
        lambda: torch._grouped_mm(x_sorted, w13_t, offs=ends))  # fmt: skip
    return rows


def main(argv=None) -> int:
    from relaymoe.kernels.gather_ws import UP_CONFIG

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3_30b_a3b_T32k", choices=sorted(SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    writer = gpu_writer("probe_gather", "gather_probe", args.out)
    if writer is None:
        return 1
    rows = probe(args.shape, [UP_CONFIG])
    for r in rows:
        writer.write({"bench": "gather_probe", "shape": args.shape, **r})
    print_table(rows, ["kernel", "rows", "out", "config", "ms", "tflops", "error"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
