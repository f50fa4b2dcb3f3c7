"""The ``lag`` host wait (``RingOptions(host_wait="lag")``, see ``faults.py``): one pending pass a
device.

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

History: docs/lab-notes/library_history.md#ring-lagwait
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

__all__ = ["swap", "take"]

log = logging.getLogger("relaymoe.ring")
POLL_S = 0.25  # how often the watchdog looks at the pending passes


@dataclass
class _Pending:
    watch: object  # faults.PeerWatch
    deferred: list
    events: list
    deadline: float  # time.monotonic() past which an unfinished pass is reported
    settled: bool = field(default=False)  # finished, or reported once


_PENDING: dict[tuple[str, int | None], _Pending] = {}
_LOCK = threading.Lock()
_THREAD: list[threading.Thread] = []


def swap(key: tuple[str, int | None], watch, deferred: list, events: list) -> _Pending | None:
    """Make this pass the device's pending one; return the pass before it (the caller waits for
    it) or None."""
    entry = _Pending(watch, deferred, events, time.monotonic() + watch.timeout_s)
    with _LOCK:
        previous = _PENDING.get(key)
        _PENDING[key] = entry
        if not _THREAD or not _THREAD[0].is_alive():
            _THREAD[:] = [threading.Thread(target=_watchdog, name="relaymoe-lag", daemon=True)]
            _THREAD[0].start()
    if previous is not None:
        previous.settled = True  # the caller waits for it now
    return previous


def take(key: tuple[str, int | None]) -> _Pending | None:
    """Remove and return the device's pending pass (the caller waits for it), or None."""
    with _LOCK:
        entry = _PENDING.pop(key, None)
    if entry is not None:
        entry.settled = True
    return entry


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


def _watchdog() -> None:
    while True:
        time.sleep(POLL_S)
        now = time.monotonic()
        with _LOCK:
            due = [e for e in _PENDING.values() if not e.settled and now > e.deadline]
        for entry in due:
            pending = _first_unfinished(entry)
            entry.settled = True
            if pending is None:
                continue
            op, hop = pending
            waited = now - entry.deadline + entry.watch.timeout_s
            err = entry.watch.error(
                "no later ring pass came to wait for it (relaymoe's lag watchdog); its transfers "
                "are still pending", op=op, hop=hop, waited_s=waited,
            )  # fmt: skip
            log.error("%s", err)
