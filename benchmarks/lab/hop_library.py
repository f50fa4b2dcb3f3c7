"""hop_cost.py's library rows (``--library``): a pass with the library's own recorded hops.

The row (``captured: True``, ``capture_path: "library"``) of the whole pass as hop_cost's eager
row runs it, with ``RingConfig.capture_hops`` on (``KernelChoice(..., capture=True)``: each hop's
compute through ``relaymoe/ring/hop_graphs.py``'s cache, recorded once per key and replayed),
measured exactly as the eager row (``hop_cost.measure_pass``) after a recording pass and the
passes that settle it: the cache records an entry on the first use of its key and addresses
(expert mode one per expert range in the backward, one per slot in the forward; token mode one
per set of slot addresses its hops see), and
per-pass buffers (trail scratch, accumulators) reach recurring addresses after a pass or two
(``settle_passes``: how many ran until one recorded nothing, ``graphs_settling`` what they
recorded), so a steady pass records nothing
while timed or profiled (``graphs_recorded_timed``, 0 expected on a GPU).

* ``host_us_per_hop``: the hop's range as in the eager row, now the copies into the cache's
  static buffers, one graph launch and the copies back (the trail's zero and adds as eager).
* ``gpu_us_per_hop``: the eager row's profiler attribution (``hop_cost.pass_fields``): a
  replay's kernels reach their hop through the host op or the runtime call
  (``cudaGraphLaunch``) the profiler links them to (``gpu_attrib`` ``"hop"``, ``"launch"``),
  else, every graph being launched inside a hop, as the unlinked rest of the device time
  (``"hop+graphs"``), else the pass's total over its hops (``"pass"``).
* ``launches_per_hop``: the eager launches left (copies, the trail's zero and adds) plus the
  graph launches (``graph_launches_per_hop``); ``kernels_per_hop``: the device ops, the graphs'
  kernels included.
* ``idle_frac``: as eager, the CUDA-event span of the pass against the profiler's busy time.
* ``capture_max_abs_diff``, ``capture_bitwise`` (``capture_diff_at`` the output that differs
  most, ``capture_compared`` how many): a replayed pass's outputs against the eager pass's
  (results, token forward's routing indices, every trail a hop sends: :func:`outputs`),
  bitwise expected.
* ``graphs``: entries this direction recorded; ``graphs_held``: the case's so far;
  ``static_bytes`` (``static_MiB``): the cache's static buffers (``HopGraphs.static_bytes``;
  the backward row's include the forward's, shared where alike: what a training step holds);
  ``held_MiB``: CUDA memory the recording pass left allocated (static buffers, the graphs'
  pool, what the cache keeps); ``capture_backend``: ``cuda_graph``, or ``eager`` (the cache's
  stand-in without CUDA: the same plumbing, no graph).
* ``capture_error``: ``hop_graphs.refusal``'s reason, nothing measured (exact pair counts when
  the bound's pair buffers exceed ``pair_buffer_mib``, as at T 32k with EP 2 or 8 under the
  default 512: 768 needed, which ``--dry-run`` prints; the torch backend on CUDA); or a pass
  that recorded nothing; or what failed (``capture_error_at``).

The cache is the ring's runtime's (``hop_cost.Ring.runtime``: ``RingRuntime.hop_graphs``), one
per case, so no case's buffers count in another's.
"""

from __future__ import annotations

import contextlib
import math

import torch

from relaymoe.activation import SWIGLU
from relaymoe.ring import hop_graphs

MiB = 2**20


def needed_mib(case) -> int:
    """The ``pair_buffer_mib`` a case needs for its pair buffers to be sized from the bound
    (``agreement._bounded``: the backward's ``(T * min(K, E/EP), J)`` pre-activation), below which
    a call counts its pairs exactly and ``hop_graphs.refusal`` refuses to record its hops."""
    return math.ceil(case.pair_bound * SWIGLU.fc1_rows(case.I) * case.dtype.itemsize / MiB)


def plan_note(case, bounded: bool) -> str | None:
    """Why ``--library`` will refuse ``case`` (``bounded``: its pair buffers sized from the
    bound), for ``print_plan``; None when it will record its hops."""
    if case.device == "cuda" and case.backend == "torch":
        return "refused (the torch backend on CUDA)"
    if not bounded:
        return (f"refused (exact pairs: needs pair_buffer_mib >= {needed_mib(case)}, "
                "RELAYMOE_PAIR_BUFFER_MIB)")  # fmt: skip
    return None


@contextlib.contextmanager
def capturing(ring):
    """``ring``'s passes with the library's capture on (``KernelChoice.capture``), for the block."""
    choice = ring.kernel_choice
    ring.kernel_choice = choice._replace(capture=True)
    try:
        yield ring
    finally:
        ring.kernel_choice = choice


def held(ring) -> tuple[int, int]:
    """``(entries, static bytes)`` of ``ring``'s hop-graph caches (its runtime's)."""
    caches = ring.runtime.hop_graphs.values()
    return sum(len(c.entries) for c in caches), sum(c.static_bytes() for c in caches)


def compared(want: dict, got: dict) -> dict:
    """The largest absolute difference between two passes' outputs by name, whether they are
    bitwise equal, the output that differs most (None when bitwise) and how many compared."""
    worst, at, same = 0.0, None, want.keys() == got.keys()
    if not same:
        return {"capture_max_abs_diff": math.inf, "capture_bitwise": False,
                "capture_diff_at": "names: " + " ".join(sorted(want.keys() ^ got.keys())),
                "capture_compared": 0}  # fmt: skip
    for name, a in want.items():
        b = got[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            worst, at, same = math.inf, name, False
            continue
        bitwise = torch.equal(_bits(a), _bits(b))
        d = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        if not bitwise:
            same = False
            if at is None or not d <= worst:  # NaN counts as the worst
                worst, at = d, name
    return {"capture_max_abs_diff": worst, "capture_bitwise": same,
            "capture_diff_at": None if same else at, "capture_compared": len(want)}  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def outputs(ring, direction: str, views) -> dict[str, torch.Tensor]:
    """One pass of ``ring`` (a ``hop_cost.Ring``) in ``direction`` with its trails kept
    (``Emulated.keep``: every arriving trail zeros, so each is that hop's own output and the
    return home is well defined): its results, the routing index of every partition a token
    forward builds, and the trail each hop sent, typed (``views``: ``hop_cost.trail_views``), by
    name (clones)."""
    tr = ring.transports[direction]
    tr.keep, tr.trails = True, {}
    try:
        res = ring.run(direction)
    finally:
        tr.keep = False
    if isinstance(res, torch.Tensor):
        got = {"out": res}
    else:
        dx, dprobs, grads = res
        got = {"dx": dx, "dprobs": dprobs, **{f"grad.{k}": v for k, v in grads.items()}}
    if ring.case.mode == "token" and direction == "fwd":
        for p, index in sorted(ring.indices.items()):
            index = getattr(index, "index", index)  # a recorded forward's PackedIndex
            got.update({f"index{p}.{k}": getattr(index, k) for k in hop_graphs.INDEX_FIELDS})
    out = {k: v.clone() for k, v in got.items()}
    for p, buf in sorted(tr.trails.items()):  # the transport's clones already
        trail = views(ring.case, ring.problem, direction, buf)
        out.update({f"trail{p}.{k}": v for k, v in trail.items()})
    tr.trails = {}
    if ring.dev.type == "cuda":
        torch.cuda.synchronize()
    return out


STEADY_PASSES = 6  # at most, before the timed ones (CPU: the stand-in never settles)


def settle(ring, direction: str, limit: int) -> int:
    """Run passes until one records no entry (the addresses of per-pass buffers, trail scratch
    and accumulators, recur once the allocator has seen a pass or two), at most ``limit``;
    returns how many ran. The timed passes then replay what a training step would."""
    for n in range(1, limit + 1):
        before, _ = held(ring)
        ring.run(direction)
        if held(ring)[0] == before:
            return n
    return limit


def library_row(ring, direction: str, a, measure, views, *, compare: bool = True) -> dict:
    """The library row's fields for ``ring``'s pass of ``direction``; ``measure`` is
    ``hop_cost.measure_pass`` (or a partial of it), ``views`` ``hop_cost.trail_views``: the
    eager pass's :func:`outputs` against a replayed pass's (``compare=False``: not compared,
    for the profiled half of a row whose timed half compared them)."""
    why = hop_graphs.refusal(ring.problem, ring.kernel_choice.backend, ring.dev)
    if why is not None:
        return {"capture_error": f"refused (hop_graphs.refusal): {why}",
                "capture_error_at": "relaymoe/ring/hop_graphs.py (refusal)"}  # fmt: skip
    cuda = ring.dev.type == "cuda"
    want = outputs(ring, direction, views) if compare else None  # eager
    entries0, _ = held(ring)
    mem0 = torch.cuda.memory_allocated(ring.dev) if cuda else None
    with capturing(ring):
        ring.run(direction)  # the recording pass: every key of the pass on first use
        if cuda:
            torch.cuda.synchronize()
        entries1, _ = held(ring)
        if entries1 == entries0:
            return {"capture_error": "no hop was recorded: the pass ran its hops eagerly"}
        held_mib = (torch.cuda.memory_allocated(ring.dev) - mem0) / MiB if cuda else None
        diff = {}
        if compare:
            got = outputs(ring, direction, views)  # a replayed pass
            diff = compared(want, got)
            del want, got
        steady = settle(ring, direction, STEADY_PASSES)
        settled, _ = held(ring)  # what the timed passes record is counted from here
        row = measure(ring, direction, a)
    entries2, static = held(ring)
    backend = {c.backend.name for c in ring.runtime.hop_graphs.values()}
    return {
        **row,
        "capture_error": None,
        **diff,
        "capture_backend": " ".join(sorted(backend)),
        "graphs": entries1 - entries0,
        "settle_passes": steady,
        "graphs_held": entries2,
        "graphs_settling": settled - entries1,
        "graphs_recorded_timed": entries2 - settled,
        "static_MiB": round(static / MiB, 3),
        "static_bytes": static,
        "held_MiB": None if held_mib is None else round(held_mib, 2),
    }
