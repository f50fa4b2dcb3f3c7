"""Transports that move one hop's byte ranges between ranks (``schedule.HopTransfer``: up to two
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

**Bounded waits** (``faults.py``). ``issue`` returns the hop's works with the peers each one
depends on; the executor waits for them with the group's timeout (per hop on CPU, at the end of
the pass on CUDA), so a dead neighbour raises ``RingPeerError`` naming it. The copy engines'
barrier is a kernel spinning on a peer's signal: it gets the timeout as ``timeout_ms``, after
which torch's barrier kernel gives up and traps (a CUDA error the executor's bounded poll of the
pass's events turns into ``RingPeerError``); a torch whose barrier takes no timeout spins on, and
then only the host side is bounded (the poll raises, the GPU keeps spinning until the process
ends). Neither is exercised on CPU.
"""

from __future__ import annotations

import abc

import torch
import torch.distributed as dist
from torch import Tensor

from relaymoe.ring.faults import PeerWatch, all_reduce_checked, ring_timeout_s
from relaymoe.ring.plan import HopTransfer

__all__ = [
    "CopyEngineTransport",
    "P2PTransport",
    "Transport",
    "copy_engine_available",
    "copy_engine_works",
]

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
