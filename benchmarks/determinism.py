"""GPU determinism of training with the ring (issue #17 item 6): two identical runs, bitwise.

    python benchmarks/determinism.py [--config tiny_qwen3] [--steps 20] [--seed 1234]
        [--transports copy_engine,nccl] [--out benchmarks/results/determinism.jsonl] [--dry-run]

Per transport, two ``torchrun -m relaymoe.megatron.pretrain`` jobs at EP = 2 (two GPUs) with
identical flags and seed: ``--moe-token-dispatcher-type ring --relaymoe-transport T`` on mock
data. Each reports its loss per step and, after the last step, every rank's SHA-256 of its
parameters (``--relaymoe-weights-digest``). Row ``bench: determinism`` per transport:
``provider`` relaymoe_ring, ``transport``, ``steps`` (completed by both), ``losses_identical``
(every step's loss equal as a float), ``weights_identical`` (every rank's digest equal),
``max_abs_loss_diff``, ``failure`` and ``ok`` (both runs trained every step and both are true).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, JsonlWriter  # noqa: E402
from benchmarks.e2e import (  # noqa: E402
    RunResult,
    _abs_diffs,
    plans_or_no_gpus,
    pretrain_args,
    run_pretrain,
)

TRANSPORTS = ("copy_engine", "nccl")


def read_digests(report: Path) -> dict[int, str]:
    """{rank: sha256} from ``report``'s ``.weights.rank<R>.json`` files."""
    out = {}
    for f in sorted(report.parent.glob(report.name + ".weights.rank*.json")):
        d = json.loads(f.read_text())
        out[int(d["rank"])] = d["sha256"]
    return out


def determinism_row(a: RunResult, b: RunResult, digests: tuple[dict, dict], *, steps: int,
                    gpus: int, transport: str, settings: dict) -> dict:  # fmt: skip
    """The row of one transport from its two runs and their ranks' weight digests."""
    why = [f"{r.name}: {w}" for r in (a, b) if (w := r.failure(steps)) is not None]
    da, db = digests
    if not why and (len(da) != gpus or len(db) != gpus):
        why.append(f"weight digests from {len(da)} and {len(db)} of {gpus} ranks")
    n = min(len(a.steps), len(b.steps))
    diffs = _abs_diffs(a, b)
    losses_same = n == steps and a.losses[:n] == b.losses[:n]
    weights_same = len(da) == gpus and da == db
    return {
        "bench": "determinism", "provider": "relaymoe_ring", "transport": transport,
        "steps": n, "losses_identical": losses_same, "weights_identical": weights_same,
        "max_abs_loss_diff": max(diffs) if diffs else None, "failure": "; ".join(why) or None,
        "ok": not why and losses_same and weights_same, "ep": gpus,
        "wall_s": round(a.seconds + b.seconds, 1), **settings,
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny_qwen3")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--run-timeout-s", type=float, default=240)
    ap.add_argument("--workdir", default="/tmp/relaymoe_determinism")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "determinism.jsonl"))
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    gpus = 2
    transports = [t for t in a.transports.split(",") if t]
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown:
        ap.error(f"--transports {unknown}: choose from {list(TRANSPORTS)}")
    settings = {"config": a.config, "steps_requested": a.steps, "seed": a.seed}
    plans = {t: pretrain_args(a.config, gpus=gpus, steps=a.steps, dispatcher="ring", seed=a.seed,
                              extra=["--relaymoe-transport", t, "--relaymoe-weights-digest"])
             for t in transports}  # fmt: skip
    early = plans_or_no_gpus({f"{t} (twice)": f for t, f in plans.items()}, dry_run=a.dry_run,
                             gpus=gpus, who="determinism")  # fmt: skip
    if early is not None:
        return early
    writer = JsonlWriter(a.out)
    bad = 0
    for t, flags in plans.items():
        runs, digests = [], []
        for n in (1, 2):
            folder = Path(a.workdir) / f"{t}_{n}"
            for old in folder.glob("steps.jsonl.weights.rank*.json"):
                old.unlink()  # a previous invocation's digests must not pass for this run's
            r = run_pretrain(flags, gpus=gpus, label=f"ring_{t}_{n}", timeout_s=a.run_timeout_s,
                             workdir=str(folder))  # fmt: skip
            runs.append(r)
            digests.append(read_digests(folder / "steps.jsonl"))
            print(f"[determinism] {t} run {n}: {r.failure(a.steps) or 'ok'} "
                  f"({r.seconds:.0f} s)", flush=True)  # fmt: skip
        row = writer.write(determinism_row(*runs, tuple(digests), steps=a.steps, gpus=gpus,
                                           transport=t, settings=settings))  # fmt: skip
        bad += not row["ok"]
        print({k: row[k] for k in ("transport", "steps", "losses_identical", "weights_identical",
                                   "max_abs_loss_diff", "failure", "ok")}, flush=True)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
