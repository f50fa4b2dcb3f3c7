"""GPU end-to-end (run by scripts/gpu_suite.sh): Megatron training with ring vs alltoall, with
TransformerEngine (Megatron's default layer implementation) where it imports and with
``--transformer-impl local``.

* the tiny Qwen3-style GPT (4 MoE layers) trains 200 steps on mock data with each dispatcher
  from the same seed; the loss curves agree within bf16 accumulation-order noise; throughput and
  peak memory are printed (``benchmarks/bench_e2e.py`` writes the committed rows);
* checkpoints: alltoall -> ring -> alltoall over one 30-iteration schedule with ``torch_dist``
  and the distributed optimizer's state, against an uninterrupted run; a local-impl checkpoint
  loaded under TE is refused by name;
* fp8 recipes (TE): the ring trains wherever megatron-core's alltoall does;
* on real text (``examples/tiny_qwen3/make_corpus.py`` + ``relaymoe data``), ring learns as
  much as alltoall does in the same test run (not yet run on a GPU: see the test's docstring);
* a Hugging Face Qwen3-MoE checkpoint converted by ``relaymoe convert-hf`` trains from
  ``--pretrained-checkpoint`` with ring and with alltoall, from the same loss (not yet run);
* with ``MEGATRON_LM_DIR`` pointing to a Megatron-LM checkout matching megatron-core 0.19
  (e.g. tag core_v0.19.0; used only for this run, never committed), a short run of its own
  ``pretrain_gpt.py`` through ``python -m relaymoe.megatron.launch``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from benchmarks.bench_e2e import FP8_FORMATS, FP8_RECIPES
from benchmarks.e2e import have_te

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 1, reason="needs CUDA"
    ),
]

GPUS = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0
# Per-step |loss difference| bound: same seed, same data, only the expert execution differs
# (bf16 GEMMs in another order); 200 steps of training let rounding differences grow a little.
MAX_ABS_DIFF = 0.1
FINAL_WINDOW_DIFF = 0.03


def _assert_same_curves(runs, steps: int, window: int, learner: int) -> None:
    """Both runs trained ``steps`` steps, ``runs[learner]`` learned, and the loss curves agree:
    every step within MAX_ABS_DIFF, the last ``window`` steps within FINAL_WINDOW_DIFF on
    average. Prints the throughput and memory summary."""
    from benchmarks.e2e import compare, print_summary

    for r in runs:
        assert r.returncode == 0 and len(r.steps) == steps, (
            f"{r.name} run failed rc={r.returncode}\n{r.command}\n{r.log_tail}"
        )
    cmp = compare(*runs)
    print_summary(runs, cmp)
    first, second = runs
    learned = runs[learner]
    assert learned.losses[-1] < learned.losses[0] - 0.5, (
        f"{learned.name} run did not learn: {learned.command}"
    )
    assert cmp["max_abs_loss_diff"] < MAX_ABS_DIFF, cmp
    pairs = zip(first.losses[-window:], second.losses[-window:], strict=True)
    last = [abs(x - y) for x, y in pairs]
    assert sum(last) / len(last) < FINAL_WINDOW_DIFF, last


# Both layer implementations where TE imports (Megatron's default, and --transformer-impl local);
# the local one alone elsewhere.
IMPLS = [
    pytest.param("transformer_engine", marks=pytest.mark.skipif(not have_te(), reason="needs TE")),
    "local",
]


@pytest.mark.parametrize("impl", IMPLS)
def test_tiny_qwen3_ring_vs_alltoall_200_steps(impl):
    from benchmarks.e2e import run_dispatcher

    runs = [
        run_dispatcher(
            "tiny_qwen3", d, gpus=GPUS, steps=200, timeout_s=300, transformer_impl=impl
        )  # fmt: skip
        for d in ("ring", "alltoall")
    ]
    _assert_same_curves(runs, steps=200, window=20, learner=0)  # the ring run learned


def _distributed_optimizer_can_resume() -> bool:
    """megatron-core 0.19.2 without Apex or TE: resuming with the distributed optimizer fails
    whatever the dispatcher (`DistributedOptimizer.state_dict` asserts one Adam 'step' over the
    still-empty torch Adam state; seen on 2x H200 with alltoall -> alltoall too). Then the round
    trip loads the weights, the iteration and the RNG state, and not the optimizer state."""
    from megatron.core.optimizer import distrib_optimizer

    return distrib_optimizer.HAVE_APEX_OR_TE


ROUND_TRIP_STEPS = 30  # one schedule for every segment: --train-iters 30, cut by --exit-interval


@pytest.mark.parametrize("impl", IMPLS)
def test_checkpoint_round_trip_alltoall_ring_alltoall(impl):
    """alltoall (iterations 1-10, saved) -> ring (11-20, saved) -> alltoall (21-30) with
    ``torch_dist`` checkpoints and the distributed optimizer's state loaded, against one
    uninterrupted alltoall run of the same 30-iteration schedule: each segment resumes at the
    saved iteration with the learning rate the schedule has there, and its losses continue the
    uninterrupted curve within the ring-vs-alltoall bound (bf16 GEMMs in another order). Without
    Apex or TE the optimizer state cannot be resumed (see above): the weights, iteration and RNG
    state are, and the test says so."""
    from benchmarks.e2e import run_dispatcher

    load_optim = _distributed_optimizer_can_resume()
    if impl == "transformer_engine":
        assert load_optim, "TE present: the distributed optimizer must resume its own state"
    with tempfile.TemporaryDirectory() as d:
        ck = os.path.join(d, "ckpt")

        def run(label, dispatcher, extra):  # in its own folder under d
            return run_dispatcher("tiny_qwen3", dispatcher, gpus=GPUS, steps=ROUND_TRIP_STEPS,
                                  extra=extra, timeout_s=240, workdir=os.path.join(d, label),
                                  transformer_impl=impl)  # fmt: skip

        fmt = ["--ckpt-format", "torch_dist"]
        load = ["--load", ck, *fmt, *([] if load_optim else ["--no-load-optim"])]
        save = ["--save", ck, "--save-interval", "10", *fmt]
        whole = run("whole", "alltoall", [])
        segments = [
            run("seg1_alltoall", "alltoall", [*save, "--exit-interval", "10"]),
            run("seg2_ring", "ring", [*load, *save, "--exit-interval", "20"]),
            run("seg3_alltoall", "alltoall", load),
        ]
        for r in (whole, *segments):
            assert r.returncode == 0, f"{r.name}: rc={r.returncode}\n{r.command}\n{r.log_tail}"
        assert len(whole.steps) == ROUND_TRIP_STEPS
        for k, seg in enumerate(segments):
            its = [s["iteration"] for s in seg.steps]
            assert its == list(range(10 * k + 1, 10 * k + 11)), (seg.name, its)
            ref = whole.steps[10 * k : 10 * k + 10]
            for got, want in zip(seg.steps, ref, strict=True):
                assert got["lr"] == pytest.approx(want["lr"], rel=1e-9), (seg.name, got, want)
            diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(seg.steps, ref, strict=True)]
            print(f"{impl} {seg.name}: max |loss - uninterrupted| = {max(diffs):.4f}")
            assert max(diffs) < MAX_ABS_DIFF, (seg.name, diffs)
        if not load_optim:
            print("optimizer state NOT resumed (no Apex or TE): --no-load-optim")


@pytest.mark.skipif(not have_te(), reason="needs TE (the other layer implementation)")
def test_checkpoint_of_the_local_impl_is_refused_by_name_under_te():
    """A checkpoint saved with ``--transformer-impl local`` keys each MoE layer's pre-MLP norm
    differently from the TE spec: loading it into a TE model is refused with the reason and the
    fix, before any tensor is read (``relaymoe/megatron/checkpoint_compat.py``)."""
    from benchmarks.e2e import run_dispatcher

    with tempfile.TemporaryDirectory() as d:
        ck = os.path.join(d, "ckpt")
        fmt = ["--ckpt-format", "torch_dist"]

        def run(label, impl, extra):
            return run_dispatcher("tiny_qwen3", "alltoall", gpus=GPUS, steps=20, extra=extra,
                                  timeout_s=240, workdir=os.path.join(d, label),
                                  transformer_impl=impl)  # fmt: skip

        saved = run("local", "local", ["--save", ck, "--save-interval", "5", "--exit-interval",
                                       "5", *fmt])  # fmt: skip
        assert saved.returncode == 0, saved.log_tail
        r = run("te", "transformer_engine", ["--load", ck, *fmt])
        assert r.returncode != 0 and not r.steps
        assert "saved with --transformer-impl local" in r.log_tail, r.log_tail
        assert "fix: resume with --transformer-impl local" in r.log_tail, r.log_tail


@pytest.mark.skipif(not have_te(), reason="fp8 recipes run through TE")
@pytest.mark.parametrize("recipe", [(f, r) for f in FP8_FORMATS for r in FP8_RECIPES],
                         ids="-".join)  # fmt: skip
def test_fp8_recipe_trains_with_the_ring_where_alltoall_does(recipe):
    """Under an fp8 recipe TE runs attention and the dense layers in fp8 and, with
    ``--relaymoe-fp8-experts on``, the ring its experts' GEMMs in fp8 too (one line at start
    says which): wherever megatron-core's alltoall trains with the recipe here, the ring trains
    too, and both learn."""
    from benchmarks.e2e import run_dispatcher

    fmt, name = recipe
    extra = ["--fp8-format", fmt, "--fp8-recipe", name]
    a2a = run_dispatcher("tiny_qwen3", "alltoall", gpus=GPUS, steps=30, extra=extra,
                         timeout_s=240, transformer_impl="transformer_engine")  # fmt: skip
    if a2a.returncode != 0:
        pytest.skip(
            f"megatron-core's alltoall does not run {fmt}/{name} here: {a2a.log_tail[-600:]}"
        )
    ring = run_dispatcher("tiny_qwen3", "ring", gpus=GPUS, steps=30, timeout_s=240,
                          extra=[*extra, "--relaymoe-fp8-experts", "on"],
                          transformer_impl="transformer_engine")  # fmt: skip
    assert ring.returncode == 0 and len(ring.steps) == 30, ring.log_tail
    with open(os.path.join(ring.workdir, "stdout.log")) as f:
        log = f.read()
    assert log.count(f"[relaymoe] fp8 format {fmt}, recipe {name}") == 1
    assert "the ring's routed experts run fprop/dgrad" in log
    for r in (ring, a2a):
        assert r.losses[-1] < r.losses[0] - 0.5, (r.name, r.losses)
    print(f"fp8 {fmt}/{name}: tokens/s ring {ring.tokens_per_s():.0f}, "
          f"alltoall {a2a.tokens_per_s():.0f}")  # fmt: skip


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_DIR"), reason="set MEGATRON_LM_DIR")
def test_launch_runs_megatron_lm_pretrain_gpt():
    from benchmarks.e2e import pretrain_args

    script = os.path.join(os.environ["MEGATRON_LM_DIR"], "pretrain_gpt.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(GPUS),
        "-m",
        "relaymoe.megatron.launch",
        script,
        *pretrain_args("tiny_qwen3", gpus=GPUS, steps=10, dispatcher="ring", seed=1),
    ]
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1"),
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert "iteration" in p.stdout and "lm loss" in p.stdout, p.stdout[-3000:]
    print(*[ln for ln in p.stdout.splitlines() if "lm loss" in ln][-3:], sep="\n")  # for the log


def test_fused_loss_gpt_bf16_parity():
    """``--relaymoe-fused-loss`` on a tiny GPTModel in bf16 with relaymoe's Triton loss kernels:
    the same masked loss and the same gradient for every parameter as Megatron's output layer +
    ``vocab_parallel_cross_entropy``, within bf16 noise (the CPU test's workers, on the GPU), at
    TP = 1 (MoE layers with alltoall, allgather and ring too) and, with two GPUs, TP = 2 with
    and without sequence parallelism."""
    from tests.fixtures import free_port, run_spawned
    from tests.lib.test_megatron_fused_loss import worker

    for world in range(1, GPUS + 1):
        port = free_port()
        hung, codes = run_spawned(
            worker, lambda r, w=world, p=port: (r, w, p, "cuda"), world, timeout=300
        )
        assert not hung and all(c == 0 for c in codes), f"TP={world}: hung {hung}, exit {codes}"


def test_fused_loss_50_steps_matches_megatron():
    """The tiny Qwen3-style GPT (ring dispatcher) trains 50 steps with and without
    ``--relaymoe-fused-loss`` from the same seed: the loss curves agree within bf16 noise."""
    from benchmarks.e2e import run_dispatcher

    runs = [
        run_dispatcher("tiny_qwen3", "ring", gpus=GPUS, steps=50, extra=extra, timeout_s=300)
        for extra in ([], ["--relaymoe-fused-loss"])
    ]
    _assert_same_curves(runs, steps=50, window=10, learner=1)  # the fused-loss run learned


def _real_data(tmp: str) -> tuple[str, str]:
    """The tiny example's real-data corpus, tokenizer and indexed dataset, made in ``tmp``."""
    from pathlib import Path

    from relaymoe import data

    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, str(root / "examples/tiny_qwen3/make_corpus.py"), tmp],
                   check=True)  # fmt: skip
    r = data.prepare([os.path.join(tmp, "corpus.jsonl")], os.path.join(tmp, "stdlib"),
                     os.path.join(tmp, "tokenizer"), progress=False)  # fmt: skip
    return r.outputs["text"], r.tokenizer_dir


def test_tiny_qwen3_real_data_ring_learns_as_alltoall_does():
    """200 steps on tokenised text with each dispatcher, same seed and data order.

    Why no absolute loss bound: one run has been measured on this corpus (1x H200, TE:
    first loss 7.00, drop to the last 20 steps' mean 1.98 for both), too few for a bound that
    cannot pass a broken run or fail a good one. Instead the same test run measures alltoall
    (megatron-core's own dispatcher) and holds ring to it: alltoall must have learned, its drop
    from the first loss to the mean of the last 20 more than 20 standard errors of that mean
    (the last 20 losses' spread over sqrt(20): real batches differ in difficulty, so the
    step-to-step spread itself, 0.12 there, is batch variety, not the run's noise); ring's drop
    must be at least 95% of alltoall's, and the curves must agree as on mock data
    (``_assert_same_curves``).
    """
    import statistics

    from benchmarks.e2e import run_dispatcher

    with tempfile.TemporaryDirectory() as d:
        data = _real_data(d)
        runs = [
            run_dispatcher("tiny_qwen3", disp, gpus=GPUS, steps=200, timeout_s=300, data=data)
            for disp in ("ring", "alltoall")
        ]
    ring, a2a = runs
    _assert_same_curves(runs, steps=200, window=20, learner=1)
    drop = {r.name: r.losses[0] - statistics.fmean(r.losses[-20:]) for r in runs}
    sem = statistics.stdev(a2a.losses[-20:]) / math.sqrt(20)
    print(f"real data: first {a2a.losses[0]:.3f}, drop {drop}, alltoall last-20 SEM {sem:.4f}")
    assert drop["alltoall"] > 20 * sem, (drop, sem)
    assert drop["ring"] >= 0.95 * drop["alltoall"], drop


@pytest.mark.parametrize("impl", IMPLS)
def test_converted_hf_checkpoint_trains_with_ring_and_alltoall(impl):
    """A random Hugging Face Qwen3-MoE of ``tiny_qwen3``'s architecture, converted by
    ``relaymoe convert-hf --transformer-impl impl`` (bf16), is the start of a 5-step run with
    each dispatcher through ``--pretrained-checkpoint`` and that layer implementation: both
    load it (under TE into the TE spec, whose pre-MoE norm key the converter writes although it
    builds local layers) and start from the same loss, far from a fresh initialisation's."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from benchmarks.e2e import run_dispatcher

    cfg = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
        rope_theta=1e6, max_position_embeddings=512, rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(3)
    hf = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # a large output layer: the loss starts far above ln(1024)
        hf.lm_head.weight.normal_(0, 1.0)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(os.path.join(d, "hf"))
        ck = os.path.join(d, "ck")
        subprocess.run([sys.executable, "-m", "relaymoe", "convert-hf", "--hf",
                        os.path.join(d, "hf"), "--out", ck, "--config", "tiny_qwen3",
                        "--transformer-impl", impl], check=True)  # fmt: skip
        extra = ["--pretrained-checkpoint", ck, "--load", os.path.join(d, "run"),
                 "--ckpt-format", "torch_dist"]  # fmt: skip
        runs = [
            run_dispatcher(
                "tiny_qwen3",
                disp,
                gpus=GPUS,
                steps=5,
                timeout_s=300,
                extra=extra,
                workdir=os.path.join(d, disp),
                transformer_impl=impl,
            )  # fmt: skip
            for disp in ("ring", "alltoall")
        ]
        fresh = run_dispatcher("tiny_qwen3", "alltoall", gpus=GPUS, steps=5, timeout_s=300,
                               transformer_impl=impl)  # fmt: skip
    for r in (*runs, fresh):
        assert r.returncode == 0 and len(r.steps) == 5, r.log_tail
    ring, a2a = runs
    assert abs(ring.losses[0] - a2a.losses[0]) < 0.02, (ring.losses, a2a.losses)
    assert ring.losses[0] > fresh.losses[0] + 1.0, (ring.losses, fresh.losses)  # loaded
