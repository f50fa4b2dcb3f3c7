"""One MoE expert layer, forward+backward, bf16 on one GPU: relaymoe vs naive vs liger.

Providers (one process, same inputs; routing ``softmax(randn) -> top-k``, probabilities without
grad, as in ``../shared/anchors``):
- ``relaymoe`` (``recompute="act"`` and ``"fc1"``; the row's ``recompute`` key says which):
  ``moe_experts`` with the Triton backend and the default dispatch; the routing-index build is
  inside the timed step. Variants: ``relaymoe_rowscopy`` (``KernelOptions(rows_gather="copy")``: one
  gathered (P, H) copy and ``torch._grouped_mm`` for the up-projection and the down backward),
  ``relaymoe_slice1g`` / ``relaymoe_slice256m`` / ``relaymoe_unsliced`` (``hop_slice_mib`` 1024 /
  256 / 0: the hop in slices of pairs, or in one pass), ``relaymoe_wgradtriton``
  (``wgrad="triton"``: weight gradients always by the gathered-operand Triton kernel, not
  ``torch._grouped_mm`` over gathered column chunks for long expert groups) and
  ``relaymoe_tritongemm`` (``dense_gemm="triton"``: no
  ``torch._grouped_mm``).
- ``naive``: gather x into a (T*K, H) buffer, ``torch._grouped_mm`` up, SiLU*up,
  ``torch._grouped_mm`` down, probability weight, ``index_add_`` (sort inside the timed step).
- ``liger``: ``liger_kernel.ops.fused_moe.LigerFusedMoEFunction`` when importable.
- ``te_grouped``: megatron-core's own expert path with TransformerEngine, when TE imports
  (``benchmarks/te_grouped.py``): TE's fused permute, ``TEGroupedMLP`` (grouped GEMMs, fused
  weighted SwiGLU) and TE's fused unpermute, weights copied from the same inputs.
- fp8 (issue #55; rows carry ``fp8``, the recipe name, absent for bf16):
  ``relaymoe_fp8_tensorwise``, ``relaymoe_fp8_blockwise``, ``relaymoe_fp8_delayed``,
  ``relaymoe_fp8_tensorwise_bf16wgrad`` and ``relaymoe_fp8_tensorwise_rowswgrad`` (the fp8
  weight gradients over the pair rows, ``KernelOptions(fp8_wgrad_layout="rows")``, against the
  default K-major ``columnwise``; rows carry ``fp8_wgrad_layout``)
  (``moe_experts(fp8=...)`` with an ``Fp8State`` kept across steps: the fp8 weights are cached,
  as in the micro-batches of one optimizer step; the rows' ``ms_weight_quant`` times the
  once-per-step weight quantisation alone), and ``te_grouped_fp8_tensorwise`` /
  ``te_grouped_fp8_blockwise`` (``te_grouped`` under megatron-core's fp8 autocast). fp8 rows are
  checked against naive's bf16 with ``FP8_AGREE_BOUND`` (their quantisation error is a few
  percent; the bound catches a wrong scale or layout, not precision).

Before timing a shape, the output and all gradients of every other provider are checked against
naive's (``err_*`` keys of relaymoe's rows); a relative error above ``AGREE_BOUND`` makes the run
exit 1 (after all rows are written): this is where the autotuned kernels are checked at real
shapes. ``--breakdown`` also times each relaymoe kernel of the first shape's layer alone (rows
``bench: experts_breakdown``), right after that shape's table. Rows:
``bench: experts`` in the format of ``benchmarks/README.md``.

``--activation NAME`` (repeatable, or a comma list; default ``swiglu``): the expert MLP the
relaymoe providers and naive compute (``relaymoe.activation.as_activation``'s names, plus
``clamped_swiglu``: GPT-OSS's ``ExpertActivation(alpha=1.702, limit=7.0, linear_offset=1.0)``),
with w13 of that activation's rows; liger and te_grouped compute SwiGLU only and are skipped for
any other. Every row carries ``activation`` (its name) and ``flops`` (one fwd+bwd: a non-gated
activation has half the fc1 FLOPs, so ``tflops_fwd_bwd`` compares time per FLOP).

``--first-call`` (issue #15, cold start) adds to each ``relaymoe`` act row ``first_call_s``: the
wall time of the first fwd+bwd (routing index included, synchronized) in a fresh process whose
Triton cache is an empty folder, with the default ``RELAYMOE_AUTOTUNE=shipped``, and
``shipped_configs``: whether ``relaymoe/kernels/tuned_configs.json`` has entries for this GPU;
``--first-call both`` adds ``first_call_autotune_s``, the same with ``RELAYMOE_AUTOTUNE=1`` (the
full search: minutes on a cold cache).

Shapes: ``DEFAULT_SHAPES`` without ``--shapes`` (qwen3 T32k alone with ``--quick``);
``OTHER_MODEL_SHAPES`` (Mixtral-like coarse experts, Qwen3-235B, DeepSeek-V3, OLMoE) by name.

    PYTHONPATH=. python3 benchmarks/bench_experts.py [--quick] [--out PATH.jsonl] [--breakdown]
        [--first-call [shipped|both]] [--profile] [--activation NAME[,NAME...]]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from itertools import product
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    MiB,
    bench_ms,
    gpu_writer,
    moe_flops_fwd_bwd,
    print_table,
    rel_err,
)
from relaymoe.activation import SWIGLU, ExpertActivation, as_activation  # noqa: E402
from relaymoe.activation_torch import activation_forward  # noqa: E402
from relaymoe.experts import moe_experts  # noqa: E402
from relaymoe.routing import build_routing_index  # noqa: E402

# name: (T, E, K, H, I); the shapes a run without --shapes times
DEFAULT_SHAPES = {
    "qwen3_30b_a3b_T32k": (32768, 128, 8, 2048, 768),
    "qwen3_30b_a3b_T64k": (65536, 128, 8, 2048, 768),
    "moeblaze_conf3": (65536, 16, 4, 1024, 4096),
    "moeblaze_conf4": (32768, 16, 4, 2048, 8192),
}
# Issue #55's shapes of other models (one GPU's experts), by --shapes only: coarse experts
# (Mixtral 8x7B: 8 experts of I 14336, top-2; its GELU variant: ``--activation gelu`` at I 8192),
# Qwen3-235B-A22B, a DeepSeek-V3 layer's 32 local experts (256 at EP 8) and OLMoE-1B-7B
OTHER_MODEL_SHAPES = {
    "mixtral_8x7b_T16k": (16384, 8, 2, 4096, 14336),
    "mixtral_I8k_T16k": (16384, 8, 2, 4096, 8192),
    "qwen3_235b_a22b_T16k": (16384, 128, 8, 4096, 1536),
    "deepseek_v3_E32_T16k": (16384, 32, 8, 7168, 2048),
    "olmoe_1b_7b_T32k": (32768, 64, 8, 2048, 1024),
}
SHAPES = {**DEFAULT_SHAPES, **OTHER_MODEL_SHAPES}
DTYPE = torch.bfloat16


# --activation's names beyond as_activation's: GPT-OSS's clamped SwiGLU
NAMED = {"clamped_swiglu": ExpertActivation(alpha=1.702, limit=7.0, linear_offset=1.0)}


def parse_activations(values: list[str] | None) -> list[ExpertActivation]:
    """The activations of ``--activation`` values (each a name or a comma list; none: SwiGLU);
    ``ValueError`` naming a bad one and the accepted names."""
    names = [n.strip() for v in values or ["swiglu"] for n in v.split(",") if n.strip()]
    return [NAMED[n] if n in NAMED else as_activation(n) for n in names or ["swiglu"]]


def make_inputs(num_tokens, num_experts, topk, hidden, ffn, seed=0, activation=SWIGLU):
    """x, w13 (E, J, H) with J ``activation``'s fc1 rows, w2, top-k ids and probabilities."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale=1.0):
        t = torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float32) * scale
        return t.to(DTYPE).requires_grad_()

    x = rand(num_tokens, hidden)
    w13 = rand(num_experts, activation.fc1_rows(ffn), hidden, scale=hidden**-0.5)
    w2 = rand(num_experts, hidden, ffn, scale=ffn**-0.5)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    probs, idx = torch.topk(torch.softmax(logits, -1), topk, dim=-1)
    return x, w13, w2, idx.to(torch.int32), probs.to(DTYPE)


# --------------------------------------------------------------------------------------------
# providers: fn(x, w13, w2, idx, probs) -> out (T, H)
# --------------------------------------------------------------------------------------------
# Two bf16 implementations of the same layer differ by ~6e-3 relative (each ~4e-3 from float64,
# tests/gpu); beyond this something is wrong, and the run exits non-zero after writing its rows.
AGREE_BOUND = 2e-2
# An fp8 layer against bf16: 5-10% (e4m3 keeps 3 mantissa bits, e5m2 2: tests/gpu/
# test_fp8_experts_gpu.py); beyond this a scale or a layout is wrong.
FP8_AGREE_BOUND = 0.25
FP8_PROVIDERS = {  # key -> (recipe name, Fp8Recipe fields beyond the name)
    "relaymoe_fp8_tensorwise": ("tensorwise", {}),
    "relaymoe_fp8_blockwise": ("blockwise", {}),
    "relaymoe_fp8_delayed": ("delayed", {}),
    "relaymoe_fp8_tensorwise_bf16wgrad": ("tensorwise", {"fp8_wgrad": False}),
    "relaymoe_fp8_tensorwise_rowswgrad": ("tensorwise", {}),
    "te_grouped_fp8_tensorwise": ("tensorwise", {}),
    "te_grouped_fp8_blockwise": ("blockwise", {}),
}
FP8_KERNELS = {  # key -> KernelOptions fields of an fp8 provider beyond the environment's
    "relaymoe_fp8_tensorwise_rowswgrad": {"fp8_wgrad_layout": "rows"},
}


def relaymoe_fn(recompute: str, kernels: dict | None = None, activation=SWIGLU, fp8=None):
    """moe_experts of ``activation`` with these ``KernelOptions`` fields for this call and the
    backward that follows (the environment's, ``benchmarks.ENV_CONFIG``, when ``kernels`` is
    empty: torch._grouped_mm on sm90). ``fp8``: None, or an ``Fp8Recipe``: one ``Fp8State``
    serves every call (its fp8 weights quantised on the first, as a step's micro-batches)."""
    from benchmarks import ENV_CONFIG

    k = ENV_CONFIG.kernels
    k = dataclasses.replace(k, **kernels) if kernels else k
    state = None
    if fp8 is not None:
        from relaymoe.fp8_state import Fp8State

        state = Fp8State(fp8)

    def fn(x, w13, w2, idx, probs):
        index = build_routing_index(idx, w13.shape[0], validate=False)
        return moe_experts(x, w13, w2, idx, probs, index=index, recompute=recompute,
                           backend="triton", kernels=k, activation=activation,
                           fp8=state)  # fmt: skip

    # delayed scaling's first call scales by 1 and its second by amaxes its first call's
    # scales produced: the check against naive looks at the third, as a run past its start
    fn.warm_calls = 2 if state is not None and state.recipe.recipe == "delayed" else 0
    return fn


def weight_quant_ms(w13, w2, recipe) -> float:
    """Time of one quantisation of the layer's weights for ``recipe`` (once per optimizer step:
    both fp8 layouts of w13 and w2, their scales)."""
    from relaymoe.kernels.fp8.weights import quantize_expert_weights

    return bench_ms(lambda: quantize_expert_weights(w13, w2, recipe), warmup_ms=10, rep_ms=50)


def first_call_seconds(shape: str, autotune: str, timeout_s: float = 900.0) -> float | None:
    """Wall time of the first relaymoe fwd+bwd at ``shape`` in a fresh process with an empty
    Triton cache and ``RELAYMOE_AUTOTUNE=autotune`` (None if the child failed)."""
    with tempfile.TemporaryDirectory(prefix="relaymoe_cold_triton_") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, RELAYMOE_AUTOTUNE=autotune,
                   PYTHONPATH=str(Path(__file__).resolve().parents[1]))  # fmt: skip
        cmd = [sys.executable, str(Path(__file__).resolve()), "--first-call-child", shape]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        print(f"[bench_experts] first call {shape} ({autotune}) failed:\n{r.stderr[-2000:]}")
        return None
    return json.loads(lines[-1])["first_call_s"]


def _first_call_child(shape: str) -> int:
    inputs = make_inputs(*SHAPES[shape])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = relaymoe_fn("act")(*inputs)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    print(json.dumps({"first_call_s": time.perf_counter() - t0}))
    return 0


def naive_fn(x, w13, w2, idx, probs, activation=SWIGLU):
    """Token-copy baseline: sort pairs by expert, copy rows, two grouped GEMMs, scatter-add.
    ``activation`` other than SwiGLU: ``relaymoe.activation_torch``'s forward (autograd)."""
    num_experts, topk = w13.shape[0], idx.shape[1]
    flat = idx.reshape(-1).long()
    perm = torch.sort(flat, stable=True).indices
    ends = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)
    tok = perm // topk
    x_rows = x.index_select(0, tok)  # the (T*K, H) copy this baseline pays for
    h = torch._grouped_mm(x_rows, w13.transpose(1, 2), offs=ends)
    if activation == SWIGLU:
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up
    else:
        a = activation_forward(activation, h)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=ends)
    y = y * probs.reshape(-1)[perm].unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, tok, y)


def liger_fn():
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except Exception as exc:  # liger is optional: its rows are skipped with the reason
        print(f"[bench_experts] liger unavailable: {exc!r}")
        return None
    return lambda x, w13, w2, idx, probs: LigerFusedMoEFunction.apply(x, w13, w2, idx, probs)


def te_grouped_provider(inputs, topk: int, fp8: str | None = None):
    """megatron-core's TEGroupedMLP path on this shape's weights (under its fp8 autocast of
    recipe ``fp8``), or None (reason printed)."""
    from benchmarks.te_grouped import TEGroupedExperts, unavailable

    why = unavailable()
    if why is not None:
        print(f"[bench_experts] te_grouped unavailable: {why}")
        return None
    try:
        return TEGroupedExperts(inputs[1].detach(), inputs[2].detach(), topk, fp8=fp8)
    except Exception as exc:  # a TE without the recipe: its rows are skipped with the reason
        print(f"[bench_experts] te_grouped fp8={fp8} unavailable: {exc!r}")
        return None


# --------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------
def clear_grads(inputs):
    for t in inputs:
        if isinstance(t, torch.Tensor):
            t.grad = None


def measure(fn, inputs, flops, quick: bool, accumulate_grads: bool = False) -> dict:
    """Times, saved activations and peak of ``fn``'s forward+backward. Each timed step starts
    with the leaves' gradients cleared (as bench_loss and bench_ring do, and triton's
    ``grad_to_none``): a training step's first micro-batch, no add into existing ``.grad``.
    ``accumulate_grads``: keep them, so every step after the first also adds each gradient into
    ``.grad`` (an extra read-modify-write of dx, dw13, dw2, dprobs: how rows before session 12
    were measured)."""
    x = inputs[0]
    for _ in range(2):  # compile + autotune outside the timed region
        fn(*inputs).backward(torch.randn_like(x))
        clear_grads(inputs)
    dy = torch.randn_like(x)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(*inputs)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    out.backward(dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    clear_grads(inputs)

    def step():
        if not accumulate_grads:
            clear_grads(inputs)
        fn(*inputs).backward(dy)

    rep = 100 if quick else 300
    ms = bench_ms(step, warmup_ms=50, rep_ms=rep)
    with torch.no_grad():
        ms_fwd = bench_ms(lambda: fn(*inputs), warmup_ms=25, rep_ms=rep)
    clear_grads(inputs)
    return {
        "grads": "accumulated" if accumulate_grads else "cleared",
        "ms_fwd_bwd": round(ms, 3),
        "ms_fwd": round(ms_fwd, 3),
        "tflops_fwd_bwd": round(flops / ms / 1e9, 1),
        "saved_for_bwd_MiB": round(saved / MiB, 1),
        "peak_over_inputs_MiB": round(peak / MiB, 1),
    }


def check_against_naive(inputs, fns: dict, naive=naive_fn) -> dict:
    """Output and all gradients of each provider vs ``naive`` on the full shape (bf16). A
    competitor that raises (a TE without an fp8 recipe, say) gets ``{"error": ...}`` instead,
    and is not timed; relaymoe's own providers raise."""
    dy = torch.randn_like(inputs[0])

    def run(fn):
        ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*ins)
        out.backward(dy)
        if hasattr(fn, "weight_grads"):  # a provider with weights of its own (te_grouped)
            dw13, dw2 = fn.weight_grads()
            return [out.detach(), ins[0].grad, dw13, dw2, ins[4].grad]
        return [out.detach()] + [ins[i].grad for i in (0, 1, 2, 4)]

    ref = run(naive)
    names = ("out", "dx", "dw13", "dw2", "dprobs")
    checks = {}
    for key, fn in fns.items():
        try:
            for _ in range(getattr(fn, "warm_calls", 0)):
                run(fn)
            got = run(fn)
        except Exception as exc:
            if key.startswith("relaymoe"):
                raise
            print(f"[bench_experts] {key} failed its check: {exc!r}", flush=True)
            checks[key] = {"error": repr(exc)[:300]}
            torch.cuda.empty_cache()
            continue
        checks[key] = {
            f"err_{n}": round(rel_err(a, b), 5) for n, a, b in zip(names, got, ref, strict=True)
        }
        del got
    return checks


def breakdown(shape: str) -> list[dict]:
    """Each relaymoe kernel of one layer timed alone (same buffers the hop functions use)."""
    from relaymoe.kernels import grouped, pairs
    from relaymoe.kernels.experts import HopGroups, gathered_rows_times_weight, wgrad_gmm

    num_tokens, num_experts, topk, hidden, ffn = SHAPES[shape]
    x, w13, w2, idx, probs = (t.detach() for t in make_inputs(*SHAPES[shape]))
    index = build_routing_index(idx, num_experts, validate=False)
    offs = index.offsets_for(0, num_experts)
    n_pairs = num_tokens * topk
    idx_P, tim = index.expert_token_indices, index.token_index_map
    prob_P = pairs.pair_probs(probs, tim, offs, n_pairs)
    groups = HopGroups(idx_P, offs, n_pairs, True)
    dprobs = torch.zeros_like(probs)
    h = x.new_empty(n_pairs, 2 * ffn)
    dh = torch.empty_like(h)
    a = x.new_empty(n_pairs, ffn)
    y = x.new_empty(n_pairs, hidden)
    out = torch.empty_like(x)
    dw13, dw2 = torch.empty_like(w13), torch.empty_like(w2)
    pf = 2.0 * n_pairs * hidden * ffn  # FLOPs of one (P, H) x (H, I) product
    ends = groups.ends
    _ = groups.tok  # built once per hop, outside the timed stages
    dprob = torch.empty(n_pairs, device="cuda")
    gmm = "torch._grouped_mm"
    stages = [
        ("route_build", lambda: build_routing_index(idx, num_experts, validate=False), 0),
        ("pair_probs", lambda: pairs.pair_probs(probs, tim, offs, n_pairs), 0),
        ("add_pair_dprobs", lambda: pairs.add_pair_dprobs(dprob, tim, offs, dprobs), 0),
        ("up_swiglu", lambda: grouped.up_swiglu(x, w13, idx_P, offs, prob_P, h, a), 2 * pf),
        ("down_rows", lambda: grouped.rows_gemm(a, w2.transpose(1, 2), offs, y), pf),
        ("down_" + gmm, lambda: torch._grouped_mm(a, w2.transpose(1, 2), offs=ends), pf),
        ("combine", lambda: grouped.combine(y, tim, offs, out, topk, accumulate=False), 0),
        ("down_bwd_gemm", lambda: grouped.rows_gemm(x, w2, offs, a, a_idx=idx_P), pf),
        ("up_copy_" + gmm, lambda: grouped.swiglu_forward(
            gathered_rows_times_weight(x, w13.transpose(1, 2), groups), prob_P, a), 2 * pf),
        ("down_bwd_copy_" + gmm, lambda: gathered_rows_times_weight(x, w2, groups), pf),
        ("swiglu_bwd", lambda: grouped.swiglu_backward(h, a, prob_P, dh, dprob), 0),
        ("wgrad_dw2", lambda: grouped.wgrad(x, a, idx_P, offs, dw2, a_gather=True,
                                            b_gather=False, accumulate=False), pf),
        ("wgrad_dw13", lambda: grouped.wgrad(dh, x, idx_P, offs, dw13, a_gather=False,
                                             b_gather=True, accumulate=False), 2 * pf),
        # as the hop runs them: a new gradient (torch's result itself when one chunk holds it)
        ("wgrad_dw2_gmm", lambda: wgrad_gmm(x, a, None, groups, a_gather=True,
                                             accumulate=False, out_like=dw2), pf),
        ("wgrad_dw13_gmm", lambda: wgrad_gmm(dh, x, None, groups, a_gather=False,
                                              accumulate=False, out_like=dw13), 2 * pf),
        ("dgrad_rows", lambda: grouped.rows_gemm(dh, w13, offs, y), 2 * pf),
        ("dgrad_" + gmm, lambda: torch._grouped_mm(dh, w13, offs=ends), 2 * pf),
    ]  # fmt: skip
    rows = []
    for name, fn, flops in stages:
        try:
            ms = bench_ms(fn, warmup_ms=25, rep_ms=100)
            row = {"stage": name, "ms": round(ms, 3),
                   "tflops": round(flops / ms / 1e9, 1) if flops else None}  # fmt: skip
            if name.startswith("swiglu_bwd"):  # reads h, g; writes dh, p*a: 6 I elements a row
                row["gbps"] = round(6 * n_pairs * ffn * x.element_size() / ms / 1e6, 1)
            rows.append(row)
        except Exception as exc:  # one failing variant must not hide the others
            rows.append({"stage": name, "error": repr(exc)[:200]})
    return rows


def _measure_activation(args, writer, shape: str, act, providers: dict, wanted: list):
    """One shape's rows for one activation: every wanted provider that computes it checked
    against naive, then timed; returns (rows, disagreements beyond AGREE_BOUND)."""
    dims = SHAPES[shape]
    flops = moe_flops_fwd_bwd(dims[0], dims[2], dims[3], dims[4], act.fc1_rows(dims[4]))
    inputs = make_inputs(*dims, activation=act)
    _te_providers(providers, wanted, inputs, dims[2], act)
    skipped = [k for k in wanted if providers[k][2] is None and k.startswith(("liger", "te_"))]
    if skipped and act != SWIGLU:
        print(f"[bench_experts] {skipped} compute SwiGLU only: skipped for {act.name}")
    # every provider's output and gradients against naive first: a competitor whose
    # semantics differed (gate/up order, prob placement) would be timed on another problem
    checks = check_against_naive(
        inputs, {k: providers[k][2] for k in wanted if k != "naive" and providers[k][2]},
        naive=providers["naive"][2],
    )  # fmt: skip
    print(f"[bench_experts] {shape} {act.name} vs naive: {checks}", flush=True)
    wrong = _disagreements(shape, act, checks)
    shape_rows = []
    for key in wanted:
        provider, recompute, fn = providers[key]
        if fn is None or "error" in checks.get(key, {}):
            continue
        try:
            r = measure(fn, inputs, flops, args.quick, args.accumulate_grads)
        except Exception as exc:  # keep the other providers' rows
            print(f"[bench_experts] {key} {shape} {act.name} failed: {exc!r}", flush=True)
            torch.cuda.empty_cache()
            continue
        row = {"bench": "experts", "provider": provider, "shape": shape, "ep": 1, **r,
               "activation": act.name, "flops": flops}  # fmt: skip
        if recompute is not None:
            row["recompute"] = recompute
        if provider.startswith("relaymoe"):
            row["variant"] = key
        if provider.startswith("relaymoe") or key in FP8_PROVIDERS:
            row.update(checks[key])
        row.update(_fp8_row_fields(key, inputs))
        if args.first_call and key == "relaymoe_act" and act == SWIGLU:
            from relaymoe.kernels.tuned import load_table

            row["first_call_s"] = first_call_seconds(shape, "shipped")
            if args.first_call == "both":
                row["first_call_autotune_s"] = first_call_seconds(shape, "1")
            row["shipped_configs"] = torch.cuda.get_device_name() in load_table()["gpus"]
        shape_rows.append(writer.write(row))
        print(f"[bench_experts] {key} {shape} {act.name} {r}", flush=True)
    del inputs
    gc.collect()
    torch.cuda.empty_cache()
    columns = ["provider", "recompute", "activation", "shape", "ms_fwd_bwd", "ms_fwd",
               "tflops_fwd_bwd", "saved_for_bwd_MiB", "peak_over_inputs_MiB"]  # fmt: skip
    print_table(shape_rows, columns)
    comp = [r["ms_fwd_bwd"] for r in shape_rows
            if r["provider"] in ("naive", "liger", "te_grouped") and "fp8" not in r]  # fmt: skip
    for r in shape_rows:
        if r["provider"].startswith("relaymoe") and comp and "fp8" not in r:
            print(f"{shape} {act.name} {r['variant']}: {min(comp) / r['ms_fwd_bwd']:.2f}x the "
                  f"faster competitor ({min(comp):.2f} ms)", flush=True)  # fmt: skip
    _print_fp8_ratios(shape, act, shape_rows)
    return shape_rows, wrong


def _te_providers(providers: dict, wanted: list, inputs, topk: int, act) -> None:
    """The wanted ``te_grouped`` providers of this shape (bf16 and fp8), built on its weights
    (SwiGLU only)."""
    if act != SWIGLU:
        return
    for key in wanted:
        if key == "te_grouped":
            providers[key] = ("te_grouped", None, te_grouped_provider(inputs, topk))
        elif key.startswith("te_grouped_fp8_"):
            fp8 = FP8_PROVIDERS[key][0]
            providers[key] = ("te_grouped", None, te_grouped_provider(inputs, topk, fp8=fp8))


def _disagreements(shape: str, act, checks: dict) -> list[str]:
    """Errors against naive beyond the provider's bound (``FP8_AGREE_BOUND`` for fp8)."""
    out = []
    for key, errs in checks.items():
        bound = FP8_AGREE_BOUND if key in FP8_PROVIDERS else AGREE_BOUND
        out += [f"{shape} {act.name} {key} {n}={v}" for n, v in errs.items()
                if n != "error" and not v <= bound]  # fmt: skip
    return out


def _fp8_row_fields(key: str, inputs) -> dict:
    """An fp8 row's ``fp8`` (the recipe name) and, for relaymoe's, ``fp8_wgrad`` and
    ``ms_weight_quant`` (the once-per-step weight quantisation, timed alone); none for bf16."""
    if key not in FP8_PROVIDERS:
        return {}
    name, fields = FP8_PROVIDERS[key]
    row = {"fp8": name}
    if key.startswith("relaymoe"):
        from relaymoe.fp8_recipe import Fp8Recipe

        recipe = Fp8Recipe(name, **fields)
        row["fp8_wgrad"] = recipe.fp8_wgrad
        if recipe.fp8_wgrad:
            from benchmarks import ENV_CONFIG

            layout = ENV_CONFIG.kernels.fp8_wgrad_layout
            row["fp8_wgrad_layout"] = FP8_KERNELS.get(key, {}).get("fp8_wgrad_layout", layout)
        ms = weight_quant_ms(inputs[1].detach(), inputs[2].detach(), recipe)
        row["ms_weight_quant"] = round(ms, 3)
    return row


def _print_fp8_ratios(shape: str, act, shape_rows: list) -> None:
    """Each relaymoe fp8 row against relaymoe's bf16 (``recompute="act"``) and TE's fp8 rows of
    the same recipe (issue #55's targets)."""
    bf16 = [r["ms_fwd_bwd"] for r in shape_rows if r.get("variant") == "relaymoe_act"]
    for r in shape_rows:
        if "fp8" not in r or not r["provider"].startswith("relaymoe"):
            continue
        te = [t["ms_fwd_bwd"] for t in shape_rows
              if t["provider"] == "te_grouped" and t.get("fp8") == r["fp8"]]  # fmt: skip
        parts = [f"{bf16[0] / r['ms_fwd_bwd']:.2f}x relaymoe bf16"] if bf16 else []
        parts += [f"{te[0] / r['ms_fwd_bwd']:.2f}x te_grouped fp8 {r['fp8']}"] if te else []
        print(f"{shape} {act.name} {r['variant']} ({r['ms_fwd_bwd']:.2f} ms): "
              f"{', '.join(parts) or 'no baseline row'}", flush=True)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="qwen3 T32k only, shorter timing")
    ap.add_argument("--out", default=None, help="JSONL path (default benchmarks/results/...)")
    ap.add_argument("--shapes", nargs="*", default=None, choices=sorted(SHAPES))
    ap.add_argument(
        "--providers",
        nargs="*",
        default=None,
        help="relaymoe_act relaymoe_fc1 relaymoe_act_wgradtriton relaymoe_act_tritongemm "
        "relaymoe_act_tma relaymoe_act_ptr relaymoe_act_rowscopy relaymoe_act_tritonup "
        "relaymoe_fc1_tritonup naive liger te_grouped, and fp8: relaymoe_fp8_tensorwise "
        "relaymoe_fp8_blockwise relaymoe_fp8_delayed relaymoe_fp8_tensorwise_bf16wgrad "
        "te_grouped_fp8_tensorwise te_grouped_fp8_blockwise (relaymoe_act: the default tma, "
        "tensor descriptors on sm90; _tma forces them, _ptr the pointer loads; _rowscopy: "
        "rows_gather='copy'; _tritonup: gather_ws='off', the Triton up-projection; "
        "relaymoe_act_slice1g / _slice256m / _unsliced: hop_slice_mib 1024 / 256 / 0)",
    )
    ap.add_argument("--breakdown", action="store_true", help="time each kernel of the first shape")
    ap.add_argument(
        "--accumulate-grads",
        action="store_true",
        help="time steps that add into the previous step's .grad (the rows before session 12); "
        "default: gradients cleared before each step",
    )
    ap.add_argument(
        "--profile",
        nargs="*",
        default=None,
        help="torch.profiler over steps of the first shape for these providers (none named: "
        "relaymoe_act): GPU time by kernel, and the gap to the step's wall time (rows "
        "experts_profile)",
    )
    ap.add_argument(
        "--first-call",
        nargs="?",
        const="shipped",
        default=None,
        choices=("shipped", "both"),
        help="cold-start fields: first fwd+bwd in a fresh process, empty Triton cache "
        "(both: also with the full autotuner search)",
    )
    ap.add_argument(
        "--activation",
        action="append",
        default=None,
        help="expert activation(s) of the relaymoe providers and naive, repeatable or a comma "
        "list: relaymoe.activation.as_activation's names (swiglu, geglu, gelu, squared_relu, ...) "
        "or clamped_swiglu (GPT-OSS's); default swiglu. liger and te_grouped: SwiGLU only",
    )
    ap.add_argument("--first-call-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.first_call_child:
        return _first_call_child(args.first_call_child)
    try:
        activations = parse_activations(args.activation)
    except ValueError as exc:
        ap.error(str(exc))
    writer = gpu_writer("bench_experts", "experts", args.out)
    if writer is None:
        return 1
    shapes = args.shapes or (["qwen3_30b_a3b_T32k"] if args.quick else list(DEFAULT_SHAPES))

    def providers_of(act: ExpertActivation) -> dict:
        """key -> (provider, recompute, fn) computing ``act`` (None: the provider cannot)."""
        swiglu = act == SWIGLU

        def rm(recompute, kernels=None):
            return relaymoe_fn(recompute, kernels, activation=act)

        def rm_fp8(key, name, fields):
            from relaymoe.fp8_recipe import Fp8Recipe

            return relaymoe_fn("act", FP8_KERNELS.get(key), activation=act,
                               fp8=Fp8Recipe(name, **fields))  # fmt: skip

        return {
            "relaymoe_act": ("relaymoe", "act", rm("act")),
            "relaymoe_fc1": ("relaymoe", "fc1", rm("fc1")),
            "relaymoe_act_wgradtriton": (
                "relaymoe_wgradtriton", "act", rm("act", {"wgrad": "triton"})),
            "relaymoe_act_tritongemm": (
                "relaymoe_tritongemm", "act", rm("act", {"dense_gemm": "triton"})),
            "relaymoe_act_tma": ("relaymoe_tma", "act", rm("act", {"tma": "on"})),
            "relaymoe_act_ptr": ("relaymoe_ptr", "act", rm("act", {"tma": "off"})),
            "relaymoe_act_rowscopy": (
                "relaymoe_rowscopy", "act", rm("act", {"rows_gather": "copy"})),
            "relaymoe_act_tritonup": ("relaymoe_tritonup", "act", rm("act", {"gather_ws": "off"})),
            # the hop in slices of pairs (KernelOptions.hop_slice_mib): what slicing costs
            "relaymoe_act_slice1g": (
                "relaymoe_slice1g", "act", rm("act", {"hop_slice_mib": 1024})),
            "relaymoe_act_slice256m": (
                "relaymoe_slice256m", "act", rm("act", {"hop_slice_mib": 256})),
            "relaymoe_act_unsliced": ("relaymoe_unsliced", "act", rm("act", {"hop_slice_mib": 0})),
            "relaymoe_fc1_tritonup": ("relaymoe_tritonup", "fc1", rm("fc1", {"gather_ws": "off"})),
            **{key: ("relaymoe", "act", rm_fp8(key, name, fields))
               for key, (name, fields) in FP8_PROVIDERS.items() if key.startswith("relaymoe")},
            **{key: ("te_grouped", None, None)  # built per shape, from its weights
               for key in FP8_PROVIDERS if key.startswith("te_grouped")},
            "naive": ("naive", None, naive_fn if swiglu else partial(naive_fn, activation=act)),
            "liger": ("liger", None, liger if swiglu else None),
            "te_grouped": ("te_grouped", None, None),  # built per shape, from its weights
        }  # fmt: skip

    liger = liger_fn()
    providers = providers_of(SWIGLU)
    # the target's comparison (relaymoe act vs naive and liger) first, so a cut-off run keeps it
    wanted = args.providers or [
        "relaymoe_act", "naive", "liger", "te_grouped", "relaymoe_fc1",
        "relaymoe_act_wgradtriton", "relaymoe_act_ptr"]  # fmt: skip
    profiled = [] if args.profile is None else args.profile or ["relaymoe_act"]
    unknown = sorted((set(wanted) | set(profiled)) - set(providers))
    if unknown:
        ap.error(f"unknown providers {unknown}; choose from {sorted(providers)}")
    columns = ["provider", "recompute", "activation", "shape", "ms_fwd_bwd", "ms_fwd",
               "tflops_fwd_bwd", "saved_for_bwd_MiB", "peak_over_inputs_MiB"]  # fmt: skip
    rows, wrong = [], []
    for n_shape, shape in enumerate(shapes):
        for act in activations:
            shape_rows, bad = _measure_activation(args, writer, shape, act, providers_of(act),
                                                  wanted)  # fmt: skip
            rows += shape_rows
            wrong += bad
        # profiles (each activation's layer; profile_experts builds its own inputs) and the
        # breakdown (SwiGLU's)
        for name, act in product(profiled if n_shape == 0 else (), activations):
            from benchmarks.profile_experts import profile_step

            prof_rows, summary = profile_step(shape, providers_of(act)[name][2], activation=act)
            tag = {"shape": shape, "profiled": name, "activation": act.name}
            for r in prof_rows:
                writer.write({"bench": "experts_profile", **tag, **r})
            writer.write({"bench": "experts_profile_step", **tag, **summary})
            print_table(prof_rows[:40], ["kernel", "calls_per_step", "us_per_step"])
            print(f"[bench_experts] {shape} profile of {name} ({tag['activation']}): {summary}",
                  flush=True)  # fmt: skip
        if args.breakdown and n_shape == 0:
            bd = breakdown(shape)
            for r in bd:
                writer.write({"bench": "experts_breakdown", "shape": shape, **r})
            print_table(bd, ["stage", "ms", "tflops", "gbps", "error"])
            sys.stdout.flush()
    if len(shapes) > 1:
        print_table(rows, columns)
    if wrong:  # the autotuned kernels at real shapes are checked here, not in the GPU tests
        print(f"[bench_experts] disagree with naive beyond {AGREE_BOUND}: {wrong}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
