"""The predicted EP-2 step of the ring with captured hops, from one-GPU hop rows (issue #34).

    python benchmarks/lab/step_prediction.py [--rows PATH ...] [--ring-rows PATH] [--all]
        [--out PATH.jsonl]

Rows in: ``bench: hop_cost`` (``benchmarks/lab/hop_cost.py --library``, default: the run in
``DEFAULT_ROWS``), one per (mode, direction, ep, tokens, capture_path); the last row of each
key wins. A prediction is made per mode (expert, token) and pass kind (``capture_path``
``eager``: the library's pass as it runs by default; ``library``: with
``RingConfig.capture_hops``) at EP 2, T 4096 (a missing or refused row there is an error), and
with ``--all`` at every other (ep, tokens) whose rows are complete.

What is summed, per pass (forward and backward, each from its own row, all in microseconds):

* ``gpu_hops``: the measured GPU time of the pass's hops, ``hops * gpu_us_per_hop``;
* ``gpu_other``: the pass's measured GPU time outside its hops, ``gpu_us_per_pass -
  hops * gpu_us_per_hop`` (the own-partition pack, the trail's return adds: device work the
  step pays too);
* ``exposed``: the part of the pass's transfers the cost model does not hide,
  ``relaymoe.cost.time._ring_pass_exposed`` with the bytes of ``relaymoe.cost.hop_bytes`` at the
  row's sizes, the link of ``DEFAULT_TIME_MODEL.link_bytes_per_s`` and its share hidden
  ``DEFAULT_TIME_MODEL.hide`` (the copy-engine transport over NVLink, what ``step_seconds``
  uses for a ring inside one node), and as each hop's compute the measured ``gpu_us_per_hop``.
  One node only: ``--all`` skips the EPs beyond ``NODE_GPUS``, whose rings cross NICs.

``predicted_ms`` is the sum of the three over both passes: a device-bound step. Not summed:
the idle gaps of the one-GPU pass (``span_us_per_pass - gpu_us_per_pass``: waiting for the
host, not compute; ``span_ms`` reports the span as measured), the call-level work the rows leave
out (agreement, expert mode's index build, ``TimeModel.call_fixed_s`` of host time) and the
transfers' issue on the host. Beside it: ``host_floor_ms``, the sum of ``host_us_per_pass``
(the host's time to issue both passes, transfers' issue excluded); ``host_bound`` when it
exceeds ``predicted_ms``; ``predicted_host_aware_ms``, per pass the larger of the host's and the
device's time, summed (the step if host and device overlapped perfectly within a pass and not
across passes); ``cost_model_ms``, ``step_seconds`` alone (``TimeModel.captured_hops()`` for
the library rows).

With ``--ring-rows`` (default: the two-GPU run of ``TARGET_MS``, when present) each row also
gets the measured eager ring step of its mode (``bench: ring``, provider
``relaymoe_ring_<mode>``, same EP and T): ``eager_gap_ms`` is that minus this script's eager
prediction, what the one-GPU rows do not see (the transfers' issue and barriers, the slower
two-process host), and ``predicted_plus_gap_ms`` the prediction if capture removes none of it.
Those rows are of another commit than the hop rows (their ``measured_commit``).

Pure Python, no torch: runs anywhere in seconds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from relaymoe import cost as cm  # noqa: E402
from relaymoe.cost.time import _ring_pass_exposed  # noqa: E402

DEFAULT_ROWS = "benchmarks/results/2026-12-02_h200x1_632c34b67cd4/hop_cost.jsonl"
DEFAULT_RING_ROWS = "benchmarks/results/2026-11-30_h200x2_3c9e7b9990cf/ring.jsonl"
# The target: the same-kernel all-to-all's measured step (fwd+bwd) at EP 2, T 4096 per GPU on
# 2x H200, commit 3c9e7b9 (provider a2a_same_kernel in DEFAULT_RING_ROWS; docs/ring_small_t.md
# section 3).
TARGET_MS = 6.77
TARGET = dict(ep=2, tokens=4096)
MODES = ("expert", "token")
PATHS = ("eager", "library")
DIRECTIONS = ("fwd", "bwd")
NODE_GPUS = 8  # an HGX H200 node: a larger ring crosses nodes, which this link model is not
TRANSPORT = "copy_engine"  # the ring's transport inside one node (step_seconds' default)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
NEEDED = ("hops", "gpu_us_per_hop", "gpu_us_per_pass", "host_us_per_pass", "H", "I", "E", "K",
          "dtype")  # fmt: skip


class MissingRows(LookupError):
    """No usable hop_cost row for a pass the prediction needs."""


def load(paths) -> list[dict]:
    """The rows of ``paths`` (JSONL files; a relative path not found here is taken from the
    checkout's root), in order."""
    rows = []
    for p in paths:
        path = Path(p) if Path(p).is_file() else ROOT / p
        if not path.is_file():
            raise MissingRows(f"step_prediction: no rows file {p}")
        for line in path.read_text().splitlines():
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def index(rows: list[dict]) -> dict[tuple, dict]:
    """``{(mode, direction, ep, tokens, capture_path): row}`` of the hop_cost rows, the last
    row of each key."""
    out = {}
    for r in rows:
        if r.get("bench") == "hop_cost":
            out[(r.get("mode"), r.get("direction"), r.get("ep"), r.get("tokens"),
                 r.get("capture_path"))] = r  # fmt: skip
    return out


def _row(rows: dict, mode: str, direction: str, ep: int, tokens: int, path: str) -> dict:
    key = (mode, direction, ep, tokens, path)
    r = rows.get(key)
    what = f"mode={mode} direction={direction} ep={ep} tokens={tokens} capture_path={path}"
    fix = f"run benchmarks/lab/hop_cost.py --library --ep {ep} --tokens {tokens}"
    if r is None:
        raise MissingRows(f"step_prediction: no hop_cost row for {what}; {fix}")
    if r.get("capture_error"):
        raise MissingRows(f"step_prediction: the hop_cost row for {what} measured nothing: "
                          f"{r['capture_error']}")  # fmt: skip
    lacking = [k for k in NEEDED if not isinstance(r.get(k), int | float | str)]
    if lacking:
        raise MissingRows(f"step_prediction: the hop_cost row for {what} lacks "
                          f"{', '.join(lacking)}; {fix}")  # fmt: skip
    return r


def dims_of(r: dict) -> cm.Dims:
    """The cost model's sizes of a hop_cost row: SwiGLU experts, router probabilities in the
    activations' dtype (as hop_cost's problem), weight gradients in ``grad_dtype``."""
    b = DTYPE_BYTES[r["dtype"]]
    gb = DTYPE_BYTES.get(r.get("grad_dtype"), b)
    ep = r["ep"]
    if r["E"] % ep:
        raise ValueError(f"step_prediction: E={r['E']} does not split over ep={ep}")
    return cm.Dims(T=r["tokens"], H=r["H"], I=r["I"], El=r["E"] // ep, K=r["K"], R=ep, b=b,
                   pb=b, gb=gb)  # fmt: skip


def pass_terms(r: dict, d: cm.Dims, model: cm.TimeModel = cm.DEFAULT_TIME_MODEL) -> dict:
    """The summed terms of one pass (module docstring), microseconds."""
    mode, bwd = r["mode"], r["direction"] == "bwd"
    h = cm.hop_bytes(mode, d)
    lead, trail = (h.bwd_lead, h.bwd_trail) if bwd else (h.fwd_lead, h.fwd_trail)
    hop_s = r["gpu_us_per_hop"] * 1e-6
    bw = model.link_bytes_per_s
    exposed = _ring_pass_exposed(lead, trail, hop_s, d.R, model.hide, bw) if d.R > 1 else 0.0
    sent = ((d.R - 1) * lead + d.R * trail) if d.R > 1 else 0
    gpu_hops = r["hops"] * r["gpu_us_per_hop"]
    return {
        "gpu_hops_us": gpu_hops,
        "gpu_other_us": r["gpu_us_per_pass"] - gpu_hops,
        "exposed_us": exposed * 1e6,
        "transfer_us": sent / bw * 1e6,
        "device_us": r["gpu_us_per_pass"] + exposed * 1e6,
        "host_us": r["host_us_per_pass"],
        "span_us": r.get("span_us_per_pass"),
        "MB_sent": sent / 1e6,
    }


def predict(rows: dict, mode: str, path: str, ep: int, tokens: int) -> dict:
    """The prediction row of ``mode`` with passes of ``path`` at ``ep`` ranks, ``tokens`` per
    rank; raises :class:`MissingRows` naming the pass without a usable row."""
    src = {dr: _row(rows, mode, dr, ep, tokens, path) for dr in DIRECTIONS}
    d = dims_of(src["fwd"])
    if dims_of(src["bwd"]) != d:
        raise ValueError(f"step_prediction: the fwd and bwd rows of {mode}/{path} at ep={ep} "
                         f"tokens={tokens} have other sizes")  # fmt: skip
    terms = {dr: pass_terms(r, d) for dr, r in src.items()}

    def total(k: str) -> float:
        return sum(t[k] for t in terms.values()) / 1e3

    spans = [t["span_us"] for t in terms.values()]
    model = cm.DEFAULT_TIME_MODEL.captured_hops() if path == "library" else cm.DEFAULT_TIME_MODEL
    predicted = total("gpu_hops_us") + total("gpu_other_us") + total("exposed_us")
    host = total("host_us")
    commits = sorted({str(r.get("commit")) for r in src.values()})
    return {
        "bench": "step_prediction",
        "mode": mode,
        "capture_path": path,
        "ep": ep,
        "tokens": tokens,
        "predicted_ms": round(predicted, 3),
        "gpu_hops_ms": round(total("gpu_hops_us"), 3),
        "gpu_other_ms": round(total("gpu_other_us"), 3),
        "exposed_transfer_ms": round(total("exposed_us"), 3),
        "transfer_ms": round(total("transfer_us"), 3),
        "host_floor_ms": round(host, 3),
        "host_bound": host > predicted,
        "predicted_host_aware_ms": round(
            sum(max(t["host_us"], t["device_us"]) for t in terms.values()) / 1e3, 3
        ),
        "span_ms": round(sum(spans) / 1e3, 3) if all(s is not None for s in spans) else None,
        "cost_model_ms": round(cm.step_seconds(mode, d, transport=TRANSPORT, model=model) * 1e3, 3),
        "target_ms": TARGET_MS if (ep, tokens) == (TARGET["ep"], TARGET["tokens"]) else None,
        "link_bytes_per_s": model.link_bytes_per_s,
        "hide": model.hide,
        "transport": TRANSPORT,
        "passes": {
            dr: {k: (round(v, 1) if isinstance(v, float) else v) for k, v in t.items()}
            for dr, t in terms.items()
        },  # fmt: skip
        "commit": commits[0] if len(commits) == 1 else " ".join(commits),
        "source_command": src["fwd"].get("command"),
        "gpu": src["fwd"].get("gpu"),
    }


def measured_steps(paths) -> dict[tuple, dict]:
    """``{(mode, ep, tokens): ring row}`` of the measured eager ring steps in ``paths`` (the
    providers ``relaymoe_ring_expert`` / ``relaymoe_ring_token``; T from the shape name)."""
    out = {}
    for r in load(paths):
        prov, shape = str(r.get("provider", "")), str(r.get("shape", ""))
        if r.get("bench") != "ring" or not prov.startswith("relaymoe_ring_"):
            continue
        mode = prov.removeprefix("relaymoe_ring_")
        if mode in MODES and shape.startswith("qwen3_30b_a3b_T") and shape.endswith("k"):
            t = shape.removeprefix("qwen3_30b_a3b_T").removesuffix("k")
            if t.isdigit():
                out[(mode, r.get("ep"), int(t) * 1024)] = r
    return out


def with_measured(preds: list[dict], measured: dict) -> list[dict]:
    """``preds`` with the measured eager step of their mode and the gap (module docstring)."""
    eager = {(p["mode"], p["ep"], p["tokens"]): p for p in preds if p["capture_path"] == "eager"}
    for p in preds:
        key = (p["mode"], p["ep"], p["tokens"])
        m, e = measured.get(key), eager.get(key)
        if m is None or e is None:
            continue
        gap = m["ms_fwd_bwd"] - e["predicted_ms"]
        p["measured_eager_ms"] = m["ms_fwd_bwd"]
        p["measured_commit"] = m.get("commit")
        p["eager_gap_ms"] = round(gap, 3)
        if p is not e:
            p["predicted_plus_gap_ms"] = round(p["predicted_ms"] + gap, 3)
    return preds


def predictions(rows: dict, *, every: bool = False) -> tuple[list[dict], list[str]]:
    """The target's rows (every mode and path at ``TARGET``; errors propagate) and with
    ``every`` those of each other (ep, tokens) present, complete ones only; returns the rows
    and a note per skipped prediction."""
    grid = [(TARGET["ep"], TARGET["tokens"])]
    if every:
        grid += sorted({(k[2], k[3]) for k in rows} - set(grid))
    out, notes = [], []
    for ep, tokens in grid:
        if ep > NODE_GPUS:
            notes.append(f"ep={ep} tokens={tokens}: the ring spans nodes of {NODE_GPUS} GPUs; "
                         "this script models one node's links")  # fmt: skip
            continue
        for mode in MODES:
            for path in PATHS:
                try:
                    out.append(predict(rows, mode, path, ep, tokens))
                except MissingRows as e:
                    if (ep, tokens) == grid[0]:
                        raise
                    notes.append(str(e))
    return out, notes


def _git_commit() -> str:
    cmd = ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


COLUMNS = ("mode", "capture_path", "ep", "tokens", "gpu_hops_ms", "gpu_other_ms",
           "exposed_transfer_ms", "predicted_ms", "host_floor_ms", "predicted_host_aware_ms",
           "span_ms", "cost_model_ms", "measured_eager_ms", "predicted_plus_gap_ms")  # fmt: skip


def _table(rows: list[dict]) -> None:
    def fmt(v):
        return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    w = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in COLUMNS]
    print("  ".join(c.ljust(n) for c, n in zip(COLUMNS, w, strict=True)))
    for r in rows:
        print("  ".join(fmt(r.get(c)).ljust(n) for c, n in zip(COLUMNS, w, strict=True)))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", action="append", default=None,
                    help=f"hop_cost JSONL (repeatable; default {DEFAULT_ROWS})")  # fmt: skip
    ap.add_argument("--ring-rows", action="append", default=None,
                    help="two-GPU ring JSONL with the measured eager steps (repeatable; default "
                         f"{DEFAULT_RING_ROWS} when present; 'none': leave them out)")  # fmt: skip
    ap.add_argument("--all", action="store_true", help="every (ep, tokens) with complete rows")
    ap.add_argument("--out", default=None, help="write the rows to this JSONL (overwritten)")
    args = ap.parse_args(argv)
    paths = args.rows or [DEFAULT_ROWS]
    ring = args.ring_rows
    if ring is None:
        ring = [DEFAULT_RING_ROWS] if (ROOT / DEFAULT_RING_ROWS).is_file() else []
    ring = [p for p in ring if p != "none"]
    try:
        preds, notes = predictions(index(load(paths)), every=args.all)
        if ring:
            preds = with_measured(preds, measured_steps(ring))
    except MissingRows as e:
        print(e, file=sys.stderr)
        return 2
    command = shlex.join(["python", "benchmarks/lab/step_prediction.py", *argv])
    here = _git_commit()
    for p in preds:
        p.update(source_rows=paths, ring_rows=ring or None, cost_model_commit=here,
                 command=command)  # fmt: skip
    _table(preds)
    for n in notes:
        print("skipped:", n)
    for p in preds:
        if p["target_ms"] is not None:
            verdict = "meets" if p["predicted_ms"] <= TARGET_MS else "misses"
            print(f"{p['mode']}/{p['capture_path']}: predicted {p['predicted_ms']:.2f} ms "
                  f"(host floor {p['host_floor_ms']:.2f}{', host-bound' if p['host_bound'] else ''}"
                  f") {verdict} the target {TARGET_MS} ms")  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(p) + "\n" for p in preds))
    for p in preds:
        print(json.dumps(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
