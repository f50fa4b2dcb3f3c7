"""The ``lag`` host wait (``RingConfig(host_wait="lag")``, see ``faults.py``): one pending pass a
device, per runtime (:class:`LagWatch`, held by ``RingRuntime.lag``).

At the end of each ring pass the host waits, bounded, for the pass before it on the same device,
never for its own, so it stays one pass ahead of the GPU instead of draining it. The last pass of a
backward has no later pass to wait for it, and the step's own syncs (the loss, the gradient norm)
would block on its dead transfer until NCCL's watchdog aborts the communicator (long past the ring's
timeout), then read the aborted buffers. So a backward pass also queues, once per backward call, an
autograd callback that runs when the backward ends and waits for the device's pending pass: the
error reaches the caller of ``backward()``. A pass outside any backward (evaluation, a forward whose
backward never comes) is watched by a daemon thread that logs its ``RingPeerError`` past the ring's
timeout (logger ``relaymoe.ring``), so the log names the dead peer before NCCL's watchdog ends the
process.

Entries hold the pass's ``PeerWatch`` (its ``error`` and ``timeout_s``), the works it deferred
(``(work, peers, op, hop)``, c10d works: ``is_completed``) and its events (``(event, op, hop)``,
CUDA events: ``query``). Nothing here calls a CUDA API that blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

__all__ = ["LagWatch"]

log = logging.getLogger("relaymoe.ring")
POLL_S = 0.25  # how often the watchdog looks at the pending passes


@dataclass
class _Pending:
    watch: object  # faults.PeerWatch
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
