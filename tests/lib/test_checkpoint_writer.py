"""``relaymoe.megatron.checkpoint_writer.stop_checkpoint_writer`` against the installed
megatron-core: the Manager its ``torch_dist`` writer starts (``filesystem_async.
get_write_results_queue``, what every save calls) is a process of this one, and the call ends
that process and lets the next save start a new one. It fails when megatron-core moves the
Manager out of ``filesystem_async._results_queue`` or stops reaching it through the queue's
proxy, where ``stop_checkpoint_writer`` would silently find nothing. A whole conversion leaving
nothing behind: ``tests/lib/test_convert_hf.py``."""

from __future__ import annotations

import os

from tests.fixtures import needs

pytestmark = needs("megatron.core")


def _children() -> dict[int, str]:
    """pid: command line of each live child of this process (Linux's /proc)."""
    me, found = os.getpid(), {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != me or fields[0] == "Z":  # its parent; a zombie has ended
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
    return found


def test_stop_checkpoint_writer_ends_the_writers_manager_process():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from relaymoe.megatron.checkpoint_writer import stop_checkpoint_writer

    stop_checkpoint_writer()  # one an earlier test of this process may have left
    before = _children()
    queue = filesystem_async.get_write_results_queue()  # as a save's writer gets it
    queue.put("result")
    assert queue.get() == "result"  # a live Manager serves it
    started = {pid: cmd for pid, cmd in _children().items()
               if pid not in before and "spawn_main" in cmd}  # fmt: skip
    assert len(started) == 1, (started, _children())  # the Manager (beside a resource tracker)
    assert stop_checkpoint_writer()
    assert not set(started) & set(_children()), started  # ended and reaped
    assert not stop_checkpoint_writer()  # nothing left to stop
    again = filesystem_async.get_write_results_queue()  # the next save's: a new Manager
    assert again is not queue
    again.put("next")
    assert again.get() == "next"
    assert stop_checkpoint_writer()
