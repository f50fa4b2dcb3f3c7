"""Tasks on GPU lanes: one worker thread per lane, each running one task at a time.

A lane is a group of GPUs that one job at a time owns (``benchmarks/max_seq.py --lanes``: one
Megatron trial a lane, pinned with ``CUDA_VISIBLE_DEVICES``). Tasks run in the order they were
queued, each on the first lane free; a running task may queue more (work that became possible
when it finished). The queue is done when nothing is queued and nothing runs. One lane runs its
tasks in the calling thread. With more, Ctrl-C sets ``cancel`` (the tasks' jobs poll it and stop
their processes), drops what is queued, waits for the lanes, and is raised again.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence


def lane_devices(lanes: int, gpus: int) -> list[tuple[int, ...]]:
    """The GPU indices of each of ``lanes`` lanes of ``gpus`` GPUs: consecutive blocks."""
    if lanes < 1 or gpus < 1:
        raise ValueError(f"lanes={lanes}, gpus={gpus}: both at least 1")
    return [tuple(range(i * gpus, (i + 1) * gpus)) for i in range(lanes)]


class LaneQueue:
    """``put(task)`` then ``run()``: each task is called as ``task(lane)`` with the lane's
    devices. An exception in a task stops nothing else; ``run`` re-raises the first one at the
    end (after every lane has finished)."""

    def __init__(self, lanes: Sequence[tuple[int, ...]]):
        if not lanes:
            raise ValueError("LaneQueue needs at least one lane")
        self.lanes = list(lanes)
        self.todo: deque[Callable] = deque()
        self.running = 0
        self.errors: list[BaseException] = []
        self.cond = threading.Condition()
        self.cancel = threading.Event()

    def put(self, task: Callable[[tuple[int, ...]], None]) -> None:
        with self.cond:
            self.todo.append(task)
            self.cond.notify_all()

    def _next(self) -> Callable | None:
        with self.cond:
            while not self.todo:
                if self.running == 0:
                    self.cond.notify_all()
                    return None
                self.cond.wait()
            self.running += 1
            return self.todo.popleft()

    def _work(self, lane: tuple[int, ...]) -> None:
        while (task := self._next()) is not None:
            try:
                task(lane)
            except Exception as e:  # noqa: BLE001 - kept and re-raised by run()
                with self.cond:
                    self.errors.append(e)
            except BaseException:  # Ctrl-C (or a cancelled job): this lane stops
                self.cancel.set()
                raise
            finally:
                with self.cond:
                    self.running -= 1
                    self.cond.notify_all()

    def run(self) -> None:
        if len(self.lanes) == 1:
            self._work(self.lanes[0])
        else:
            threads = [threading.Thread(target=self._work, args=(lane,), daemon=True)
                       for lane in self.lanes]  # fmt: skip
            for t in threads:
                t.start()
            try:
                for t in threads:
                    t.join()
            except KeyboardInterrupt:
                self.cancel.set()
                with self.cond:
                    self.todo.clear()
                for t in threads:
                    t.join()
                raise
        if self.errors:
            raise self.errors[0]
