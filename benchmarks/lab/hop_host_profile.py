"""Where a recorded hop's host time goes: hop_cost's library pass under cProfile, hop by hop.

    python benchmarks/lab/hop_host_profile.py [--ep 2 64] [--tokens 4096] [--modes expert token]
        [--passes 40] [--top 25] [--out PATH.jsonl]

For each case and direction (issue #34): hop_cost's ``Ring`` with the library's capture on
(``hop_library.capturing``), settled (``hop_library.settle``), then ``--passes`` passes timed per
hop (each hop's own span, by its index in the pass: ``host_us_by_hop``) and ``--passes`` more
under cProfile, switched on inside each hop's range only (the pass's set-up and the trail's
return left out). Rows (``bench: hop_host_profile``, JSONL) carry the per-hop host time and, per
function, its calls and own time per hop (``top``: the ``--top`` heaviest by own time), so a C
call that blocks (a graph launch, an allocation, an event) shows as its own line, and the
library's own functions by cumulative time (``top_cum``: where a hop's time goes by caller).
The profile's own overhead inflates Python-heavy lines; compare lines with each other, and the
unprofiled ``host_us_per_hop`` with hop_cost's rows.

``--parts`` adds, without cProfile, the host time per hop of named parts of a hop (``PARTS``:
the executor's transfer start and stream handshake, the cache's run and the graph's launch,
the copies, the clone and adds, the hop's key): each wrapped in a timer that counts only inside
a hop's range (``parts``: microseconds per hop, inclusive of what a part calls; ``parts_calls``
per hop; ``host_us_per_hop_timed`` the hops' own time with the timers on).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import itertools
import os
import pstats
import statistics
import sys
import time
from functools import partial
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from benchmarks.common import JsonlWriter, environment  # noqa: E402
from benchmarks.lab import hop_cost, hop_library  # noqa: E402
from relaymoe.ring import executor, expert_mode, hop_graphs, token_mode  # noqa: E402
from relaymoe.ring.plan import Layout  # noqa: E402
from relaymoe.routing import RoutingIndex  # noqa: E402

# A part's name -> (the object and attribute its timer wraps). Where a module imported the
# function by name, its own attribute is wrapped (both modes' hop_key).
PARTS = {
    "executor.start": (executor.RingExecutor, "start"),
    "executor.on_comm": (executor.RingExecutor, "_on_comm"),
    "executor.wait": (executor.RingExecutor, "wait"),
    "graphs.run": (hop_graphs.HopGraphs, "run"),
    "graph.replay": (torch.cuda.CUDAGraph, "replay"),
    "copy_all": (hop_graphs, "_copy_all"),
    "tensor.clone": (torch.Tensor, "clone"),
    "tensor.add_": (torch.Tensor, "add_"),
    "hop_key.token": (token_mode, "hop_key"),
    "hop_key.expert": (expert_mode, "hop_key"),
    "pair_rows.token": (token_mode, "pair_rows"),
    "pair_rows.expert": (expert_mode, "pair_rows"),
    "layout.views": (Layout, "views"),
    "layout.runs": (Layout, "runs"),
    "offsets_for": (RoutingIndex, "offsets_for"),
}
# A part that is a callback of the pass a function is given: name -> (owner, function, the
# ``PassWork`` field) (each mode's hop compute, which ``ring_pass`` hands to ``executor.relay``)
ARG_PARTS = {
    "compute.token": (token_mode, "ring_pass", "compute"),
    "compute.expert": (expert_mode, "ring_pass", "compute"),
}


class _ByHop:
    """Stands in for ``executor._hop_range``: each hop's host span, by its index in the pass."""

    def __init__(self):
        self.spans: list[float] = []

    def __call__(self, name):
        return self

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.spans.append(time.perf_counter() - self.t0)
        return False


def by_hop(ring, direction: str, n: int) -> dict:
    timer, R = _ByHop(), ring.case.ep
    with mock.patch.object(executor, "_hop_range", timer):
        for _ in range(n):
            torch.cuda.synchronize() if ring.dev.type == "cuda" else None
            ring.run(direction)
    spans = [timer.spans[i : i + R] for i in range(0, len(timer.spans), R)]
    med = [round(statistics.median(s[h] for s in spans) * 1e6, 1) for h in range(min(R, 4))]
    return {"host_us_per_hop": round(statistics.median(sum(s) / R for s in spans) * 1e6, 1),
            "host_us_by_hop": med}  # fmt: skip


class _Profiled:
    """Stands in for ``executor._hop_range``: cProfile on inside each hop's range only."""

    def __init__(self, prof: cProfile.Profile):
        self.prof = prof

    def __call__(self, name):
        return self

    def __enter__(self):
        self.prof.enable()

    def __exit__(self, *exc):
        self.prof.disable()
        return False


class _PartTimers:
    """Stands in for ``executor._hop_range`` and wraps each of ``PARTS``: a part's time counts
    while a hop's range is open (a part called outside a hop, the pass's set-up or return, is
    not counted)."""

    def __init__(self):
        self.inside, self.hops, self.hop_s = False, 0, 0.0
        self.spent = dict.fromkeys([*PARTS, *ARG_PARTS], 0.0)
        self.calls = dict.fromkeys([*PARTS, *ARG_PARTS], 0)

    def __call__(self, name):
        return self

    def __enter__(self):
        self.inside, self.t0 = True, time.perf_counter()

    def __exit__(self, *exc):
        self.hop_s += time.perf_counter() - self.t0
        self.inside, self.hops = False, self.hops + 1
        return False

    def wrap(self, name: str, fn):
        def timed(*args, **kw):
            if not self.inside:
                return fn(*args, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.spent[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return timed

    def wrap_arg(self, name: str, fn, field: str):
        """``fn`` with the ``field`` callback of its ``PassWork`` argument (its last positional
        one) wrapped as :meth:`wrap` wraps a part."""

        def given(*args, **kw):
            work = args[-1]
            work = dataclasses.replace(work, **{field: self.wrap(name, getattr(work, field))})
            return fn(*args[:-1], work, **kw)

        return given


def parts(ring, direction: str, n: int) -> dict:
    """``n`` passes with :data:`PARTS` timed (see the module doc)."""
    timers = _PartTimers()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(executor, "_hop_range", timers))
        for name, (owner, attr) in PARTS.items():
            stack.enter_context(
                mock.patch.object(owner, attr, timers.wrap(name, getattr(owner, attr)))
            )
        for name, (owner, attr, field) in ARG_PARTS.items():
            wrapped = timers.wrap_arg(name, getattr(owner, attr), field)
            stack.enter_context(mock.patch.object(owner, attr, wrapped))
        for _ in range(n):
            if ring.dev.type == "cuda":
                torch.cuda.synchronize()
            ring.run(direction)
    hops = max(timers.hops, 1)
    called = [k for k, c in timers.calls.items() if c]
    return {"parts": {k: round(timers.spent[k] / hops * 1e6, 2) for k in called},
            "parts_calls": {k: round(timers.calls[k] / hops, 2) for k in called},
            "host_us_per_hop_timed": round(timers.hop_s / hops * 1e6, 1)}  # fmt: skip


def profiled(ring, direction: str, n: int, top: int) -> tuple[list[dict], list[dict]]:
    prof = cProfile.Profile()
    cuda = ring.dev.type == "cuda"
    with mock.patch.object(executor, "_hop_range", _Profiled(prof)):
        for _ in range(n):
            if cuda:
                torch.cuda.synchronize()
            ring.run(direction)
    st = pstats.Stats(prof)
    hops = n * ring.case.ep
    rows = []
    for (file, line, fn), (_, ncalls, tt, ct, _) in st.stats.items():
        where = f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({fn})"
        rows.append({"fn": where, "calls_per_hop": round(ncalls / hops, 2),
                     "own_us_per_hop": round(tt / hops * 1e6, 2),
                     "cum_us_per_hop": round(ct / hops * 1e6, 2)})  # fmt: skip
    ours = sorted((r for r in rows if "relaymoe/" in r["fn"]), key=lambda r: -r["cum_us_per_hop"])
    rows.sort(key=lambda r: -r["own_us_per_hop"])
    return rows[:top], ours[:top]


GC_MODES = {"on": (True,), "off": (False,), "both": (True, False)}


@contextlib.contextmanager
def _collector(on: bool):
    """Python's cyclic garbage collector on or off (``gc.disable()``) for the block."""
    was = gc.isenabled()
    (gc.enable if on else gc.disable)()
    try:
        yield
    finally:
        (gc.enable if was else gc.disable)()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, nargs="+", default=[2, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--modes", nargs="+", default=list(hop_cost.MODES), choices=hop_cost.MODES)
    ap.add_argument("--passes", type=int, default=40)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny widths")
    ap.add_argument(
        "--after-profiler",
        action="store_true",
        help="run 2 passes under torch.profiler (CPU+CUDA) before the timed ones, as hop_cost "
        "does before its library rows: whether a finished profiler session slows the host",
    )
    ap.add_argument("--parts", action="store_true", help="also the named parts' times (PARTS)")
    ap.add_argument("--no-cprofile", action="store_true", help="skip the cProfile passes")
    ap.add_argument(
        "--eager-first",
        type=int,
        default=0,
        help="run this many eager passes (capture off) of the case before the recorded ones, as "
        "hop_cost times its library rows after its eager ones: whether that slows the host",
    )
    ap.add_argument(
        "--gc",
        choices=["on", "off", "both"],
        default="on",
        help="Python's cyclic garbage collector during the timed passes (off: gc.disable(), as "
        "under megatron-core's --manual-gc); both: a row each",
    )
    ap.add_argument("--out", default=None, help="JSONL path")
    a = ap.parse_args(argv)
    a.quick, a.backend = False, "auto"
    plan = hop_cost.cases(a)
    env = environment()
    writer = JsonlWriter(a.out or f"benchmarks/results/hop_host_profile_{env['date']}.jsonl",
                         env=env)  # fmt: skip
    group = hop_cost.init_group()
    for case in plan:
        ring = hop_cost.Ring(case, group=group)  # its own runtime: no case's hops in another's
        for direction, gc_on in itertools.product(hop_cost.DIRECTIONS, GC_MODES[a.gc]):
            for _ in range(a.eager_first):
                ring.run(direction)
            with hop_library.capturing(ring), _collector(gc_on):
                ring.run(direction)
                hop_library.settle(ring, direction, hop_library.STEADY_PASSES)
                if a.after_profiler and ring.dev.type == "cuda":
                    name = f"relaymoe.{case.mode}.{direction}.hop"
                    hop_cost.profile_passes(partial(ring.run, direction), 2, name, case.ep)
                row = by_hop(ring, direction, a.passes)
                if a.parts:
                    row.update(parts(ring, direction, a.passes))
                top, top_cum = [], []
                if not a.no_cprofile:
                    top, top_cum = profiled(ring, direction, a.passes, a.top)
            writer.write(
                {
                    "bench": "hop_host_profile",
                    "mode": case.mode,
                    "ep": case.ep,
                    "tokens": case.tokens,
                    "direction": direction,
                    "gc": gc_on,
                    "eager_first": a.eager_first,
                    **row,
                    "top": top,
                    "top_cum": top_cum,
                }
            )
            print(f"== {case.mode} {direction} EP {case.ep} T {case.tokens}: {row}")
            for r in top:
                print(f"   {r['own_us_per_hop']:8.2f} us own {r['cum_us_per_hop']:8.2f} cum "
                      f"{r['calls_per_hop']:6.2f}x  {r['fn']}")  # fmt: skip
            print("   -- the library's functions by cumulative time")
            for r in top_cum:
                print(f"   {r['cum_us_per_hop']:8.2f} us cum {r['own_us_per_hop']:8.2f} own "
                      f"{r['calls_per_hop']:6.2f}x  {r['fn']}")  # fmt: skip
        del ring
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
