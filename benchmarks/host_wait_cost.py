"""What the ring's host wait costs a Megatron run (issue #17): ``RELAYMOE_RING_HOST_WAIT`` A/B.

    python benchmarks/host_wait_cost.py [--shape qwen3_slice_s4k] [--values off,lag,pass]
        [--repeats 2] [--steps 50] [--out benchmarks/results/host_wait.jsonl] [--dry-run]

``bench_e2e.py``'s ring run of ``--shape`` (the same flags and seed), once per value and repeat,
the values interleaved (off, lag, pass, off, ...) so that a drift of the machine shows as a
difference between repeats of one value rather than as a cost. Row ``bench: host_wait`` per run:
``shape``, ``host_wait``, ``repeat``, ``tokens_per_s`` (steps past the warm-up), ``peak_MiB``,
``final_loss``, ``failure``. Only the ring runs: the value does not reach megatron-core's
dispatchers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_e2e import SHAPE_STEPS, SHAPES, plan_runs  # noqa: E402
from benchmarks.common import ROOT, JsonlWriter  # noqa: E402
from benchmarks.e2e import plans_or_no_gpus, run_pretrain  # noqa: E402
from relaymoe.options import env_var  # noqa: E402

HOST_WAIT_ENV = env_var("host_wait")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3_slice_s4k", choices=sorted(SHAPES))
    ap.add_argument("--values", default="off,lag,pass")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=SHAPE_STEPS)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--run-timeout-s", type=float, default=300)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "host_wait.jsonl"))
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    values = [v for v in a.values.split(",") if v]
    gpus = 2
    ring = plan_runs(SHAPES[a.shape], gpus=gpus, steps=a.steps, seed=a.seed, noise_run=False)[0]
    order = [(rep, v) for rep in range(a.repeats) for v in values]
    plans = {f"ring_{v}_{rep}": list(ring.flags) for rep, v in order}
    early = plans_or_no_gpus(plans, dry_run=a.dry_run, gpus=gpus, who="host_wait_cost")
    if early is not None:
        return early
    writer = JsonlWriter(a.out)
    ok = True
    for rep, v in order:
        r = run_pretrain(list(ring.flags), gpus=gpus, label=f"ring_{v}_{rep}",
                         timeout_s=a.run_timeout_s, env={HOST_WAIT_ENV: v})  # fmt: skip
        why = r.failure(a.steps)
        ok &= why is None
        row = writer.write({
            "bench": "host_wait", "shape": a.shape, "provider": "relaymoe_ring",
            "host_wait": v, "repeat": rep, "steps": len(r.steps), "failure": why,
            "tokens_per_s": r.tokens_per_s() if why is None else None,
            "peak_MiB": r.peak_mib() if why is None else None,
            "final_loss": r.losses[-1] if r.losses else None, "wall_s": r.seconds,
        })  # fmt: skip
        print({k: row[k] for k in ("host_wait", "repeat", "tokens_per_s", "failure")}, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
