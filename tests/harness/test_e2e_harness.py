"""The end-to-end benchmark's plumbing on CPU: the Megatron flags of each shape and provider, the
parity/noise computation and the rows of failed runs (``benchmarks/bench_e2e.py``,
``benchmarks/e2e.py``). The training itself runs on GPUs only (``tests/gpu``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks import bench_e2e
from benchmarks.e2e import (
    REGIMES,
    RunResult,
    loss_parity,
    merge_flags,
    pretrain_args,
    run_pretrain,
)
from relaymoe.config import load_config
from tests.fixtures import run_python

GPUS = 2


def _groups(flags) -> dict[str, list[str]]:
    """flag -> its values; asserts that no flag appears twice."""
    out: dict[str, list[str]] = {}
    cur = None
    for t in flags:
        if t.startswith("--"):
            assert t not in out, f"{t} given twice"
            out[t] = []
            cur = t
        else:
            out[cur].append(t)
    return out


def _v(g, flag) -> str:
    assert flag in g, f"{flag} missing"
    (val,) = g[flag]
    return val


def test_qwen3_slice_config():
    cfg = load_config("qwen3_slice")
    m, p, t = cfg.model, cfg.parallel, cfg.training
    assert (m.num_layers, m.hidden_size, m.num_experts, m.moe_router_topk) == (4, 2048, 128, 8)
    assert (m.moe_ffn_hidden_size, m.num_attention_heads, m.query_groups, m.head_dim) == (
        768,
        32,
        4,
        128,
    )
    assert m.vocab_size == 32768 and m.padded_vocab_size(1) == 32768
    assert m.qk_layernorm and m.moe_layer_pattern == (1, 1, 1, 1) and t.precision == "bf16"
    assert load_config("tiny_qwen3").model.qk_layernorm  # as the tiny config, qk-layernorm on
    assert (p.ep, p.dp, p.world_size) == (2, 2, 2)


GBS_SHAPES = {  # issue #49: name -> (sequence, global batch, recompute)
    "qwen3_slice_s4k_gbs16_te": (4096, 16, None),
    "qwen3_slice_s4k_gbs64_te": (4096, 64, None),
    "qwen3_slice_s16k_gbs8_te": (16384, 8, "selective"),
    "qwen3_slice_v152k_s4k_gbs16_fused_loss_te": (4096, 16, "full"),
    "qwen3_slice_v152k_s4k_gbs64_fused_loss_te": (4096, 64, "full"),
}
LOCAL_GBS_SHAPES = {"qwen3_slice_s4k_gbs16"}  # the gbs comparison without TE
QWEN_SHAPES = [
    n
    for n in bench_e2e.SHAPES
    if n.startswith("qwen3_slice") and n not in {*GBS_SHAPES, *LOCAL_GBS_SHAPES}
]
PP_SHAPES = [n for n in bench_e2e.SHAPES if "_pp2" in n]
EXPERT_MLP_SHAPES = {"tiny_qwen3_gelu": "gelu", "tiny_qwen3_squared_relu": "squared_relu"}


def test_every_shape_is_checked_below():
    assert set(QWEN_SHAPES) | set(PP_SHAPES) | set(EXPERT_MLP_SHAPES) | set(GBS_SHAPES) | set(
        LOCAL_GBS_SHAPES
    ) == set(bench_e2e.SHAPES)


def test_the_gbs_shape_without_te_runs_local_layers():
    """``qwen3_slice_s4k_gbs16``: the ring eager and under the whole-step graph, against
    megatron-core's alltoall, all with megatron-core's local layers and no TE flag (local
    per-layer graphs over the ring's MoE layer are refused)."""
    plans = _plans("qwen3_slice_s4k_gbs16")
    assert [p.provider for p in plans] == list(bench_e2e.LOCAL_GBS_PROVIDERS)
    g = {p.provider: _groups(p.flags) for p in plans}
    for name, f in g.items():
        assert _v(f, "--transformer-impl") == "local" and _v(f, "--global-batch-size") == "16"
        assert "--moe-permute-fusion" not in f and "--moe-expert-capacity-factor" not in f, name
    assert _v(g["relaymoe_ring_graphed"], "--cuda-graph-impl") == "full_iteration"
    assert "--cuda-graph-impl" not in g["relaymoe_ring"]
    assert "--cuda-graph-impl" not in g["mcore_alltoall"]
    assert PP_SHAPES


@pytest.mark.parametrize("shape", sorted(EXPERT_MLP_SHAPES))
def test_expert_mlp_shapes_differ_from_tiny_qwen3_only_in_the_activation(shape):
    """Issue #36: tiny_qwen3 with GELU (megatron-core's default MLP) or squared-ReLU experts,
    50 steps under the stable regime at EP = GPUs; ring and alltoall differ in the dispatcher."""
    spec = bench_e2e.SHAPES[shape]
    plans = bench_e2e.plan_runs(spec, gpus=GPUS, steps=50, seed=1234, noise_run=True,
                                check_te=False)  # fmt: skip
    groups = {p.label: _groups(p.flags) for p in plans}
    tiny = bench_e2e.E2EShape("tiny_qwen3_swiglu", "tiny_qwen3")  # the same but SwiGLU
    bases = {p.dispatcher: _groups(p.flags) for p in bench_e2e.plan_runs(
        tiny, gpus=GPUS, steps=50, seed=1234, noise_run=False, check_te=False)}  # fmt: skip
    for plan in plans:
        g, base = groups[plan.label], bases[plan.dispatcher]
        assert "--swiglu" not in g and g["--disable-bias-linear"] == []
        assert ("--squared-relu" in g) == (EXPERT_MLP_SHAPES[shape] == "squared_relu")
        assert _v(g, "--expert-model-parallel-size") == str(GPUS) and _v(g, "--train-iters") == "50"
        assert float(_v(g, "--lr")) == 1e-4 and _v(g, "--seq-length") == "512"
        same = g.keys() & base.keys()
        assert {k: g[k] for k in same} == {k: base[k] for k in same}  # the rest is tiny_qwen3's
        assert set(g) - set(base) <= {"--squared-relu"} and set(base) - set(g) <= {"--swiglu"}
    ring = {k: v for k, v in groups["ring"].items() if k != "--relaymoe-mode"}
    diff = {k for k in ring.keys() | groups["alltoall"].keys()
            if ring.get(k) != groups["alltoall"].get(k)}  # fmt: skip
    assert diff == {"--moe-token-dispatcher-type"}, diff


def test_megatron_builds_the_expert_mlp_shapes_activations():
    """Megatron's parser and validation take the ring runs' flags (the ring's refusals among
    them, via register()); the parsed flags map to the activation the shape names (the
    alltoall runs' flags differ in the dispatcher only, checked above)."""
    from types import SimpleNamespace

    from relaymoe.activation import ExpertActivation
    from relaymoe.megatron.activation_map import expert_activation_problems

    keys = ("swiglu", "squared_relu", "quick_geglu", "add_bias_linear", "bias_gelu_fusion",
            "bias_swiglu_fusion", "transformer_impl", "moe_grouped_gemm",
            "moe_token_dispatcher_type")  # fmt: skip
    rings = {
        shape: bench_e2e.plan_runs(bench_e2e.SHAPES[shape], gpus=GPUS, steps=50, seed=1,
                                   noise_run=False, check_te=False)[0]
        for shape in EXPERT_MLP_SHAPES
    }  # fmt: skip
    parsed = megatron_args([(ring.flags, keys) for ring in rings.values()])  # one subprocess
    for (shape, fn), a in zip(EXPERT_MLP_SHAPES.items(), parsed, strict=True):
        ring = rings[shape]
        assert isinstance(a, dict), a  # a refusal's traceback otherwise
        assert a["moe_token_dispatcher_type"] == ring.dispatcher == "ring"
        assert not a["swiglu"] and not a["add_bias_linear"] and not a["bias_gelu_fusion"]
        act, problems = expert_activation_problems(SimpleNamespace(**a), args_style=True)
        assert problems == [] and act == ExpertActivation(fn=fn, gated=False), (act, problems)


@pytest.mark.parametrize("shape", PP_SHAPES)
def test_pipeline_shapes_run_1f1b_at_ep1(shape):
    """Issue #17: PP=2 on 2 GPUs, EP=1, two micro-batches a step (1F1B needs >= PP of them),
    the interleaved variant with two virtual stages; ring and alltoall differ in the dispatcher."""
    plans = bench_e2e.plan_runs(bench_e2e.SHAPES[shape], gpus=GPUS, steps=50, seed=1234,
                                noise_run=True)  # fmt: skip
    groups = {p.label: _groups(p.flags) for p in plans}
    for g in groups.values():
        assert _v(g, "--pipeline-model-parallel-size") == "2"
        assert _v(g, "--expert-model-parallel-size") == "1"
        mbs, gbs = int(_v(g, "--micro-batch-size")), int(_v(g, "--global-batch-size"))
        assert gbs == 2 * mbs  # DP = 1: two micro-batches through the pipeline
        vpp = g.get("--num-layers-per-virtual-pipeline-stage")
        assert (vpp == ["1"]) == shape.endswith("_vpp2"), vpp
    ring = {k: v for k, v in groups["ring"].items() if k != "--relaymoe-mode"}
    diff = {k for k in ring.keys() | groups["alltoall"].keys()
            if ring.get(k) != groups["alltoall"].get(k)}  # fmt: skip
    assert diff == {"--moe-token-dispatcher-type"}, diff


@pytest.mark.parametrize("shape", QWEN_SHAPES)
def test_shape_flags_per_provider(shape):
    seq = {"qwen3_slice_s4k": 4096, "qwen3_slice_s16k": 16384}.get(shape, 4096)
    vocab = "151936" if "v152k" in shape else "32768"
    spec = bench_e2e.SHAPES[shape]
    plans = bench_e2e.plan_runs(spec, gpus=GPUS, steps=50, seed=1234, noise_run=True,
                                check_te=False)  # fmt: skip
    assert [(p.label, p.dispatcher) for p in plans] == [
        ("ring", "ring"),
        ("alltoall", "alltoall"),
        ("alltoall_repeat", "alltoall"),
    ]
    groups = {p.label: _groups(p.flags) for p in plans}
    for label, g in groups.items():
        assert _v(g, "--seq-length") == str(seq) and _v(g, "--max-position-embeddings") == str(seq)
        assert _v(g, "--micro-batch-size") == "1" and _v(g, "--global-batch-size") == str(GPUS)
        assert _v(g, "--expert-model-parallel-size") == "2"
        assert _v(g, "--tensor-model-parallel-size") == "1"
        assert _v(g, "--num-layers") == "4" and _v(g, "--hidden-size") == "2048"
        assert _v(g, "--num-experts") == "128" and _v(g, "--moe-router-topk") == "8"
        assert _v(g, "--moe-ffn-hidden-size") == "768" and _v(g, "--vocab-size") == vocab
        assert _v(g, "--num-attention-heads") == "32" and _v(g, "--num-query-groups") == "4"
        assert _v(g, "--kv-channels") == "128" and g["--qk-layernorm"] == []
        assert g["--bf16"] == [] and "--moe-layer-freq" not in g  # every layer MoE
        assert _v(g, "--tokenizer-type") == "NullTokenizer" and g["--mock-data"] == []
        assert _v(g, "--train-iters") == "50" and _v(g, "--seed") == "1234"
        # the stable regime
        assert float(_v(g, "--lr")) == 1e-4 and float(_v(g, "--min-lr")) == 1e-5
        assert _v(g, "--lr-warmup-iters") == "10" and float(_v(g, "--clip-grad")) == 1.0
        assert _v(g, "--lr-decay-style") == "cosine" and float(_v(g, "--adam-beta2")) == 0.95
        fused = "_fused_loss" in shape and label == "ring"
        assert ("--relaymoe-fused-loss" in g) == fused, label
        if spec.anchor:  # megatron-core at its best, and the ring with the same flags
            assert _v(g, "--transformer-impl") == "transformer_engine"
            for flag in bench_e2e.ANCHOR_FLAGS:
                assert g[flag] == [], (label, flag)
            # the kept candidates: the router/preprocess graphs on the alltoall runs only; none
            # under full recompute (megatron-core refuses partial graphs there)
            modules = ["attn", "moe_router", "moe_preprocess"] if label != "ring" else ["attn"]
            if g.get("--recompute-granularity") == ["full"]:
                assert "--cuda-graph-impl" not in g and "--cuda-graph-modules" not in g, label
            else:
                assert g["--cuda-graph-modules"] == modules, label
        else:
            assert "--moe-permute-fusion" not in g and "--cross-entropy-loss-fusion" not in g
        if spec.fp8:
            assert (_v(g, "--fp8-format"), _v(g, "--fp8-recipe")) == spec.fp8
        else:
            assert "--fp8-format" not in g and "--fp8-recipe" not in g
        if shape == "qwen3_slice_s16k":
            assert _v(g, "--recompute-granularity") == "selective"
            assert g["--recompute-modules"] == ["core_attn"]
        elif "v152k" in shape:
            assert _v(g, "--recompute-granularity") == "full"
        else:
            assert "--recompute-granularity" not in g and "--recompute-modules" not in g
        want = "ring" if label == "ring" else "alltoall"
        assert _v(g, "--moe-token-dispatcher-type") == want
        assert ("--relaymoe-mode" in g) == (label == "ring")
    assert _v(groups["ring"], "--relaymoe-mode") == "auto"
    # identical flags otherwise; the noise run is the first alltoall run's exact command
    assert plans[1].flags == plans[2].flags
    ring = {k: v for k, v in groups["ring"].items() if k != "--relaymoe-mode"}
    diff = {
        k
        for k in ring.keys() | groups["alltoall"].keys()
        if ring.get(k) != groups["alltoall"].get(k)
    }
    expected = {"--moe-token-dispatcher-type"}
    if spec.anchor and "--cuda-graph-modules" in groups["alltoall"]:
        expected.add("--cuda-graph-modules")  # the router/preprocess graphs: alltoall's alone
    if "_fused_loss" in shape:
        expected.add("--relaymoe-fused-loss")
    assert diff == expected, diff


def test_cli_dry_run_and_early_errors(capsys):
    argv = ["--shapes", "qwen3_slice_s4k,qwen3_slice_s16k", "--noise-run", "--dry-run"]
    assert bench_e2e.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [ln for ln in lines if ln.startswith("# ")]
    assert len(heads) == 6 and heads[2] == "# qwen3_slice_s4k alltoall_repeat (regime stable, EP=2)"
    assert lines[lines.index(heads[2]) + 1] == lines[lines.index(heads[1]) + 1]
    with pytest.raises(SystemExit):  # 5 steps: fewer than the stable regime's warm-up
        bench_e2e.main(["--shapes", "qwen3_slice_s4k", "--steps", "5", "--dry-run"])
    assert "do not exceed its 10 warm-up" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_e2e.main(["--shapes", "qwen3_slice_s8k", "--dry-run"])
    assert "unknown shape" in capsys.readouterr().err


def test_noise_run_only_when_asked():
    shape = bench_e2e.SHAPES["qwen3_slice_s4k"]
    plans = bench_e2e.plan_runs(shape, gpus=GPUS, steps=50, seed=1, noise_run=False)
    assert [p.label for p in plans] == ["ring", "alltoall"]


_MEGATRON_ARGS = textwrap.dedent(
    """
    import contextlib, io, json, os, sys, traceback, warnings
    warnings.filterwarnings("ignore")
    import torch
    torch.cuda.get_device_capability = lambda *a: (9, 0)  # validate_args asks for it
    from relaymoe.megatron import register
    register()
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables
    env = dict(os.environ)
    for i, (flags, keys) in enumerate(json.loads(sys.stdin.read())):
        sys.argv, err = ["pretrain", *flags], io.StringIO()
        try:
            with contextlib.redirect_stderr(err):  # where argparse says what it refuses
                a = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
            print("ARGS " + json.dumps([i, {k: getattr(a, k) for k in keys}]), flush=True)
        except BaseException:  # argparse exits: the next flags still get parsed
            print("ERROR " + json.dumps([i, err.getvalue() + traceback.format_exc()]), flush=True)
        finally:  # each flag set from a clean slate, as in a process of its own
            unset_global_variables()
            os.environ.clear()
            os.environ.update(env)
    """
)


def megatron_args(jobs, world: int = 2) -> list:
    """For each ``(flags, keys)`` of ``jobs``: the ``keys`` of the arguments Megatron's own parser
    and validation make of ``flags`` at world size ``world``, or the traceback of its refusal.
    One process (no GPU; ``run_python``) parses them all in turn, Megatron's global state unset
    between them: importing Megatron is most of its time."""
    env = dict(os.environ, WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0",
               CUDA_VISIBLE_DEVICES="")  # fmt: skip
    payload = json.dumps([[list(flags), list(keys)] for flags, keys in jobs])
    p = run_python(["-c", _MEGATRON_ARGS], timeout=240, env=env, input=payload)
    got = {}
    for ln in p.stdout.splitlines():
        if ln.startswith(("ARGS ", "ERROR ")):
            i, value = json.loads(ln.split(" ", 1)[1])
            got[i] = value if ln.startswith("ARGS ") else "refused:\n" + value
    assert p.returncode == 0 and len(got) == len(jobs), p.stdout[-2000:] + p.stderr[-4000:]
    return [got[i] for i in range(len(jobs))]


# The shapes whose runs' flags go through Megatron's parser, with the arguments each test reads.
PARSED_SHAPES = {
    "qwen3_slice_s16k": (
        "seq_length", "micro_batch_size", "global_batch_size", "data_parallel_size",
        "expert_model_parallel_size", "padded_vocab_size", "num_experts",
        "moe_token_dispatcher_type", "lr", "lr_warmup_iters", "clip_grad", "adam_beta2",
        "recompute_granularity", "bf16", "train_iters",
    ),
    "tiny_qwen3_pp2_vpp2": (
        "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "data_parallel_size", "expert_model_parallel_size", "global_batch_size",
        "micro_batch_size", "moe_token_dispatcher_type",
    ),
}  # fmt: skip


UNKNOWN_FLAG = "--no-such-flag"


@pytest.fixture(scope="module")
def parsed_plans() -> dict:
    """shape -> [(plan, its ``PARSED_SHAPES`` arguments as Megatron makes them at world size 2
    (EP=2, DP=2), or its refusal)] for every run ``plan_runs`` gives the shape, all in one
    Megatron subprocess; ``"unknown flag"``: what the subprocess made of the first of them with
    ``UNKNOWN_FLAG`` added, parsed before all the others."""
    plans = [(name, plan) for name in PARSED_SHAPES
             for plan in bench_e2e.plan_runs(bench_e2e.SHAPES[name], gpus=GPUS, steps=50,
                                             seed=1234, noise_run=False)]  # fmt: skip
    first, plan = plans[0]
    bad = ((*plan.flags, UNKNOWN_FLAG), PARSED_SHAPES[first])
    refused, *parsed = megatron_args([bad] + [(p.flags, PARSED_SHAPES[n]) for n, p in plans])
    out: dict = {name: [] for name in PARSED_SHAPES}
    for (name, plan), args in zip(plans, parsed, strict=True):
        out[name].append((plan, args))
    out["unknown flag"] = refused
    return out


def test_megatron_parses_the_shape_flags(parsed_plans):
    """Megatron's own parser and validation accept the flags (world size 2: EP=2, DP=2)."""
    runs = parsed_plans["qwen3_slice_s16k"]
    assert runs
    for plan, a in runs:
        assert a == {
            "seq_length": 16384,
            "micro_batch_size": 1,
            "global_batch_size": 2,
            "data_parallel_size": 2,
            "expert_model_parallel_size": 2,
            "padded_vocab_size": 32768,
            "num_experts": 128,
            "moe_token_dispatcher_type": plan.dispatcher,
            "lr": 1e-4,
            "lr_warmup_iters": 10,
            "clip_grad": 1.0,
            "adam_beta2": 0.95,
            "recompute_granularity": "selective",
            "bf16": True,
            "train_iters": 50,
        }, a


def test_megatron_refuses_flags_it_does_not_know(parsed_plans):
    """The shared subprocess reports a refused flag set as refused (the checks above can fail),
    and parses the flag sets after it as if alone (they pass above)."""
    refused = parsed_plans["unknown flag"]
    assert isinstance(refused, str), refused
    assert f"unrecognized arguments: {UNKNOWN_FLAG}" in refused, refused


def test_default_mode_keeps_the_tiny_runs():
    """No --shapes: tiny_qwen3 at 200 steps, ring + alltoall, the launcher's regime as before."""
    (shape,) = [bench_e2e.config_shape("tiny_qwen3", 200)]
    plans = bench_e2e.plan_runs(shape, gpus=2, steps=200, seed=1234, noise_run=False)
    assert shape.name == "tiny_qwen3_steps200" and [p.label for p in plans] == ["ring", "alltoall"]
    g = _groups(plans[0].flags)
    assert (float(_v(g, "--lr")), float(_v(g, "--min-lr"))) == (3e-4, 3e-5)
    assert _v(g, "--lr-warmup-iters") == "10" and float(_v(g, "--clip-grad")) == 1.0
    assert "--adam-beta2" not in g and "--adam-beta1" not in g
    assert (_v(g, "--seq-length"), _v(g, "--micro-batch-size"), _v(g, "--global-batch-size")) == (
        "512",
        "4",
        "8",
    )
    assert list(plans[0].flags) == pretrain_args(
        "tiny_qwen3", gpus=2, steps=200, dispatcher="ring", seed=1234
    )


def test_extra_flags_replace_instead_of_repeating():
    base = pretrain_args("tiny_qwen3", gpus=2, steps=20, dispatcher="ring", seed=1)
    out = pretrain_args(
        "tiny_qwen3",
        gpus=2,
        steps=20,
        dispatcher="ring",
        seed=1,
        extra=["--lr", "5e-5", "--save", "/ck", "--save-interval", "10"],
    )
    g = _groups(out)  # asserts no duplicate
    assert _v(g, "--lr") == "5e-5" and _v(g, "--save") == "/ck"
    assert out.index("--lr") == base.index("--lr")  # replaced in place
    assert out[-4:] == ["--save", "/ck", "--save-interval", "10"]
    assert merge_flags(["--a", "1", "--b"], ["--b", "--c", "-1", "--a", "2"]) == [
        "--a",
        "2",
        "--b",
        "--c",
        "-1",
    ]
    with pytest.raises(ValueError, match="starts with the value"):
        merge_flags(["1", "--a"], [])


def test_regime_and_sequence_guards():
    with pytest.raises(ValueError, match="do not exceed its 10 warm-up"):
        pretrain_args("qwen3_slice", gpus=2, steps=10, dispatcher="ring", seed=1, regime="stable")
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        pretrain_args("tiny_qwen3", gpus=2, steps=20, dispatcher="ring", seed=1, seq_length=1024)
    with pytest.raises(ValueError, match="known"):
        pretrain_args("tiny_qwen3", gpus=2, steps=20, dispatcher="ring", seed=1, regime="fast")
    f = REGIMES["stable"].row_fields(50)
    assert (f["lr"], f["lr_warmup_iters"], f["clip_grad"], f["adam_beta2"]) == (1e-4, 10, 1.0, 0.95)
    assert REGIMES["launcher"].row_fields(50)["lr_warmup_iters"] == 2  # max(1, steps // 20)


# -- parity / noise on synthetic loss curves ------------------------------------------------------


def _run(label, losses, rc=0, dispatcher=None, **kw):
    steps = [
        {"loss": x, "tokens_per_s": 1000.0 + i, "peak_MiB": 10.0} for i, x in enumerate(losses)
    ]
    d = dispatcher or ("ring" if label == "ring" else "alltoall")
    return RunResult(d, rc, steps=steps, label=label, seconds=12.5, command="torchrun x", **kw)


BASE = [5.0 - 0.05 * i for i in range(50)]


def _shift(curve, at, by):
    return [x + (by if i == at else 0.0) for i, x in enumerate(curve)]


def test_parity_within_twice_the_noise():
    ring = _run("ring", _shift(BASE, 30, 0.0499))
    a2a = _run("alltoall", BASE)
    rep = _run("alltoall_repeat", _shift(BASE, 7, -0.02))
    par = loss_parity(ring, a2a, rep, steps=50)
    assert par["max_abs_loss_diff"] == pytest.approx(0.0499)
    assert par["noise_max_abs_loss_diff"] == pytest.approx(0.02)
    assert par["parity_bound"] == pytest.approx(0.05) and par["parity_ok"] is True
    assert par["steps_compared"] == 50 and par["failures"] == {}
    par = loss_parity(_run("ring", _shift(BASE, 30, 0.0501)), a2a, rep, steps=50)
    assert par["parity_ok"] is False
    # identical curves: no noise, the 0.01 slack alone
    par = loss_parity(_run("ring", _shift(BASE, 3, 0.009)), a2a, _run("alltoall_repeat", BASE),
                      steps=50)  # fmt: skip
    assert par["noise_max_abs_loss_diff"] == 0.0 and par["parity_ok"] is True
    # no repeat run: the difference is measured, parity is not judged
    par = loss_parity(ring, a2a, None, steps=50)
    assert par["max_abs_loss_diff"] == pytest.approx(0.0499) and par["parity_ok"] is None


def test_a_repeat_cut_short_gives_partial_noise_but_no_verdict():
    ring = _run("ring", _shift(BASE, 5, 0.03))
    a2a = _run("alltoall", BASE)
    rep = _run("alltoall_repeat", _shift(BASE[:31], 4, 0.2), rc=-9, timed_out=True)
    par = loss_parity(ring, a2a, rep, steps=50)
    assert par["parity_ok"] is False and par["noise_max_abs_loss_diff"] is None
    assert par["partial_steps"] == 31
    assert par["partial_noise_max_abs_loss_diff"] == pytest.approx(0.2)
    assert par["partial_max_abs_loss_diff"] == pytest.approx(0.03)
    # a ring difference after the repeat's last step is not in the partial comparison
    par = loss_parity(_run("ring", _shift(BASE, 40, 0.5)), a2a, rep, steps=50)
    assert par["partial_max_abs_loss_diff"] == pytest.approx(0.0)
    # every run complete: no partial fields
    assert loss_parity(ring, a2a, _run("alltoall_repeat", BASE), steps=50)["partial_steps"] is None


@pytest.mark.parametrize(
    "broken",
    [
        dict(losses=[], rc=1),  # crashed before the first step
        dict(losses=[], rc=0),  # exited 0 without reporting a step
        dict(losses=BASE[:49], rc=0),  # one step short
        dict(losses=BASE, rc=1),  # all steps, then failed at exit
        dict(losses=_shift(BASE, 20, math.nan), rc=0),  # diverged
        dict(losses=BASE[:10], rc=-9, timed_out=True),
    ],
)
@pytest.mark.parametrize("who", ["ring", "alltoall", "alltoall_repeat"])
def test_a_failed_run_never_passes_parity(broken, who):
    runs = {k: _run(k, BASE) for k in ("ring", "alltoall", "alltoall_repeat")}
    runs[who] = _run(
        who, broken["losses"], rc=broken["rc"], timed_out=broken.get("timed_out", False)
    )
    par = loss_parity(runs["ring"], runs["alltoall"], runs["alltoall_repeat"], steps=50)
    assert par["parity_ok"] is False and list(par["failures"]) == [who]
    if who != "alltoall_repeat":
        assert par["max_abs_loss_diff"] is None  # a failed run is no data
    if who != "ring":
        assert par["noise_max_abs_loss_diff"] is None


@pytest.mark.parametrize("reported", [0, 20])  # crashed before any step / at step 21
def test_rows_of_a_shape_with_a_failed_ring_run(reported):
    shape = bench_e2e.SHAPES["qwen3_slice_s4k"]
    plans = bench_e2e.plan_runs(shape, gpus=2, steps=50, seed=1234, noise_run=True)
    results = {
        "ring": _run("ring", BASE[:reported], rc=1),
        "alltoall": _run("alltoall", BASE),
        "alltoall_repeat": _run("alltoall_repeat", _shift(BASE, 4, 0.03)),
    }
    ring, a2a = bench_e2e.shape_rows(plans, results, gpus=2, steps=50, seed=1234)
    assert (ring["provider"], a2a["provider"]) == ("relaymoe_ring", "mcore_alltoall")
    for row in (ring, a2a):
        assert row["bench"] == "e2e" and row["shape"] == "qwen3_slice_s4k"
        assert row["parity_ok"] is False and row["max_abs_loss_diff_vs_other"] is None
        assert row["noise_max_abs_loss_diff"] == pytest.approx(0.03)
        assert (row["lr"], row["lr_warmup_iters"], row["clip_grad"]) == (1e-4, 10, 1.0)
        assert (row["regime"], row["seq_length"], row["global_batch_size"]) == ("stable", 4096, 2)
        assert row["ep"] == 2 and row["steps_requested"] == 50
    assert ring["failure"] == "exit status 1" and ring["returncode"] == 1
    assert ring["steps"] == reported and ring["losses"] == BASE[:reported]  # the record only
    assert ring["tokens_per_s"] is None and ring["peak_MiB"] is None and ring["final_loss"] is None
    assert a2a["failure"] is None and a2a["steps"] == 50 and a2a["tokens_per_s"] is not None
    assert a2a["losses"] == BASE and a2a["repeat_steps"] == 50 and a2a["repeat_failure"] is None
    assert a2a["wall_s"] == 12.5 and a2a["returncode"] == 0


class _Writer:
    def __init__(self):
        self.rows = []

    def write(self, row):
        self.rows.append(row)


def test_run_shapes_reports_failures_and_respects_the_budget(capsys):
    calls = []

    def runner(flags, *, gpus, label, timeout_s):
        calls.append((label, timeout_s))
        if label == "ring":
            return RunResult("ring", 1, label=label, command="torchrun RING", log_tail="OOM here")
        return _run(label, BASE)

    now = [0.0]

    def clock():
        now[0] += 100.0  # every call to the clock: 100 s later
        return now[0]

    w = _Writer()
    shapes = [bench_e2e.SHAPES["qwen3_slice_s4k"], bench_e2e.SHAPES["qwen3_slice_s16k"]]
    rows, ok = bench_e2e.run_shapes(shapes, gpus=2, steps=50, seed=1, noise_run=True, writer=w,
                                    budget_s=450, runner=runner, clock=clock)  # fmt: skip
    assert not ok and len(rows) == 4 and w.rows == rows
    err = capsys.readouterr().err
    assert "run ring failed: exit status 1 (rc=1)" in err and "torchrun RING" in err
    assert "OOM here" in err and "--- run alltoall not started: 0 s of --budget-s 450" in err
    # left per run: 350, 250, 150 (s4k), 50 (< MIN_RUN_S: s16k ring and the rest not started)
    assert calls == [("ring", 350.0), ("alltoall", 250.0), ("alltoall_repeat", 150.0)]
    s16k = [r for r in rows if r["shape"] == "qwen3_slice_s16k"]
    assert all(r["parity_ok"] is False for r in rows)
    assert all(r["failure"].startswith("not started") for r in s16k)
    assert s16k[1]["repeat_failure"].startswith("not started")


def test_run_pretrain_stops_the_job_at_its_timeout(monkeypatch, tmp_path):
    """A job past its timeout is stopped with its whole process group and reported, no raise.
    The stand-in job is started and has started its worker before the job's clock runs (the
    Popen stand-in waits for it), so a short timeout is past either way."""
    import benchmarks.e2e as e2e

    started = []
    real_popen = subprocess.Popen
    ready = tmp_path / "worker_started"

    def popen(cmd, **kw):
        # a stand-in job: a parent that starts a child, both sleeping (like torchrun + workers)
        code = (
            "import pathlib, subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print('started worker', c.pid, flush=True)\n"
            f"pathlib.Path({str(ready)!r}).touch()\n"
            "time.sleep(60)\n"
        )
        p = real_popen([sys.executable, "-c", code], **kw)
        started.append(p)
        deadline = time.monotonic() + 60
        while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return p

    monkeypatch.setattr(e2e.subprocess, "Popen", popen)
    r = run_pretrain(["--moe-token-dispatcher-type", "alltoall"], gpus=2, label="alltoall_repeat",
                     timeout_s=0.5, workdir=str(tmp_path / "w"))  # fmt: skip
    assert r.timed_out and r.failure(50).startswith("timed out after")
    assert r.dispatcher == "alltoall" and r.name == "alltoall_repeat" and not r.steps
    assert "--relaymoe-report" in r.command and r.seconds < 30, r.seconds
    workers = [int(ln.split()[-1]) for ln in r.log_tail.splitlines() if "started worker" in ln]
    assert len(workers) == 1, r.log_tail  # the stand-in got as far as starting its worker
    # the job and its worker (its own child, as torchrun's) are both stopped
    deadline = time.monotonic() + 10  # a killed process may take a moment to disappear
    while (_alive(started[0].pid) or _alive(workers[0])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(started[0].pid) and not _alive(workers[0])


def _alive(pid: int) -> bool:
    """A running process (a zombie waiting to be reaped is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_run_pretrain_runs_another_entry_module_with_extra_environment(monkeypatch, tmp_path):
    """``module``/``env`` (the soak's drifting-router entry point): the command and environment
    the job gets, with the checkout importable."""
    import benchmarks.e2e as e2e

    seen = {}
    real_popen = subprocess.Popen

    def popen(cmd, **kw):
        seen["cmd"], seen["env"] = cmd, kw["env"]
        return real_popen([sys.executable, "-c", "pass"], **kw)

    monkeypatch.setattr(e2e.subprocess, "Popen", popen)
    run_pretrain(["--moe-token-dispatcher-type", "ring"], gpus=2, workdir=str(tmp_path / "w"),
                 module="benchmarks.soak_pretrain", env={"RELAYMOE_SOAK_EP": "2"})  # fmt: skip
    assert seen["cmd"][seen["cmd"].index("-m", 2) + 1] == "benchmarks.soak_pretrain"
    assert seen["env"]["RELAYMOE_SOAK_EP"] == "2"
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == e2e._CHECKOUT


def test_megatron_validates_the_pipeline_shape_flags(parsed_plans):
    """Megatron's parser and validation accept the PP=2 shapes at world 2 (DP = 1) with the
    interleaved schedule's two virtual stages."""
    runs = parsed_plans["tiny_qwen3_pp2_vpp2"]
    assert runs
    for plan, a in runs:
        assert isinstance(a, dict), a
        assert a["pipeline_model_parallel_size"] == 2 and a["data_parallel_size"] == 1
        assert a["virtual_pipeline_model_parallel_size"] == 2
        assert a["expert_model_parallel_size"] == 1
        assert a["global_batch_size"] == 2 * a["micro_batch_size"]
        assert a["moe_token_dispatcher_type"] == plan.dispatcher


# ------------------------------------------------------------------ issue #31: the TE stack
def test_transformer_impl_of_a_run(monkeypatch):
    """None: Megatron's default (TE) where TE imports, else local with the flags local layers
    need; TE asked for without TE is a clear error unless the plan is a dry run's."""
    import benchmarks.e2e as e2e

    kw = dict(gpus=1, steps=20, dispatcher="ring", seed=1)
    for have_te, impl in ((False, "local"), (True, "transformer_engine")):
        monkeypatch.setattr(e2e, "have_te", lambda have_te=have_te: have_te)
        g = _groups(pretrain_args("tiny_qwen3", **kw))
        assert _v(g, "--transformer-impl") == impl and e2e.run_impl(list(g)) in e2e.IMPLS
        assert ("--no-rope-fusion" in g) == (impl == "local")
        assert "--no-gradient-accumulation-fusion" not in g  # the fallback stands in for apex
        g = _groups(pretrain_args("tiny_qwen3", **kw, transformer_impl="local"))
        assert _v(g, "--transformer-impl") == "local" and "--no-masked-softmax-fusion" in g
    monkeypatch.setattr(e2e, "have_te", lambda: False)
    with pytest.raises(ValueError, match="TransformerEngine does not import here"):
        pretrain_args("tiny_qwen3", **kw, transformer_impl="transformer_engine")
    g = _groups(pretrain_args("tiny_qwen3", **kw, transformer_impl="transformer_engine",
                              check_te=False))  # fmt: skip
    assert _v(g, "--transformer-impl") == "transformer_engine" and "--no-rope-fusion" not in g
    with pytest.raises(ValueError, match="one of"):
        e2e.resolve_impl("te")
    assert e2e.run_impl(["--bf16"]) == "transformer_engine"  # Megatron's default


@pytest.mark.parametrize("shape", ["qwen3_slice_s4k_te", "qwen3_slice_s4k_te_fp8_e4m3_delayed"])
def test_te_shape_rows_name_the_anchor_and_the_stack(shape, monkeypatch):
    monkeypatch.setattr(bench_e2e, "te_version", lambda: "2.20.2")
    spec = bench_e2e.SHAPES[shape]
    plans = bench_e2e.plan_runs(spec, gpus=1, steps=50, seed=1234, noise_run=False,
                                check_te=False)  # fmt: skip
    results = {"ring": _run("ring", BASE), "alltoall": _run("alltoall", BASE)}
    ring, a2a = bench_e2e.shape_rows(plans, results, gpus=1, steps=50, seed=1234)
    assert (ring["provider"], a2a["provider"]) == ("relaymoe_ring", "mcore_alltoall_te")
    for row, plan in ((ring, plans[0]), (a2a, plans[1])):
        assert row["transformer_impl"] == "transformer_engine" and row["te_version"] == "2.20.2"
        assert row["flags"] == list(plan.flags) and "--moe-router-fusion" in row["flags"]
        assert row["anchor_flags"] == list(bench_e2e.ANCHOR_FLAGS) and row["anchor_kept"] == list(
            bench_e2e.ANCHOR_KEPT
        )
    if spec.fp8:
        assert ring["shape"] == "qwen3_slice_s4k_te_fp8"  # one shape, the recipe in its fields
        assert (ring["fp8_format"], ring["fp8_recipe"]) == ("e4m3", "delayed")
    else:
        assert ring["shape"] == shape and ring["fp8_recipe"] is None
    old = bench_e2e.plan_runs(bench_e2e.SHAPES["qwen3_slice_s4k"], gpus=1, steps=50, seed=1,
                              noise_run=False, check_te=False)  # fmt: skip
    old_rows = bench_e2e.shape_rows(old, results, gpus=1, steps=50, seed=1)
    assert old_rows[1]["provider"] == "mcore_alltoall" and old_rows[1]["anchor_flags"] is None


def test_kept_anchor_candidates_reach_the_runs_by_scope(monkeypatch):
    """A candidate kept from a measured sweep joins the alltoall runs with its alltoall flags, and
    the ring's runs with its ring flags: the part concerning layers both run."""
    kept = ("cuda_graph_attn_moe_router", "cross_entropy_te")
    monkeypatch.setattr(bench_e2e, "ANCHOR_KEPT", kept)
    spec = bench_e2e.SHAPES["qwen3_slice_s4k_te"]
    ring, a2a = (_groups(spec.run_flags(d)) for d in ("ring", "alltoall"))
    assert a2a["--cuda-graph-modules"] == ["attn", "moe_router", "moe_preprocess"]
    assert ring["--cuda-graph-modules"] == ["attn"]  # the ring refuses CUDA graphs over the MoE
    assert ring["--cuda-graph-impl"] == a2a["--cuda-graph-impl"] == ["transformer_engine"]
    assert ring["--cross-entropy-fusion-impl"] == a2a["--cross-entropy-fusion-impl"] == ["te"]
    monkeypatch.setattr(bench_e2e, "ANCHOR_KEPT", ("cuda_graph_moe_router",))
    assert "--cuda-graph-impl" not in _groups(spec.run_flags("ring"))


def test_full_recompute_shapes_run_without_the_refused_graphs():
    flags = ["--recompute-granularity", "full", "--cuda-graph-impl", "transformer_engine",
             "--cuda-graph-modules", "attn", "moe_router", "--seed", "1"]  # fmt: skip
    kept = bench_e2e.drop_refused_graphs(flags)
    assert kept == ["--recompute-granularity", "full", "--seed", "1"]
    flags[1] = "selective"
    assert bench_e2e.drop_refused_graphs(flags) == flags
    assert bench_e2e.kept_in(flags[2:], "ring") == []
    assert bench_e2e.kept_in(bench_e2e.ANCHOR_CANDIDATES["cuda_graph_attn_moe_router"][0],
                             "alltoall") == ["cuda_graph_attn_moe_router"]  # fmt: skip


def test_every_anchor_candidates_ring_flags_pass_the_ring_validation():
    """What a kept candidate gives the ring's runs is accepted by the ring's config check."""
    from types import SimpleNamespace

    from relaymoe.megatron.validate import ring_config_problems

    for name, (_a2a, ring_flags) in bench_e2e.ANCHOR_CANDIDATES.items():
        g = _groups(ring_flags)
        ns = SimpleNamespace(moe_token_dispatcher_type="ring", swiglu=True,
                             cuda_graph_impl=(g.get("--cuda-graph-impl") or ["none"])[0],
                             cuda_graph_modules=g.get("--cuda-graph-modules"))  # fmt: skip
        assert not [p for p in ring_config_problems(ns, args_style=True) if "CUDA graph" in p], name


def test_run_shapes_warms_each_configuration_before_the_measured_runs():
    calls = []

    def runner(flags, *, gpus, label, timeout_s):
        calls.append((label, flags[flags.index("--train-iters") + 1]))
        return _run(label, BASE if not label.startswith("warm_up") else BASE[:12])

    w = _Writer()
    rows, ok = bench_e2e.run_shapes([bench_e2e.SHAPES["qwen3_slice_s4k"]], gpus=1, steps=50,
                                    seed=1, noise_run=True, writer=w, runner=runner,
                                    warm_up_steps=12)  # fmt: skip
    assert ok and [c[0] for c in calls] == ["warm_up_ring", "warm_up_alltoall", "ring",
                                            "alltoall", "alltoall_repeat"]  # fmt: skip
    assert [c[1] for c in calls] == ["12", "12", "50", "50", "50"]
    assert len(rows) == 2 and all(r["warm_up_steps"] == 12 for r in rows)


def test_anchor_sweep_times_each_candidate_alone(capsys, monkeypatch):
    import benchmarks.e2e as e2e

    monkeypatch.setattr(e2e, "have_te", lambda: True)  # the runs are faked; TE is "here"
    monkeypatch.setattr(bench_e2e, "te_version", lambda: "2.20.2")
    spec = bench_e2e.SHAPES["qwen3_slice_s4k_te"]
    plans = bench_e2e.sweep_plans(spec, gpus=1, steps=25, seed=1, check_te=False)
    labels = [label for label, _ in plans]
    assert labels == ["base", *bench_e2e.ANCHOR_CANDIDATES, "base_repeat"]
    base = _groups(plans[0][1])
    assert _v(base, "--moe-token-dispatcher-type") == "alltoall" and plans[-1][1] == plans[0][1]
    for label, flags in plans[1:-1]:
        g = _groups(flags)  # the candidate's flags on top of the base run's, nothing else
        extra = _groups(bench_e2e.ANCHOR_CANDIDATES[label][0])
        assert {k: v for k, v in g.items() if k not in extra} == {
            k: v for k, v in base.items() if k not in extra
        }, label
        assert all(g[k] == v for k, v in extra.items())
    tps = {"base": 100.0, "cuda_graph_moe_router": 110.0, "base_repeat": 101.0}

    def runner(flags, *, gpus, label, timeout_s):
        if label not in tps:
            return RunResult("alltoall", 1, label=label, command="x", log_tail="no graph")
        steps = [{"loss": 5.0, "tokens_per_s": tps[label], "peak_MiB": 1.0}] * 25
        return RunResult("alltoall", 0, steps=steps, label=label, command="x")

    with pytest.raises(ValueError, match="needs an anchor shape"):
        bench_e2e.sweep_plans(bench_e2e.SHAPES["qwen3_slice_s4k"], gpus=1, steps=25, seed=1)
    w = _Writer()
    rows = bench_e2e.run_anchor_sweep(spec, gpus=1, steps=25, seed=1, writer=w, runner=runner)
    assert [r["candidate"] for r in rows] == labels and w.rows == rows
    by = {r["candidate"]: r for r in rows}
    assert by["cuda_graph_moe_router"]["speedup_vs_base"] == pytest.approx(1.1)
    assert by["base_repeat"]["speedup_vs_base"] == pytest.approx(1.01)
    assert by["te_activation"]["failure"] == "exit status 1"
    assert by["te_activation"]["speedup_vs_base"] is None
    assert by["te_activation"]["candidate_flags"] == ["--use-te-activation-func"]
    assert all(r["bench"] == "e2e_anchor_sweep" and r["provider"] == "mcore_alltoall_te"
               for r in rows)  # fmt: skip
    assert "no graph" in capsys.readouterr().err
    some = bench_e2e.sweep_plans(spec, gpus=1, steps=25, seed=1, check_te=False,
                                 candidates=("no_wgrad_fusion",))  # fmt: skip
    assert [label for label, _ in some] == ["base", "no_wgrad_fusion", "base_repeat"]
    assert "--no-gradient-accumulation-fusion" in some[1][1]
    assert "--no-gradient-accumulation-fusion" not in some[0][1]
    with pytest.raises(ValueError, match="unknown \\['nope'\\]"):
        bench_e2e.sweep_plans(spec, gpus=1, steps=25, seed=1, check_te=False,
                              candidates=("nope",))  # fmt: skip


def test_e2e_run_result_peaks_split_warmup_from_steady():
    from benchmarks.e2e import RunResult  # the e2e harness (lives beside the benchmarks)

    peaks = [500.0, 480.0, 300.0, 300.0, 301.0, 310.0, 305.0]
    r = RunResult("ring", 0, steps=[{"loss": 1.0, "peak_MiB": p} for p in peaks])
    assert r.peak_mib() == 310.0 and r.warmup_peak_mib() == 500.0
    short = RunResult("ring", 0, steps=[{"loss": 1.0, "peak_MiB": 42.0}])
    assert short.peak_mib() == 42.0  # fewer steps than the warm-up: all of them


def test_e2e_rows_carry_fp8_experts_and_the_weight_bytes_sent():
    """A row says whether the experts ran in fp8 and the expert-weight bytes sent per step
    after the warm-up (the step report's ``fp8_experts``/``ring_weight_bytes_sent``)."""
    from benchmarks.e2e import RunResult

    sent = [9, 9, 9, 9, 9, 100, 100, 100]
    steps = [{"loss": 1.0, "peak_MiB": 1.0, "step_s": 1.0, "tokens_per_s": 1.0,
              "ring_weight_bytes_sent": b, "fp8_experts": True} for b in sent]  # fmt: skip
    fields = bench_e2e._run_fields(RunResult("ring", 0, steps=steps), len(steps))
    assert fields["failure"] is None, fields["failure"]
    assert fields["fp8_experts"] is True and fields["ring_weight_bytes_sent_per_step"] == 100
    for s in steps:
        s["fp8_experts"] = False
    assert (
        bench_e2e._run_fields(RunResult("ring", 0, steps=steps), len(steps))["fp8_experts"] is False
    )


def test_fp8_experts_provider_runs_the_fp8_shapes_ring_with_its_experts_on():
    """``relaymoe_ring_fp8_experts``: the fp8 shape's ring flags and ``--relaymoe-fp8-experts
    on`` (the default auto keeps the experts in bf16); refused on a shape without fp8."""
    spec = bench_e2e.SHAPES["qwen3_slice_s4k_te_fp8_hybrid_tensorwise"]
    plans = bench_e2e.plan_runs(spec, gpus=1, steps=50, seed=1234, noise_run=False,
                                check_te=False, providers=["relaymoe_ring",
                                "relaymoe_ring_fp8_experts"])  # fmt: skip
    plain, fp8 = (list(p.flags) for p in plans)
    assert fp8[-2:] == ["--relaymoe-fp8-experts", "on"] and "--relaymoe-fp8-experts" not in plain
    assert fp8[:-2] == plain and "--fp8-recipe" in fp8
    with pytest.raises(ValueError, match="runs on an fp8 shape"):
        bench_e2e.plan_runs(bench_e2e.SHAPES["qwen3_slice_s4k_gbs16"], gpus=1, steps=50,
                            seed=1, noise_run=False, check_te=False,
                            providers=["relaymoe_ring_fp8_experts"])  # fmt: skip


def _trace(tmp_dir, kernels, steps=((0, 1000), (1000, 2000))):
    import gzip
    import json

    ev = [{"ph": "X", "name": f"ProfilerStep#{j}", "cat": "cpu_op", "ts": a, "dur": b - a}
          for j, (a, b) in enumerate(steps)]  # fmt: skip
    ev += [{"ph": "X", "name": n, "cat": "kernel", "ts": ts, "dur": d} for n, ts, d in kernels]
    path = os.path.join(tmp_dir, "torch_profile", "rank-0.json.gz")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return path


def test_trace_summary_counts_overlap_once_and_categorises(tmp_path):
    from benchmarks.trace_summary import category_of, summarise_file

    path = _trace(str(tmp_path), [
        ("_up_swiglu_kernel", 0, 300), ("nvjet_tst_128x256", 200, 200),  # overlap 100 us
        ("flash_fwd_kernel", 1000, 100), ("ncclDevKernel_AllReduce", 1500, 100),
        ("vectorized_elementwise_kernel", 5000, 999),  # outside every step: left out
    ])  # fmt: skip
    s = summarise_file(path)
    assert s["steps"] == 2 and s["step_ms"] == pytest.approx(1.0)
    assert s["gpu_busy_ms"] == pytest.approx((400 + 100 + 100) / 2 / 1e3)
    assert s["gpu_idle_frac"] == pytest.approx(1 - 600 / 2000)
    idle = s["gpu_idle_ms_by_gap"]  # a step is 1000 us, so its gaps hold 1400 us in 2 steps
    assert sum(idle.values()) == pytest.approx(1.4 / 2) and idle["1ms_and_over"] == 0.0
    assert s["kernel_ms"] == pytest.approx(700 / 2 / 1e3)
    assert s["by_category"] == pytest.approx({"relaymoe_experts": 0.15, "gemm": 0.1,
                                              "attention": 0.05, "nccl": 0.05})  # fmt: skip
    assert s["top_kernels"][0]["name"] == "_up_swiglu_kernel"
    assert category_of("fused_moe_permute_kernel") == "moe_permute_router"
    assert category_of("whatever") == "elementwise_other"


def test_run_shapes_profiles_ring_and_alltoall_not_the_noise_run(tmp_path, monkeypatch):
    seen = {}

    def runner(flags, *, gpus, label, timeout_s, workdir=None):
        seen[label] = (list(flags), workdir)
        if workdir is not None and label == "ring":  # alltoall's trace is missing: a failure row
            _trace(workdir, [("_up_swiglu_kernel", 0, 500)], steps=((0, 1000),))
        return _run(label, BASE)

    w = _Writer()
    rows, ok = bench_e2e.run_shapes([bench_e2e.SHAPES["qwen3_slice_s4k"]], gpus=1, steps=50,
                                    seed=1, noise_run=True, writer=w, runner=runner,
                                    profile_steps=(10, 12))  # fmt: skip
    assert ok
    assert seen["alltoall_repeat"][1] is None and "--profile" not in seen["alltoall_repeat"][0]
    for label in ("ring", "alltoall"):
        flags, workdir = seen[label]
        i = flags.index("--profile-step-start")
        assert flags[i + 1 : i + 4] == ["10", "--profile-step-end", "12"]
        assert flags[flags.index("--tensorboard-dir") + 1] == os.path.join(workdir, "tb")
    prof = {r["label"]: r for r in w.rows if r["bench"] == "e2e_profile"}
    assert prof["ring"]["failure"] is None and prof["ring"]["gpu_idle_frac"] == pytest.approx(0.5)
    assert prof["alltoall"]["failure"].startswith("no trace at")
    assert [r["bench"] for r in rows] == ["e2e", "e2e"]  # the profile rows are written, not rows
    with pytest.raises(ValueError, match="0 < START < END"):
        bench_e2e.profile_flags((12, 10), "x")


def test_trace_summary_counts_only_steps_holding_gpu_work(tmp_path):
    from benchmarks.trace_summary import summarise_file

    steps = ((0, 1000), (1000, 2000), (2000, 3000))  # the first: a schedule's wait step
    path = _trace(str(tmp_path), [("nvjet_a", 1000, 500), ("nvjet_a", 2000, 500)], steps=steps)
    s = summarise_file(path)
    assert s["steps"] == 2 and s["top_kernels"][0]["calls"] == 1.0
    assert s["gpu_idle_frac"] == pytest.approx(0.5) and s["cuda_graph_launches"] == 0


def test_trace_summary_names_what_the_host_did_while_the_gpu_idled():
    """Issue #49: the graphed step's idle time is attributed to the host events overlapping the
    GPU's gaps (inclusive, nested spans each counted; ProfilerStep itself left out)."""
    from benchmarks.trace_summary import summarise

    ev = [{"ph": "X", "name": "ProfilerStep#0", "cat": "cpu_op", "ts": 0, "dur": 1000}]
    ev += [{"ph": "X", "name": n, "cat": "kernel", "ts": a, "dur": d}
           for n, a, d in (("k1", 0, 300), ("k2", 200, 200), ("k3", 700, 100))]  # fmt: skip
    # GPU gaps: [400, 700) and [800, 1000)
    ev += [
        {"ph": "X", "name": "Optimizer.step", "cat": "user_annotation", "ts": 350, "dur": 400},
        {"ph": "X", "name": "aten::item", "cat": "cpu_op", "ts": 500, "dur": 50},
        {"ph": "X", "name": "cudaStreamSynchronize", "cat": "cuda_runtime", "ts": 850, "dur": 300},
        {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 0, "dur": 200},  # GPU busy then
        {"ph": "X", "name": "k1", "cat": "kernel_like_but_not_host", "ts": 400, "dur": 100},
    ]
    s = summarise({"traceEvents": ev})
    assert s["gpu_idle_gaps"] == 2 and s["gpu_idle_max_gap_ms"] == pytest.approx(0.3)
    # both gaps (300 and 200 us) are short host work; none is a kernel-to-kernel step
    assert s["gpu_idle_ms_by_gap"] == pytest.approx(
        {"under_10us": 0.0, "10us_100us": 0.0, "100us_1ms": 0.5, "1ms_and_over": 0.0}
    )
    assert s["gpu_events_per_step"] == 3 and s["calls_by_category"] == {"elementwise_other": 3}
    host = {h["name"]: h["ms"] for h in s["idle_host_ops"]}
    assert host == pytest.approx({"Optimizer.step": 0.3, "aten::item": 0.05,
                                  "cudaStreamSynchronize": 0.15})  # fmt: skip
    assert [h["name"] for h in s["idle_host_ops"]][0] == "Optimizer.step"


# ------------------------------------------- issue #49: gradient accumulation, providers, fields
FIVE = ("relaymoe_ring", "relaymoe_ring_graphed", "mcore_alltoall_te", "mcore_alltoall_te_drop",
        "relaymoe_ring_layer_graphs")  # fmt: skip


def _plans(shape, gpus=1, **kw):
    kw = {"steps": 15, "seed": 1234, "noise_run": False, "check_te": False, **kw}
    return bench_e2e.plan_runs(bench_e2e.SHAPES[shape], gpus=gpus, **kw)


@pytest.mark.parametrize("shape", sorted(GBS_SHAPES))
@pytest.mark.parametrize("gpus", [1, 2])
def test_gbs_shapes_plan_each_provider(shape, gpus):
    """Each gradient-accumulation shape runs the five providers in order; their flags are the
    shape's (sequence, global batch, recompute, TE with the anchor's fusions) and differ only in
    what each provider is: the dispatcher, the CUDA graphs and the drop-and-pad capacity."""
    seq, gbs, recompute = GBS_SHAPES[shape]
    plans = _plans(shape, gpus=gpus)
    assert [(p.label, p.provider, p.repeat) for p in plans] == [(n, n, 0) for n in FIVE]
    g = {p.provider: _groups(p.flags) for p in plans}
    for name, f in g.items():
        assert _v(f, "--seq-length") == str(seq) and _v(f, "--micro-batch-size") == "1"
        assert _v(f, "--global-batch-size") == str(gbs)  # not micro-batch x GPUs
        assert _v(f, "--expert-model-parallel-size") == str(gpus)
        assert (
            _v(f, "--transformer-impl") == "transformer_engine" and _v(f, "--train-iters") == "15"
        )
        assert all(f[flag] == [] for flag in bench_e2e.ANCHOR_FLAGS), name
        assert (f.get("--recompute-granularity") or [None])[0] == recompute
        want = "ring" if name.startswith("relaymoe") else "alltoall"
        assert _v(f, "--moe-token-dispatcher-type") == want
        assert ("--relaymoe-fused-loss" in f) == ("fused_loss" in shape and want == "ring")
        dropping = name == "mcore_alltoall_te_drop"
        assert ("--moe-expert-capacity-factor" in f) == dropping, name
        assert ("--moe-pad-expert-input-to-capacity" in f) == dropping, name
        assert bench_e2e.tokens_dropped(plans[FIVE.index(name)].flags) == (True if dropping else 0)
    graphed = g["relaymoe_ring_graphed"]
    assert _v(graphed, "--cuda-graph-impl") == "full_iteration"
    assert "--cuda-graph-modules" not in graphed  # megatron-core: empty with full_iteration
    assert graphed["--no-check-for-nan-in-loss-and-grad"] == []
    assert _v(graphed, "--cuda-graph-warmup-steps") == str(bench_e2e.GRAPH_WARMUP_STEPS)
    drop = g["mcore_alltoall_te_drop"]
    assert _v(drop, "--moe-expert-capacity-factor") == "1.0"
    if recompute == "full":  # megatron-core refuses per-layer graphs under full recompute
        for name in ("relaymoe_ring", "mcore_alltoall_te", "mcore_alltoall_te_drop"):
            assert "--cuda-graph-impl" not in g[name] and "--cuda-graph-modules" not in g[name]
    else:
        assert g["relaymoe_ring"]["--cuda-graph-modules"] == ["attn"]
        assert g["mcore_alltoall_te"]["--cuda-graph-modules"] == [
            "attn", "moe_router", "moe_preprocess"]  # fmt: skip
        assert _v(drop, "--cuda-graph-impl") == "transformer_engine"
        assert drop["--cuda-graph-modules"] == ["attn", "moe"]
        layers = g["relaymoe_ring_layer_graphs"]  # the same graphs, dropless (the ring)
        assert _v(layers, "--cuda-graph-impl") == "transformer_engine"
        assert layers["--cuda-graph-modules"] == ["attn", "moe"]
        assert "--moe-expert-capacity-factor" not in layers
    # everything else is the same flag for flag
    provider_flags = {"--moe-token-dispatcher-type", "--relaymoe-mode", "--relaymoe-fused-loss",
                      "--cuda-graph-impl", "--cuda-graph-modules", "--cuda-graph-warmup-steps",
                      "--no-check-for-nan-in-loss-and-grad", "--moe-expert-capacity-factor",
                      "--moe-pad-expert-input-to-capacity"}  # fmt: skip
    rest = [{k: v for k, v in f.items() if k not in provider_flags} for f in g.values()]
    assert all(r == rest[0] for r in rest)


def test_old_shapes_keep_their_runs_and_providers_are_checked():
    """Shapes from before providers plan ring, alltoall[, alltoall_repeat] as they did; --repeats
    and unknown or misplaced providers are refused before any GPU time."""
    assert [p.label for p in _plans("qwen3_slice_s4k_te", noise_run=True)] == [
        "ring", "alltoall", "alltoall_repeat"]  # fmt: skip
    assert _v(_groups(_plans("qwen3_slice_s4k_te")[0].flags), "--global-batch-size") == "1"
    with pytest.raises(ValueError, match="--repeats needs providers"):
        _plans("qwen3_slice_s4k_te", repeats=2)
    with pytest.raises(ValueError, match="unknown provider"):
        _plans("qwen3_slice_s4k_gbs16_te", providers=["relaymoe_rign"])
    with pytest.raises(ValueError, match="runs on an anchor"):
        _plans("qwen3_slice_s4k", providers=["mcore_alltoall_te_drop"])
    with pytest.raises(ValueError, match="runs on a shape without '_te'"):
        _plans("qwen3_slice_s4k_gbs16_te", providers=["mcore_alltoall"])
    with pytest.raises(ValueError, match="--noise-run repeats the anchor"):
        _plans("qwen3_slice_s4k_gbs16_te", providers=["relaymoe_ring"], noise_run=True)
    with pytest.raises(ValueError, match="not a multiple of micro-batch"):
        pretrain_args("qwen3_slice", gpus=2, steps=20, dispatcher="ring", seed=1,
                      global_batch_size=7)  # fmt: skip
    # providers on an old shape: its ring and alltoall as providers, the same flags
    old = _plans("qwen3_slice_s4k_te")
    new = _plans("qwen3_slice_s4k_te", providers=["relaymoe_ring", "mcore_alltoall_te"])
    assert [p.flags for p in new] == [p.flags for p in old]


def test_repeats_interleave_the_providers_and_the_noise_run_ends_them():
    plans = _plans("qwen3_slice_s4k_gbs16_te", repeats=2, noise_run=True,
                   providers=["mcore_alltoall_te", "relaymoe_ring_graphed"])  # fmt: skip
    assert [(p.label, p.repeat, p.noise) for p in plans] == [
        ("mcore_alltoall_te", 0, False), ("relaymoe_ring_graphed", 0, False),
        ("mcore_alltoall_te_r1", 1, False), ("relaymoe_ring_graphed_r1", 1, False),
        ("mcore_alltoall_te_noise", 0, True),
    ]  # fmt: skip
    assert plans[0].flags == plans[2].flags == plans[4].flags and plans[1].flags == plans[3].flags


def test_dry_run_of_the_gbs16_shape_prints_the_four_providers(capsys):
    argv = ["--shapes", "qwen3_slice_s4k_gbs16_te", "--providers", ",".join(FIVE),
            "--steps", "15", "--gpus", "1", "--dry-run"]  # fmt: skip
    assert bench_e2e.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [ln for ln in lines if ln.startswith("# ")]
    assert [h.split()[2] for h in heads] == list(FIVE)
    assert all("global batch 16 = 16 micro-batches a rank" in h for h in heads)
    assert "CUDA graphs full_iteration, tokens dropped 0" in heads[1]
    assert "CUDA graphs transformer_engine, tokens dropped True" in heads[3]
    assert "--cuda-graph-impl full_iteration" in lines[lines.index(heads[1]) + 1]
    assert bench_e2e.main(argv[:4] + ["--dry-run"]) == 0  # the shape's own providers: the four
    assert [h.split()[2] for h in capsys.readouterr().out.splitlines() if h.startswith("# ")] == [
        *FIVE]  # fmt: skip
    with pytest.raises(SystemExit):
        bench_e2e.main([*argv, "--profile-busy", "--profile-steps", "8", "9"])
    assert "exclude each other" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_e2e.main(
            [*argv[:-5], "--steps", "7", "--regime", "launcher", "--profile-busy", "--dry-run"]
        )
    assert "train at least 8 steps" in capsys.readouterr().err


def _fake_runs(plans, tps: dict[str, float], bad_steps=(), ramp=0.0):
    """A complete run per plan at ``tps[provider]`` tokens/s (times 1 + ``ramp`` x the 0-based
    step), 15 steps; ``bad_steps`` (1-based) run at 1 token/s (a profiled step's slowdown)."""
    out = {}
    for p in plans:
        steps = [{"loss": 5.0 - 0.1 * i + (0.02 if p.provider == "mcore_alltoall_te_drop" else 0),
                  "tokens_per_s": 1.0 if i + 1 in bad_steps else tps[p.provider] * (1 + ramp * i),
                  "peak_MiB": 10.0} for i in range(15)]  # fmt: skip
        out[p.label] = RunResult(p.dispatcher, 0, steps=steps, label=p.label, command="x")
    return out


def test_provider_rows_carry_batch_graphs_drops_and_model_flops(monkeypatch):
    from benchmarks.flops import shape_flops_per_token

    monkeypatch.setattr(bench_e2e, "te_version", lambda: "2.20.2")
    for gpus, micro_batches in ((1, 16), (2, 8)):
        plans = _plans("qwen3_slice_s4k_gbs16_te", gpus=gpus, noise_run=True)
        tps = dict(zip(FIVE, (48_000.0, 96_000.0, 24_000.0, 80_000.0, 64_000.0), strict=True))
        rows = bench_e2e.provider_rows(plans, _fake_runs(plans, tps), gpus=gpus, steps=15, seed=1)
        by = {r["label"]: r for r in rows}
        assert list(by) == [*FIVE, "mcore_alltoall_te_noise"]
        fpt = shape_flops_per_token("qwen3_slice", 4096)
        for r in rows:
            assert (r["gbs"], r["global_batch_size"], r["micro_batches"]) == (16, 16, micro_batches)
            assert r["flops_per_token"] == fpt and r["gpu_busy_frac"] is None
            assert r["model_tflops_per_gpu"] == pytest.approx(
                tps[r["provider"]] * fpt / gpus / 1e12
            )
            assert r["anchor_provider"] == "mcore_alltoall_te" and r["repeats"] == 1
        assert [by[n]["cuda_graph_impl"] for n in FIVE] == [
            "transformer_engine",
            "full_iteration",
            "transformer_engine",
            "transformer_engine",
            "transformer_engine",
        ]
        assert [by[n]["tokens_dropped"] for n in FIVE] == [0, 0, 0, True, 0]
        assert by["relaymoe_ring_layer_graphs"]["cuda_graph_modules"] == ["attn", "moe"]
        assert by["relaymoe_ring_graphed"]["cuda_graph_modules"] is None
        assert by["mcore_alltoall_te_drop"]["cuda_graph_modules"] == ["attn", "moe"]
        assert by["relaymoe_ring_graphed"]["speedup_vs_anchor"] == pytest.approx(4.0)
        assert by["relaymoe_ring"]["parity_ok"] is True  # identical losses, noise 0
        assert by["mcore_alltoall_te"]["max_abs_loss_diff_vs_anchor"] is None  # the anchor
        drop = by["mcore_alltoall_te_drop"]
        assert drop["max_abs_loss_diff_vs_anchor"] == pytest.approx(0.02)
        assert drop["parity_ok"] is None  # token dropping trains another model: no verdict
        assert by["mcore_alltoall_te_noise"]["noise"] and rows[0]["noise_max_abs_loss_diff"] == 0
    # the rows of the shapes before providers carry the same fields
    old = _plans("qwen3_slice_s4k_te", gpus=1)
    ring, a2a = bench_e2e.shape_rows(old, {"ring": _run("ring", BASE), "alltoall": _run(
        "alltoall", BASE)}, gpus=1, steps=50, seed=1)  # fmt: skip
    assert (ring["gbs"], ring["micro_batches"], ring["tokens_dropped"]) == (1, 1, 0)
    assert ring["cuda_graph_impl"] == "transformer_engine" and a2a["gpu_busy_frac"] is None
    assert a2a["model_tflops_per_gpu"] == pytest.approx(a2a["tokens_per_s"] * ring[
        "flops_per_token"] / 1e12)  # fmt: skip


def test_profile_busy_profiles_one_step_of_every_run_and_leaves_it_out_of_tokens_per_s(
    monkeypatch,
):
    """--profile-busy: every run (the noise run too) profiles its second-last step; the row
    carries that step's busy fraction, and tokens/s leaves out the profiled step and the
    profiler's warm-up step before it (here made 1 token/s, which would move the median)."""
    import benchmarks.e2e as e2e

    monkeypatch.setattr(e2e, "have_te", lambda: True)  # the runs are faked; TE is "here"
    monkeypatch.setattr(bench_e2e, "te_version", lambda: "2.20.2")
    seen = {}
    busy = {"relaymoe_ring": 0.5, "relaymoe_ring_graphed": 0.9, "mcore_alltoall_te": 0.25}
    start, end = bench_e2e.profile_busy_steps(15)
    assert (start, end) == (14, 15) and bench_e2e.profiler_slowed_steps((start, end)) == {13, 14}
    tps = dict(zip(FIVE, (48_000.0, 96_000.0, 24_000.0, 80_000.0, 64_000.0), strict=True))

    def runner(flags, *, gpus, label, timeout_s, workdir=None):
        seen[label] = list(flags)
        provider = label.removesuffix("_noise").removesuffix("_r1")
        if provider in busy:  # a step of 1000 us, busy for the fraction
            _trace(workdir, [("nvjet_x", 0, busy[provider] * 1000)], steps=((0, 1000),))
        plan = bench_e2e.PlannedRun(None, label, "ring" if "ring" in label else "alltoall",
                                    "stable", (), provider=provider)  # fmt: skip
        return _fake_runs([plan], tps, bad_steps=(13, 14), ramp=1e-3)[label]

    w = _Writer()
    rows, ok = bench_e2e.run_shapes([bench_e2e.SHAPES["qwen3_slice_s4k_gbs16_te"]], gpus=1,
                                    steps=15, seed=1, noise_run=True, writer=w, runner=runner,
                                    profile_busy=True, repeats=2)  # fmt: skip
    assert ok and len(rows) == 2 * len(FIVE) + 1  # two passes and the anchor's noise run
    for label, flags in seen.items():
        i = flags.index("--profile-step-start")
        assert flags[i + 1 : i + 4] == ["14", "--profile-step-end", "15"], label
    by = {r["label"]: r for r in rows}
    assert by["relaymoe_ring_graphed_r1"]["repeat"] == 1
    assert by["relaymoe_ring_graphed_r1"]["gpu_busy_frac"] == pytest.approx(0.9)
    assert by["mcore_alltoall_te_noise"]["gpu_busy_frac"] == pytest.approx(0.25)
    assert by["mcore_alltoall_te_drop"]["gpu_busy_frac"] is None  # its trace is missing
    for r in rows:  # the median of steps 6-12 and 15: steps 9 and 10 (0-based 8 and 9)
        assert r["tokens_per_s"] == pytest.approx(tps[r["provider"]] * 1.0085), r["label"]
        assert r["tokens_per_s_excluded_steps"] == [13, 14] and r["profile_steps"] == [14, 15]
    prof = [r for r in w.rows if r["bench"] == "e2e_profile"]
    assert len(prof) == 2 * len(FIVE) + 1 and prof[1]["cuda_graph_impl"] == "full_iteration"
    assert prof[3]["failure"].startswith("no trace at")


_MEGATRON_CONFIG = textwrap.dedent(
    """
    import json, os, sys, traceback, warnings
    warnings.filterwarnings("ignore")
    import torch
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    from relaymoe.megatron import register
    register()
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.global_vars import unset_global_variables
    env = dict(os.environ)
    for i, flags in enumerate(json.loads(sys.stdin.read())):
        sys.argv = ["pretrain", *flags]
        try:
            a = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
            c = core_transformer_config_from_args(a)
            out = {"cuda_graph_impl": c.cuda_graph_impl,
                   "cuda_graph_modules": [m.name for m in c.cuda_graph_modules],
                   "capacity": c.moe_expert_capacity_factor,
                   "pad": c.moe_pad_expert_input_to_capacity,
                   "nan_check": a.check_for_nan_in_loss_and_grad,
                   "graph_warmup": c.cuda_graph_warmup_steps,
                   "global_batch_size": a.global_batch_size}
            print("ARGS " + json.dumps([i, out]), flush=True)
        except BaseException:
            print("ERROR " + json.dumps([i, traceback.format_exc()]), flush=True)
        finally:
            unset_global_variables()
            os.environ.clear()
            os.environ.update(env)
    """
)

# TE's own kernels that megatron-core checks for when it builds the config; TE is not here, and
# they do not touch the CUDA-graph and capacity checks
_TE_KERNEL_FLAGS = ("--moe-permute-fusion", "--moe-router-fusion")


def test_megatron_core_takes_the_providers_graph_scopes():
    """megatron-core's own argument validation and TransformerConfig checks (one subprocess, world
    1) accept the drop provider's MoE graphs with drop-and-pad and refuse them without padding
    ("only supported with drop-padding MoE"); the whole-iteration graph with its NaN check off and
    no graph modules, on the alltoall dispatcher (megatron-core's checks alone); and on the ring
    either take it or refuse it only through relaymoe's CUDA-graph check (lifted by the ring's
    capture work)."""
    plans = {p.provider: p for p in _plans("qwen3_slice_s4k_gbs16_te")}

    def cpu(flags, dispatcher=None, drop=()):
        out = [f for f in flags if f not in (*_TE_KERNEL_FLAGS, *drop)] + ["--no-rope-fusion"]
        if dispatcher:
            out = merge_flags(out, ["--moe-token-dispatcher-type", dispatcher])
            out = [t for g in bench_e2e.flag_groups(out) if g[0] != "--relaymoe-mode" for t in g]
        return out

    jobs = [
        cpu(plans["mcore_alltoall_te_drop"].flags),
        cpu(plans["mcore_alltoall_te_drop"].flags, drop=("--moe-pad-expert-input-to-capacity",)),
        cpu(plans["relaymoe_ring_graphed"].flags, dispatcher="alltoall"),
        cpu(plans["relaymoe_ring_graphed"].flags),
        cpu(plans["mcore_alltoall_te"].flags),
    ]
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", CUDA_VISIBLE_DEVICES="")
    p = run_python(["-c", _MEGATRON_CONFIG], timeout=240, env=env, input=json.dumps(jobs))
    got = {}
    for ln in p.stdout.splitlines():
        if ln.startswith(("ARGS ", "ERROR ")):
            i, value = json.loads(ln.split(" ", 1)[1])
            got[i] = value
    assert p.returncode == 0 and len(got) == len(jobs), p.stdout[-2000:] + p.stderr[-4000:]
    drop, unpadded, whole, ring_whole, anchor = (got[i] for i in range(len(jobs)))
    assert isinstance(drop, dict), drop
    assert drop["cuda_graph_modules"] == ["attn", "moe"] and drop["pad"] is True
    assert drop["capacity"] == 1.0 and drop["global_batch_size"] == 16
    assert isinstance(unpadded, str) and "only supported with drop-padding MoE" in unpadded
    assert isinstance(whole, dict), whole
    assert whole["cuda_graph_impl"] == "full_iteration" and whole["cuda_graph_modules"] == []
    assert whole["nan_check"] is False and whole["graph_warmup"] == bench_e2e.GRAPH_WARMUP_STEPS
    if isinstance(ring_whole, str):  # refused: by relaymoe's ring check, nothing else
        assert "--moe-token-dispatcher-type ring cannot run" in ring_whole, ring_whole
        assert "CUDA graphs over the MoE layer" in ring_whole, ring_whole
    else:
        assert ring_whole["cuda_graph_impl"] == "full_iteration"
    assert isinstance(anchor, dict) and anchor["cuda_graph_modules"] == [
        "attn", "moe_router", "moe_preprocess"]  # fmt: skip
