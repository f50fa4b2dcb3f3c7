"""What the ring keeps from call to call, held by an object its owner keeps: :class:`RingRuntime`.

A ``RingDispatcher`` (Megatron) owns one runtime for its lifetime; a Python caller of
``ring_moe`` passes its own (``runtime=RingRuntime(group)``) to keep the same across calls, or
passes none and gets a fresh one for that call and its backward. Nothing of this lives at
module level: two dispatchers (two models, two layers with different options) in one process
keep apart everything below, and dropping the runtime drops it all.

A runtime holds:

* the group it serves, and one communication stream per CUDA device (``executor.py``);
* the copy engines' symmetric-memory slots per (group, device) and whether the copy engines
  work over a group (``executor.py``), and the views a pass cuts of those slots (the slot memo);
* the agreements of trusted calls by input signature (``agreement.py``): a call in steady state
  neither communicates nor synchronises there. A call captured into a CUDA graph finds the
  agreement its eager warm-up made here, so both must run with the same runtime;
* the recorded hop graphs and their static buffers (``hop_graphs.py``, ``capture_hops``);
* the lag watch: the pending pass of each device, and the waits queued at a backward's end
  (``faults.py``);
* the per-hop timeline recorders open on it (:meth:`record_timeline`, ``executor.py``), and the
  bytes of expert weights its calls copied (``copied_weight_bytes``, ``weights.py``: a training
  step's difference of it is what the step copies of its experts), and the bytes of expert
  weights it sent to its peers (``weight_bytes_sent``: expert mode's leads, counted by
  ``executor.relay`` per pass from the plan; bf16 weights, or their fp8 copies with scales under
  ``ring_moe(fp8=...)``; the travelling gradients are not counted).

What a call without a runtime loses: the agreement is made again at every call (a collective
and a host sync; a captured call refuses, naming ``runtime=``), recorded hops are recorded again,
and the copy engines' workspace is set up again (``transport="auto"`` then takes NCCL; see
``agreement.py``). The results are the same.

:class:`RingCall` is one call's view: its group and runtime, and the options this rank's passes
read (how a hop computes, its :class:`KernelChoice`; overlap, the host wait, the timeout).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from relaymoe.options import KernelOptions, RingConfig
from relaymoe.ring.faults import LagWatch, PeerWatch, ring_timeout_s

__all__ = ["KernelChoice", "RingCall", "RingRuntime"]


class KernelChoice(NamedTuple):
    """How a hop's compute runs: the hop primitives' backend and their kernel options, and
    whether it is recorded and replayed (``RingConfig.capture_hops``, ``hop_graphs.py``). The
    same for every hop of a call."""

    backend: str
    kernels: KernelOptions
    capture: bool = False


class RingRuntime:
    """The ring's state kept across calls for one owner (see the module doc).

    ``group``: the process group the runtime serves (None: the one each call names, or the
    default group). ``persistent``: whether it is kept across calls (False: made for one call
    by ``ring_moe``; the copy engines, whose workspace is set up collectively and must outlive
    every peer's last read of it, are then not used by ``transport="auto"``)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, persistent: bool = True):
        self.group = group
        self.persistent = persistent
        # agreement.py: RingProblem by (group, rank, world, input signature)
        self.agreements: dict[tuple, object] = {}
        # hop_graphs.py: HopGraphs by (replay kind, device); the lines logged once
        self.hop_graphs: dict[tuple[str, torch.device], object] = {}
        self.logged: set[str] = set()
        # hop_graphs.py: a small int per (backend, kernel options, activation) of recorded hops
        self.kernel_choice_ids: dict[tuple, int] = {}
        # executor.py: the communication stream per device index; the views of persistent
        # slots per device: (the slots' addresses and sizes, the memo)
        self.streams: dict[int, torch.cuda.Stream] = {}
        self.slot_memos: dict[torch.device, tuple[tuple, dict]] = {}
        self.recorders: list[list] = []
        self.copied_weight_bytes = 0  # weights.py: stacks and slot packs of expert weights
        # executor.py: bytes of expert weights (expert mode's leads) this rank sent to a peer
        self.weight_bytes_sent = 0
        # executor.py: (buffer, handle, capacity) per (group name, device index); whether the
        # copy engines work per group name; whether the barrier takes a timeout (None: unknown)
        self.workspaces: dict[tuple[str, int | None], tuple] = {}
        self.copy_engine_ok: dict[str, bool] = {}
        self.barrier_takes_timeout: bool | None = None
        # faults.py: the pending pass per device, the waits queued at a backward's
        # end by (graph task, device)
        self.lag = LagWatch()
        self.backward_waits: set[tuple[int, tuple[str, int | None]]] = set()
        self._lock = threading.Lock()

    def comm_stream(self, device: torch.device) -> torch.cuda.Stream:
        """This runtime's communication stream of ``device``."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self.streams.get(idx)
            if stream is None:
                stream = self.streams[idx] = torch.cuda.Stream(device=idx)
        return stream

    def workspace_bytes(self) -> int:
        """Bytes held by this runtime's copy-engine slots (all groups and devices)."""
        return sum(2 * cap for (_, _, cap) in self.workspaces.values())

    def log_once(self, log, line: str) -> None:
        """``log.info(line)`` the first time this runtime sees ``line``."""
        if line not in self.logged:
            self.logged.add(line)
            log.info(line)

    def forget(self) -> None:
        """Drop the agreements, the recorded hops and their buffers (every rank of the group at
        the same point: the next trusted call agrees again, a collective). The copy-engine
        workspace is kept: peers may still read it."""
        self.agreements.clear()
        self.hop_graphs.clear()
        self.kernel_choice_ids.clear()

    @contextlib.contextmanager
    def record_timeline(self) -> Iterator[list]:
        """Collect a ``HopTiming`` per hop of every ring pass of this runtime run inside the
        block (``relaymoe.ring.record_timeline``)."""
        from relaymoe.ring.executor import record_timeline

        with record_timeline(self) as out:
            yield out

    def __repr__(self) -> str:
        name = getattr(self.group, "group_name", None)
        return (
            f"RingRuntime(group={name!r}, agreements={len(self.agreements)}, "
            f"hop_graphs={len(self.hop_graphs)}, workspace_bytes={self.workspace_bytes()})"
        )


@dataclass(frozen=True)
class RingCall:
    """One ``ring_moe`` call as its passes see it: the group, the runtime, how a hop computes
    and this rank's options of the call's ``RingConfig`` (overlap, host wait, timeout)."""

    group: dist.ProcessGroup | None
    runtime: RingRuntime
    kernel_choice: KernelChoice
    overlap: bool = True
    host_wait: str = "lag"
    timeout_s: float | None = None

    @classmethod
    def of(
        cls, group, runtime: RingRuntime, kernel_choice: KernelChoice, config: RingConfig
    ) -> RingCall:
        return cls(
            group, runtime, kernel_choice, config.overlap, config.host_wait, config.timeout_s
        )

    def watch(self, *, mode: str, phase: str, group=None, **view) -> PeerWatch:
        """A :class:`PeerWatch` of this call over ``group`` (default: the call's), with the
        call's timeout, host wait and runtime; ``view``: ``PeerWatch``'s ``ring=``."""
        g = self.group if group is None else group
        return PeerWatch(
            g, mode=mode, phase=phase, timeout_s=ring_timeout_s(g, self.timeout_s),
            host_wait=self.host_wait, runtime=self.runtime, **view,
        )  # fmt: skip
