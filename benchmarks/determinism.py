"""GPU determinism of training with the ring (issue #17 item 6): two identical runs, bitwise.

    python benchmarks/determinism.py [--config tiny_qwen3] [--steps 20] [--seed 1234]
        [--modes expert,token] [--transports copy_engine,nccl] [--parallel N]
        [--out benchmarks/results/determinism.jsonl] [--dry-run]

Per ring mode and transport, two ``torchrun -m relaymoe.megatron.pretrain`` jobs at EP = 2 (two
GPUs) with identical flags and seed: ``--moe-token-dispatcher-type ring --relaymoe-mode M
--relaymoe-transport T`` on mock data (the mode forced: "auto" may pick the all-to-all mode, where
the transport does nothing). ``--parallel N``: N jobs at once on the same GPUs (a bitwise check,
not a timing). Each reports its loss per step and, after the last step, every rank's SHA-256 of
its parameters (``--relaymoe-weights-digest``). Row ``bench: determinism`` per mode and
transport: ``provider`` relaymoe_ring, ``mode``, ``transport``, ``steps`` (completed by both),
``losses_identical`` (every step's loss equal as a float), ``weights_identical`` (every rank's
digest equal),
``max_abs_loss_diff``, ``failure`` and ``ok`` (both runs trained every step and both are true).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, JsonlWriter  # noqa: E402
from benchmarks.e2e import (  # noqa: E402
    RunResult,
    abs_diffs,
    plans_or_no_gpus,
    pretrain_args,
    run_pretrain,
)

TRANSPORTS = ("copy_engine", "nccl")
MODES = ("expert", "token")  # the ring modes whose hops the transport carries


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
    diffs = abs_diffs(a, b)
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
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--run-timeout-s", type=float, default=240)
    ap.add_argument("--parallel", type=int, default=1, help="runs at once (they share the GPUs)")
    ap.add_argument("--workdir", default="/tmp/relaymoe_determinism")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "determinism.jsonl"))
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    gpus = 2
    modes = [m for m in a.modes.split(",") if m]
    transports = [t for t in a.transports.split(",") if t]
    for what, got, known in (("--modes", modes, MODES), ("--transports", transports, TRANSPORTS)):
        unknown = sorted(set(got) - set(known))
        if unknown:
            ap.error(f"{what} {unknown}: choose from {list(known)}")
    settings = {"config": a.config, "steps_requested": a.steps, "seed": a.seed}
    # the mode is forced: at tiny_qwen3's tokens per rank "auto" is the all-to-all mode, whose
    # one all-to-all no transport flag reaches (session 9 measured that by mistake)
    plans = {(m, t): pretrain_args(a.config, gpus=gpus, steps=a.steps, dispatcher="ring",
                                   seed=a.seed, extra=["--relaymoe-mode", m,
                                                       "--relaymoe-transport", t,
                                                       "--relaymoe-weights-digest"])
             for m in modes for t in transports}  # fmt: skip
    early = plans_or_no_gpus({f"{m} {t} (twice)": f for (m, t), f in plans.items()},
                             dry_run=a.dry_run, gpus=gpus, who="determinism")  # fmt: skip
    if early is not None:
        return early

    def one(job):
        (m, t), n = job
        folder = Path(a.workdir) / f"{m}_{t}_{n}"
        for old in folder.glob("steps.jsonl.weights.rank*.json"):
            old.unlink()  # a previous invocation's digests must not pass for this run's
        r = run_pretrain(plans[m, t], gpus=gpus, label=f"ring_{m}_{t}_{n}",
                         timeout_s=a.run_timeout_s, workdir=str(folder))  # fmt: skip
        print(f"[determinism] {m} {t} run {n}: {r.failure(a.steps) or 'ok'} "
              f"({r.seconds:.0f} s)", flush=True)  # fmt: skip
        return r, read_digests(folder / "steps.jsonl")

    jobs = [(key, n) for key in plans for n in (1, 2)]
    with ThreadPoolExecutor(max(1, a.parallel)) as pool:
        done = dict(zip(jobs, pool.map(one, jobs), strict=True))
    writer = JsonlWriter(a.out)
    bad = 0
    for m, t in plans:
        (ra, da), (rb, db) = done[(m, t), 1], done[(m, t), 2]
        row = determinism_row(ra, rb, (da, db), steps=a.steps, gpus=gpus, transport=t,
                              settings={"mode": m, **settings})  # fmt: skip
        row = writer.write(row)
        bad += not row["ok"]
        print({k: row[k] for k in ("mode", "transport", "steps", "losses_identical",
                                   "weights_identical", "max_abs_loss_diff", "failure", "ok")},
              flush=True)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
