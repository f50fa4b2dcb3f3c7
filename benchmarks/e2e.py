"""Train one config with ``ring`` and with ``alltoall`` from the same seed and compare.

    python -m benchmarks.e2e --config tiny_qwen3 --gpus 2 --steps 200   (from the repo root)

A harness, not part of the library: it lives beside the benchmarks that use it and drives the
library's supported entry point, ``python -m relaymoe.megatron.pretrain``.

Each dispatcher is one ``torchrun -m relaymoe.megatron.pretrain`` job on mock data, or on an
indexed dataset with ``--data-path PREFIX --tokenizer DIR`` (sequential,
same machine, same seed, same flags but the dispatcher), which writes a JSON line per step
(``--relaymoe-report``). The result: both loss curves, their max |difference|, median
tokens/s over the steps after warm-up, and peak memory (``torch.cuda.max_memory_allocated``
within each step on the reporting rank; the steady peak is the largest after warm-up). Used by
``examples/tiny_qwen3/train.sh``, ``benchmarks/bench_e2e.py`` and ``tests/gpu/test_e2e_gpu.py``.

EP = number of GPUs (one data-parallel rank per GPU, experts split over all of them). The layer
implementation is Megatron's default, TransformerEngine, where TE imports (TE attention and fused
layers, TEGroupedMLP experts with ``--moe-grouped-gemm``), else the local spec (``SequentialMLP``
experts); ``transformer_impl`` asks for either.

Training regimes (``REGIMES``: optimizer and schedule flags, recorded in benchmark rows).
``launcher`` (the default: lr 3e-4 -> 3e-5 cosine, warm-up max(1, steps // 20) iterations,
clip 1.0) learns the tiny config fast; on a realistic model its 1-2 warm-up iterations to 3e-4
were seen (commit 1991b42) to let two alltoall runs from one seed drift 0.46 apart in loss
within 30 steps. ``stable`` (lr 1e-4 -> 1e-5 cosine after 10 warm-up iterations, clip 1.0, Adam
beta2 0.95) is what ``benchmarks/bench_e2e.py`` uses for its realistic shapes. ``loss_parity``
is the parity criterion: max |loss(ring) - loss(alltoall)| <= 2 x max |loss(alltoall) -
loss(alltoall again, same seed)| + 0.01, judged only on complete runs with finite losses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_CHECKOUT = str(Path(__file__).resolve().parents[1])
if __package__ in (None, ""):  # run as a file: make ``relaymoe`` and ``configs`` importable
    sys.path.insert(0, _CHECKOUT)

from benchmarks.processes import stop_group  # noqa: E402
from relaymoe.config import flag_groups  # noqa: E402

__all__ = [
    "PARITY_TOL",
    "REGIMES",
    "Regime",
    "RunResult",
    "abs_diffs",
    "compare",
    "flag_value",
    "have_te",
    "loss_parity",
    "main",
    "merge_flags",
    "pretrain_args",
    "resolve_impl",
    "run_impl",
    "te_version",
    "run_dispatcher",
    "run_pretrain",
]


@dataclass
class RunResult:
    dispatcher: str
    returncode: int
    steps: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    command: str = ""
    log_tail: str = ""
    label: str = ""  # which run of several (``alltoall_repeat``); "" -> the dispatcher
    timed_out: bool = False
    note: str = ""  # why it did not run, when it did not
    workdir: str = ""  # the job's folder: steps.jsonl, stdout.log, stderr.log (whole logs)

    @property
    def name(self) -> str:
        return self.label or self.dispatcher

    @property
    def losses(self) -> list[float]:
        return [s["loss"] for s in self.steps]

    def failure(self, expected_steps: int | None = None) -> str | None:
        """Why this run is no data (``None`` when it is): not started, timed out, a non-zero
        exit, fewer steps reported than ``expected_steps``, or a non-finite loss."""
        if self.note:
            return self.note
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        if self.returncode != 0:
            return f"exit status {self.returncode}"
        if not self.steps:
            return "no training step reported"
        if expected_steps is not None and len(self.steps) != expected_steps:
            return f"{len(self.steps)} of {expected_steps} steps reported"
        bad = [i for i, x in enumerate(self.losses) if not math.isfinite(x)]
        if bad:
            return f"non-finite loss {self.losses[bad[0]]} at step {bad[0] + 1}"
        return None

    def tokens_per_s(self, warmup: int = 5, exclude=()) -> float | None:
        """Median tokens/s over the steps after ``warmup`` (all steps when there are no more),
        leaving out the 1-based steps in ``exclude`` (e.g. a profiled step)."""
        kept = [(i, s["tokens_per_s"]) for i, s in enumerate(self.steps, 1) if i not in exclude]
        vals = [v for i, v in kept if i > warmup] or [v for _, v in kept]
        return statistics.median(vals) if vals else None

    def peak_mib(self, warmup: int = 5) -> float | None:
        """Largest per-step peak after ``warmup`` steps (steady training)."""
        steps = self.steps[warmup:] or self.steps
        return max((s["peak_MiB"] for s in steps), default=None)

    def warmup_peak_mib(self, warmup: int = 5) -> float | None:
        """Largest per-step peak of the first ``warmup`` steps (one-off transients included)."""
        return max((s["peak_MiB"] for s in self.steps[:warmup]), default=None)


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401

        return True
    except Exception:
        return False


TE_IMPL, LOCAL_IMPL = "transformer_engine", "local"
IMPLS = (TE_IMPL, LOCAL_IMPL)


def te_version() -> str | None:
    """TransformerEngine's version where it imports here, else None (rows' ``te_version``)."""
    if not have_te():
        return None
    import transformer_engine

    return str(getattr(transformer_engine, "__version__", "unknown"))


def resolve_impl(transformer_impl: str | None, *, check: bool = True) -> str:
    """``--transformer-impl`` of a run: None -> Megatron's default (TransformerEngine) where TE
    imports, else ``local``; ``transformer_engine`` without TE is a ``ValueError`` unless
    ``check`` is False (a dry run printing commands for another machine)."""
    if transformer_impl is None:
        return TE_IMPL if have_te() else LOCAL_IMPL
    if transformer_impl not in IMPLS:
        raise ValueError(f"transformer_impl={transformer_impl!r}; one of {IMPLS} or None")
    if check and transformer_impl == TE_IMPL and not have_te():
        raise ValueError(
            "transformer_impl='transformer_engine' but TransformerEngine does not import here; "
            "fix: install it (pip install -e '.[te]') or ask for 'local'"
        )
    return transformer_impl


def run_impl(flags) -> str:
    """The ``--transformer-impl`` a flag list runs (Megatron's default when absent)."""
    return flag_value(flags, "--transformer-impl") or TE_IMPL


# Without TE (or asked for): RoPE fusion is a TE kernel, the persistent LayerNorm (Megatron's
# default) is apex's, and the fused masked softmax of the local attention is a CUDA extension that
# the megatron-core wheel does not ship.
# TE's attention builds the causal mask itself: the data loader's (seq x seq) boolean mask per
# sample (Megatron's default) only costs the host, 16 MiB a 4k sample through the loader's
# worker pipe, and a whole-iteration graph waits for every micro-batch's read. MoE training
# scripts on TE commonly pass this.
TE_DATA_FLAGS = ("--no-create-attention-mask-in-dataloader",)
LOCAL_FLAGS = ("--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
               "--no-masked-softmax-fusion")  # fmt: skip


@dataclass(frozen=True)
class Regime:
    """Optimizer and learning-rate schedule of a run (Megatron flags; recorded in rows)."""

    name: str
    lr: float
    min_lr: float
    lr_decay_style: str = "cosine"  # over all --train-iters (Megatron's default decay length)
    lr_warmup_iters: int | None = None  # None: max(1, steps // 20)
    clip_grad: float = 1.0
    weight_decay: float = 0.01
    init_method_std: float = 0.02
    adam_beta1: float | None = None  # None: not passed (Megatron's default, 0.9)
    adam_beta2: float | None = None  # None: not passed (Megatron's default, 0.999)

    def warmup_iters(self, steps: int) -> int:
        if self.lr_warmup_iters is None:
            return max(1, steps // 20)
        if steps <= self.lr_warmup_iters:
            raise ValueError(
                f"regime {self.name!r}: {steps} training steps do not exceed its "
                f"{self.lr_warmup_iters} warm-up iterations (Megatron needs warm-up < decay "
                f"iterations = steps); train more than {self.lr_warmup_iters} steps"
            )
        return self.lr_warmup_iters

    def flags(self, steps: int) -> list[str]:
        out = [
            "--lr", repr(self.lr), "--min-lr", repr(self.min_lr),
            "--lr-decay-style", self.lr_decay_style,
            "--lr-warmup-iters", str(self.warmup_iters(steps)),
            "--clip-grad", repr(self.clip_grad), "--weight-decay", repr(self.weight_decay),
            "--init-method-std", repr(self.init_method_std),
        ]  # fmt: skip
        for name in ("adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            if v is not None:
                out += ["--" + name.replace("_", "-"), repr(v)]
        return out

    def row_fields(self, steps: int) -> dict:
        """The regime as benchmark-row keys (warm-up as applied for ``steps``)."""
        return {
            "regime": self.name,
            "lr": self.lr,
            "min_lr": self.min_lr,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_iters": steps,
            "lr_warmup_iters": self.warmup_iters(steps),
            "clip_grad": self.clip_grad,
            "weight_decay": self.weight_decay,
            "init_method_std": self.init_method_std,
            "adam_beta1": 0.9 if self.adam_beta1 is None else self.adam_beta1,
            "adam_beta2": 0.999 if self.adam_beta2 is None else self.adam_beta2,
        }


REGIMES = {
    # What this launcher always used: fast on the tiny config (the GPU suite's 200-step parity
    # test and the committed tiny rows use it), too aggressive for a realistic model.
    "launcher": Regime("launcher", lr=3e-4, min_lr=3e-5),
    # Realistic shapes: a 10-iteration warm-up to a 3x lower peak, Adam's second moment over
    # ~20 steps instead of ~1000 (beta2 0.95, the usual LLM-pretraining value).
    "stable": Regime(
        "stable", lr=1e-4, min_lr=1e-5, lr_warmup_iters=10, adam_beta1=0.9, adam_beta2=0.95
    ),
}


def _regime(regime: str | Regime) -> Regime:
    if isinstance(regime, Regime):
        return regime
    if regime not in REGIMES:
        raise ValueError(f"regime={regime!r}; known: {sorted(REGIMES)}")
    return REGIMES[regime]


def merge_flags(base, extra) -> list[str]:
    """``base`` with ``extra`` applied: a flag ``base`` already has takes ``extra``'s values in
    its place (one occurrence; Megatron's argparse would take the last one anyway), a new flag
    is appended, in ``extra``'s order. Negations (``--no-x`` vs ``--x``) are different flags."""
    for flags in (base, extra):
        if flags and not flags[0].startswith("--"):
            raise ValueError(
                f"flag list starts with the value {flags[0]!r}; expected a --flag first"
            )
    out = flag_groups(base)
    where = {g[0]: i for i, g in enumerate(out)}
    for g in flag_groups(extra):
        if g[0] in where:
            out[where[g[0]]] = g
        else:
            where[g[0]] = len(out)
            out.append(g)
    return [t for g in out for t in g]


def pretrain_args(
    config: str,
    *,
    gpus: int,
    steps: int,
    dispatcher: str,
    seed: int,
    extra: list[str] = (),
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    recompute_modules: tuple[str, ...] | None = None,
    regime: str | Regime = "launcher",
    transformer_impl: str | None = None,
    check_te: bool = True,
    data: tuple[str, str] | None = None,
    global_batch_size: int | None = None,
) -> list[str]:
    """Megatron flags for a mock-data run of ``config`` with EP = ``gpus``.

    ``data`` = (dataset prefix, tokenizer folder) trains on that indexed dataset (``relaymoe
    data``'s output) with Megatron's HuggingFaceTokenizer instead; the embedding keeps the
    config's vocabulary (``--padded-vocab-size``), and 1% of the documents are held out
    (``--split 99,1,0``) as ``examples/qwen3/train.sh`` does.

    ``seq_length`` / ``micro_batch_size`` replace the config's; ``recompute_modules`` asks for
    selective recompute of those modules; the global batch is micro-batch x ``gpus`` (one
    micro-batch per data-parallel rank per step) unless ``global_batch_size`` is given: then
    Megatron accumulates gradients over global / (micro-batch x data-parallel size) micro-batches
    a step (a multiple of micro-batch x ``gpus``, else a ``ValueError``). ``regime`` names the
    optimizer and schedule (``REGIMES``). ``transformer_impl`` (``resolve_impl``):
    TransformerEngine (Megatron's default: TE layers, TEGroupedMLP experts with the config's
    --moe-grouped-gemm) or ``local`` (``LOCAL_FLAGS``); None takes TE where it imports;
    ``check_te=False`` plans TE runs where it does not (dry runs). ``extra`` flags replace the
    same flags' values (``merge_flags``).
    """
    from relaymoe.config import load_config, to_megatron_args

    reg = _regime(regime)
    cfg = load_config(config)
    tr: dict = {}
    if seq_length is not None:
        tr["seq_length"] = seq_length
    if micro_batch_size is not None:
        tr["micro_batch_size"] = micro_batch_size
    if recompute_modules:
        tr["recompute_granularity"] = "selective"
        tr["recompute_modules"] = tuple(recompute_modules)
    if tr:
        tr["global_batch_size"] = None  # set below: micro-batch x gpus
        cfg = cfg.replace(training=tr)
    max_pos = cfg.model.max_position_embeddings
    if max_pos is not None and cfg.training.seq_length > max_pos:
        raise ValueError(
            f"seq_length={cfg.training.seq_length} exceeds model.max_position_embeddings="
            f"{max_pos} of config {config!r}; use a shorter sequence or a config without that cap"
        )
    base = to_megatron_args(cfg, dispatcher=dispatcher)
    out: list[str] = []
    skip_next = False
    overrides = {"--expert-model-parallel-size": str(gpus)}
    for a in base:
        if skip_next:
            skip_next = False
            continue
        if a in overrides:
            out += [a, overrides.pop(a)]
            skip_next = True
            continue
        if a == "--global-batch-size":  # one micro-batch per DP rank per step, unless asked
            mbs = int(base[base.index("--micro-batch-size") + 1])
            if global_batch_size is not None and global_batch_size % (mbs * gpus):
                raise ValueError(
                    f"global_batch_size={global_batch_size} is not a multiple of micro-batch "
                    f"{mbs} x {gpus} GPUs; Megatron needs whole micro-batches per rank"
                )
            out += [a, str(global_batch_size or mbs * gpus)]
            skip_next = True
            continue
        out.append(a)
    out += [*(f for kv in overrides.items() for f in kv)]
    if data is None:
        out += ["--mock-data", "--tokenizer-type", "NullTokenizer"]
    else:
        prefix, tokenizer = data
        out += ["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                "--tokenizer-model", tokenizer,
                "--padded-vocab-size", str(cfg.model.vocab_size)]  # fmt: skip
    out += [
        "--train-iters", str(steps),
        "--eval-iters", "0",
        "--eval-interval", str(10 * steps + 1),
        *reg.flags(steps),
        "--seed", str(seed),
        "--log-interval", "1",
        "--split", "100,0,0" if data is None else "99,1,0",
        # gradient-accumulation fusion stays on (Megatron's default, and what users of NVIDIA's
        # containers with apex run): relaymoe.megatron.pretrain supplies a torch stand-in for
        # apex's extension where it is missing (relaymoe/megatron/wgrad_fallback.py)
        "--distributed-backend", "nccl",
    ]  # fmt: skip
    if resolve_impl(transformer_impl, check=check_te) == LOCAL_IMPL:
        out += LOCAL_FLAGS
    else:
        out += ["--transformer-impl", TE_IMPL, *TE_DATA_FLAGS]
    return merge_flags(out, extra)


def flag_value(flags, name: str) -> str | None:
    for g in flag_groups(flags):
        if g[0] == name:
            return g[1] if len(g) > 1 else ""
    return None


def run_dispatcher(
    config: str,
    dispatcher: str,
    *,
    gpus: int,
    steps: int,
    seed: int = 1234,
    extra: list[str] = (),
    timeout_s: float = 600,
    workdir: str | None = None,
    transformer_impl: str | None = None,
    data: tuple[str, str] | None = None,
) -> RunResult:
    flags = pretrain_args(config, gpus=gpus, steps=steps, dispatcher=dispatcher, seed=seed,
                          extra=extra, transformer_impl=transformer_impl,
                          data=data)  # fmt: skip
    return run_pretrain(flags, gpus=gpus, timeout_s=timeout_s, workdir=workdir)


def plans_or_no_gpus(plans: dict, *, dry_run: bool, gpus: int, who: str) -> int | None:
    """A harness's early exit: with ``dry_run`` print each plan's flags (exit 0); without
    ``gpus`` CUDA GPUs say so (exit 3); else None (go on and run the plans)."""
    if dry_run:
        for label, flags in plans.items():
            print(f"# {label}\n" + " ".join(shlex.quote(f) for f in flags))
        return 0
    import torch

    if torch.cuda.device_count() < gpus:
        print(f"{who}: needs {gpus} CUDA GPUs; nothing measured")
        return 3
    return None


def _text(x) -> str:
    if x is None:
        return ""
    return x.decode(errors="replace") if isinstance(x, bytes) else x


def run_pretrain(
    flags: list[str],
    *,
    gpus: int,
    label: str = "",
    timeout_s: float = 600,
    workdir: str | None = None,
    module: str = "relaymoe.megatron.pretrain",
    env: dict | None = None,
) -> RunResult:
    """One ``torchrun -m relaymoe.megatron.pretrain FLAGS`` job; never raises for a failed job.

    The job runs in its own process group: past ``timeout_s`` the whole group (torchrun and its
    workers, which would otherwise keep the GPUs) is stopped and the result says ``timed_out``.
    ``module``: another entry point that runs the same pretrain (e.g. ``benchmarks.soak_pretrain``;
    the checkout is put on ``PYTHONPATH``); ``env``: extra environment variables of the job.
    """
    dispatcher = flag_value(flags, "--moe-token-dispatcher-type") or "?"
    name = label or dispatcher
    workdir = workdir or tempfile.mkdtemp(prefix=f"relaymoe_e2e_{name}_")
    os.makedirs(workdir, exist_ok=True)  # a caller's folder may not exist yet (it is the cwd)
    report = os.path.join(workdir, "steps.jsonl")
    if os.path.exists(report):
        os.remove(report)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", str(gpus),
        "-m", module,
        *flags,
        "--relaymoe-report", report,
    ]  # fmt: skip
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="4", **(env or {}),
               PYTHONPATH=_CHECKOUT + (os.pathsep + path if path else ""))  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=workdir,
        start_new_session=True,  # its own process group, stopped as one on timeout
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop_group(proc)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside the group holds the pipes
            out, err = "", "(no output collected: the job's pipes stayed open after it was stopped)"
    except BaseException:  # e.g. Ctrl-C: do not leave the workers on the GPUs
        stop_group(proc)
        raise
    for name, text in (("stdout.log", out), ("stderr.log", err)):
        with open(os.path.join(workdir, name), "w") as f:
            f.write(_text(text))
    res = RunResult(
        dispatcher=dispatcher,
        returncode=proc.returncode,
        seconds=time.perf_counter() - t0,
        command=" ".join(shlex.quote(c) for c in cmd),
        log_tail=(_text(out)[-4000:] + "\n" + _text(err)[-6000:]),
        label=label,
        timed_out=timed_out,
        workdir=workdir,
    )
    if os.path.exists(report):
        with open(report) as f:
            res.steps = [json.loads(line) for line in f if line.strip()]
    return res


def compare(a: RunResult, b: RunResult) -> dict:
    """max/mean |loss difference| over the common steps, and the last losses."""
    n = min(len(a.steps), len(b.steps))
    diffs = [abs(x - y) for x, y in zip(a.losses[:n], b.losses[:n], strict=True)]
    return {
        "steps_compared": n,
        "max_abs_loss_diff": max(diffs) if diffs else None,
        "mean_abs_loss_diff": statistics.fmean(diffs) if diffs else None,
        "final_loss": {
            a.dispatcher: a.losses[-1] if a.steps else None,
            b.dispatcher: b.losses[-1] if b.steps else None,
        },
        "first_loss": {
            a.dispatcher: a.losses[0] if a.steps else None,
            b.dispatcher: b.losses[0] if b.steps else None,
        },
    }


PARITY_TOL = 0.01  # the issue's absolute slack on top of twice the run-to-run noise


def abs_diffs(a: RunResult, b: RunResult) -> list[float]:
    n = min(len(a.steps), len(b.steps))
    return [abs(x - y) for x, y in zip(a.losses[:n], b.losses[:n], strict=True)]


def loss_parity(
    ring: RunResult,
    alltoall: RunResult,
    repeat: RunResult | None = None,
    *,
    steps: int,
    tol: float = PARITY_TOL,
) -> dict:
    """Ring vs alltoall loss curves against alltoall's own run-to-run noise.

    ``repeat`` is a second alltoall run with the same seed and flags. Only runs that completed
    all ``steps`` with finite losses count (``RunResult.failure``); ``parity_ok`` is
    ``max|ring - alltoall| <= 2 * max|alltoall - repeat| + tol`` over the ``steps`` steps, False
    when any run failed, and None when there is no repeat run to measure the noise with.
    """
    runs = [("ring", ring), ("alltoall", alltoall)]
    if repeat is not None:
        runs.append(("repeat", repeat))
    failures = {r.name: why for _, r in runs if (why := r.failure(steps)) is not None}
    good = {key for key, r in runs if r.failure(steps) is None}
    out = {
        "steps_compared": None,
        "max_abs_loss_diff": None,
        "mean_abs_loss_diff": None,
        "noise_max_abs_loss_diff": None,
        "noise_mean_abs_loss_diff": None,
        "parity_bound": None,
        "parity_ok": False if failures else None,
        "parity_tol": tol,
        "failures": failures,
    }
    if {"ring", "alltoall"} <= good:
        d = abs_diffs(ring, alltoall)
        out.update(steps_compared=len(d), max_abs_loss_diff=max(d),
                   mean_abs_loss_diff=statistics.fmean(d))  # fmt: skip
    if {"alltoall", "repeat"} <= good:
        n = abs_diffs(alltoall, repeat)
        out.update(noise_max_abs_loss_diff=max(n), noise_mean_abs_loss_diff=statistics.fmean(n))
    if not failures and repeat is not None:
        out["parity_bound"] = 2 * out["noise_max_abs_loss_diff"] + tol
        out["parity_ok"] = out["max_abs_loss_diff"] <= out["parity_bound"]
    out.update(_partial_noise(ring, alltoall, repeat, good))
    return out


def _partial_noise(ring, alltoall, repeat, good: set[str]) -> dict:
    """When only the repeat run stopped early (a budget cut), both differences over the steps it
    finished with finite losses: a hint, never a verdict (``parity_ok`` stays False)."""
    fields = {"partial_steps": None, "partial_max_abs_loss_diff": None,
              "partial_noise_max_abs_loss_diff": None}  # fmt: skip
    if repeat is None or "repeat" in good or not {"ring", "alltoall"} <= good:
        return fields
    n = 0
    while n < len(repeat.losses) and math.isfinite(repeat.losses[n]):
        n += 1
    if n == 0:
        return fields
    d = [abs(x - y) for x, y in zip(ring.losses[:n], alltoall.losses[:n], strict=True)]
    e = [abs(x - y) for x, y in zip(alltoall.losses[:n], repeat.losses[:n], strict=True)]
    return {"partial_steps": n, "partial_max_abs_loss_diff": max(d),
            "partial_noise_max_abs_loss_diff": max(e)}  # fmt: skip


def print_summary(results: list[RunResult], cmp: dict | None) -> None:
    print(
        f"{'run':<16} {'rc':>3} {'steps':>5} {'first loss':>10} {'final loss':>10} "
        f"{'tokens/s':>10} {'peak MiB':>9} {'wall s':>7}"
    )
    for r in results:
        fl = f"{r.losses[0]:.4f}" if r.steps else "-"
        ll = f"{r.losses[-1]:.4f}" if r.steps else "-"
        tps = r.tokens_per_s()
        pk = r.peak_mib()
        print(
            f"{r.name:<16} {r.returncode:>3} {len(r.steps):>5} {fl:>10} {ll:>10} "
            f"{(f'{tps:.0f}' if tps else '-'):>10} {(f'{pk:.0f}' if pk else '-'):>9} "
            f"{r.seconds:>7.1f}"
        )
    if cmp and cmp["max_abs_loss_diff"] is not None:
        print(
            f"loss curves over {cmp['steps_compared']} steps: max |ring - alltoall| = "
            f"{cmp['max_abs_loss_diff']:.4g}, mean = {cmp['mean_abs_loss_diff']:.4g}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny_qwen3")
    p.add_argument("--gpus", type=int, default=None, help="default: all visible GPUs, at most 2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dispatchers", nargs="+", default=["ring", "alltoall"])
    p.add_argument("--json", default=None, help="write the comparison as JSON here")
    p.add_argument("--data-path", default=None, help="an indexed dataset prefix (default: mock)")
    p.add_argument("--tokenizer", default=None, help="with --data-path: its tokenizer folder")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then extra Megatron flags")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("relaymoe e2e: no CUDA GPU on this machine; training needs 1 or 2 GPUs.")
        return 3
    if (a.data_path is None) != (a.tokenizer is None):
        p.error("--data-path and --tokenizer go together (relaymoe data prints both)")
    data = None if a.data_path is None else (a.data_path, a.tokenizer)
    gpus = a.gpus or min(2, torch.cuda.device_count())
    extra = [x for x in a.extra if x != "--"]
    results = [
        run_dispatcher(a.config, d, gpus=gpus, steps=a.steps, seed=a.seed, extra=extra, data=data)
        for d in a.dispatchers
    ]
    for r in results:
        if r.returncode != 0 or not r.steps:
            print(
                f"--- {r.dispatcher} failed (rc={r.returncode}); command:\n{r.command}\n"
                f"{r.log_tail}",
                file=sys.stderr,
            )
    cmp = compare(results[0], results[1]) if len(results) == 2 else None
    print_summary(results, cmp)
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "config": a.config,
                    "data_path": a.data_path,
                    "gpus": gpus,
                    "steps": a.steps,
                    "seed": a.seed,
                    "runs": [
                        {
                            "dispatcher": r.dispatcher,
                            "returncode": r.returncode,
                            "tokens_per_s": r.tokens_per_s(),
                            "peak_MiB": r.peak_mib(),
                            "losses": r.losses,
                            "seconds": r.seconds,
                        }
                        for r in results
                    ],
                    "compare": cmp,
                },
                indent=1,
            )
        )
    return 0 if all(r.returncode == 0 and r.steps for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
