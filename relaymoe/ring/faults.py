"""A dead or stalled peer of the EP group: one error type, and the bounded waits that raise it.

Every collective and P2P transfer the ring issues either completes or raises
:class:`RingPeerError` within the process group's timeout; its output is never read otherwise.

Why the ring waits itself rather than trusting the backend. On gloo (torch 2.14, measured) a
dead peer fails the next transfer at once and a stalled one times out after the group's own
timeout, both as a bare ``RuntimeError`` that names neither the ring call nor the rank. On NCCL
a plain ``wait()`` only orders streams: after a timeout the watchdog aborts the communicator (or
ends the process, per ``TORCH_NCCL_ASYNC_ERROR_HANDLING``) and an aborted all-reduce's buffer
can then be read as data, which is how the agreement once reported "E_local differs across
ranks: [4, 0]" 82 s after a peer died. ``Work.wait(timeout)`` blocks the host until the work
completes or the timeout passes, then aborts and raises, on both backends; so every wait here
passes the timeout explicitly (``RingConfig.timeout_s`` may then be shorter than the group's),
and every sum-all-reduce the ring reads carries a validity marker per rank.

Where the host waits (``RingConfig.host_wait``):

* on CPU every hop's transfer is waited for before its data is read (as before), each wait
  bounded by the timeout;
* on CUDA the hops stay asynchronous for the host. With ``pass`` the host waits at the end of
  each pass (and of each all-to-all forward/backward) for the pass's transfers, bounded by the
  timeout: one host sync per pass, so a dead peer is named before the pass returns. With ``lag``
  the host waits at the end of each pass for the *previous* pass's transfers instead (one per
  device), so it stays at most one pass ahead of the GPU rather than draining it: a dead peer is
  named at the end of the next ring pass, and the last pass of a backward when the backward
  ends (an autograd callback: one host sync a backward call); a pass that nothing follows is
  watched by a thread that logs its error past the timeout (the lag wait, below). ``lag`` is the
  default. With ``off`` there is no host sync (a trusted ring call in steady state makes none),
  and a hang is bounded by NCCL's watchdog and the copy engines' device-side barrier timeout,
  without the ring's diagnosis (most NCCL fault cases then read aborted buffers or fault).
  ``lag`` costs no throughput against ``off``; ``pass`` costs some (the host no longer runs ahead
  of the GPU); with ``lag`` and with ``pass`` a peer that dies or stalls at any point of a call
  over NCCL raises RingPeerError within the timeout.

The timeout is the group's own (``timeout=`` of ``init_process_group``/``new_group``), on NCCL
less ``min(5 s, 25%)`` so the ring's error comes before the watchdog acts (:func:`ring_timeout_s`),
or ``RingConfig.timeout_s`` seconds when set. The host wait is ``RingConfig.host_wait``; both
are the call's (its ``RingConfig``, built by the caller or by an entry point from
``RELAYMOE_RING_TIMEOUT_S`` / ``RELAYMOE_RING_HOST_WAIT`` or Megatron's flags), and the lag
wait's pending passes are its runtime's (``RingRuntime.lag``).

**The lag wait** (:class:`LagWatch`, one per runtime: ``RingRuntime.lag``). At the end of each
ring pass the host waits, bounded, for the pass before it on the same device, never for its own,
so it stays one pass ahead of the GPU instead of draining it. The last pass of a backward has no
later pass to wait for it, and the step's own syncs (the loss, the gradient norm) would block on
its dead transfer until NCCL's watchdog aborts the communicator (long past the ring's timeout),
then read the aborted buffers. So a backward pass also queues, once per backward call, an
autograd callback that runs when the backward ends and waits for the device's pending pass: the
error reaches the caller of ``backward()``. A pass outside any backward (evaluation, a forward
whose backward never comes) is watched by a daemon thread that logs its ``RingPeerError`` past
the ring's timeout (logger ``relaymoe.ring``), so the log names the dead peer before NCCL's
watchdog ends the process. The watch's entries hold the pass's ``PeerWatch`` (its ``error`` and
``timeout_s``), the works it deferred (``(work, peers, op, hop)``, c10d works: ``is_completed``)
and its events (``(event, op, hop)``, CUDA events: ``query``); the thread calls no CUDA API that
blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from relaymoe.options import HOST_WAIT_CHOICES
from relaymoe.ring.hop_graphs import capturing

__all__ = [
    "HOST_WAITS",
    "LagWatch",
    "PeerWatch",
    "RingPeerError",
    "all_reduce_checked",
    "check_markers",
    "group_timeout_s",
    "host_wait_enabled",
    "host_wait_mode",
    "nccl_margin_s",
    "ring_timeout_s",
]

HOST_WAITS = HOST_WAIT_CHOICES  # RingConfig.host_wait on CUDA; the first is the default
_FALLBACK_TIMEOUT_S = 1800.0  # torch's default for non-NCCL groups
# the ring gives up this much before NCCL's watchdog: 5 s, at most a quarter of the timeout (with
# a tenth, 1 s of a 10 s group, a loaded host's survivor lost the race to its own watchdog)
NCCL_MARGIN_S = 5.0
NCCL_MARGIN_FRACTION = 0.25


class RingPeerError(RuntimeError):
    """A peer of the EP group did not answer a ring transfer or collective within the timeout
    (it died, stalled, or itself failed after another rank did).

    Attributes: ``call`` (which ring call, e.g. ``"expert fwd hop 1 (p2p)"``), ``mode``,
    ``phase``, ``hop`` (None outside a hop), ``op``, ``rank`` (this process's global rank),
    ``group_ranks`` (global ranks of the EP group), ``peers`` (global ranks that did not answer,
    or None when unknown which), ``timeout_s``, ``waited_s`` and ``cause`` (the backend's words).
    """

    def __init__(
        self,
        *,
        mode: str,
        phase: str,
        op: str,
        hop: int | None,
        rank: int,
        group_ranks: Sequence[int],
        peers: Sequence[int] | None,
        timeout_s: float,
        waited_s: float,
        cause: str,
        neighbours: tuple[int, int] | None = None,
    ):
        self._kwargs = dict(mode=mode, phase=phase, op=op, hop=hop, rank=rank,
                            group_ranks=tuple(group_ranks), peers=peers, timeout_s=timeout_s,
                            waited_s=waited_s, cause=cause, neighbours=neighbours)  # fmt: skip
        self.mode, self.phase, self.op, self.hop = mode, phase, op, hop
        self.rank = rank
        self.group_ranks = tuple(group_ranks)
        self.peers = None if peers is None else tuple(sorted(set(peers)))
        self.timeout_s, self.waited_s = float(timeout_s), float(waited_s)
        self.cause = cause
        where = f"{mode} {phase}" + (f" hop {hop}" if hop is not None else "")
        self.call = f"{where} ({op})"
        if self.peers:
            names = ", ".join(str(p) for p in self.peers)
            who = f"rank{'s' if len(self.peers) > 1 else ''} {names} did not answer"
            check = f"check the log of rank {self.peers[0]} first"
        else:
            others = [r for r in self.group_ranks if r != rank]
            who = f"a peer among ranks {others} did not answer (unknown which)"
            check = "check the logs of those ranks"
        ring = ""
        if neighbours is not None:
            ring = f"; in the ring it sends to {neighbours[0]}, receives from {neighbours[1]}"
        super().__init__(
            f"ring_moe: {self.call} on rank {rank} of the EP group {list(self.group_ranks)}: "
            f"{who} (waited {waited_s:.1f} s of the timeout of {self.timeout_s:g} s{ring}; "
            f"backend: {cause.strip() or 'no detail'}). The peer died or stalled: {check}. If "
            f"it was only slow (a long step, a checkpoint write, a straggler), raise the process "
            f"group's timeout (timeout= of init_process_group/new_group) or RingConfig.timeout_s "
            f"(RELAYMOE_RING_TIMEOUT_S). The "
            f"group is unusable now: end this process and restart the job."
        )

    def __reduce__(self):  # keyword-only construction: pickle (multiprocessing) needs this
        return _restore, (self._kwargs,)


def _restore(kwargs: dict) -> RingPeerError:
    return RingPeerError(**kwargs)


def nccl_margin_s(pg_timeout_s: float) -> float:
    """Seconds the ring's NCCL waits give up before the group's own timeout."""
    return min(NCCL_MARGIN_S, NCCL_MARGIN_FRACTION * pg_timeout_s)


def ring_timeout_s(group: dist.ProcessGroup, timeout_s: float | None = None) -> float:
    """Seconds the ring waits for a peer: ``timeout_s`` (the call's ``RingConfig.timeout_s``)
    if set, else ``group``'s own timeout (:func:`group_timeout_s`); on NCCL that less
    :func:`nccl_margin_s`, so that the ring's wait gives up, and names the peer, before NCCL's
    watchdog (which may end
    the process at the group's timeout) acts on the same work."""
    if timeout_s is not None:
        return float(timeout_s)
    pg = group_timeout_s(group)
    if _is_nccl(group):
        return pg - nccl_margin_s(pg)
    return pg


def group_timeout_s(group: dist.ProcessGroup) -> float:
    """``group``'s own timeout in seconds (its backend's options), else torch's default."""
    for dev in _comm_devices(group):
        try:
            return _backend(group, dev).options._timeout.total_seconds()
        except Exception:  # a torch without backend options: fall back to the default below
            continue
    try:
        name = str(dist.get_backend(group))
        return dist.distributed_c10d._get_default_timeout(name).total_seconds()
    except Exception:  # private API moved: torch's documented default for gloo
        return _FALLBACK_TIMEOUT_S


def _backend(group, dev: torch.device):
    return group._get_backend(dev)


def _is_nccl(group) -> bool:
    try:
        return "nccl" in str(dist.get_backend(group)).lower()
    except Exception:  # not a real group (tests): no watchdog to race
        return False


def _comm_devices(group) -> list[torch.device]:
    if _is_nccl(group) and torch.cuda.is_available():
        return [torch.device("cuda", torch.cuda.current_device())]
    return [torch.device("cpu")]


def host_wait_enabled(device: torch.device, host_wait: str) -> bool:
    """Whether the host waits (bounded) for a pass's transfers before the pass returns."""
    return host_wait_mode(device, host_wait) != "off"


def host_wait_mode(device: torch.device, host_wait: str) -> str:
    """``"hop"`` (CPU: every hop's transfer is waited for before it is read), else
    ``host_wait`` (the call's ``RingConfig.host_wait``) on CUDA: ``"lag"`` (the default),
    ``"off"`` or ``"pass"`` (see the module doc)."""
    if device.type != "cuda":
        return "hop"
    return host_wait


class PeerWatch:
    """The bounded waits of one ring call (a pass, an agreement, an all-to-all) on one rank.

    ``wait`` blocks until the works complete, at most ``timeout_s`` from the call, and turns any
    failure into :class:`RingPeerError`. ``defer`` keeps CUDA works (already ordered on the
    stream) for ``finish``, the host wait at the end of the pass. Peers are group ranks here and
    global ranks in the error.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        mode: str,
        phase: str,
        timeout_s: float | None = None,
        rank: int | None = None,
        ranks: Sequence[int] | None = None,
        ring: Sequence[int] | None = None,
        host_wait: str = HOST_WAITS[0],
        runtime=None,
    ):
        """``rank`` (this process's group rank), ``ranks`` (the group's global ranks) and
        ``timeout_s`` default to ``group``'s; pass all three to watch without a group.
        ``ring``: the group ranks of the ring the P2P transfers go around, in order (default:
        the whole group), which names a hop's neighbours. ``host_wait``: the call's
        ``RingConfig.host_wait`` (:meth:`finish`); ``runtime``: the call's ``RingRuntime``,
        whose lag watch holds the pending pass (without one, ``lag`` waits as ``pass``)."""
        self.group, self.mode, self.phase = group, mode, phase
        self.rank = dist.get_rank(group) if rank is None else rank
        self.ranks = tuple(dist.get_process_group_ranks(group) if ranks is None else ranks)
        self.timeout_s = ring_timeout_s(group) if timeout_s is None else float(timeout_s)
        self.ring = tuple(range(len(self.ranks)) if ring is None else ring)
        self.host_wait, self.runtime = host_wait, runtime
        self._deferred: list[tuple[object, tuple[int, ...] | None, str, int | None]] = []
        self._events: list[tuple[torch.cuda.Event, str, int | None]] = []

    # -- errors ---------------------------------------------------------------------------------
    def error(
        self,
        cause: object,
        *,
        op: str,
        hop: int | None = None,
        peers: Sequence[int] | None = None,
        waited_s: float = 0.0,
    ) -> RingPeerError:
        """The error naming ``peers`` (group ranks; None: unknown which)."""
        neighbours = None
        R = len(self.ranks)
        if (op == "p2p" or op.startswith("copy-engine")) and self.rank in self.ring:
            at, n = self.ring.index(self.rank), len(self.ring)
            neighbours = (self.ranks[self.ring[(at + 1) % n]], self.ranks[self.ring[(at - 1) % n]])
        if peers is None and R == 2:  # only one rank can have failed to answer
            peers = [1 - self.rank]
        return RingPeerError(
            mode=self.mode,
            phase=self.phase,
            op=op,
            hop=hop,
            rank=self.ranks[self.rank],
            group_ranks=self.ranks,
            peers=None if peers is None else [self.ranks[p] for p in peers],
            timeout_s=self.timeout_s,
            waited_s=waited_s,
            cause=_cause(cause),
            neighbours=neighbours,
        )

    def issuing(
        self, *, op: str, hop: int | None = None, peers: Sequence[int] | None = None
    ) -> _Issuing:
        """A context for issuing a transfer, which can fail at once (gloo sends to a peer whose
        connection closed): such a ``RuntimeError`` (c10d's errors derive from it) becomes
        RingPeerError."""
        return _Issuing(self, op, hop, peers)

    # -- waits ----------------------------------------------------------------------------------
    def wait(self, works: Sequence, *, op: str, hop: int | None = None) -> None:
        """Wait for ``works``: each a ``Work`` or ``(Work, peers)`` with the group ranks it
        depends on (None: any). Returns when all completed; raises RingPeerError otherwise."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        for item in works:
            work, peers = item if isinstance(item, tuple) else (item, None)
            # at least 1 ms: a zero timedelta means "no timeout" to c10d
            left = max(deadline - time.monotonic(), 1e-3)
            try:
                ok = work.wait(timedelta(seconds=left))
            except Exception as exc:  # the backend's own error or timeout: never read the data
                waited = time.monotonic() - start
                raise self.error(exc, op=op, hop=hop, peers=peers, waited_s=waited) from exc
            if ok is False:
                waited = time.monotonic() - start
                raise self.error(
                    "the work reported failure", op=op, hop=hop, peers=peers, waited_s=waited
                )

    def defer(self, works: Sequence, *, op: str, hop: int | None = None) -> None:
        """Keep stream-ordered CUDA works for the host wait of :meth:`finish`."""
        for item in works:
            work, peers = item if isinstance(item, tuple) else (item, None)
            self._deferred.append((work, peers, op, hop))

    def mark(self, stream: torch.cuda.Stream, *, op: str, hop: int | None = None) -> None:
        """Record an event on ``stream`` for :meth:`finish` to wait on (device-side waits such
        as the copy engines' barriers, which have no work object)."""
        ev = torch.cuda.Event()
        ev.record(stream)
        self._events.append((ev, op, hop))

    def finish(self, device: torch.device) -> None:
        """The host wait at the end of a pass (see the module doc): for this pass's transfers
        (``pass``), for the previous pass's on ``device`` (``lag``: this one waits for the next),
        or none (``off``)."""
        deferred, events = self._deferred, self._events
        self._deferred, self._events = [], []
        wait_mode = host_wait_mode(device, self.host_wait)
        if wait_mode == "lag" and self.runtime is None:  # no lag watch to hand the pass to
            wait_mode = "pass"
        if wait_mode == "off" or capturing(device):
            # a captured pass is replayed without the host: nothing to wait for here, and its
            # events cannot be queried (``hop_graphs.capturing``)
            return
        if wait_mode == "lag":
            key = (device.type, device.index)
            previous = self.runtime.lag.swap(key, self, deferred, events)
            _wait_at_end_of_backward(key, self.runtime)
            if previous is None:
                return
            previous.watch.wait_all(previous.deferred, previous.events)
            return
        self.wait_all(deferred, events)

    def wait_all(self, deferred: Sequence, events: Sequence) -> None:
        """Wait for deferred works ``(work, peers, op, hop)`` and events ``(event, op, hop)``."""
        for work, peers, op, hop in deferred:
            self.wait([(work, peers)], op=op, hop=hop)
        for ev, op, hop in events:
            self.wait_event(ev, op=op, hop=hop)

    def wait_event(self, event: torch.cuda.Event, *, op: str, hop: int | None = None) -> None:
        """Poll ``event`` until it completes, at most ``timeout_s``; a CUDA error raised by the
        poll (e.g. a device-side barrier that gave up and trapped) becomes RingPeerError."""
        start = time.monotonic()
        nap = 2e-5
        while True:
            try:
                if event.query():
                    return
            except Exception as exc:  # a sticky CUDA error: the device side timed out
                raise self.error(exc, op=op, hop=hop, waited_s=time.monotonic() - start) from exc
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                raise self.error(
                    "the device-side wait did not finish; the GPU may still spin on it",
                    op=op, hop=hop, waited_s=waited,
                )  # fmt: skip
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)


class _Issuing:
    """:meth:`PeerWatch.issuing`'s context manager (a class, not a generator: the ring enters
    one every hop)."""

    __slots__ = ("watch", "op", "hop", "peers", "start")

    def __init__(self, watch: PeerWatch, op: str, hop: int | None, peers: Sequence[int] | None):
        self.watch, self.op, self.hop, self.peers = watch, op, hop, peers

    def __enter__(self) -> None:
        self.start = time.monotonic()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if isinstance(exc, RuntimeError) and not isinstance(exc, RingPeerError):
            waited = time.monotonic() - self.start
            raise self.watch.error(
                exc, op=self.op, hop=self.hop, peers=self.peers, waited_s=waited
            ) from exc
        return False  # no error, RingPeerError already, or not the backend's: propagates as is


def _wait_at_end_of_backward(key: tuple[str, int | None], runtime) -> None:
    """Inside a backward, queue (once per backward call, device and runtime) the wait for the
    device's last pending pass of ``runtime`` when the backward ends (``lag``; see
    :class:`LagWatch`). Its RingPeerError is raised to the caller of ``backward()``."""
    task = torch._C._current_graph_task_id()
    queued = runtime.backward_waits  # (task, device) of the waits queued and not yet run
    if task < 0 or (task, key) in queued:
        return
    queued.add((task, key))

    def wait_for_last_pass() -> None:
        queued.discard((task, key))
        last = runtime.lag.take(key)
        if last is not None:
            last.watch.wait_all(last.deferred, last.events)

    torch.autograd.Variable._execution_engine.queue_callback(wait_for_last_pass)


def all_reduce_checked(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    mode: str,
    phase: str,
    timeout_s: float | None = None,
) -> PeerWatch:
    """Sum-all-reduce ``tensor`` in place; returns after it completed (host-blocking, bounded
    by the timeout: ``timeout_s``, the call's ``RingConfig.timeout_s``, else the group's) or
    raises RingPeerError. The returned watch names peers in later checks."""
    watch = PeerWatch(group, mode=mode, phase=phase, timeout_s=ring_timeout_s(group, timeout_s))
    with watch.issuing(op="all_reduce"):
        work = dist.all_reduce(tensor, group=group, async_op=True)
    watch.wait([work], op="all_reduce")
    return watch


def check_markers(watch: PeerWatch, markers: Sequence[int], *, what: str) -> None:
    """Every rank writes 1 into its own marker before a sum-all-reduce: a result whose marker of
    rank ``r`` is not exactly 1 did not get rank ``r``'s contribution (e.g. a reduce aborted
    after a timeout) and is never read as data."""
    if all(m == 1 for m in markers):
        return
    missing = [r for r, m in enumerate(markers) if m == 0]
    clean = all(m in (0, 1) for m in markers)
    raise watch.error(
        f"{what} returned without the validity marker of "
        + (f"group rank(s) {missing}" if clean else f"some ranks (markers {list(markers)})"),
        op="all_reduce",
        peers=missing if clean and missing else None,
    )


def _cause(cause: object) -> str:
    if isinstance(cause, BaseException):
        text = f"{type(cause).__name__}: {cause}"
    else:
        text = str(cause)
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:397] + "..."


# ---------------------------------------------------------------------------------------------
# the lag wait: one pending pass a device, per runtime
# ---------------------------------------------------------------------------------------------
log = logging.getLogger("relaymoe.ring")
POLL_S = 0.25  # how often the watchdog looks at the pending passes


@dataclass
class _Pending:
    watch: PeerWatch
    deferred: list
    events: list
    deadline: float  # time.monotonic() past which an unfinished pass is reported
    settled: bool = field(default=False)  # finished, or reported once


class LagWatch:
    """The pending pass of each device, and the daemon thread that watches those no later pass
    waits for. One per :class:`~relaymoe.ring.runtime.RingRuntime`: the passes of one runtime
    wait for each other, another runtime's are its own. The thread runs only while a pass is
    unsettled: it reports a pass still unfinished past its deadline, and ends when none is left
    (a runtime made for one call leaves no thread behind once its passes are waited for)."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, int | None], _Pending] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def swap(self, key: tuple[str, int | None], watch, deferred: list, events: list):
        """Make this pass the device's pending one; return the pass before it (the caller waits
        for it) or None."""
        entry = _Pending(watch, deferred, events, time.monotonic() + watch.timeout_s)
        with self._lock:
            previous = self._pending.get(key)
            self._pending[key] = entry
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watchdog, name="relaymoe-lag", daemon=True
                )
                self._thread.start()
        if previous is not None:
            previous.settled = True  # the caller waits for it now
        return previous

    def take(self, key: tuple[str, int | None]) -> _Pending | None:
        """Remove and return the device's pending pass (the caller waits for it), or None."""
        with self._lock:
            entry = self._pending.pop(key, None)
        if entry is not None:
            entry.settled = True
        return entry

    def pending(self) -> dict[tuple[str, int | None], _Pending]:
        """The pending pass of each device (a copy; tests)."""
        with self._lock:
            return dict(self._pending)

    def _watchdog(self) -> None:
        while True:
            time.sleep(POLL_S)
            now = time.monotonic()
            with self._lock:
                live = [e for e in self._pending.values() if not e.settled]
                if not live:  # nothing to watch: the next swap starts a new thread
                    self._thread = None
                    return
            # only past its deadline is a pass queried (never while a step may be captured
            # into a CUDA graph on another thread, in the normal run of things)
            for entry in (e for e in live if now > e.deadline):
                pending = _first_unfinished(entry)
                entry.settled = True
                if pending is None:
                    continue
                op, hop = pending
                waited = now - entry.deadline + entry.watch.timeout_s
                err = entry.watch.error(
                    "no later ring pass came to wait for it (relaymoe's lag watchdog); its "
                    "transfers are still pending", op=op, hop=hop, waited_s=waited,
                )  # fmt: skip
                log.error("%s", err)


def _first_unfinished(entry: _Pending) -> tuple[str, int | None] | None:
    """``(op, hop)`` of the first transfer of ``entry`` not finished yet, else None. A query
    that raises (a failed work, a sticky CUDA error) counts as unfinished."""
    for work, _peers, op, hop in entry.deferred:
        try:
            if not work.is_completed():
                return op, hop
        except Exception:
            return op, hop
    for ev, op, hop in entry.events:
        try:
            if not ev.query():
                return op, hop
        except Exception:
            return op, hop
    return None
