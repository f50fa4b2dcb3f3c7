"""Routing-drift soak (issue #17 item 2): a long Megatron run whose routing swings from uniform to
one EP rank's experts and back, ring against alltoall from the same seed.

    python benchmarks/soak.py [--config tiny_qwen3] [--steps 1000] [--period 200]
        [--strength 12] [--warmup 50] [--ring-mode token] [--ring-transport copy_engine]
        [--parallel] [--out benchmarks/results/soak.jsonl] [--dry-run]

Three ``torchrun -m benchmarks.soak_pretrain`` jobs at EP = 2 (two GPUs), identical flags and seed
but the dispatcher: ``ring`` (``--ring-mode``/``--ring-transport``, default the token ring over
the copy engine, whose workspace the soak watches), ``alltoall`` and ``alltoall`` again
(megatron-core's own run-to-run noise). The router drift is ``benchmarks/soak_pretrain.py``'s
triangle wave (every ``--period`` steps from no bias to ``--strength`` on EP rank 0's experts and
back, so the other rank's experts receive almost no token at each peak).

Row ``bench: soak`` per dispatcher run: ``provider``, ``steps`` (completed), ``failure``,
``peak_growth_pct`` (largest ``memory_allocated`` after a step past ``--warmup``, over the value
after step ``--warmup``, in percent, the worse rank), ``workspace_bytes_final`` and
``workspace_collective`` (every step, every rank held the same copy-engine workspace: it grew only
together), ``max_abs_loss_diff_vs_other`` (ring vs the first alltoall run, on both rows),
``noise_max_abs_loss_diff`` (alltoall vs its repeat), ``ok`` (all steps trained, growth <= 1%,
the workspace collective, and the ring within ``2 x noise + 0.01`` of alltoall, as
``benchmarks/bench_e2e.py``'s parity), with the regime and drift settings. A hang is a failure
(``--run-timeout-s``). ``--dry-run`` prints the commands.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, JsonlWriter  # noqa: E402
from benchmarks.e2e import loss_parity, plans_or_no_gpus, pretrain_args, run_pretrain  # noqa: E402

GROWTH_LIMIT_PCT = 1.0
RUNS = (("ring", "ring"), ("alltoall", "alltoall"), ("alltoall_repeat", "alltoall"))


def memory_stats(rank_lines: dict[int, list[dict]], warmup: int) -> dict:
    """Growth past warm-up (the worse rank) and whether the workspace moved only collectively."""
    growth = 0.0
    for lines in rank_lines.values():
        after = [x["allocated_MiB"] for x in lines if x["step"] >= warmup]
        if len(after) >= 2 and after[0] > 0:
            growth = max(growth, 100.0 * (max(after) - after[0]) / after[0])
    by_step: dict[int, set] = {}
    for lines in rank_lines.values():
        for x in lines:
            by_step.setdefault(x["step"], set()).add(x["workspace_bytes"])
    counts = {len(lines) for lines in rank_lines.values()}
    collective = len(counts) == 1 and all(len(v) == 1 for v in by_step.values())
    final = max((x["workspace_bytes"] for lines in rank_lines.values() for x in lines), default=0)
    return {"peak_growth_pct": growth, "workspace_collective": collective,
            "workspace_bytes_final": final}  # fmt: skip


def read_rank_logs(folder: Path) -> dict[int, list[dict]]:
    out = {}
    for f in sorted(folder.glob("rank*.jsonl")):
        out[int(f.stem.removeprefix("rank"))] = [json.loads(x) for x in f.read_text().splitlines()]
    return out


def soak_rows(results: dict, logs: dict, *, steps: int, warmup: int, settings: dict) -> list[dict]:
    """The two rows (ring, alltoall) from the three runs' results and rank logs."""
    par = loss_parity(results["ring"], results["alltoall"], results.get("alltoall_repeat"),
                      steps=steps)  # fmt: skip
    rows = []
    for label in ("ring", "alltoall"):
        r = results[label]
        why = r.failure(steps)
        mem = memory_stats(logs.get(label, {}), warmup) if why is None else {}
        ok = (
            why is None
            and mem.get("peak_growth_pct", 1e9) <= GROWTH_LIMIT_PCT
            and mem.get("workspace_collective") is True
            and par["parity_ok"] is True
        )
        rows.append({
            "bench": "soak", "provider": {"ring": "relaymoe_ring", "alltoall": "mcore_alltoall"}[
                label], "dispatcher": r.dispatcher, "steps": len(r.steps), "failure": why,
            **mem, "max_abs_loss_diff_vs_other": par["max_abs_loss_diff"],
            "noise_max_abs_loss_diff": par["noise_max_abs_loss_diff"],
            "parity_bound": par["parity_bound"], "growth_limit_pct": GROWTH_LIMIT_PCT,
            "ok": ok, "wall_s": r.seconds, **settings,
        })  # fmt: skip
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny_qwen3")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--period", type=int, default=200)
    ap.add_argument("--strength", type=float, default=12.0)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--run-timeout-s", type=float, default=900)
    ap.add_argument("--workdir", default="/tmp/relaymoe_soak")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.jsonl"))
    ap.add_argument("--ring-mode", default="token", choices=("expert", "token", "auto"))
    ap.add_argument("--ring-transport", default="copy_engine", choices=("copy_engine", "nccl"))
    ap.add_argument(
        "--parallel",
        action="store_true",
        help="the three runs at once on the same GPUs (wall_s is then not a speed)",
    )
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    if a.warmup >= a.steps or a.period < 2:
        ap.error(f"--warmup {a.warmup} must be below --steps {a.steps}, --period >= 2")
    gpus = 2
    settings = {"config": a.config, "ep": gpus, "period": a.period, "strength": a.strength,
                "warmup": a.warmup, "steps_requested": a.steps, "seed": a.seed,
                "parallel": a.parallel, "ring_mode": a.ring_mode,
                "ring_transport": a.ring_transport}  # fmt: skip
    # the ring's mode and transport forced: at tiny_qwen3's tokens per rank "auto" is the
    # all-to-all mode, which never touches the copy-engine workspace this soak watches
    ring = ["--relaymoe-mode", a.ring_mode, "--relaymoe-transport", a.ring_transport]
    plans = {label: pretrain_args(a.config, gpus=gpus, steps=a.steps, dispatcher=d, seed=a.seed,
                                  regime="stable", extra=ring if d == "ring" else ())
             for label, d in RUNS}  # fmt: skip
    early = plans_or_no_gpus(plans, dry_run=a.dry_run, gpus=gpus, who="soak")
    if early is not None:
        return early
    results, logs = {}, {}

    def one(label: str) -> None:
        folder = Path(a.workdir) / label
        env = {
            "RELAYMOE_SOAK_DIR": str(folder / "ranks"),
            "RELAYMOE_SOAK_EP": str(gpus),
            "RELAYMOE_SOAK_PERIOD": str(a.period),
            "RELAYMOE_SOAK_STRENGTH": str(a.strength),
        }
        results[label] = run_pretrain(plans[label], gpus=gpus, label=label,
                                      timeout_s=a.run_timeout_s, workdir=str(folder),
                                      module="benchmarks.soak_pretrain", env=env)  # fmt: skip
        logs[label] = read_rank_logs(folder / "ranks")
        why = results[label].failure(a.steps)
        print(f"[soak] {label}: {why or 'ok'} ({results[label].seconds:.0f} s)", flush=True)

    if a.parallel:  # nothing measured here is a time: the runs may share the GPUs
        with ThreadPoolExecutor(len(plans)) as pool:
            list(pool.map(one, plans))
    else:
        for label in plans:
            one(label)
    writer = JsonlWriter(a.out)
    rows = [writer.write(r) for r in soak_rows(results, logs, steps=a.steps, warmup=a.warmup,
                                                settings=settings)]  # fmt: skip
    for r in rows:
        print({k: r[k] for k in ("provider", "steps", "peak_growth_pct", "workspace_collective",
                                 "max_abs_loss_diff_vs_other", "noise_max_abs_loss_diff", "ok")
               if k in r})  # fmt: skip
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
