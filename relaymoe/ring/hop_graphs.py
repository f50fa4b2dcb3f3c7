"""CUDA graphs of the ring: hop bodies recorded once and replayed, and the ring inside a
caller's whole-step graph.

**Recorded hops.** A cache of captured hop bodies: one recorded hop compute per key, replayed on
fixed addresses.

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
  the weight-gradient accumulators (expert mode's trail, token mode's local ones, a caller's
  ``main_grad``: ``main_grads.py``); in a ring of
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
out of its key where :func:`range_window` serves every range (its offsets copied in), forward
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

**A hop's routing index as a recorded hop's input.** Its four arrays are packed into one buffer
(:func:`packed_index`: one copy a hop, not four; one tensor a recorded token forward builds and
returns), and one expert-mode body serves every expert range of a ring, forward and backward
(:func:`range_window`: the range's offsets an input, views made once a pass).

**The ring inside a whole-step CUDA graph** (megatron-core's ``--cuda-graph-impl full_iteration``,
or any ``torch.cuda.graph`` around a training step).

A captured step is replayed without the host: whatever the host would read from the device, or
wait for, during the step cannot happen at replay. So a ``ring_moe`` call that is being captured
runs the one path of the ring that needs no host at all, and refuses, by name, what would need it:

* **The agreement comes from an eager call.** The ranks agree once per input signature
  (``agreement.py``, ``trusted=True``): an eager step with the same shapes (Megatron's
  ``--cuda-graph-warmup-steps``, at least 1) must precede the capture. A captured call never
  enters the agreement's all-reduce; an untrusted call (its ids are validated on the host) or an
  uncached signature raises ``ValueError``.
* **Every hop's buffers are sized for the worst case, and that is a proof, not a guess.** A
  token's K expert ids are distinct (a router's top-k), so at most ``min(K, E_local)`` of them
  fall in any one rank's experts: a hop over ``T`` tokens never has more than
  ``T * min(K, E_local)`` pairs. The captured call sizes its pair buffers from that bound, never
  from counts read on the host, so no routing, however skewed (every token to one expert, one
  rank's experts never used), drops or overflows anything. The kernels find each expert's rows on
  the device (``kernels/grouped/tiles.py``). The pair-buffer budget (``pair_buffer_mib``) does not
  apply under capture: its exact-count path is a host read.
* **Only the ring modes.** ``mode="alltoall"`` sizes its messages on the host; a captured call
  whose agreed mode is the all-to-all raises. ``capturable=True`` (Megatron's dispatcher passes it
  whenever the model's step is captured) keeps ``mode="auto"`` among the ring modes, in the eager
  calls too, so that the eager warm-up and the captured step run the same code.
* **No host wait.** The bounded host waits that name a dead peer (``faults.py``) are skipped while
  capturing: a dead or stalled peer of a replayed step is left to NCCL's watchdog.
* **No hop graphs inside.** ``capture_hops`` (each hop recorded in a graph of its own) is off for a
  captured call: the step's graph already holds every hop.

Allocations made while capturing come from the graph's private memory pool and are the same
addresses at every replay (torch's capture semantics), so the ring needs no static buffers of its
own. A copy-engine transport's workspace must already be large enough: it is sized by the largest
pass of the eager steps, whose shapes a captured step repeats.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from relaymoe.experts import resolve_backend
from relaymoe.kernels.index_arrays import index_arrays_like
from relaymoe.ring.plan import Layout, RingProblem
from relaymoe.routing import RoutingIndex

if TYPE_CHECKING:
    from relaymoe.ring.runtime import RingCall

__all__ = [
    "BOUND",
    "INDEX_FIELDS",
    "CudaGraphReplay",
    "EagerReplay",
    "HopGraphs",
    "PackedIndex",
    "capturing",
    "check_captured",
    "graphs_for",
    "hop_graphs_of",
    "hop_head",
    "hop_key",
    "index_from",
    "index_inputs",
    "index_layout",
    "index_sizes",
    "packed_index",
    "range_window",
    "refusal",
    "run_hop",
    "stage_pass",
    "window_fits",
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


def refusal(problem, backend: str, device: torch.device) -> str | None:
    """Why this call's hops cannot be recorded, or None when they can: exact pair counts
    anywhere (what the hop computes would depend on host integers of one step), and on CUDA a
    hop backend that reads the routing on the host."""
    if problem.pairs is not None:
        return (
            "the hops' pair counts are exact host integers of this step's routing (an untrusted "
            "call, or pair buffers whose bound exceeds pair_buffer_mib="
            f"{problem.pair_buffer_mib}); a graph would keep them: call with trusted=True and a "
            "pair_buffer_mib (RELAYMOE_PAIR_BUFFER_MIB) that holds the bound, or leave "
            "capture_hops off"
        )
    if device.type == "cuda" and resolve_backend(backend, device, problem.dtype) != "triton":
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


def graphs_for(problem, backend: str, device: torch.device, runtime) -> HopGraphs | None:
    """``runtime``'s cache (a ``RingRuntime``: ``runtime.hop_graphs``) for a call on ``device``
    with capture on: the CUDA-graph one, the eager plumbing without CUDA, or None (eager, logged
    once per runtime) when :func:`refusal` names why."""
    why = refusal(problem, backend, device)
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


# ---------------------------------------------------------------------------------------------
# a pass's recorded hops: the cache, and the keys of its entries
# ---------------------------------------------------------------------------------------------
def hop_graphs_of(problem: RingProblem, call: RingCall, device) -> HopGraphs | None:
    """The cache of recorded hop bodies a pass runs its hops through (the call's runtime's),
    or None (eager)."""
    choice = call.kernel_choice
    return graphs_for(problem, choice.backend, device, call.runtime) if choice.capture else None


def hop_head(problem: RingProblem, call: RingCall, phase: str) -> tuple[str, str, int]:
    """The first part of a pass's recorded hops' keys, made once a pass: ``(mode, phase, n)``,
    ``n`` a small int standing for the backend, kernel options and activation (equal ones, one
    int, numbered by the call's runtime), so that the cache's lookup at every hop hashes no
    options object."""
    ids = call.runtime.kernel_choice_ids
    choice = call.kernel_choice
    n = ids.setdefault((choice.backend, choice.kernels, problem.activation), len(ids))
    return problem.mode, phase, n


def hop_key(head: tuple, expert_range: tuple[int, int], rows: dict) -> tuple:
    """The host values a recorded hop keeps (its tensors' shapes are added by the cache):
    :func:`hop_head`'s, the hop's expert range and its pair-count keyword."""
    return (*head, expert_range, *rows.items())


# ---------------------------------------------------------------------------------------------
# a hop's routing index as a recorded hop's input
# ---------------------------------------------------------------------------------------------
INDEX_FIELDS = ("expert_token_indices", "expert_token_offsets", "token_expert_indices",
                "token_index_map")  # fmt: skip


def index_inputs(index: RoutingIndex | PackedIndex, prefix: str = "index.") -> dict[str, Tensor]:
    """The routing index's arrays as inputs of :meth:`HopGraphs.run`: its one packed buffer
    when it has one (:func:`packed_index`: one copy a hop, not four), else the four arrays."""
    if index.packed is not None:
        return {prefix + "packed": index.packed}
    return {prefix + f: getattr(index, f) for f in INDEX_FIELDS}


@functools.cache
def index_layout(sizes: tuple[int, int, int]) -> Layout:
    """The four arrays of a routing index of ``sizes`` (:func:`index_sizes`) in one buffer."""
    T, K, E = sizes
    arrays = index_arrays_like(T * K, E)
    return Layout.of(*((f, dt, shape) for f, (shape, dt) in zip(INDEX_FIELDS, arrays, strict=True)))


def packed_index(buf: Tensor, sizes: tuple[int, int, int]) -> RoutingIndex:
    """The routing index whose arrays are views of ``buf`` (uint8, :func:`index_layout`):
    what a recorded token forward builds into one buffer, so that the hop returns it as one
    tensor (one clone after the replay) and the backward copies it in as one."""
    views = index_layout(sizes).views(buf)
    return RoutingIndex(*(views[f] for f in INDEX_FIELDS), *sizes, packed=buf)


class PackedIndex(NamedTuple):
    """A routing index kept as its packed buffer (:func:`index_layout`) and sizes: what a
    recorded token forward returns for each visiting partition. The backward copies the buffer
    into its hop as one tensor and never needs the arrays on the host, so their views are made
    only where read (:attr:`index`), not every hop."""

    packed: Tensor
    sizes: tuple[int, int, int]

    @property
    def index(self) -> RoutingIndex:
        """The :class:`RoutingIndex` whose arrays are views of :attr:`packed`."""
        return packed_index(self.packed, self.sizes)

    num_tokens = property(lambda self: self.sizes[0])
    topk = property(lambda self: self.sizes[1])
    num_experts = property(lambda self: self.sizes[2])


def index_sizes(index: RoutingIndex | PackedIndex) -> tuple[int, int, int]:
    """``(num_tokens, topk, num_experts)`` of ``index``: what :func:`index_from` rebuilds it of
    (a body keeps these host sizes, never the index of the call that recorded it)."""
    return index.num_tokens, index.topk, index.num_experts


def index_from(tensors: dict[str, Tensor], sizes: tuple[int, int, int],
               prefix: str = "index.") -> RoutingIndex:  # fmt: skip
    """A routing index over the arrays ``tensors[prefix + field]`` of ``sizes``
    (:func:`index_sizes`), or over the packed buffer ``tensors[prefix + "packed"]``."""
    buf = tensors.get(prefix + "packed")
    if buf is not None:
        return packed_index(buf, sizes)
    return RoutingIndex(*(tensors[prefix + f] for f in INDEX_FIELDS), *sizes)


def window_fits(problem) -> bool:
    """Whether one recorded expert-mode hop (forward or backward) can serve every expert range
    through :func:`range_window`: a ring of more than one, and no fc2 bias (the forward's
    combine and the backward's router gradient read ``b2`` at ``e - e0``, ``e0`` a host value
    of the range)."""
    return problem.world_size > 1 and not problem.has_b2


def range_window(index: RoutingIndex, offsets: Tensor) -> tuple[RoutingIndex, tuple[int, int]]:
    """``(index, range)`` for a hop body recorded once for every expert range of one size:
    ``offsets (El+1,)`` are experts ``[e0, e0+El)``'s entries of ``index``'s offsets (global
    positions, an input of the hop copied into its static buffer each replay), and the result's
    range ``(0, El)`` reads them where the kernels read a range's offsets
    (``offsets_for(0, El)``). The kernels then depend on ``e0`` only through that device data;
    the pair count comes from the caller's bound (``max_pairs``), never from the range. The
    expert ids (``token_expert_indices``) stay global: only a hop without fc2 bias reads no
    expert id by range (:func:`window_fits`), forward or backward."""
    El = offsets.shape[0] - 1
    return replace(index, expert_token_offsets=offsets, packed=None), (0, El)


# ---------------------------------------------------------------------------------------------
# the ring inside a caller's whole-step CUDA graph
# ---------------------------------------------------------------------------------------------
def capturing(where: Tensor | torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph, for a call on ``where``
    (a tensor or a device; False off CUDA, and where no GPU is present)."""
    device = where.device if isinstance(where, Tensor) else where
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    )


def check_captured(*, trusted: bool, agree_mode: str) -> None:
    """Refuse, before anything runs, a captured call that would need the host."""
    if not trusted:
        raise ValueError(
            "ring_moe is being captured into a CUDA graph with trusted=False: an untrusted call "
            "validates its expert ids on the host, which a replayed graph cannot; fix: pass "
            "trusted=True (ids from a router, the same shapes on every rank) and run one eager "
            "call with the same shapes first"
        )
    if agree_mode == "every_call":
        raise ValueError(
            "ring_moe is being captured into a CUDA graph with RingConfig.agree='every_call' "
            "(RELAYMOE_RING_AGREE): every call would all-reduce and read the agreement on the "
            "host, which a replayed graph cannot; fix: agree='cached' (the default)"
        )
