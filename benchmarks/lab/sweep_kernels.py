"""Each weight-gradient variant of one expert layer timed alone, per tile configuration (#15).

``--kernels accumulate`` times the weight gradient as a training step with Megatron's gradient-
accumulation fusion runs it: added into an fp32 ``main_grad`` (experts in reverse order), at one
micro-batch's tokens (``--tokens``, default 4,096: the e2e slice at EP 1, 256 pairs an expert),
per configuration; ``gbps`` counts c's read and write (8 bytes an element).

``--kernels rows`` also times up_swiglu and the gathered-dy ``rows_gemm`` per configuration
(``ROW_CONFIGS``), ``--kernels combine`` the deterministic combine (``COMBINE_CONFIGS``).

At one shape (default qwen3 T32k, bf16, one GPU) it times, with the buffers the hop backward uses:
- the Triton wgrad kernel (``dw2``: dy gathered, p*a contiguous; ``dw13``: dh contiguous, x
  gathered) for each configuration of ``CONFIGS``, with the contiguous operand by pointer loads
  (``tma=0``) and through a tensor descriptor (``tma=1``);
- the default ``torch._grouped_mm`` path (``gmm``) whole, and its parts: the column-chunk
  gathers alone, the grouped GEMMs alone on gathered chunks, and the copies into the gradient.
Each variant's result is compared with the float32 ``gmm`` result (``err``), so a fast wrong
configuration is visible. Rows ``bench: kernel_sweep`` (``kernel``, ``variant``, ``config``,
``ms``, ``tflops``, ``err``).

    PYTHONPATH=. python3 benchmarks/lab/sweep_kernels.py [--shape qwen3_30b_a3b_T32k]
        [--out F.jsonl] [--configs all|short] [--kernels wgrad,rows]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_experts import SHAPES  # noqa: E402
from benchmarks.common import bench_ms, gpu_writer, print_table  # noqa: E402
from relaymoe.kernels import select  # noqa: E402
from relaymoe.options import KernelOptions  # noqa: E402
from relaymoe.routing import build_routing_index  # noqa: E402


def _cfg(bm, bn, bk, warps, stages) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}


# (M tile over the gradient's rows, N tile over its columns, K: pairs a step)
CONFIGS = [
    _cfg(128, 128, 64, 8, 5),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 128, 64, 8, 3),
    _cfg(128, 128, 32, 8, 6),
    _cfg(128, 256, 64, 8, 3),
]
SHORT = CONFIGS[:2]


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return round(((got.float() - ref).norm() / ref.norm()).item(), 5)


def _wgrad_problem(dims, device, dtype, *, seed: int = 0) -> dict:
    """One expert layer's weight-gradient operands at ``dims`` = (T, E, K, H, I): top-K routing
    of random logits, its index and hop groups (built here, outside the timed stages), and the
    two kernels' operands as ``kernels``: (name, a, b, a_gather, out shape, flops) for ``dw2``
    (dy gathered, p*a contiguous) and ``dw13`` (dh contiguous, x gathered); ``gen``: the
    generator, for more inputs from the same seed."""
    from relaymoe.kernels.experts import HopGroups

    num_tokens, num_experts, topk, hidden, ffn = dims
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, device=device, generator=gen) * scale).to(dtype)

    logits = torch.randn(num_tokens, num_experts, device=device, generator=gen)
    idx = torch.topk(logits, topk, dim=-1).indices.to(torch.int32)
    index = build_routing_index(idx, num_experts, validate=False)
    offs = index.offsets_for(0, num_experts)
    n_pairs = num_tokens * topk
    idx_P = index.expert_token_indices
    groups = HopGroups(idx_P, offs, n_pairs, True)
    _ = groups.tok, groups.ends
    x, dy = randn(num_tokens, hidden), randn(num_tokens, hidden)
    a, dh = randn(n_pairs, ffn, scale=0.1), randn(n_pairs, 2 * ffn, scale=0.1)
    pf = 2.0 * n_pairs * hidden * ffn
    kernels = [
        ("dw2", dy, a, True, (num_experts, hidden, ffn), pf),
        ("dw13", dh, x, False, (num_experts, 2 * ffn, hidden), 2 * pf),
    ]
    return {"idx_P": idx_P, "offs": offs, "groups": groups, "n_pairs": n_pairs,
            "kernels": kernels, "gen": gen}  # fmt: skip


def sweep(
    shape: str, configs: list[dict], *, dims=None, device="cuda", dtype=torch.bfloat16,
    kernels=None,
) -> list[dict]:  # fmt: skip
    """Rows for ``shape`` (``dims`` = (T, E, K, H, I) overrides it: the CPU check of this
    harness runs a tiny problem under the Triton interpreter). ``kernels``: the
    ``KernelOptions`` whose pair-buffer budget sizes the gathered chunks (default: the
    environment's, ``relaymoe.options.from_env``)."""
    from relaymoe import options

    budget = kernels if kernels is not None else options.from_env().kernels
    from relaymoe.kernels import grouped
    from relaymoe.kernels.experts import wgrad_gmm

    p = _wgrad_problem(dims or SHAPES[shape], device, dtype)
    idx_P, offs, groups, n_pairs = p["idx_P"], p["offs"], p["groups"], p["n_pairs"]
    kernels = p["kernels"]
    rows = []

    def add(kernel, variant, config, fn, flops, out, ref):
        try:
            ms = bench_ms(fn, warmup_ms=25, rep_ms=100)
            rows.append({"kernel": kernel, "variant": variant, "config": config,
                         "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1),
                         "err": _err(out() if callable(out) else out, ref)
                         if ref is not None else None})  # fmt: skip
        except Exception as exc:  # one failing configuration must not hide the others
            rows.append({"kernel": kernel, "variant": variant, "config": config,
                         "error": repr(exc)[:300]})  # fmt: skip
        print(rows[-1], flush=True)

    for name, op_a, op_b, a_gather, out_shape, flops in kernels:
        out = torch.empty(out_shape, device=device, dtype=dtype)
        ref = torch.empty(out_shape, device=device, dtype=torch.float32)
        wgrad_gmm(op_a, op_b, ref, groups, a_gather=a_gather, accumulate=False)
        got = {}

        def gmm(o=out, aa=op_a, bb=op_b, ag=a_gather, g=got):  # its result, uncopied when whole
            g["out"] = wgrad_gmm(aa, bb, None, groups, a_gather=ag, accumulate=False, out_like=o)

        add(name, "gmm", None, gmm, flops, lambda g=got: g["out"], ref)
        gathered = op_a if a_gather else op_b
        chunks = select.col_chunks(n_pairs, gathered.shape[1], gathered.element_size(),
                                   budget)  # fmt: skip
        bufs = [gathered[:, c0:c1].index_select(0, groups.tok) for c0, c1 in chunks]

        def gathers(g=gathered, ch=chunks):
            for c0, c1 in ch:
                g[:, c0:c1].index_select(0, groups.tok)

        def gemms(bb=bufs, aa=op_a, b_=op_b, ag=a_gather):
            for buf in bb:
                if ag:
                    torch._grouped_mm(buf.t(), b_, offs=groups.ends)
                else:
                    torch._grouped_mm(aa.t(), buf, offs=groups.ends)

        res = [torch._grouped_mm(b.t(), op_b, offs=groups.ends) if a_gather
               else torch._grouped_mm(op_a.t(), b, offs=groups.ends) for b in bufs]  # fmt: skip

        def copies(o=out, rr=res, ch=chunks, ag=a_gather):
            for (c0, c1), r in zip(ch, rr, strict=True):
                (o[:, c0:c1, :] if ag else o[:, :, c0:c1]).copy_(r)

        add(name, "gmm_gathers", {"chunks": len(chunks)}, gathers, 0.0, out, None)
        add(name, "gmm_gemms", {"chunks": len(chunks)}, gemms, flops, out, None)
        add(name, "gmm_copies", {"chunks": len(chunks)}, copies, 0.0, out, None)
        del bufs, res
        for tma in ("0", "1"):
            k = KernelOptions(tma="on" if tma == "1" else "off")
            for cfg in configs:
                out.fill_(float("nan"))

                def run(o=out, aa=op_a, bb=op_b, ag=a_gather, c=cfg, k=k):
                    grouped.wgrad(aa, bb, idx_P, offs, o, a_gather=ag, b_gather=not ag,
                                  accumulate=False, config=c, kernels=k)  # fmt: skip

                add(name, f"triton_tma{tma}", cfg, run, flops, out, ref)
        # the ceiling without the gather: both operands contiguous (the gathered one copied in
        # pair order beforehand, not timed), both through descriptors
        k_on = KernelOptions(tma="on")
        full = gathered.index_select(0, groups.tok)
        ca, cb = (full, op_b) if a_gather else (op_a, full)
        for cfg in configs[:2]:

            def run_c(o=out, c=cfg, x_a=ca, x_b=cb, k_on=k_on):
                grouped.wgrad(x_a, x_b, idx_P, offs, o, a_gather=False, b_gather=False,
                              accumulate=False, config=c, kernels=k_on)  # fmt: skip

            add(name, "triton_contiguous_tma1", cfg, run_c, flops, out, ref)
        del full, ca, cb
        del out, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# each also with PRELOAD_C (the output tile read before the pairs' loop, a wgrad candidate)
ACCUMULATE_CONFIGS = [
    {**c, "PRELOAD_C": p}
    for c in (CONFIGS[0], _cfg(128, 128, 64, 8, 3), _cfg(64, 128, 64, 4, 4),
              _cfg(128, 64, 64, 4, 4), _cfg(64, 64, 64, 4, 4))
    for p in (False, True)
]  # fmt: skip


def sweep_accumulate(
    shape: str,
    tokens: int,
    configs: list[dict],
    *,
    tmas=("auto",),
    dims=None,
    device="cuda",
    dtype=torch.bfloat16,
) -> list[dict]:
    """The weight gradients added into fp32 ``main_grad`` (reverse expert order), per
    configuration and ``tmas`` (``KernelOptions.tma``); each result checked once against c's
    start + the float32 ``gmm`` product (``err``). ``dims`` = (E, K, H, I) overrides the
    shape's (the CPU check: a tiny fp32 problem)."""
    from relaymoe.kernels import grouped
    from relaymoe.kernels.experts import wgrad_gmm

    p = _wgrad_problem((tokens, *(dims or SHAPES[shape][1:])), device, dtype)
    idx_P, offs, groups, gen = p["idx_P"], p["offs"], p["groups"], p["gen"]
    rows = []
    for name, op_a, op_b, a_gather, out_shape, flops in p["kernels"]:
        ref = torch.empty(out_shape, device=device, dtype=torch.float32)
        wgrad_gmm(op_a, op_b, ref, groups, a_gather=a_gather, accumulate=False)
        start = torch.randn(out_shape, device=device, generator=gen)
        want = start + ref.flip(0)  # the gradient buffer holds the experts in reverse order
        main_grad = start.clone()
        nbytes = 8 * main_grad.numel()
        for tma in tmas:
            k = KernelOptions(tma=tma)
            for cfg in configs:

                def run(c=cfg, k=k, aa=op_a, bb=op_b, ag=a_gather, mg=main_grad):
                    grouped.wgrad(aa, bb, idx_P, offs, mg, a_gather=ag, b_gather=not ag,
                                  accumulate=True, config=c, kernels=k, reverse=True)  # fmt: skip

                row = {"kernel": name, "variant": f"accumulate_tma_{tma}", "config": cfg,
                       "tokens": tokens}  # fmt: skip
                try:
                    main_grad.copy_(start)
                    run()
                    row["err"] = _err(main_grad, want)
                    ms = bench_ms(run, warmup_ms=25, rep_ms=100)
                    row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                               gbps=round(nbytes / ms / 1e6, 1))  # fmt: skip
                except Exception as exc:  # one failing configuration must not hide the others
                    row["error"] = repr(exc)[:300]
                rows.append(row)
                print(row, flush=True)
        del ref, start, want, main_grad
    return rows


# the gathered-row GEMMs: up_swiglu (x[tok] @ w13[e]^T, two accumulators) and the down
# projection's backward (dy[tok] @ w2[e]); a 64-pair step uses 48 KB (up) of shared memory a stage
ROW_CONFIGS = {
    "up_swiglu": [
        _cfg(128, 128, 64, 8, 4),
        _cfg(128, 128, 64, 8, 3),
        _cfg(128, 128, 32, 8, 6),
        _cfg(128, 128, 32, 8, 8),
        _cfg(128, 64, 64, 4, 5),
    ],
    "down_bwd": [
        _cfg(128, 256, 64, 8, 3),
        _cfg(128, 128, 64, 8, 4),
        _cfg(128, 128, 64, 8, 5),
        _cfg(128, 256, 32, 8, 5),
        _cfg(128, 128, 32, 8, 8),
    ],
}


# the warp-specialised Gluon kernels (kernels/gather_ws.py): overrides of their UP_CONFIG and
# ROWS_CONFIG (``{}`` keeps GROUP_M 8 at every shape; the library's default takes WIDE_GROUP_M
# for wide experts)
WS_VARIANTS = {
    "up_swiglu": [
        {},
        {"STAGES": 2},
        {"BLOCK_K": 32, "STAGES": 6},
        {"EPI_ROWS": 32},
        {"producer_regs": 56, "storer_regs": 80},
        {"GROUP_M": 1},  # the order before GROUP_M: N tiles fastest
        {"GROUP_M": 4},
        {"GROUP_M": 16},
        # fewer storer or producer warps (a 2-warp storer spills with 16-row slices)
        {"storer_warps": 2, "EPI_ROWS": 8},
        {"producer_warps": 2},
        {"outputs": "a"},  # the forward of recompute="fc1"
        {"outputs": "h"},  # its backward's recompute
        {"outputs": "none"},
        {"outputs": "none", "STAGES": 4},  # no epilogue buffer: room for a 4th slot
    ],
    "down_bwd": [
        {},
        {"EPI_ROWS": 16},
        {"BLOCK_K": 32, "STAGES": 6},
        {"GROUP_M": 1},
        {"GROUP_M": 16},
        {"storer_warps": 2},
        {"producer_warps": 2},
        {"outputs": "none"},
        {"outputs": "none", "STAGES": 4},
    ],
}
# ``outputs`` (a variant's key, not a kernel configuration): what the storer writes. "h+a" (the
# default: act mode's forward) or "h" for the down backward; "a" and "h" alone; "none" stores
# nothing and the consumer keeps only its accumulators' row sums (no epilogue buffer, so a 4th
# slot fits): the main loop's time alone, what the epilogue and the slot count cost (a
# diagnostic).


def routed_pairs(dims, device, dtype):
    """Softmax top-k routing of random logits over ``dims`` = (T, E, K, H, I), seed 0: the
    generator (drawn on next), the whole range's offsets, the pair tokens and the pair probs."""
    from relaymoe.kernels import pairs

    num_tokens, num_experts, topk, _, _ = dims
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_tokens, num_experts, device=device, generator=gen)
    probs, idx = torch.topk(torch.softmax(logits, -1), topk, dim=-1)
    index = build_routing_index(idx.to(torch.int32), num_experts, validate=False)
    offs = index.offsets_for(0, num_experts)
    prob_P = pairs.pair_probs(probs.to(dtype), index.token_index_map, offs, num_tokens * topk)
    return gen, offs, index.expert_token_indices, prob_P


def sweep_rows(shape: str, configs: dict, *, dims=None, device="cuda", dtype=torch.bfloat16,
               ws_configs=None):  # fmt: skip
    """up_swiglu and the gathered-dy rows_gemm per configuration (default ``RELAYMOE_TMA``);
    ``err`` against the first configuration's result. ``ws_configs``: kernel -> the Gluon
    kernels' configurations (overrides of ``UP_CONFIG`` / ``ROWS_CONFIG``), timed after the
    Triton ones (variant ``gluon_ws``)."""
    from relaymoe.kernels import grouped

    ws_configs = ws_configs or {}
    num_tokens, num_experts, topk, hidden, ffn = dims or SHAPES[shape]
    gen, offs, idx_P, prob_P = routed_pairs(dims or SHAPES[shape], device, dtype)
    n_pairs = num_tokens * topk

    def randn(*size, scale=1.0):
        return (torch.randn(*size, device=device, generator=gen) * scale).to(dtype)

    x, dy = randn(num_tokens, hidden), randn(num_tokens, hidden)
    w13 = randn(num_experts, 2 * ffn, hidden, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, ffn, scale=ffn**-0.5)
    h, a = x.new_empty(n_pairs, 2 * ffn), x.new_empty(n_pairs, ffn)
    pf = 2.0 * n_pairs * hidden * ffn
    ws, why = select.gather_ws_module() if ws_configs else (None, None)
    if why:
        print(why)
    rows = []
    for kernel, cfgs in configs.items():
        runs = [("triton", grouped, cfg) for cfg in cfgs]
        if ws is not None:
            base = ws.UP_CONFIG if kernel == "up_swiglu" else ws.ROWS_CONFIG
            runs += [("gluon_ws", ws, {**base, **v}) for v in ws_configs.get(kernel, ())]
        ref = None
        for variant, lib, cfg in runs:
            outputs = cfg.get("outputs", "default")
            c_run = {k: v for k, v in cfg.items() if k != "outputs"}
            if outputs != "default":
                fn, out = _ws_outputs_run(ws, kernel, outputs, c_run, x, dy, w13, w2, idx_P,
                                          offs, prob_P, h, a)  # fmt: skip
                flops = 2 * pf if kernel == "up_swiglu" else pf
            elif kernel == "up_swiglu":

                def fn(c=c_run, m=lib):
                    m.up_swiglu(x, w13, idx_P, offs, prob_P, h, a, config=c)

                out, flops = h, 2 * pf
            elif variant == "triton":

                def fn(c=c_run):
                    grouped.rows_gemm(dy, w2, offs, a, a_idx=idx_P, config=c)

                out, flops = a, pf
            else:

                def fn(c=c_run):
                    ws.rows_gemm(dy, w2, idx_P, offs, a, config=c)

                out, flops = a, pf
            row = {"kernel": kernel, "variant": variant, "config": cfg}
            rate = lambda ms, f=flops: {"tflops": round(f / ms / 1e9, 1)}  # noqa: E731
            if outputs == "default":
                ref = _time_config(row, fn, out, ref, rate)
            else:  # other outputs: compared with nothing (``err`` of a run against itself)
                _time_config(row, fn, out, None, rate)
                if outputs == "none":
                    row["err"] = None
            rows.append(row)
    return rows


def _ws_outputs_run(ws, kernel, outputs, cfg, x, dy, w13, w2, idx_P, offs, prob_P, h, a):
    """``(fn, out)``: the Gluon kernel with only ``outputs`` stored (see ``WS_VARIANTS``)."""
    if kernel == "up_swiglu" and outputs in ("a", "h"):
        h_out, a_out = (None, a) if outputs == "a" else (h, None)

        def fn():
            ws.up_swiglu(x, w13, idx_P, offs, prob_P if outputs == "a" else None, h_out, a_out,
                         config=cfg)  # fmt: skip

        return fn, a if outputs == "a" else h
    if outputs != "none":
        raise ValueError(f"outputs={outputs!r} for {kernel}: 'a', 'h' (up_swiglu) or 'none'")
    # nothing stored: the public launchers' diagnostic ``store_nothing`` (outputs untouched)
    if kernel == "up_swiglu":

        def fn():
            ws.up_swiglu(x, w13, idx_P, offs, None, h, a, config=cfg, store_nothing=True)

    else:

        def fn():
            ws.rows_gemm(dy, w2, idx_P, offs, a, config=cfg, store_nothing=True)

    return fn, a


def _time_config(row: dict, fn, out, ref, rate):
    """Fill ``row``: ``err`` of ``fn``'s ``out`` against ``ref`` (its own first result when None)
    and its time, with ``rate(ms)``'s keys; or ``error``. Returns ``ref``."""
    try:
        out.fill_(float("nan"))
        fn()
        if ref is None:
            ref = out.float().clone()
        row["err"] = _err(out, ref)
        ms = bench_ms(fn, warmup_ms=25, rep_ms=100)
        row.update(ms=round(ms, 3), **rate(ms))
    except Exception as exc:  # e.g. shared memory: the other configurations still run
        row["error"] = repr(exc)[:300]
    print(row, flush=True)
    return ref


# combine (BLOCK_T tokens, BLOCK_N columns, warps): the first is the launcher's default (session
# 12: 32 x 256 with 8 warps, 0.167 ms against 0.198 for 16 x 256 with 4 warps, the old default)
COMBINE_CONFIGS = [
    (32, 256, 8), (16, 256, 4), (32, 256, 4), (64, 128, 8), (16, 512, 8), (8, 512, 4),
]  # fmt: skip


def sweep_combine(shape: str, configs: list, *, dims=None, device="cuda", dtype=torch.bfloat16):
    """The deterministic combine of one (P, H/2) column chunk (what the down projection and the
    dgrad reduce per chunk at the default pair-buffer budget) per configuration; ``err``
    against the first configuration's result, ``gbps`` = bytes of y read and out written."""
    from relaymoe.kernels import grouped

    num_tokens, num_experts, topk, hidden, _ = dims or SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_tokens, num_experts, device=device, generator=gen)
    idx = torch.topk(logits, topk, dim=-1).indices.to(torch.int32)
    index = build_routing_index(idx, num_experts, validate=False)
    offs = index.offsets_for(0, num_experts)
    n_pairs, ncols = num_tokens * topk, max(1, hidden // 2)
    y = torch.randn(n_pairs, ncols, device=device, generator=gen).to(dtype)
    out = torch.empty(num_tokens, ncols, device=device, dtype=dtype)
    nbytes = (n_pairs + num_tokens) * ncols * y.element_size()
    rows, ref = [], None
    for cfg in configs:

        def fn(c=cfg):
            grouped.combine(y, index.token_index_map, offs, out, topk, accumulate=False, config=c)

        row = {"kernel": "combine", "variant": "triton", "config": list(cfg)}
        ref = _time_config(row, fn, out, ref, lambda ms: {"gbps": round(nbytes / ms / 1e6, 1)})
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3_30b_a3b_T32k", choices=sorted(SHAPES))
    ap.add_argument("--configs", default="all", choices=("all", "short"))
    ap.add_argument("--kernels", default="wgrad,rows",
                    help="wgrad, rows (up_swiglu, down_bwd), combine, accumulate")  # fmt: skip
    ap.add_argument(
        "--gluon-only",
        action="store_true",
        help="rows kernels: time the Gluon variants alone (no Triton compiles)",
    )
    ap.add_argument(
        "--ws-only",
        default=None,
        metavar="TEXT",
        help="time only the Gluon variants whose override mentions TEXT (or one of TEXT1|TEXT2; "
        "{} is the unchanged configuration)",
    )
    ap.add_argument(
        "--triton-order",
        action="store_true",
        help="rows kernels: the first Triton configuration alone, at GROUP_M 1 (N "
        "tiles fastest), its default and 16",
    )
    ap.add_argument("--tokens", type=int, default=4096,
                    help="--kernels accumulate: one micro-batch's tokens")  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    writer = gpu_writer("sweep_kernels", "kernel_sweep", args.out)
    if writer is None:
        return 1
    rows = []
    which = {k: v for k, v in ROW_CONFIGS.items() if "rows" in args.kernels or k in args.kernels}
    if which and args.gluon_only:
        which = {k: [] for k in which}
    if which and args.triton_order:
        first = {k: v[0] for k, v in which.items()}
        which = {k: [dict(c, GROUP_M=1), c, dict(c, GROUP_M=16)] for k, c in first.items()}
    if which:
        ws = {} if args.triton_order else WS_VARIANTS
        if args.ws_only:  # alternatives split by "|"; "{}" is the unchanged configuration
            alts = args.ws_only.split("|")
            ws = {k: [v for v in vs if any(a in repr(v) for a in alts)] for k, vs in ws.items()}
        rows += sweep_rows(args.shape, which, ws_configs=ws)
    if "combine" in args.kernels:
        rows += sweep_combine(args.shape, COMBINE_CONFIGS)
    if "accumulate" in args.kernels:
        rows += sweep_accumulate(args.shape, args.tokens, ACCUMULATE_CONFIGS)
    if "wgrad" in args.kernels.split(","):
        rows += sweep(args.shape, CONFIGS if args.configs == "all" else SHORT)
    for r in rows:
        writer.write({"bench": "kernel_sweep", "shape": args.shape, **r})
    print_table(rows, ["kernel", "variant", "config", "ms", "tflops", "gbps", "err", "error"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
