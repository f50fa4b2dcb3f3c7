"""Stopping a job and everything it started, so that no process of a stopped job stays on a GPU.

A benchmark or test job is started in a session of its own and stopped as a process group. That
misses what the job started in sessions of their own: torchrun puts each worker in its own
session, and the e2e harness puts each Megatron run (torchrun) in its own. Those survive a
stopped parent and keep the GPU for the next job. So the stops here also walk the job's
process tree (Linux ``/proc``; elsewhere the group alone) and identify each process by pid and
start time, never signalling a reused pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

__all__ = ["descendants", "kill_leftovers", "proc_start", "stop_group", "stop_tree"]


def proc_start(pid: int) -> int | None:
    """Start time (clock ticks since boot) of ``pid``, None if it is gone (Linux /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def descendants(pid: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of ``pid`` (Linux /proc; {} elsewhere)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(d.name))
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            start = proc_start(c)
            if start is not None and c not in out:
                out[c] = start
                todo.append(c)
    return out


def _signal_known(seen: dict[int, int], sig: int) -> list[int]:
    """``sig`` to each process of ``seen`` still alive (same pid and start time)."""
    hit = []
    for pid, start in seen.items():
        if proc_start(pid) == start:
            try:
                os.kill(pid, sig)
                hit.append(pid)
            except ProcessLookupError:
                pass
    return hit


def kill_leftovers(seen: dict[int, int]) -> list[int]:
    """SIGKILL the processes of ``seen`` still alive (same pid and start time: never a reused
    pid); the pids killed."""
    return _signal_known(seen, signal.SIGKILL)


def stop_group(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """Stop the job's own process group: SIGTERM, then SIGKILL to whatever is left once the
    leader has exited or ``grace_s`` have passed; the leader is reaped unless it outlives
    SIGKILL by 30 s (stuck in the kernel: the caller is not held)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def stop_tree(proc: subprocess.Popen, grace_s: float = 15) -> list[int]:
    """Stop the job's process group and every process it started, in its group or not: SIGTERM
    to the group and to each descendant (torchrun stops its workers on it), then, once the
    leader has exited or ``grace_s`` have passed, SIGKILL to the group and to every descendant
    seen before or after that is still alive. The pids killed by SIGKILL outside the group."""
    seen = descendants(proc.pid)
    _signal_known(seen, signal.SIGTERM)
    stop_group(proc, grace_s)  # SIGTERM, the wait, SIGKILL to the group, the reap
    seen.update(descendants(proc.pid))
    return kill_leftovers(seen)
