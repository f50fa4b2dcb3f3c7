"""Refit ``relaymoe.cost.TimeModel`` (the runtime's ``mode="auto"``) on measured ring rows.

    python benchmarks/fit_time_model.py          # the newest CURRENT run that has ring rows
    python benchmarks/fit_time_model.py --rows 'benchmarks/results/<run>/ring.jsonl'
    python benchmarks/fit_time_model.py --captured-hops 'benchmarks/results/<run>/hop_cost.jsonl'

Rows: ``bench: ring`` with a modelled ``mode`` (``expert``, ``token``, ``alltoall``) at EP > 1,
overlapped, and a shape the simulator knows (``benchmarks.sim.calibrate.shape_of``), the newest
row of each measurement identity; rows of other code (providers ending ``_at_<commit>``) are
left out. By default one run only: host-bound times differ by up to 1.5x between machines, and
older runs measured older code.
Each row's prediction is ``step_seconds(mode, dims, transport=row transport)``; the fit
minimises the sum of squared log errors over the eight constants by coordinate search on a log
scale (the share-hidden constants stay in [0, 1]), starting from the package's defaults.

Prints the per-row error of the defaults and of the fit, and the fitted ``TimeModel(...)``: to
regenerate the runtime's constants, paste those values into ``relaymoe/cost/time.py`` (the
package ships them as plain data and reads no result file). Pure Python, seconds on a CPU.

``--captured-hops``: ``captured_hop_fixed_s`` alone, from ``bench: hop_cost`` rows
(``benchmarks/lab/hop_cost.py --library``; :func:`captured_hop_fit`), printed beside the package's
value, not fitted with the others (the ring rows measure no captured pass).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from relaymoe import cost as cm  # noqa: E402
from relaymoe.options import MODES, TRANSPORTS  # noqa: E402

FIELDS = tuple(f.name for f in dataclasses.fields(cm.TimeModel))
FRACTIONS = ("hide", "nccl_hide")


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured row as the cost model sees it."""

    label: str
    mode: str
    transport: str
    dims: cm.Dims
    measured_s: float


def points(rows: list[dict]) -> list[Point]:
    """The rows the time model describes (see the module docstring), one per identity."""
    from benchmarks.sim.calibrate import latest_rows, shape_of

    out = []
    for r in latest_rows([r for r in rows if r.get("bench") == "ring"]):
        mode, ms, ep = r.get("mode"), r.get("ms_fwd_bwd"), int(r.get("ep") or 1)
        if mode not in MODES or ep < 2 or not isinstance(ms, int | float) or ms <= 0:
            continue
        if r.get("overlap") is False:  # the model describes the overlapped schedule only
            continue
        if re.search(r"_at_[0-9a-f]{7,}$", str(r.get("provider", ""))):
            continue
        s = shape_of(r)
        if s is None or s.E % ep:
            continue
        d = cm.Dims(T=s.T, H=s.H, I=s.I, El=s.E // ep, K=s.K, R=ep, b=s.dtype_bytes,
                    pb=s.prob_bytes)  # fmt: skip
        transport = r.get("transport") if r.get("transport") in TRANSPORTS else "nccl"
        out.append(Point(f"{r.get('provider')} {r.get('shape')}", mode, transport, d, ms / 1e3))
    return out


def log_errors(model: cm.TimeModel, pts: list[Point]) -> list[float]:
    return [
        math.log(cm.step_seconds(p.mode, p.dims, transport=p.transport, model=model) / p.measured_s)
        for p in pts
    ]


def loss(model: cm.TimeModel, pts: list[Point]) -> float:
    return sum(e * e for e in log_errors(model, pts))


def fit(pts: list[Point], start: cm.TimeModel = cm.DEFAULT_TIME_MODEL, rounds: int = 400):
    """Coordinate search: each constant in turn times or divided by ``1 + step`` while that
    lowers the loss; a constant's step halves when neither direction helps. Deterministic."""
    if not pts:
        raise ValueError("no ring rows with a modelled mode at EP > 1: nothing to fit")
    best, best_loss = start, loss(start, pts)
    steps = dict.fromkeys(FIELDS, 0.5)
    for _ in range(rounds):
        for name in FIELDS:
            moved = False
            for factor in (1 + steps[name], 1 / (1 + steps[name])):
                v = getattr(best, name) * factor
                if name in FRACTIONS:
                    v = min(1.0, v)
                try:
                    trial = dataclasses.replace(best, **{name: v})
                except ValueError:
                    continue
                trial_loss = loss(trial, pts)
                if trial_loss < best_loss - 1e-12:
                    best, best_loss, moved = trial, trial_loss, True
                    break
            if not moved:
                steps[name] /= 2
        if max(steps.values()) < 1e-3:
            break
    return best


def captured_hop_fit(rows: list[dict], *, ep: int | None = None) -> dict:
    """``TimeModel.captured_hop_fixed_s`` from hop_cost rows (one GPU, transfers left out).

    ``step_seconds`` charges a ring pass ``R * hop_fixed_s`` of host time (the call's own is
    ``call_fixed_s``), so a row's host time per hop is its whole pass's over its hops,
    ``host_us_per_pass / hops`` (the pass's set-up, plans and trail return included, as in the
    ring steps ``hop_fixed_s`` was fitted on), not ``host_us_per_hop`` (the hop's range alone).
    The value minimises the squared log errors of ``hops * h`` against ``host_us_per_pass``
    over the ``capture_path: "library"`` rows that measured a pass (the loss of :func:`fit`):
    their geometric mean. Returned with the same of the eager rows (``eager_hop_fixed_s``, to
    set against ``hop_fixed_s``, fitted on two-GPU steps), the median of the library rows'
    ``host_us_per_hop`` (``hop_range_s``), the value per EP (``by_ep``) and the rows used;
    ``ep`` keeps the rows of that EP only."""

    def per_hop(path: str) -> list[tuple[int, float]]:
        out = []
        for r in rows:
            if r.get("bench") != "hop_cost" or r.get("capture_path") != path:
                continue
            if r.get("capture_error") or ep is not None and r.get("ep") != ep:
                continue
            host, hops = r.get("host_us_per_pass"), r.get("hops")
            if isinstance(host, int | float) and host > 0 and isinstance(hops, int) and hops > 0:
                out.append((r["ep"], host * 1e-6 / hops))
        return out

    def geomean(xs: list[float]) -> float | None:
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None

    lib = per_hop("library")
    if not lib:
        raise ValueError("no hop_cost library rows with a measured pass: nothing to fit")
    ranges = [
        r["host_us_per_hop"] * 1e-6
        for r in rows
        if r.get("bench") == "hop_cost" and r.get("capture_path") == "library"
        and isinstance(r.get("host_us_per_hop"), int | float)
        and (ep is None or r.get("ep") == ep)
    ]  # fmt: skip
    return {
        "captured_hop_fixed_s": geomean([h for _, h in lib]),
        "eager_hop_fixed_s": geomean([h for _, h in per_hop("eager")]),
        "hop_range_s": statistics.median(ranges) if ranges else None,
        "by_ep": {e: geomean([h for e2, h in lib if e2 == e]) for e in sorted({e for e, _ in lib})},
        "rows": len(lib),
    }


def _print_captured_hop_fit(rows: list[dict], ep: int | None) -> int:
    try:
        f = captured_hop_fit(rows, ep=ep)
    except ValueError as e:
        print(f"fit_time_model: {e}", file=sys.stderr)
        return 2
    m = cm.DEFAULT_TIME_MODEL

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.3f} ms"

    print(
        f"captured_hop_fixed_s from {f['rows']} library rows"
        f"{'' if ep is None else f' at EP {ep}'}: {ms(f['captured_hop_fixed_s'])} a hop "
        f"(host_us_per_pass / hops, geometric mean); package {ms(m.captured_hop_fixed_s)}"
    )
    print("  by EP: " + ", ".join(f"EP {e} {ms(v)}" for e, v in f["by_ep"].items()))
    print(f"  the hop's range alone (median host_us_per_hop): {ms(f['hop_range_s'])}")
    print(
        f"  the same fit of the eager rows: {ms(f['eager_hop_fixed_s'])}, against hop_fixed_s "
        f"{ms(m.hop_fixed_s)} fitted on two-GPU steps (transfers' issue included)"
    )
    return 0


def _literal(model: cm.TimeModel) -> str:
    parts = [f"{n}={getattr(model, n):.4g}" for n in FIELDS]
    return "TimeModel(" + ", ".join(parts) + ")"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=None,
                    help="row files (globs) instead of the CURRENT runs")  # fmt: skip
    ap.add_argument(
        "--captured-hops",
        nargs="+",
        default=None,
        metavar="ROWS",
        help="hop_cost row files (globs): fit captured_hop_fixed_s alone",
    )
    ap.add_argument("--ep", type=int, default=None,
                    help="with --captured-hops: the rows of this EP only")  # fmt: skip
    args = ap.parse_args(argv)
    if args.captured_hops:
        from benchmarks.sim.calibrate import load_rows

        return _print_captured_hop_fit(load_rows(args.captured_hops), args.ep)
    if args.rows:
        from benchmarks.sim.calibrate import load_rows

        rows = load_rows(args.rows)
    else:
        from benchmarks.runs import current_runs, run_rows

        rows = []
        for run in reversed(current_runs()):  # the newest run with ring rows to fit
            rows = [r.data for r in run_rows(run)]
            if points(rows):
                print(f"rows: benchmarks/results/{run.name}")
                break
    pts = points(rows)
    if not pts:
        print("fit_time_model: no ring rows with a modelled mode at EP > 1", file=sys.stderr)
        return 2
    fitted = fit(pts)
    before, after = log_errors(cm.DEFAULT_TIME_MODEL, pts), log_errors(fitted, pts)
    print(f"{'row':<58} {'mode':<9} {'measured ms':>11} {'default':>8} {'fitted':>8}")
    for p, a, b in zip(pts, before, after, strict=True):
        print(f"{p.label:<58} {p.mode:<9} {p.measured_s * 1e3:>11.2f} "
              f"{math.exp(a) - 1:>+8.1%} {math.exp(b) - 1:>+8.1%}")  # fmt: skip
    worst = {k: max(abs(math.exp(e) - 1) for e in v) for k, v in (("default", before),
                                                                  ("fitted", after))}  # fmt: skip
    print(f"largest error: defaults {worst['default']:.1%}, fitted {worst['fitted']:.1%} "
          f"over {len(pts)} rows")  # fmt: skip
    print("fitted:", _literal(fitted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
