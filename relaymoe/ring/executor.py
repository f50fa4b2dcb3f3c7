"""The ring's executor and its transports: double-buffered slots, a communication stream, the
relay loop, and what moves a hop's bytes between ranks.

**The relay.** ``relay`` runs one pass (forward or backward) of the ring for any mode: a *lead*
(the partition needed by the next hop) and an optional *trail* (an accumulator every rank adds
into, one hop behind its partition; see ``plan.py``). Per hop ``h`` on rank ``r``:

1. ``start(h)``: the communication stream waits for everything the compute stream queued so far
   (the slot being sent is final, the slot being received into is no longer read), then issues
   the transfer of hop ``h`` (lead of hop ``h+1`` + trail of hop ``h-1``);
2. the compute stream computes hop ``h`` against the visiting lead; its share of the trail goes
   to a scratch (at hop 0, straight into the next slot: nothing arrives there at hop 0);
3. the compute stream waits for the transfer and adds the scratch into the arrived trail.

With ``overlap=False`` step 3's wait moves before step 2 (the ablation of RelayMoE Fig. 17). On
CPU the transfers run in gloo's background threads; there are no streams.

Faults (``faults.py``): on CPU step 3 waits for the hop's works with the group's timeout and a
failure raises ``RingPeerError`` naming the neighbour before anything reads the slot. On CUDA the
host does not wait per hop; ``finish`` hands the pass's works, and events recorded after each
copy-engine hop, to the host wait of ``RingConfig.host_wait`` (``faults.PeerWatch.finish``:
the default ``lag`` waits for them at the end of the next pass or of the backward; ``pass`` before
this pass returns; ``off`` never).

Memory: two slots of ``plan.capacity()`` bytes, one trail scratch, and whatever one hop's
compute allocates; the caller's accumulators. The returned trail lives in a fresh buffer.

**The transports** move one hop's byte ranges between ranks (``plan.HopTransfer``: up to two
sends and two receives, each with its own peer; one of each in a flat ring).

* ``nccl`` (:class:`P2PTransport`): ``dist.batch_isend_irecv`` with the hop's sends and receives
  in one group, in the same order on every rank. The same code runs over gloo on CPU and over NCCL
  within and across nodes. On CUDA it is issued from the executor's communication stream.
* ``copy_engine`` (:class:`CopyEngineTransport`, CUDA within one node): both slots live in one
  persistent ``torch.distributed._symmetric_memory`` allocation per (group, device), held by the
  call's runtime (``RingRuntime.workspaces``); each rank
  *pulls* the visiting range straight from its neighbour's slot with a device-to-device copy of
  peer-mapped memory, which the GPU's copy engines execute without SMs, so more of a transfer hides
  under a grouped GEMM than with NCCL, whose kernels compete for SMs. A group-wide barrier on the
  signal pads precedes every pull, on the communication stream. After barrier ``h`` every rank has
  (a) finished writing the slot it sends at hop ``h`` (the executor orders that before the barrier)
  and (b) finished its pull of hop ``h-1``, i.e. stopped reading the slot its sender overwrites at
  hop ``h``. So nothing is read before it is written nor overwritten while read. One more barrier at
  the start of every pass keeps a pass from overwriting slots a peer still reads from the previous
  pass.

Both are issued on the current stream (the executor's communication stream on CUDA).

**The transports' bounded waits** (``faults.py``). ``issue`` returns the hop's works with the
peers each one depends on; the executor waits for them with the group's timeout (per hop on CPU,
at the end of the pass on CUDA), so a dead neighbour raises ``RingPeerError`` naming it. The copy
engines' barrier is a kernel spinning on a peer's signal: it gets the timeout as ``timeout_ms``,
after which torch's barrier kernel gives up and traps (a CUDA error the executor's bounded poll of
the pass's events turns into ``RingPeerError``); a torch whose barrier takes no timeout spins on,
and then only the host side is bounded (the poll raises, the GPU keeps spinning until the process
ends). Neither is exercised on CPU.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from relaymoe.ring.faults import (
    PeerWatch,
    RingPeerError,
    all_reduce_checked,
    host_wait_enabled,
    ring_timeout_s,
)
from relaymoe.ring.plan import HopTransfer, Layout, RingPlan, RingProblem

if TYPE_CHECKING:
    from relaymoe.ring.runtime import RingCall

__all__ = [
    "CopyEngineTransport",
    "HopTiming",
    "P2PTransport",
    "PassWork",
    "RingExecutor",
    "Transport",
    "copy_engine_available",
    "copy_engine_works",
    "record_timeline",
    "relay",
    "ring_pass",
    "transport_of",
]


# ---------------------------------------------------------------------------------------------
# the transports: a hop's sends and receives
# ---------------------------------------------------------------------------------------------
# The persistent symmetric slots live in the runtime (``RingRuntime.workspaces``), per (group
# name, device index): (tensor (2*cap,), handle, cap), grown in steps of this many bytes.
_SYMM_GRANULE = 2 * 1024 * 1024


class Transport(abc.ABC):
    """Interface: ``slots`` gives the two slot buffers, ``issue`` one hop's transfer."""

    name = "base"
    # whether ``slots`` returns the same memory every pass (the executor then keeps its views
    # of them from pass to pass instead of cutting them again)
    persistent_slots = False
    needs_entry_sync = False

    @abc.abstractmethod
    def slots(self, capacity: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """The two slot buffers of at least ``capacity`` bytes each."""

    def watch_view(self) -> dict:
        """``PeerWatch`` keywords when the plan's ring is not the whole group (``ring``: its
        group ranks in order); empty: the group's own."""
        return {}

    def group_peers(self, peers) -> set[int]:
        """The group ranks of a plan's peers (the plan's own numbering)."""
        return set(peers)

    def entry_sync(self) -> None:  # noqa: B027 (optional hook: most transports need none)
        """Called once per pass before the first hop when ``needs_entry_sync``."""

    @abc.abstractmethod
    def issue(self, xfer: HopTransfer, sends: list[Tensor], recvs: list[Tensor]) -> list:
        """Start the transfer on the current stream (``sends``/``recvs``: the byte views of
        ``xfer.sends``/``xfer.recvs``, in order); returns ``(work, peers)`` pairs: the works
        to wait for (bounded) before the data is read on CPU, or at the end of the pass on CUDA
        (already ordered on the stream), and the group ranks each depends on."""


class P2PTransport(Transport):
    """``batch_isend_irecv`` (NCCL on CUDA, gloo on CPU): a hop's sends and receives at once."""

    name = "nccl"

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def slots(self, capacity: int, device: torch.device) -> tuple[Tensor, Tensor]:
        # Fresh per pass: they return to the caching allocator when the pass ends.
        return (
            torch.empty(capacity, dtype=torch.uint8, device=device),
            torch.empty(capacity, dtype=torch.uint8, device=device),
        )

    def issue(self, xfer: HopTransfer, sends: list[Tensor], recvs: list[Tensor]) -> list:
        # Same order on every rank: the sends first, then the receives. No two messages of one
        # hop share a (sender, receiver) pair, so the order cannot mismatch them.
        ops = [
            dist.P2POp(dist.isend, t, group=self.group, group_peer=leg.peer)
            for leg, t in zip(xfer.sends, sends, strict=True)
        ]
        ops += [
            dist.P2POp(dist.irecv, t, group=self.group, group_peer=leg.peer)
            for leg, t in zip(xfer.recvs, recvs, strict=True)
        ]
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        if ops[0].tensor.is_cuda:
            # Non-blocking for the host: the current (communication) stream waits for NCCL's.
            for w in works:
                w.wait()
        peers = [op.group_peer for op in ops]
        if len(works) == len(ops):  # one work per op (gloo): the failing one names its peer
            return [(w, (p,)) for w, p in zip(works, peers, strict=True)]
        return [(w, tuple(peers)) for w in works]  # coalesced (NCCL): either neighbour


def copy_engine_available() -> bool:
    """This process can use symmetric memory on its current CUDA device."""
    if not torch.cuda.is_available():
        return False
    try:
        import importlib

        importlib.import_module("torch.distributed._symmetric_memory")
    except Exception:  # torch built without symmetric memory
        return False
    return True


class CopyEngineTransport(Transport):
    """Pull from the neighbour's persistent symmetric-memory slot with the copy engines."""

    name = "copy_engine"
    persistent_slots = True  # one symmetric-memory buffer per (group, device) and runtime
    needs_entry_sync = True

    def __init__(self, group: dist.ProcessGroup, runtime, timeout_s: float | None = None):
        """``runtime``: the ``RingRuntime`` whose workspace the slots are; ``timeout_s``: the
        call's ``RingConfig.timeout_s`` (None: the group's)."""
        self.group, self.runtime = group, runtime
        self._buf: Tensor | None = None
        self._hdl = None
        self._cap = 0
        self.timeout_s = ring_timeout_s(group, timeout_s)

    def slots(self, capacity: int, device: torch.device) -> tuple[Tensor, Tensor]:
        import torch.distributed._symmetric_memory as symm_mem

        key = (self.group.group_name, device.index)
        workspaces = self.runtime.workspaces
        entry = workspaces.get(key)
        if entry is None or entry[2] < capacity:
            # Collective: every rank computes the same capacity from the agreed sizes, so all
            # ranks grow (and rendezvous) together.
            cap = max(_SYMM_GRANULE, -(-capacity // _SYMM_GRANULE) * _SYMM_GRANULE)
            if entry is not None:
                _barrier(self.runtime, entry[1], self.timeout_s)  # no peer reads the old slots
                done = torch.cuda.Event()
                done.record()
                # the barrier waits on peers: bounded here, so a dead one raises RingPeerError
                # instead of hanging the synchronize below (which then waits for local work only)
                watch = PeerWatch(self.group, mode="ring", phase="workspace regrowth",
                                  timeout_s=self.timeout_s)  # fmt: skip
                watch.wait_event(done, op="copy-engine barrier")
                torch.cuda.synchronize(device)
                del workspaces[key]
                entry = None
            buf = symm_mem.empty(2 * cap, dtype=torch.uint8, device=device)
            # By name: the form every torch with symmetric memory accepts.
            hdl = symm_mem.rendezvous(buf, self.group.group_name)
            entry = (buf, hdl, cap)
            workspaces[key] = entry
        self._buf, self._hdl, self._cap = entry
        return self._buf[: self._cap], self._buf[self._cap : 2 * self._cap]

    def entry_sync(self) -> None:
        _barrier(self.runtime, self._hdl, self.timeout_s)

    def issue(self, xfer: HopTransfer, sends: list[Tensor], recvs: list[Tensor]) -> list:
        _barrier(self.runtime, self._hdl, self.timeout_s)
        for leg, recv in zip(xfer.recvs, recvs, strict=True):
            src = leg.src
            # Byte offset of the sender's range inside its allocation (slot + range start).
            offset = int(getattr(self._hdl, "offset", 0)) + src.slot * self._cap + src.start
            peer = self._hdl.get_buffer(leg.peer, (src.nbytes,), torch.uint8, offset)
            recv.copy_(peer)  # device-to-device memcpy of peer memory: copy engines, no SMs
        return []


def _barrier(runtime, hdl, timeout_s: float) -> None:
    """The symmetric-memory barrier on the current stream, bounded on the device by
    ``timeout_s`` where torch's barrier takes a timeout (see the module doc); whether it does
    is learned once per runtime (``RingRuntime.barrier_takes_timeout``)."""
    if runtime.barrier_takes_timeout is not False:
        try:
            hdl.barrier(channel=0, timeout_ms=max(1, int(timeout_s * 1000)))
            runtime.barrier_takes_timeout = True
            return
        except TypeError:  # an older signature: barrier(channel) only
            runtime.barrier_takes_timeout = False
    hdl.barrier(channel=0)


def copy_engine_works(
    group: dist.ProcessGroup, device: torch.device, runtime, timeout_s: float | None = None
) -> bool:
    """Collective, cached per group in ``runtime`` (``RingRuntime.copy_engine_ok``): every rank
    set up and pulled through symmetric memory (the runtime's workspace).

    ``transport="auto"`` asks this before choosing the copy engines, so a torch whose symmetric
    memory API differs (or a machine without peer access) falls back to NCCL on every rank
    together instead of failing mid-pass. All ranks of ``group`` must call it.
    """
    name = group.group_name
    known = runtime.copy_engine_ok
    if name not in known:
        ok = 1
        try:
            ce = CopyEngineTransport(group, runtime, timeout_s)
            ce.slots(1, device)
            ce.entry_sync()
            peer = (dist.get_rank(group) - 1) % dist.get_world_size(group)
            probe = ce._hdl.get_buffer(peer, (1,), torch.uint8, int(getattr(ce._hdl, "offset", 0)))
            torch.empty(1, dtype=torch.uint8, device=device).copy_(probe)
            torch.cuda.synchronize(device)
        except Exception:  # any failure here means: use NCCL (decided jointly below)
            ok = 0
        # [ranks that succeeded, ranks that answered]: a sum missing a rank is never read as "ok"
        flag = torch.tensor([ok, 1], dtype=torch.int64, device=device)
        watch = all_reduce_checked(
            flag, group, mode="ring", phase="copy-engine probe", timeout_s=timeout_s
        )
        ok_ranks, live = flag.tolist()  # host sync, once per group
        world = dist.get_world_size(group)
        if live != world:
            raise watch.error(
                f"the probe's all-reduce counted {live} of {world} ranks", op="all_reduce"
            )
        known[name] = ok_ranks == world
    return known[name]


# ---------------------------------------------------------------------------------------------
# the executor: slots, streams, the per-hop order of work
# ---------------------------------------------------------------------------------------------
# The views a pass cuts of persistent slots (Transport.persistent_slots) are kept for the next
# pass over the same slots, in the runtime (``RingRuntime.slot_memos``): by device, (the slots'
# addresses and sizes, the memo). Slots at other addresses (a regrown workspace, another group's)
# replace the entry, and with it the views that hold the old slots' memory.
# A memo's entries (views, runs and plans' ranges together) before it starts afresh: each
# problem of other sizes (another T in token mode) adds its own, and the memo outlives them
MAX_SLOT_MEMO = 512


def _slot_memo(runtime, transport: Transport, slots: tuple[Tensor, ...], device: torch.device):
    """The memo of views of ``slots`` (``flats``: each slot's typed flat views; ``views`` and
    ``runs``: by (layout, slot, base); ``ranges``: each plan's byte-range views), or None when
    the transport's slots are fresh every pass."""
    if not transport.persistent_slots:
        return None
    key = tuple((s.data_ptr(), s.numel()) for s in slots)
    memos = runtime.slot_memos
    entry = memos.get(device)
    if entry is None or entry[0] != key or sum(map(len, entry[1].values())) > MAX_SLOT_MEMO:
        memo = {"flats": ({}, {}), "views": {}, "runs": {}, "ranges": {}}
        entry = memos[device] = (key, memo)
    return entry[1]


# The per-hop stream handshake (an event record and wait each way, two switches of the current
# stream) through torch's C entries, each stream's ids resolved once: the Python wrappers of
# Event.record, Stream.wait_event and set_stream cost a replayed hop several microseconds of host
# time. The public calls where a torch lacks the entries.
_EVENT = getattr(torch._C, "_CudaEventBase", None)
_record = _EVENT.record if _EVENT is not None else (lambda ev, stream: ev.record(stream))
_wait = _EVENT.wait if _EVENT is not None else (lambda ev, stream: ev.wait(stream))


def _make_current(stream: torch.cuda.Stream) -> Callable[[], None]:
    """A call that makes ``stream`` the current stream (``torch.cuda.set_stream``)."""
    setter = getattr(torch._C, "_cuda_setStream", None)
    if setter is None:
        return partial(torch.cuda.set_stream, stream)
    return partial(setter, stream_id=stream.stream_id, device_index=stream.device_index,
                   device_type=stream.device_type)  # fmt: skip


# The per-hop profiler range: torch's C++ range (the one torch.compile's generated code opens)
# records the same user range as torch.profiler.record_function for every observer (the
# profiler, NVTX), without going through the dispatcher; record_function where a torch lacks it.
_hop_range = getattr(torch._C._profiler, "_RecordFunctionFast", torch.profiler.record_function)


@dataclass(frozen=True)
class HopTiming:
    """One hop of one pass on this rank, in milliseconds.

    ``compute_ms``: the hop's expert compute; ``transfer_ms``: the hop's transfer (issued to
    done, on the communication stream); ``hop_ms``: hop start to the end of the wait + add.
    ``hidden`` = share of the transfer hidden under compute, ``(compute + transfer - hop) /
    transfer`` clipped to [0, 1] (None without a transfer).
    """

    mode: str
    phase: str
    hop: int
    transfer_bytes: int
    compute_ms: float
    transfer_ms: float
    hop_ms: float

    @property
    def hidden(self) -> float | None:
        if self.transfer_ms <= 0:
            return None
        share = (self.compute_ms + self.transfer_ms - self.hop_ms) / self.transfer_ms
        return min(1.0, max(0.0, share))


@contextmanager
def record_timeline(runtime) -> Iterator[list[HopTiming]]:
    """Collect a :class:`HopTiming` per hop of every ring pass of ``runtime`` (a
    ``RingRuntime``: pass the same to ``ring_moe``) run inside the block.

    Adds CUDA events (or host timestamps on CPU); the list is filled when the block exits
    (which synchronizes the device).
    """
    raw: list = []
    out: list[HopTiming] = []
    recorders = runtime.recorders
    recorders.append(raw)
    try:
        yield out
    finally:
        recorders.remove(raw)
        if any(r[-1] == "cuda" for r in raw):
            torch.cuda.synchronize()
        for mode, phase, hop, nbytes, marks, kind in raw:
            if kind == "cuda":

                def ms(a, b, marks=marks):
                    if a not in marks or b not in marks:
                        return 0.0
                    return marks[a].elapsed_time(marks[b])

            else:

                def ms(a, b, marks=marks):
                    if a not in marks or b not in marks:
                        return 0.0
                    return (marks[b] - marks[a]) * 1e3

            out.append(
                HopTiming(
                    mode,
                    phase,
                    hop,
                    nbytes,
                    compute_ms=ms("c0", "c1"),
                    transfer_ms=ms("t0", "t1"),
                    hop_ms=ms("h0", "h1"),
                )
            )


class _Pending:
    __slots__ = ("done", "works", "waited")

    def __init__(self, done, works):
        self.done, self.works, self.waited = done, works, False


class RingExecutor:
    """Issues a plan's transfers on a communication stream and orders them with compute."""

    def __init__(
        self,
        transport: Transport,
        plan: RingPlan,
        device: torch.device,
        *,
        call,
        mode: str = "",
        phase: str = "",
        capacity: int | None = None,
    ):
        """``call``: the ``RingCall`` (runtime, overlap, host wait, timeout) of the pass."""
        self.transport, self.plan, self.device = transport, plan, device
        self.overlap = call.overlap
        runtime = call.runtime
        self.recorders = runtime.recorders
        self.cuda = device.type == "cuda"
        self.stream = runtime.comm_stream(device) if self.cuda else None
        # The caller's stream (the compute stream) for the whole pass, and one event that
        # orders the communication stream after it (re-recorded every hop: a wait takes the
        # event as it is when issued). Resolved once: torch.cuda.current_stream and a fresh
        # Event cost the host more than the hop's own replayed compute.
        self.compute = torch.cuda.current_stream(device) if self.cuda else None
        self._ready = torch.cuda.Event() if self.cuda else None
        # each hop's "transfer done" event, by hop parity (a pass waits for hop h's before it
        # starts hop h+1, so two never overlap in use)
        self._done = (torch.cuda.Event(), torch.cuda.Event()) if self.cuda else None
        if self.cuda:  # the current stream's switches of _on_comm
            self._to_comm, self._to_compute = map(_make_current, (self.stream, self.compute))
        self.mode, self.phase = mode, phase
        group = getattr(transport, "group", None)
        self.watch = None
        if group is not None:  # the ring's view of the group: its plan's ranks
            self.watch = call.watch(mode=mode or "ring", phase=phase or "pass", group=group,
                                    **transport.watch_view())  # fmt: skip
        # device-side waits with no work object (the copy engines' barriers): an event per hop,
        # recorded only when finish() will wait on it
        self._mark_events = (
            self.cuda
            and self.watch is not None
            and transport.needs_entry_sync
            and host_wait_enabled(device, call.host_wait)
        )
        self._marks: dict[int, dict] = {}
        self._recording = bool(self.recorders)
        table = plan.pass_table()  # every hop's transfers, planned once (cached by the plan)
        self._transfers, self._legs, self._byte_ranges = table.transfers, table.legs, table.ranges
        cap = plan.capacity() if capacity is None else max(capacity, plan.capacity())
        self.slots = transport.slots(max(cap, 1), device)
        # the slots' byte-range views, cut once a pass (persistent slots: once for all passes)
        self.memo = _slot_memo(runtime, transport, self.slots, device)
        fresh = [None] * len(table.ranges)
        self._range_views: list[Tensor | None] = (
            fresh
            if self.memo is None
            else self.memo["ranges"].setdefault(id(table), (table, fresh))[1]
        )
        if transport.needs_entry_sync:
            self._on_comm(transport.entry_sync)
            if self.cuda:
                self.compute.wait_stream(self.stream)

    # -- timeline -----------------------------------------------------------------------------
    def mark(self, hop: int, name: str, on_comm: bool = False) -> None:
        if not self._recording:
            return
        marks = self._marks.setdefault(hop, {})
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream if on_comm else self.compute)
            marks[name] = ev
        else:
            marks[name] = time.perf_counter()

    def _on_comm(self, fn: Callable[..., object], *args):
        """``fn(*args)`` on the communication stream, after everything queued on the compute
        stream so far."""
        if not self.cuda:
            return fn(*args)
        _record(self._ready, self.compute)
        _wait(self._ready, self.stream)
        self._to_comm()
        try:
            return fn(*args)
        finally:
            self._to_compute()

    # -- transfers ------------------------------------------------------------------------------
    def start(self, hop: int, recv_into: Tensor | None = None) -> _Pending:
        """Issue hop ``hop``'s transfer after all work queued so far on the compute stream.

        ``recv_into``: destination of the final return (hop ``R``); slots otherwise.
        """
        xfers = self._transfers
        xfer = xfers[hop] if 0 <= hop < len(xfers) else self.plan.transfer(hop)  # (that raises)
        send_at, recv_at = self._legs[hop]
        cut, views = self._cut, self._range_views
        sends = [views[i] if views[i] is not None else cut(i, recv_into) for i in send_at]
        recvs = [views[i] if views[i] is not None else cut(i, recv_into) for i in recv_at]
        if self._recording:
            self._marks.setdefault(hop, {})["_bytes"] = xfer.send_bytes
        if not self.cuda:  # no streams: issued from the host right away
            return _Pending(None, self._issue(hop, xfer, sends, recvs))
        works = self._on_comm(self._issue, hop, xfer, sends, recvs)
        done = self._done[hop & 1]
        _record(done, self.stream)
        if works:  # stream-ordered already; the host waits for them in finish()
            self.watch.defer(works, op="p2p", hop=hop)
            works = []
        return _Pending(done, works)

    def _cut(self, i: int, recv_into: Tensor | None) -> Tensor:
        """The bytes of the plan's byte range ``i``: in a slot (cut once per pass, the same view
        every time the range recurs), or in ``recv_into`` for the final return (slot -1)."""
        rng = self._byte_ranges[i]
        if rng.slot < 0:
            return recv_into[rng.start : rng.stop]
        view = self._range_views[i] = self.slots[rng.slot][rng.start : rng.stop]
        return view

    def _issue(self, hop: int, xfer: HopTransfer, sends: list[Tensor], recvs: list[Tensor]):
        """Issue the hop on the current stream (the communication stream on CUDA); a failure
        to issue (a ``RuntimeError``: c10d's errors derive from it) becomes RingPeerError
        naming the hop's peers, as :meth:`PeerWatch.issuing` does (inlined: once per hop)."""
        recording = self._recording
        if recording:
            self.mark(hop, "t0", on_comm=True)
        start = time.monotonic()
        try:
            works = self.transport.issue(xfer, sends, recvs)
        except RingPeerError:
            raise
        except RuntimeError as exc:
            peers = self.transport.group_peers(xfer.peers)
            waited = time.monotonic() - start
            raise self.watch.error(exc, op="p2p", hop=hop, peers=peers, waited_s=waited) from exc
        if recording:
            self.mark(hop, "t1", on_comm=True)
        if self._mark_events:
            self.watch.mark(self.stream, op="copy-engine barrier and pull", hop=hop)
        return works

    def wait(self, pending: _Pending, hop: int | None = None) -> None:
        if pending.waited:
            return
        pending.waited = True
        if self.cuda:
            _wait(pending.done, self.compute)
        else:
            if pending.works:  # bounded: a dead or stalled neighbour raises RingPeerError
                self.watch.wait(pending.works, op="p2p", hop=hop)
            if hop is not None and self._recording:
                self._marks.setdefault(hop, {})["t1"] = time.perf_counter()

    def finish(self) -> None:
        """Order everything later on the compute stream after the last transfer; on CUDA wait
        (bounded) for the pass's transfers on the host; flush marks."""
        if self.cuda:
            self.compute.wait_stream(self.stream)
            if self.watch is not None:
                self.watch.finish(self.device)
        if self._recording and self.recorders:
            kind = "cuda" if self.cuda else "cpu"
            for hop, marks in sorted(self._marks.items()):
                nbytes = marks.pop("_bytes", 0)
                self.recorders[-1].append((self.mode, self.phase, hop, nbytes, marks, kind))


def _zero_views(layout: Layout, buf: Tensor, base: int = 0) -> dict[str, Tensor]:
    views = layout.views(buf, base)
    for v in views.values():
        v.zero_()
    return views


@dataclass(frozen=True)
class PassWork:
    """What one pass moves and computes at each hop, handed to :func:`relay` as one object.

    ``lead_layout(p)``: the layout of partition ``p``'s lead. ``own_lead``: this rank's
    partition, packed into slot 0 before hop 0: tensors by segment name, or a callable that fills
    the typed views of slot 0 itself (e.g. per-expert copies).
    ``compute(hop, partition, lead, trail)``: ``lead`` are typed views of the visiting partition
    in its slot (at hop 0 the rank's own partition in slot 0), None only in a world of one (use
    the local tensors; nothing is packed); ``trail`` are zero-initialised views to ADD this
    rank's share of ``partition``'s accumulator into (None without a trail).
    ``trail_layout(p)``: the layout of partition ``p``'s trail (None: nothing trails).
    ``prepare(hop, partition, lead)``: called before the hop's transfer is issued, with the lead
    already in place (e.g. node-batched rounds exchange it inside the node there, so that on
    NCCL that exchange is not queued behind the hop's transfer, which overlaps the compute).
    ``capacity``: reserve at least this many bytes per slot (e.g. the backward's, at forward).
    ``zero_trail=False``: the trail views reach ``compute`` as they are, and ``compute`` writes
    its whole share (zeroing first what it adds into, or writing over), also at a hop it has
    nothing to compute for: a recorded hop zeroes inside its graph, one host launch less a hop.
    """

    lead_layout: Callable[[int], Layout]
    own_lead: dict[str, Tensor] | Callable[[dict[str, Tensor]], None]
    compute: Callable[[int, int, dict[str, Tensor] | None, dict[str, Tensor] | None], None]
    trail_layout: Callable[[int], Layout] | None = None
    prepare: Callable[[int, int, dict[str, Tensor] | None], None] | None = None
    capacity: int | None = None
    zero_trail: bool = True


def relay(
    plan: RingPlan,
    work: PassWork,
    *,
    transport: Transport | None,
    device: torch.device,
    call: RingCall,
    mode: str = "",
    phase: str = "",
) -> dict[str, Tensor] | None:
    """One ring pass of ``work`` (:class:`PassWork`) over ``plan``'s hops, its transfers through
    ``transport`` (None in a world of one). Returns the views of this rank's complete trail
    (None without a trail). ``call``: the ``RingCall`` (runtime, overlap, host wait, timeout);
    ``mode``/``phase``: the pass's labels (timeline, profiler ranges, errors)."""
    R, rank = plan.world_size, plan.rank
    if R == 1:
        return _relay_alone(rank, work, device)
    ex = RingExecutor(transport, plan, device, call=call, mode=mode, phase=phase,
                      capacity=work.capacity)  # fmt: skip
    views_of, runs_of, own_views = _pass_views(ex, work, device)
    _hops(ex, work, views_of, runs_of, own_views, overlap=call.overlap,
          hop_name=f"relaymoe.{mode}.{phase}.hop")  # fmt: skip
    if mode == "expert":  # the leads of expert mode are the experts' weights (runtime.py)
        call.runtime.weight_bytes_sent += plan.lead_bytes_sent()
    result = None
    if work.trail_layout is not None:
        result = _trail_home(ex, work.trail_layout(rank), device)
    ex.finish()
    return result


def _relay_alone(rank: int, work: PassWork, device: torch.device):
    """A world of one: the compute gets the local tensors (no lead views) and a fresh trail."""
    trail = None
    if work.trail_layout is not None:
        lay = work.trail_layout(rank)
        buf = torch.empty(lay.nbytes, dtype=torch.uint8, device=device)
        trail = _zero_views(lay, buf) if work.zero_trail else lay.views(buf)
    if work.prepare is not None:
        work.prepare(0, rank, None)
    work.compute(0, rank, None, trail)
    return trail


def _cached(make: Callable, bufs: list[Tensor], flats: list[dict], slot_store: dict | None):
    """``make(layout, buffer, base, flats)`` (``Layout.views`` or ``Layout.runs``) by
    (layout, buffer, base), made once per pass, and once for all passes where the slots
    persist (``slot_store``, the memo's): a view is the same at every hop that asks for it
    again (equal layouts of the partitions, the same slot and offset). The scratch's
    (buffer 2) are this pass's."""
    store: dict[tuple[Layout, int, int], object] = {}
    slots_store = store if slot_store is None else slot_store

    def get(layout: Layout, buf: int, base: int = 0):
        key = (layout, buf, base)
        mine = slots_store if buf < 2 else store
        out = mine.get(key)
        if out is None:
            out = mine[key] = make(layout, bufs[buf], base, flats[buf])
        return out

    return get


def _pass_views(ex: RingExecutor, work: PassWork, device: torch.device):
    """The pass's set-up: ``(views_of, runs_of, own_views)``, the cached typed views and runs
    of the two slots and the trail scratch (allocated here, buffer 2), and this rank's lead
    packed into slot 0."""
    R, rank = ex.plan.world_size, ex.plan.rank
    slots, memo = ex.slots, ex.memo
    bufs = [slots[0], slots[1]]  # and the trail scratch (buffer 2), below
    # each buffer's typed flat views, shared by its layouts (persistent slots': the memo's)
    flats: list[dict] = [{}, {}, {}] if memo is None else [*memo["flats"], {}]
    views_of = _cached(Layout.views, bufs, flats, None if memo is None else memo["views"])
    # A trail's runs (``Layout.runs``), which its zeroing and the adds go over; the compute
    # gets its named views (views_of) only where it writes: the scratch, and hop 0's region
    runs_of = _cached(Layout.runs, bufs, flats, None if memo is None else memo["runs"])

    own_lead, trail_layout = work.own_lead, work.trail_layout
    own_views = views_of(work.lead_layout(rank), 0)
    if callable(own_lead):
        own_lead(own_views)
    else:
        for name, view in own_views.items():
            view.copy_(own_lead[name])
    if trail_layout is not None:
        scratch_buf = torch.empty(
            max(trail_layout(p).nbytes for p in range(R)) or 1, dtype=torch.uint8, device=device
        )
        bufs.append(scratch_buf)
    return views_of, runs_of, own_views


def _hops(ex: RingExecutor, work: PassWork, views_of, runs_of, own_views, *, overlap: bool,
          hop_name: str) -> None:  # fmt: skip
    """The hop loop: at each hop, the next transfer issued, the visiting partition computed
    (into its trail share), and what arrived of the trail added to."""
    lead_layout, trail_layout, compute = work.lead_layout, work.trail_layout, work.compute
    prepare, zero_trail = work.prepare, work.zero_trail
    has_trail = trail_layout is not None
    table = ex.plan.pass_table()
    partitions, trail_offsets = table.partitions, table.trail_offsets
    recording, mark, start, wait = ex._recording, ex.mark, ex.start, ex.wait
    part = dst_runs = part_runs = None
    for h in range(ex.plan.world_size):
        p = partitions[h]
        with _hop_range(hop_name):  # host time per hop
            if recording:
                mark(h, "h0")
            lead = own_views if h == 0 else views_of(lead_layout(p), h & 1)
            if prepare is not None:
                prepare(h, p, lead)
            pending = start(h)
            if not overlap:
                wait(pending, h)
            if has_trail:
                trail_p = trail_layout(p)
                # hop 0: nothing arrives into the trail region, so the compute writes it itself;
                # later hops compute into the scratch, added to what arrived once it is in
                dst = (trail_p, (h + 1) & 1, trail_offsets[h + 1])
                dst_runs = runs_of(*dst)
                if h == 0:
                    part, part_runs = views_of(*dst), dst_runs
                else:
                    part, part_runs = views_of(trail_p, 2), runs_of(trail_p, 2)
                if zero_trail:
                    for v in part_runs:
                        v.zero_()
            if recording:
                mark(h, "c0")
            compute(h, p, lead, part)
            if recording:
                mark(h, "c1")
            wait(pending, h)
            if h and has_trail:  # one call for every run (a trail of two dtypes: two)
                if len(dst_runs) > 1:
                    torch._foreach_add_(dst_runs, part_runs)
                elif dst_runs:  # (a partition of no tokens has none)
                    dst_runs[0].add_(part_runs[0])
            if recording:
                mark(h, "h1")


def _trail_home(ex: RingExecutor, lay: Layout, device: torch.device) -> dict[str, Tensor]:
    """The trail's return (hop ``R``): this rank's complete accumulator, in a fresh buffer."""
    R = ex.plan.world_size
    final = torch.empty(max(lay.nbytes, 1), dtype=torch.uint8, device=device)
    ex.mark(R, "h0")
    pending = ex.start(R, recv_into=final)
    ex.wait(pending, R)
    ex.mark(R, "h1")
    return lay.views(final)


# ---------------------------------------------------------------------------------------------
# a problem's pass: its transport, and the relay every pass runs
# ---------------------------------------------------------------------------------------------
def transport_of(problem: RingProblem, call: RingCall) -> Transport | None:
    """The transport of the call's agreed ``problem.transport`` (None in a world of one)."""
    if problem.transport == "copy_engine":
        return CopyEngineTransport(call.group, call.runtime, call.timeout_s)
    if problem.transport == "nccl":
        return P2PTransport(call.group)
    return None


def ring_pass(
    problem: RingProblem, call: RingCall, device, phase: str, plan: RingPlan, work: PassWork
):
    """One :func:`relay` pass of ``work`` in this call: the transport, device, call and labels
    every pass of a problem shares."""
    return relay(plan, work, transport=transport_of(problem, call), device=device, call=call,
                 mode=problem.mode, phase=phase)  # fmt: skip
