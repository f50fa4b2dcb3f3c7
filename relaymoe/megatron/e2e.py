"""Train one config with ``ring`` and with ``alltoall`` from the same seed and compare.

    python -m relaymoe.megatron.e2e --config tiny_qwen3 --gpus 2 --steps 200

Each dispatcher is one ``torchrun -m relaymoe.megatron.pretrain`` job on mock data (sequential,
same machine, same seed, same flags but the dispatcher), which writes a JSON line per step
(``--relaymoe-report``). The result: both loss curves, their max |difference|, median
tokens/s over the steps after warm-up, and peak memory (``torch.cuda.max_memory_allocated``
within each step on the reporting rank; the steady peak is the largest after warm-up). Used by
``examples/tiny_qwen3/train.sh``, ``benchmarks/bench_e2e.py`` and ``tests/gpu/test_e2e_gpu.py``.

EP = number of GPUs (one data-parallel rank per GPU, experts split over all of them). Without
TransformerEngine the local (non-TE) layer spec is used (``SequentialMLP`` experts).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RunResult", "run_dispatcher", "compare", "pretrain_args", "main"]


@dataclass
class RunResult:
    dispatcher: str
    returncode: int
    steps: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    command: str = ""
    log_tail: str = ""

    @property
    def losses(self) -> list[float]:
        return [s["loss"] for s in self.steps]

    def tokens_per_s(self, warmup: int = 5) -> float | None:
        vals = [s["tokens_per_s"] for s in self.steps[warmup:]] or [
            s["tokens_per_s"] for s in self.steps
        ]
        return statistics.median(vals) if vals else None

    def peak_mib(self, warmup: int = 5) -> float | None:
        """Largest per-step peak after ``warmup`` steps (steady training)."""
        steps = self.steps[warmup:] or self.steps
        return max((s["peak_MiB"] for s in steps), default=None)

    def warmup_peak_mib(self, warmup: int = 5) -> float | None:
        """Largest per-step peak of the first ``warmup`` steps (one-off transients included)."""
        return max((s["peak_MiB"] for s in self.steps[:warmup]), default=None)


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401

        return True
    except Exception:
        return False


def pretrain_args(
    config: str, *, gpus: int, steps: int, dispatcher: str, seed: int, extra: list[str] = ()
) -> list[str]:
    """Megatron flags for a mock-data run of ``config`` with EP = ``gpus``."""
    from relaymoe.config import load_config, to_megatron_args

    cfg = load_config(config)
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
        if a == "--global-batch-size":  # one micro-batch per DP rank per step
            mbs = base[base.index("--micro-batch-size") + 1]
            out += [a, str(int(mbs) * gpus)]
            skip_next = True
            continue
        out.append(a)
    out += [*(f for kv in overrides.items() for f in kv)]
    out += [
        "--mock-data",
        "--tokenizer-type", "NullTokenizer",
        "--train-iters", str(steps),
        "--eval-iters", "0",
        "--eval-interval", str(10 * steps + 1),
        "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(1, steps // 20)),
        "--clip-grad", "1.0", "--weight-decay", "0.01",
        "--init-method-std", "0.02",
        "--seed", str(seed),
        "--log-interval", "1",
        "--split", "100,0,0",
        "--no-gradient-accumulation-fusion",
        "--distributed-backend", "nccl",
    ]  # fmt: skip
    if not _have_te():
        # Without TE: RoPE fusion is a TE kernel, the persistent LayerNorm (Megatron's default)
        # is apex's, and the fused masked softmax of the local attention is a CUDA extension
        # that the megatron-core wheel does not ship.
        out += ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
                "--no-masked-softmax-fusion"]  # fmt: skip
    return out + list(extra)


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
) -> RunResult:
    import time

    workdir = workdir or tempfile.mkdtemp(prefix=f"relaymoe_e2e_{dispatcher}_")
    os.makedirs(workdir, exist_ok=True)  # a caller's folder may not exist yet (it is the cwd)
    report = os.path.join(workdir, "steps.jsonl")
    if os.path.exists(report):
        os.remove(report)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", str(gpus),
        "-m", "relaymoe.megatron.pretrain",
        *pretrain_args(config, gpus=gpus, steps=steps, dispatcher=dispatcher, seed=seed,
                       extra=extra),
        "--relaymoe-report", report,
    ]  # fmt: skip
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="4")
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=workdir
    )
    res = RunResult(
        dispatcher=dispatcher,
        returncode=proc.returncode,
        seconds=time.perf_counter() - t0,
        command=" ".join(shlex.quote(c) for c in cmd),
        log_tail=(proc.stdout[-4000:] + "\n" + proc.stderr[-6000:]),
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


def print_summary(results: list[RunResult], cmp: dict | None) -> None:
    print(
        f"{'dispatcher':<10} {'rc':>3} {'steps':>5} {'first loss':>10} {'final loss':>10} "
        f"{'tokens/s':>10} {'peak MiB':>9} {'wall s':>7}"
    )
    for r in results:
        fl = f"{r.losses[0]:.4f}" if r.steps else "-"
        ll = f"{r.losses[-1]:.4f}" if r.steps else "-"
        tps = r.tokens_per_s()
        pk = r.peak_mib()
        print(
            f"{r.dispatcher:<10} {r.returncode:>3} {len(r.steps):>5} {fl:>10} {ll:>10} "
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
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then extra Megatron flags")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("relaymoe e2e: no CUDA GPU on this machine; training needs 1 or 2 GPUs.")
        return 3
    gpus = a.gpus or min(2, torch.cuda.device_count())
    extra = [x for x in a.extra if x != "--"]
    results = [
        run_dispatcher(a.config, d, gpus=gpus, steps=a.steps, seed=a.seed, extra=extra)
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
