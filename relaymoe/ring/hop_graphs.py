"""A cache of captured hop bodies: one recorded hop compute per key, replayed on static buffers.

At small T the ring is host-bound: issuing a hop's kernels takes the host about as long as the
GPU takes to run them. With ``RingOptions.capture_hops`` a hop's compute (the hop primitive call
of ``expert_mode``/``token_mode``, token forward's routing-index build included) is recorded
once per key into a ``torch.cuda.CUDAGraph`` and replayed, so a hop costs the host a few copies
and one graph launch.

What a replay reads and writes (:meth:`HopGraphs.run`):

* ``inputs``: copied into the cache's static buffers before every replay (the hop's tokens,
  weights, probabilities and the routing index's arrays). Routing changes every step: its
  arrays are inputs like any other, never baked into the graph.
* ``inouts``: the accumulators a hop adds into (``out``, ``dx``, ``dprobs``, the weight
  gradients): copied in before the replay and back after it, so the kernels add into the same
  values as the eager call does (bitwise the same sums).
* what the body returns (``produced``): tensors it allocates (token forward's routing index,
  the first weight gradients of token backward); they live in the graph's memory pool and are
  cloned out after every replay.

Static buffers are owned by the cache, one per (name, shape, dtype, device), and shared by every
entry that names one alike (expert mode's hops of different expert ranges, forward and
backward): replays run one at a time on the compute stream, each after copying its own inputs.
Every graph of a device shares one memory pool: nothing a replay leaves in the pool outlives the
clone that follows it.

A key is the caller's (mode, direction, expert range, pair bound, backend, kernel options,
activation, ...) plus the name, shape and dtype of every input and in-out: a hop of another
shape (a token partition of another T) builds its own entry, one of the same shape reuses it.

What refuses capture (:func:`refusal`; the call then runs eagerly, named in one log line): exact
pair counts (``RingProblem.pairs``, an untrusted call or pair buffers above the budget: host
integers from this step's routing, which a graph would keep) and, on CUDA, the torch backend
(it reads each expert's offsets on the host). Without CUDA the cache runs the same plumbing
with :class:`EagerReplay` (the body called on the static buffers, no graph), which is what the
CPU tests exercise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from relaymoe import options
from relaymoe.experts import resolve_backend
from relaymoe.routing import RoutingIndex

__all__ = [
    "CudaGraphReplay",
    "EagerReplay",
    "HopGraphs",
    "graphs_for",
    "index_from",
    "index_inputs",
    "index_sizes",
    "refusal",
    "run_hop",
]

log = logging.getLogger("relaymoe.ring")

Body = Callable[[dict[str, Tensor]], dict[str, Tensor] | None]
Replay = Callable[[], dict[str, Tensor]]
INDEX_FIELDS = ("expert_token_indices", "expert_token_offsets", "token_expert_indices",
                "token_index_map")  # fmt: skip


class EagerReplay:
    """Records nothing: a replay calls the body on the static buffers (CPU, no CUDA)."""

    name = "eager"

    def record(self, body: Body, static: dict[str, Tensor], device: torch.device) -> Replay:
        return lambda: body(static) or {}


class CudaGraphReplay:
    """Records the body into a ``torch.cuda.CUDAGraph`` after ``warmup`` eager runs on a side
    stream (kernels compiled and tuned, the allocator primed); a replay launches the graph on
    the current stream. One memory pool per device for all its graphs."""

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


class HopGraphs:
    """The recorded hop bodies of one device and their static buffers (see the module doc)."""

    def __init__(self, backend: EagerReplay | CudaGraphReplay):
        self.backend = backend
        self.entries: dict[tuple, Replay] = {}
        self.buffers: dict[tuple, Tensor] = {}

    def static_bytes(self) -> int:
        """Bytes of the static buffers held (the graphs' pool not included)."""
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def _buffer(self, name: str, like: Tensor) -> Tensor:
        key = (name, tuple(like.shape), like.dtype, like.device)
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        return buf

    def run(self, key: tuple, body: Body, inputs: dict[str, Tensor],
            inouts: dict[str, Tensor] | None = None) -> dict[str, Tensor]:  # fmt: skip
        """Run ``body`` (reads ``inputs``, adds into ``inouts``, by name, from the dict it is
        given; returns what it allocates) for this call's tensors through the entry of ``key``
        (recorded on first use). Returns clones of what the body returned."""
        inouts = inouts or {}
        live = {**inputs, **inouts}
        if len(live) != len(inputs) + len(inouts):
            raise ValueError(
                f"HopGraphs.run: {sorted(set(inputs) & set(inouts))} are both inputs and "
                "inouts; name each tensor once"
            )
        full = (key, tuple((n, tuple(t.shape), t.dtype, t.device) for n, t in live.items()))
        static = {n: self._buffer(n, t) for n, t in live.items()}
        for n, t in live.items():
            static[n].copy_(t)
        replay = self.entries.get(full)
        if replay is None:
            device = next(iter(live.values())).device
            replay = self.entries[full] = self.backend.record(body, static, device)
            for n, t in inouts.items():  # the warm-up runs added into them
                static[n].copy_(t)
        produced = replay()
        for n, t in inouts.items():
            t.copy_(static[n])
        return {n: t.clone() for n, t in produced.items()}


def index_inputs(index: RoutingIndex, prefix: str = "index.") -> dict[str, Tensor]:
    """The routing index's arrays as inputs of :meth:`HopGraphs.run`."""
    return {prefix + f: getattr(index, f) for f in INDEX_FIELDS}


def index_sizes(index: RoutingIndex) -> tuple[int, int, int]:
    """``(num_tokens, topk, num_experts)`` of ``index``: what :func:`index_from` rebuilds it of
    (a body keeps these host sizes, never the index of the call that recorded it)."""
    return index.num_tokens, index.topk, index.num_experts


def index_from(tensors: dict[str, Tensor], sizes: tuple[int, int, int],
               prefix: str = "index.") -> RoutingIndex:  # fmt: skip
    """A routing index over the arrays ``tensors[prefix + field]`` of ``sizes``
    (:func:`index_sizes`)."""
    return RoutingIndex(*(tensors[prefix + f] for f in INDEX_FIELDS), *sizes)


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
            inouts: dict[str, Tensor] | None = None) -> dict[str, Tensor]:  # fmt: skip
    """``body`` on the live tensors (``graphs`` None: capture off or refused), else through the
    cache (:meth:`HopGraphs.run`); returns what the body returned."""
    if graphs is None:
        return body({**inputs, **(inouts or {})}) or {}
    return graphs.run(key, body, inputs, inouts)


_CACHES: dict[tuple[str, torch.device], HopGraphs] = {}
_LOGGED: set[str] = set()


def _log_once(line: str) -> None:
    if line not in _LOGGED:
        _LOGGED.add(line)
        log.info(line)


def graphs_for(prob, backend: str, device: torch.device) -> HopGraphs | None:
    """This process's cache for a call on ``device`` with capture on: the CUDA-graph one, the
    eager plumbing without CUDA, or None (eager, logged once) when :func:`refusal` names why."""
    why = refusal(prob, backend, device)
    if why is not None:
        _log_once(f"relaymoe capture_hops: hops run eagerly: {why}")
        return None
    kind = CudaGraphReplay
    if device.type != "cuda" or not torch.cuda.is_available():
        _log_once("relaymoe capture_hops: no CUDA device; hops replay eagerly on static buffers")
        kind = EagerReplay
    key = (kind.name, device)
    cache = _CACHES.get(key)
    if cache is None:
        cache = _CACHES[key] = HopGraphs(kind())
    return cache


def caches() -> dict[tuple[str, torch.device], HopGraphs]:
    """This process's caches by (backend name, device) (tests, memory accounting)."""
    return _CACHES


def forget() -> None:
    """Drop every recorded hop and static buffer (the installed options changed: the keys hold
    kernel options, and a cache no call uses any more should not keep its memory)."""
    _CACHES.clear()


options.on_install(forget)
