"""A cache of captured hop bodies: one recorded hop compute per key, replayed on fixed addresses.

At small T the ring is host-bound: issuing a hop's kernels takes the host about as long as the
GPU takes to run them. With ``RingConfig.capture_hops`` a hop's compute (the hop primitive call
of ``expert_mode``/``token_mode``, token forward's routing-index build included) is recorded
once per key into a ``torch.cuda.CUDAGraph`` and replayed, so a hop costs the host a few small
copies and one graph launch.

A graph keeps the addresses its kernels read and write. Each tensor of a hop reaches them one
of two ways (:meth:`HopGraphs.run`):

* **copied**: the per-step tensors of the caller (the tokens ``x``/``dy``, the probabilities,
  the routing index's arrays, the accumulators ``out``/``dx``/``dprobs``). Inputs are copied
  into cache-owned static buffers before every replay, in-outs in before and back after it, so
  the kernels add into the same values as the eager call does (bitwise the same sums). Routing
  changes every step: its arrays are inputs like any other, never baked into the graph. What
  every hop of a pass shares (expert mode's own tokens, probabilities, index and accumulators)
  is *staged* (:meth:`HopGraphs.staging`): copied once as the pass starts and back once as it
  ends, not at every hop.
* **bound** (:data:`BOUND`): the large, address-stable ones: the experts' weights and biases
  (expert mode the visiting slot's views or the local experts, token mode the local experts) and
  the weight-gradient accumulators (expert mode's trail, token mode's local ones); in a ring of
  more than one, token mode's visiting partition and trail too (``run_hop``'s ``travelling``:
  views of the ring's slots and trail scratch, at one of a few addresses). The body gets
  the live tensor itself: no static buffer, no copy (at qwen3 widths, EP 2, the copies were about
  600 MB a hop). The entry's key holds each bound tensor's address and layout
  ``(data_ptr, shape, stride, dtype, device)``, so a replay runs only where the call's tensors sit
  where the recorded ones sat, and then reads and writes them there: correct by construction (a
  weight updated in place between steps is read as it is now). The cache keeps no bound tensor
  alive (a graph holds addresses, not tensors; :class:`EagerReplay` keeps its record-time dict,
  which is the CPU's stand-in for addresses baked in at record time).

One key has one entry per set of bound addresses it meets (its *variants*): every layer binds its
own experts (token mode, a world of one) and its own pass's slots, so a model of L MoE layers
records about L x 2 variants of each key (the slots alternate hop to hop) in its first steps and
replays them after: a training step's allocations repeat step to step, so the caching allocator
hands each layer the same addresses again. Nothing guarantees that, though: at most
``max_variants`` (default :data:`MAX_VARIANTS`) entries of one key differ only in their bound
addresses. A call past that copies its bound tensors into static buffers like the rest (one
copied entry per key, correct but paying the copies; logged once per mode, direction and names).
Entries are never evicted or re-recorded.

What the body returns (``produced``): tensors it allocates (token forward's routing index); they
live in the graph's memory pool and are cloned out after every replay. Token backward's
weight-gradient accumulators under capture start as zeros that every hop adds into (bound
in-outs), so nothing of that size is returned or cloned.

The caches live in the call's runtime (``RingRuntime.hop_graphs``, one per replay kind and
device): a dispatcher's recorded hops are its own, and go with it.

Static buffers are owned by the cache, one per (name, shape, dtype, device), and shared by every
entry that names one alike (expert mode's hops of different expert ranges, forward and
backward): replays run one at a time on the compute stream, each after copying its own inputs.
Every graph of a device shares one memory pool: nothing a replay leaves in the pool outlives the
clone that follows it.

A key is the caller's (mode, direction, expert range, pair bound, backend, kernel options,
activation, ...) plus the name, shape and dtype of every copied tensor and the address and
layout of every bound one: a hop of another shape (a token partition of another T) builds its
own entry, one of the same shape at the same addresses reuses it. Expert mode leaves the range
out of its key where ``hop_index.range_window`` serves every range (its offsets copied in), forward
and backward: queued back to back, distinct graphs leave the GPU idle between them, one does
not.

Recording: the body runs ``warmup`` times before the capture (kernels compiled and tuned, the
allocator primed). Those runs add into the in-outs: the copied ones are copied in again after
the recording, the bound ones are snapshot before it and restored after, so the replay that
follows adds exactly once.

What refuses capture (:func:`refusal`; the call then runs eagerly, named in one log line): exact
pair counts (``RingProblem.pairs``, an untrusted call or pair buffers above the budget: host
integers from this step's routing, which a graph would keep) and, on CUDA, the torch backend
(it reads each expert's offsets on the host). Without CUDA the cache runs the same plumbing
with :class:`EagerReplay` (the body called on the record-time tensors, no graph), which is what
the CPU tests exercise.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable

import torch
from torch import Tensor

from relaymoe.experts import resolve_backend

__all__ = [
    "BOUND",
    "CudaGraphReplay",
    "EagerReplay",
    "HopGraphs",
    "graphs_for",
    "refusal",
    "run_hop",
    "stage_pass",
]

log = logging.getLogger("relaymoe.ring")

Body = Callable[[dict[str, Tensor]], dict[str, Tensor] | None]
Replay = Callable[[], dict[str, Tensor]]
# The names a ring hop binds by address (see the module doc): the experts' weights and biases,
# and their gradient accumulators. Every other tensor of a hop is copied.
BOUND = frozenset({"w13", "w2", "b13", "b2", "dw13", "dw2", "db13", "db2"})
# Entries of one key that differ only in their bound addresses (module doc): room for a model of
# ~100 MoE layers on one rank at two slot parities each. An entry costs one graph (its kernels'
# parameters) and what its body returns (token forward's routing index, in the graphs' pool).
MAX_VARIANTS = 256


class EagerReplay:
    """Records nothing: the body runs ``warmup`` times at record (as :class:`CudaGraphReplay`'s
    warm-up does, so the CPU exercises what the cache does about it) and a replay calls it again
    on the record-time dict: its static buffers and the bound tensors it was recorded with,
    which it keeps (on CPU, the stand-in for addresses baked into a graph)."""

    name = "eager"

    def __init__(self, warmup: int = 1):
        self.warmup = warmup

    def record(self, body: Body, static: dict[str, Tensor], device: torch.device) -> Replay:
        for _ in range(self.warmup):
            body(static)
        return lambda: body(static) or {}


class CudaGraphReplay:
    """Records the body into a ``torch.cuda.CUDAGraph`` after ``warmup`` eager runs on a side
    stream (kernels compiled and tuned, the allocator primed); a replay launches the graph on
    the current stream. One memory pool per device for all its graphs. The replay holds the
    graph and what the body returned, not ``static`` (a bound tensor stays the caller's)."""

    name = "cuda_graph"

    def __init__(self, warmup: int = 2):
        self.warmup = warmup
        self.pools: dict[torch.device, object] = {}

    def record(self, body: Body, static: dict[str, Tensor], device: torch.device) -> Replay:
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                body(static)
        current.wait_stream(side)
        pool = self.pools.get(device)
        if pool is None:
            pool = self.pools[device] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            produced = body(static) or {}

        def replay() -> dict[str, Tensor]:
            graph.replay()
            return produced

        return replay


def _signature(name: str, t: Tensor) -> tuple:
    """A copied tensor's part of an entry's key, and its static buffer's key."""
    return name, tuple(t.shape), t.dtype, t.device


class HopGraphs:
    """The recorded hop bodies of one device and their static buffers (see the module doc).

    ``entries``: the replays by full key; ``variants``: how many entries of bound addresses each
    key (the caller's, with every tensor's name and layout) has recorded, at most
    ``max_variants`` (None: :data:`MAX_VARIANTS`, read when the cache is made)."""

    def __init__(self, backend: EagerReplay | CudaGraphReplay, max_variants: int | None = None):
        max_variants = MAX_VARIANTS if max_variants is None else max_variants
        if max_variants < 0:
            raise ValueError(f"HopGraphs: max_variants must be >= 0, got {max_variants}")
        self.backend = backend
        self.max_variants = max_variants
        self.entries: dict[tuple, Replay] = {}
        # this pass's staged tensors by name: (tensor, signature, buffer) (staging)
        self._staged: dict[str, tuple[Tensor, tuple, Tensor]] = {}
        self.variants: dict[tuple, int] = {}
        self.buffers: dict[tuple, Tensor] = {}
        self.logged: set[str] = set()  # the lines logged once by this cache

    def static_bytes(self) -> int:
        """Bytes of the static buffers held: the copied tensors' (a bound tensor has one only
        once a call past ``max_variants`` copied it); the graphs' pool not included."""
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def _buffer(self, name: str, like: Tensor) -> Tensor:
        return self._buffer_of(_signature(name, like))

    def _buffer_of(self, sig: tuple) -> Tensor:
        """The static buffer of ``sig`` (``_signature``: name, shape, dtype, device)."""
        buf = self.buffers.get(sig)
        if buf is None:
            _, shape, dtype, device = sig
            buf = self.buffers[sig] = torch.empty(shape, dtype=dtype, device=device)
        return buf

    def run(self, key: tuple, body: Body, inputs: dict[str, Tensor],
            inouts: dict[str, Tensor] | None = None,
            bound: frozenset[str] | tuple[str, ...] = ()) -> dict[str, Tensor]:  # fmt: skip
        """Run ``body`` (reads ``inputs``, adds into ``inouts``, by name, from the dict it is
        given; returns what it allocates) for this call's tensors through the entry of ``key``
        (recorded on first use). The names in ``bound`` (those present) reach the body as the
        live tensors, keyed by address; the others through static buffers (module doc).
        Returns clones of what the body returned."""
        inouts = inouts or {}
        live = {**inputs, **inouts}
        if len(live) != len(inputs) + len(inouts):
            raise ValueError(
                f"HopGraphs.run: {sorted(set(inputs) & set(inouts))} are both inputs and "
                "inouts; name each tensor once"
            )
        # one walk over the tensors (this is every replayed hop's host time): a staged tensor
        # brings its signature and buffer, a copied one is signed here, a bound one keyed by
        # its layout and address
        staged, static = self._staged, {}
        sigs, layouts, moved = [], [], []
        for n, t in live.items():
            if n in bound:  # (name, layout, address): the device is the cache's own
                layouts.append((n, t.shape, t.stride(), t.dtype, t.data_ptr()))
                static[n] = t
                continue
            st = staged.get(n)
            if st is not None and st[0] is t:
                sigs.append(st[1])
                static[n] = st[2]
            else:
                sig = _signature(n, t)
                sigs.append(sig)
                static[n] = self._buffer_of(sig)
                moved.append(n)
        full = (key, tuple(sigs), tuple(layouts))
        replay = self.entries.get(full)
        # a miss: the bound names, and the key without their addresses (a variant's base)
        tied = [lay[0] for lay in layouts] if replay is None else []
        base = (key, full[1], tuple(lay[:-1] for lay in layouts)) if tied else None
        if tied and self.variants.get(base, 0) >= self.max_variants:
            self._log_once(
                f"relaymoe capture_hops: the {' '.join(map(str, key[:2]))} hop's {sorted(tied)} "
                f"came at more than max_variants={self.max_variants} sets of addresses; a call "
                "at unrecorded ones copies them into static buffers (a copied entry: correct, "
                "but it pays their copies)"
            )
            full = (key, tuple(_signature(n, t) for n, t in live.items()), None)
            for n in tied:  # the entry of a call that binds nothing
                static[n] = self._buffer(n, live[n])
                moved.append(n)
            tied = []
            replay = self.entries.get(full)
        _copy_all([static[n] for n in moved], [live[n] for n in moved])
        if replay is None:
            # the warm-up runs add into the in-outs: bound and staged ones are restored from a
            # snapshot (a staged one holds the pass's sums so far), copied ones copied in again
            kept = {n: static[n] for n in inouts if n in tied or n not in moved}
            replay = self._record(full, body, static, kept)
            back = [n for n in moved if n in inouts]
            _copy_all([static[n] for n in back], [inouts[n] for n in back])
            if tied:
                self.variants[base] = self.variants.get(base, 0) + 1
        produced = replay()
        back = [n for n in moved if n in inouts]
        _copy_all([inouts[n] for n in back], [static[n] for n in back])
        if not produced:
            return {}
        if len(produced) == 1:  # one call
            return {n: t.clone() for n, t in produced.items()}
        made = {n: torch.empty_like(t) for n, t in produced.items()}  # the clones, one launch
        _copy_all(list(made.values()), list(produced.values()))
        return made

    @contextlib.contextmanager
    def staging(self, inputs: dict[str, Tensor], inouts: dict[str, Tensor]):
        """One pass's tensors that every hop reads (``inputs``) or adds into (``inouts``) alike
        (expert mode's own tokens, probabilities, routing index and accumulators): copied into
        their static buffers once as the pass starts, the in-outs back once as it ends, and
        skipped by the runs inside (a run skips a name staged for that very tensor object)."""
        outer, self._staged = self._staged, {}
        for n, t in {**inputs, **inouts}.items():
            sig = _signature(n, t)
            self._staged[n] = (t, sig, self._buffer_of(sig))
        staged = list(self._staged.values())
        _copy_all([b for _, _, b in staged], [t for t, _, _ in staged])
        try:
            yield
            _copy_all(list(inouts.values()), [self._staged[n][2] for n in inouts])
        finally:
            self._staged = outer

    def _log_once(self, line: str) -> None:
        if line not in self.logged:
            self.logged.add(line)
            log.info(line)

    def _record(self, full: tuple, body: Body, static: dict[str, Tensor],
                bound_inouts: dict[str, Tensor]) -> Replay:  # fmt: skip
        """Record the entry ``full``. The warm-up runs add into ``bound_inouts`` (the bound
        ones, the caller's live accumulators, and the staged ones' static buffers): they are
        restored from a snapshot after the recording."""
        warm = getattr(self.backend, "warmup", 1)
        snapshot = {n: t.clone() for n, t in bound_inouts.items()} if warm else {}
        device = next(iter(static.values())).device
        replay = self.entries[full] = self.backend.record(body, static, device)
        for n, t in snapshot.items():
            bound_inouts[n].copy_(t)
        return replay


def _copy_all(dsts: list[Tensor], srcs: list[Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for every ``i`` (alike shapes and dtypes), in one call
    (``torch._foreach_copy_``: a launch per dtype group rather than per tensor, the host's
    cost of a hop's copies)."""
    if len(dsts) > 1:
        torch._foreach_copy_(dsts, srcs)
    elif dsts:
        dsts[0].copy_(srcs[0])


def refusal(prob, backend: str, device: torch.device) -> str | None:
    """Why this call's hops cannot be recorded, or None when they can: exact pair counts
    anywhere (what the hop computes would depend on host integers of one step), and on CUDA a
    hop backend that reads the routing on the host."""
    if prob.pairs is not None:
        return (
            "the hops' pair counts are exact host integers of this step's routing (an untrusted "
            "call, or pair buffers whose bound exceeds pair_buffer_mib="
            f"{prob.pair_buffer_mib}); a graph would keep them: call with trusted=True and a "
            "pair_buffer_mib (RELAYMOE_PAIR_BUFFER_MIB) that holds the bound, or leave "
            "capture_hops off"
        )
    if device.type == "cuda" and resolve_backend(backend, device, prob.dtype) != "triton":
        return (
            "the torch hop backend reads each expert's pair offsets on the host; use "
            "backend='triton' (or 'auto' with a dtype the kernels take)"
        )
    return None


def run_hop(graphs: HopGraphs | None, key: tuple, body: Body, inputs: dict[str, Tensor],
            inouts: dict[str, Tensor] | None = None,
            travelling: tuple[str, ...] = ()) -> dict[str, Tensor]:  # fmt: skip
    """``body`` on the live tensors (``graphs`` None: capture off or refused), else through the
    cache (:meth:`HopGraphs.run`): the names of :data:`BOUND` bound by address, and those of
    ``travelling`` (views of the ring's slots and trail scratch: token mode's visiting tokens
    and trail, whose addresses recur hop to hop and pass to pass); returns what the body
    returned."""
    if graphs is None:
        return body({**inputs, **(inouts or {})}) or {}
    return graphs.run(key, body, inputs, inouts, _bound_with(travelling))


@functools.cache
def _bound_with(travelling: tuple[str, ...]) -> frozenset[str]:
    """:data:`BOUND` and ``travelling``: built once per tuple, not once per hop."""
    return BOUND.union(travelling)


def stage_pass(graphs: HopGraphs | None, inputs: dict[str, Tensor], inouts: dict[str, Tensor]):
    """:meth:`HopGraphs.staging` of ``graphs``, or nothing (capture off or refused)."""
    return contextlib.nullcontext() if graphs is None else graphs.staging(inputs, inouts)


def graphs_for(prob, backend: str, device: torch.device, runtime) -> HopGraphs | None:
    """``runtime``'s cache (a ``RingRuntime``: ``runtime.hop_graphs``) for a call on ``device``
    with capture on: the CUDA-graph one, the eager plumbing without CUDA, or None (eager, logged
    once per runtime) when :func:`refusal` names why."""
    why = refusal(prob, backend, device)
    if why is not None:
        runtime.log_once(log, f"relaymoe capture_hops: hops run eagerly: {why}")
        return None
    kind = CudaGraphReplay
    if device.type != "cuda" or not torch.cuda.is_available():
        runtime.log_once(
            log, "relaymoe capture_hops: no CUDA device; hops replay eagerly through the cache"
        )
        kind = EagerReplay
    key = (kind.name, device)
    cache = runtime.hop_graphs.get(key)
    if cache is None:
        cache = runtime.hop_graphs[key] = HopGraphs(kind())
    return cache
