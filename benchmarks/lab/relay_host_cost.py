"""Host time of the ring's own machinery per hop, with the hop's compute and transfer removed.

    python benchmarks/lab/relay_host_cost.py [--world 8] [--passes 300] [--repeats 5] [--profile]

Runs ``relaymoe.ring.executor.relay`` (an expert-mode backward pass: lead and trail) on CPU
tensors in one process, with a transport that moves nothing and a compute that does nothing, so
what is timed is the schedule, the slot views, the trail scratch adds and the executor's
bookkeeping: the share of the ring's per-hop host cost that is not the hop's kernel launches.
The ``passes`` are timed ``repeats`` times: ``us_per_pass``/``us_per_hop`` are the median of the
repeats, ``us_per_hop_min`` the fastest, ``us_per_hop_cpu`` the median of the process's CPU time
(what the host spent, without the time other load on the host took the core away).
``--profile`` prints the top functions by own time. Prints one JSON row (``bench: relay_host``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import ENV_CONFIG  # noqa: E402
from benchmarks.common import environment  # noqa: E402
from benchmarks.numerics import free_port  # noqa: E402
from relaymoe.ring.executor import PassWork, Transport, relay  # noqa: E402
from relaymoe.ring.plan import Layout, RingPlan  # noqa: E402
from relaymoe.ring.runtime import KernelChoice, RingCall, RingRuntime  # noqa: E402


class _NoTransfer(Transport):
    """Slots on the CPU; ``issue`` moves nothing (the hop's transfer is not what is timed).
    ``persistent``: the same slots every pass (as the copy engines' workspace: the executor
    keeps its views of them), else fresh ones (as NCCL's P2P transport)."""

    name = "none"

    def __init__(self, group, persistent: bool = False):
        self.group = group
        self.persistent_slots = persistent
        self._made = None

    def slots(self, capacity, device):
        if self.persistent_slots and self._made is not None and self._made[0].numel() >= capacity:
            return self._made
        self._made = tuple(torch.empty(capacity, dtype=torch.uint8) for _ in range(2))
        return self._made

    def issue(self, xfer, sends, recvs):
        return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=8, help="ring size R of the plan")
    ap.add_argument("--passes", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of --passes passes")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--persistent-slots",
        action="store_true",
        help="the same slots every pass (the copy engines' transport), not fresh ones",
    )
    a = ap.parse_args(argv)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)  # fmt: skip
    R, El, H, I = a.world, 4, 32, 32  # sizes do not matter here: nothing is computed or moved
    lead = Layout.of(("w13", torch.bfloat16, (El, 2 * I, H)), ("w2", torch.bfloat16, (El, H, I)))
    trail = Layout.of(("dw13", torch.bfloat16, (El, 2 * I, H)),
                      ("dw2", torch.bfloat16, (El, H, I)))  # fmt: skip
    plan = RingPlan(0, R, [lead.nbytes] * R, [trail.nbytes] * R)
    own = {"w13": torch.zeros(El, 2 * I, H, dtype=torch.bfloat16),
           "w2": torch.zeros(El, H, I, dtype=torch.bfloat16)}  # fmt: skip
    group = dist.group.WORLD
    transport = _NoTransfer(group, persistent=a.persistent_slots)
    # every pass one call's view of one runtime (its lag watch and slot memo kept across passes,
    # as a dispatcher's), with the environment's host wait and timeout; the hop computes nothing
    call = RingCall.of(
        group, RingRuntime(group), KernelChoice("torch", ENV_CONFIG.kernels), ENV_CONFIG
    )

    def one_pass():
        work = PassWork(lead_layout=lambda p: lead, own_lead=own, compute=lambda *args: None,
                        trail_layout=lambda p: trail)  # fmt: skip
        relay(plan, work, transport=transport, device=torch.device("cpu"), call=call,
              mode="expert", phase="bwd")  # fmt: skip

    for _ in range(20):
        one_pass()
    runs, cpu = [], []
    for _ in range(max(a.repeats, 1)):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(a.passes):
            one_pass()
        runs.append((time.perf_counter() - t0) / a.passes)
        cpu.append((time.process_time() - c0) / a.passes)
    per_pass, fastest, per_pass_cpu = statistics.median(runs), min(runs), statistics.median(cpu)
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            one_pass()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(16)
    env = environment()
    print(json.dumps({"bench": "relay_host", "world": R, "hops": R + 1,
                      "persistent_slots": a.persistent_slots,
                      "us_per_pass": round(per_pass * 1e6, 1),
                      "us_per_hop": round(per_pass / (R + 1) * 1e6, 1),
                      "us_per_hop_min": round(fastest / (R + 1) * 1e6, 1),
                      "us_per_hop_cpu": round(per_pass_cpu / (R + 1) * 1e6, 1),
                      "repeats": len(runs),
                      **{k: env[k] for k in ("commit", "torch", "date")}}))  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
