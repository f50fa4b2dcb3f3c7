"""One ring pass's hop bodies on one GPU, the transfer left out: what a hop costs the host and
the GPU, so the gain of cheaper hops (CUDA graphs, fused prologues) is known before two GPUs are
lent.

    python benchmarks/lab/hop_cost.py [--quick] [--captured] [--library] [--out PATH.jsonl]
        [--dry-run] [--ep 2 8 64] [--tokens 4096 8192 32768] [--modes expert token] [--passes 5]
    python benchmarks/lab/hop_cost.py --tiny [--library] [--backend torch]   # CPU (the tests)

Rank 0 of an EP-rank ring, emulated in one process: the library's own passes
(``expert_mode.expert_forward``/``expert_backward``, ``token_mode.token_forward``/
``token_backward``) run through the real executor (``executor.relay``: slots, the communication
stream, the trail scratch adds, the bounded-wait bookkeeping) with a transport that moves
nothing (``executor.transport_of`` patched for the pass), the passes' state in one
``RingRuntime`` per case (their ``RingCall`` made of the case's ``RingConfig``: the
environment's, ``benchmarks.ENV_CONFIG``). Each hop computes what rank 0's hop computes at that
EP: its tokens against the visiting slice of E/EP experts (expert mode, one
routing index over all E experts, the pairs routed to that slice), or a visiting partition of T
tokens against rank 0's own E/EP experts (token mode, the partition's routing index built in the
hop; backward reuses it), with the pair buffers sized as the trusted ring sizes them (the bound
``T * min(K, E/EP)`` under ``pair_buffer_mib``, else the exact counts) and the weight gradients
accumulated (expert mode: into the travelling trail, fp32 from 16 ranks; token mode: locally).
Since nothing moves, slot 1 is filled once with a valid partition: in expert mode the weights of
partition ``R-1`` (what hop 1 computes with; later odd hops compute their own expert slice with
those values, which costs the same), in token mode the tokens of rank 0 (every rank holds the
same tokens here, so every hop computes exactly its hop of that world). Routing: uniform random
top-k over E, fixed seed. qwen3-30b-a3b widths (H 2048, I 768, E 128, K 8, SwiGLU, bf16).

Rows (``bench: hop_cost``), one per (mode, direction, ep, tokens, capture_path);
``capture_path`` tells the three kinds apart: ``"eager"`` (``captured: False``, the library's
pass as it runs by default), ``"hop_graph"`` (``--captured``: one hop's compute in hop_cost's
own CUDA graph) and ``"library"`` (``--library``: the library's pass with its own capture on,
``RingConfig.capture_hops``). The eager row:

* ``host_us_per_hop``: host time of one hop of the pass's loop (``executor.relay``'s per-hop
  range, timed with ``time.perf_counter``; the GPU never stalls the host here: no host sync
  inside a pass), ``host_cpu_us_per_hop`` the same as the thread's CPU time
  (``time.thread_time``: not the time the thread was off its core); ``host_us_per_pass``: the
  whole pass (set-up, plans, own-partition pack, trail return included).
* ``gpu_us_per_hop``: GPU time (kernels, memcpy, memset) launched inside a hop's range, from
  torch.profiler (``pass_fields``): device work linked (the profiler's correlation) to a host
  op that started inside a hop's range (``gpu_attrib: "hop"``, ``gpu_linked_frac`` the share of
  the device time linked; ``"pass"`` when under half is: then the pass's total over its hops;
  ``pass_fields`` names the other links it tries first, for replayed graphs' kernels);
  ``gpu_us_per_pass``: all of the pass's (the own-partition pack and the return included);
  ``kernels_per_hop``: the device ops given to a hop.
* ``launches_per_hop``: launches (kernel launch and graph launch runtime or driver calls)
  inside a hop's range (``graph_launches_per_hop``, ``memcpy_per_hop``, ``memset_per_hop``
  beside it); ``*_per_pass`` the pass's.
* ``idle_frac``: ``1 - busy / span``: busy the union of the pass's device intervals (profiler),
  span the pass on the GPU from CUDA events recorded before it is issued and after (no profiler),
  a pass issued after a sync, so its host set-up before the first kernel counts as idle;
  ``idle_frac_chained``: the same against the span per pass of passes issued back to back (as
  a step's layers: a pass's set-up overlaps the work queued before it), what is left is the
  GPU idle inside the passes; ``host_us_per_hop_chained`` the hops' host time in those chains
  (no sync before a pass: the first hops after a sync cost the host up to 2-3x a later one's),
  the host's own cost only while it has not run ahead of the GPU by the launch queue's depth:
  past that a launch waits for room and the field tells the GPU's pace (EP 64 with
  ``--passes 30``: 169-177 us a hop against a 210-216 us GPU hop).
  Every case's timed passes run before any profiled one (a finished profiler session slows the
  process's host), so rows are measured in two halves.

The hop_graph row (``captured: True``): hop 1's compute (the hop primitive call of the pass's
compute, token forward's index build included) captured in a ``torch.cuda.CUDAGraph`` with static
inputs, outputs and pair buffers sized from the bound, and replayed: ``host_us_per_hop`` the host
time of one replay, ``gpu_us_per_hop`` its kernels, ``launches_per_hop`` graph launches
(``kernels_per_hop`` the kernels inside), ``idle_frac`` of one replay; ``capture_error`` (and
``capture_error_at``, the innermost relaymoe frame) when the hop cannot be captured,
``capture_max_abs_diff`` between replay and eager otherwise.

The library row (``captured: True``): the whole pass as the eager row runs it, each hop's
compute recorded and replayed by ``hop_graphs.py``'s cache, measured exactly as the eager row
after a recording pass, with its outputs against the eager pass's (bitwise expected), what the
cache holds, or ``capture_error`` where ``hop_graphs.refusal`` refuses (exact pair counts at
T 32k, EP 2 and 8, under the default budget: ``--dry-run`` says what it would take); its fields
are described in ``benchmarks/lab/hop_library.py``.

Not measured: the transfer and its issue (``batch_isend_irecv`` or the copy engines' pull and
barrier), the slots' per-pass allocation (persistent here), the call-level work (agreement,
index build in expert mode, the exact pair counts' all-reduce above the budget).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import ENV_CONFIG  # noqa: E402
from benchmarks.common import JsonlWriter, busy_us, environment, print_table  # noqa: E402
from benchmarks.lab import hop_library  # noqa: E402
from relaymoe.activation import SWIGLU  # noqa: E402
from relaymoe.cost import grad_accum_bytes  # noqa: E402
from relaymoe.experts import expert_hop_backward, expert_hop_forward  # noqa: E402
from relaymoe.options import RingConfig  # noqa: E402
from relaymoe.ring import executor  # noqa: E402
from relaymoe.ring.agreement import _bounded, _pairs_per_owner  # noqa: E402
from relaymoe.ring.expert_mode import expert_backward, expert_forward  # noqa: E402
from relaymoe.ring.plan import (  # noqa: E402
    IDX,
    RingProblem,
    expert_plans,
    pair_rows,
    token_lead,
    token_plans,
    token_trail,
    weights_layout,
)
from relaymoe.ring.runtime import KernelChoice, RingCall, RingRuntime  # noqa: E402
from relaymoe.ring.token_mode import token_backward, token_forward  # noqa: E402
from relaymoe.ring.weights import (  # noqa: E402
    FORWARD,
    LocalExperts,
    biases,
    hop_grads,
    hop_options,
)
from relaymoe.routing import build_routing_index  # noqa: E402

QWEN3 = dict(H=2048, I=768, E=128, K=8)
TINY = dict(H=32, I=16, E=8, K=2)
FULL = dict(ep=[2, 8, 64], tokens=[4096, 8192, 32768])
QUICK = dict(ep=[2, 64], tokens=[4096])
TINY_GRID = dict(ep=[2, 4], tokens=[16])
MODES = ("expert", "token")
DIRECTIONS = ("fwd", "bwd")
CHAINS = 3  # chains of back-to-back passes timed (time_host)
NOT_MEASURED = dict.fromkeys(("host_us_per_hop", "gpu_us_per_hop", "launches_per_hop", "idle_frac"))
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
RUNTIME_CALLS = LAUNCHES + GRAPH_LAUNCHES + ("cudaMemcpy", "cudaMemset", "cuMemcpy", "cuMemset")


@dataclass(frozen=True)
class Case:
    mode: str
    ep: int
    tokens: int
    H: int
    I: int  # noqa: E741 (the expert FFN width, the library's name)
    E: int
    K: int
    dtype: torch.dtype
    device: str
    backend: str

    @property
    def El(self) -> int:
        return self.E // self.ep

    @property
    def pair_bound(self) -> int:
        return self.tokens * min(self.K, self.El)


# ---------------------------------------------------------------------------------------------
# inputs and the problem rank 0 of the ring would agree on
# ---------------------------------------------------------------------------------------------
def make_data(case: Case, *, distinct: bool, seed: int = 0) -> dict:
    """Every expert's weights (E of them: expert mode's visiting slices come from here) and the
    token partitions of the ring: R distinct ones with ``distinct``, else rank 0's alone (every
    rank holds the same tokens). Uniform random top-k over E, int32 ids."""
    dev, dt = torch.device(case.device), case.dtype
    g = torch.Generator(device=dev).manual_seed(seed)
    J = SWIGLU.fc1_rows(case.I)
    w13 = (torch.randn(case.E, J, case.H, generator=g, device=dev) * case.H**-0.5).to(dt)
    w2 = (torch.randn(case.E, case.H, case.I, generator=g, device=dev) * case.I**-0.5).to(dt)
    parts = []
    for _ in range(case.ep if distinct else 1):
        T = case.tokens
        scores = torch.rand(T, case.E, generator=g, device=dev)
        parts.append({
            "x": torch.randn(T, case.H, generator=g, device=dev).to(dt),
            "idx": scores.topk(case.K, dim=1).indices.to(IDX).contiguous(),
            "probs": torch.softmax(torch.randn(T, case.K, generator=g, device=dev), -1).to(dt),
            "dy": torch.randn(T, case.H, generator=g, device=dev).to(dt),
        })  # fmt: skip
    return {"w13": w13, "w2": w2, "parts": parts}


def part_of(data: dict, p: int) -> dict:
    """Token partition ``p`` (rank 0's when every rank holds the same tokens)."""
    parts = data["parts"]
    return parts[p if len(parts) > 1 else 0]


def expert_slice(data: dict, case: Case, p: int) -> dict:
    """The weights of partition ``p``'s experts ``[p*El, (p+1)*El)`` (views)."""
    s = slice(p * case.El, (p + 1) * case.El)
    return {"w13": data["w13"][s], "w2": data["w2"][s]}


def agreed_problem(case: Case, data: dict | None, config: RingConfig = ENV_CONFIG) -> RingProblem:
    """Rank 0's agreed problem of an EP-rank ring (``agreement.py``'s result for a trusted call):
    pair buffers from the bound under ``config.kernels.pair_buffer_mib``, else the exact counts
    (``data`` None: the problem before that choice, pairs None, for the plan)."""
    R, dt = case.ep, case.dtype
    grad = torch.float32 if grad_accum_bytes("auto", R, dt) > dt.itemsize else dt
    problem = RingProblem(
        rank=0, world_size=R, num_local_experts=case.El, hidden=case.H, ffn=case.I,
        topk=case.K, dtype=dt, prob_dtype=dt, tokens=(case.tokens,) * R, mode=case.mode,
        transport="nccl", needs_grad=True, pairs=None, grad_dtype=grad,
        pair_buffer_mib=config.kernels.pair_buffer_mib, activation=SWIGLU,
    )  # fmt: skip
    if data is None or _bounded(problem):
        return problem
    return replace(problem, pairs=pair_matrix(case, data))


def pair_matrix(case: Case, data: dict) -> tuple[tuple[int, ...], ...]:
    """``pairs[r][q]``: pairs of token partition r whose expert rank q owns (host sync)."""
    return tuple(
        tuple(_pairs_per_owner(part_of(data, r)["idx"], case.El, case.ep).tolist())
        for r in range(case.ep)
    )


def hop_pairs(case: Case, data: dict) -> float:
    """Mean pairs a hop of rank 0 computes: its tokens with each slice (expert mode), or each
    visiting partition with rank 0's experts (token mode)."""
    m = pair_matrix(case, data)
    if case.mode == "expert":
        return sum(m[0]) / case.ep
    return sum(m[r][0] for r in range(case.ep)) / case.ep


# ---------------------------------------------------------------------------------------------
# the transport that moves nothing (or, for the CPU check, what the peers would have sent)
# ---------------------------------------------------------------------------------------------
class Emulated(executor.Transport):
    """Rank 0's transport in a ring of ``plan.world_size`` ranks, without the peers.

    ``issue`` moves nothing (``leads`` None), or, for the check, writes what the ring would
    deliver if the peers computed nothing themselves: the lead of the next partition (``leads[p]``,
    its bytes) and zeros for every arriving trail, and keeps each trail this rank sends
    (``trails[p]``: its own share of partition p's accumulator, i.e. that hop's output); the
    final return brings back this rank's share of its own partition. ``keep`` (no ``leads``):
    the same for the trails alone, the slots' leads left as they are (what
    ``hop_library.outputs`` compares). ``prefill(slot)`` writes a valid lead into slot 1 once
    (nothing arrives there when nothing moves). Slots persist."""

    name = "emulated"
    persistent_slots = True  # made once, as the copy engines' workspace

    def __init__(self, group, plan, *, prefill=None, leads: dict | None = None):
        self.group = group if group is not None else "emulated"
        self.plan, self.prefill, self.leads = plan, prefill, leads
        self.keep = False  # (no leads) keep the trails as the check does: hop_library
        self.trails: dict[int, torch.Tensor] = {}
        self._slots: tuple[torch.Tensor, torch.Tensor] | None = None

    def watch_view(self) -> dict:
        if isinstance(self.group, str):  # no process group: PeerWatch without one (the call's
            # timeout is set then: Ring)
            return {"rank": 0, "ranks": tuple(range(self.plan.world_size))}
        return {}

    def slots(self, capacity, device):
        if self._slots is None or self._slots[0].numel() < capacity:
            self._slots = tuple(
                torch.zeros(capacity, dtype=torch.uint8, device=device) for _ in range(2)
            )
            if self.prefill is not None:
                self.prefill(self._slots[1])
        return self._slots

    def issue(self, xfer, sends, recvs):
        if self.leads is None and not self.keep:
            return []
        h, plan, R = xfer.hop, self.plan, self.plan.world_size
        lay = plan.slot_layout(h)
        if lay.trail_partition is not None and lay.trail_bytes:
            t0, t1 = lay.trail_offset, lay.trail_offset + lay.trail_bytes
            for leg, buf in zip(xfer.sends, sends, strict=True):
                a, b = leg.range.start, leg.range.stop
                if a <= t0 and t1 <= b:
                    self.trails[lay.trail_partition] = buf[t0 - a : t1 - a].clone()
        nxt = plan.slot_layout(h + 1) if h < R else None  # where the arriving trail lands
        for leg, buf in zip(xfer.recvs, recvs, strict=True):
            if h == R:  # the trail's return home
                buf.zero_()
                buf.copy_(self.trails[plan.rank][: buf.numel()])
            elif self.leads is None:  # keep: the arriving trail is zeros, the prefilled lead stays
                a, b = leg.range.start, leg.range.stop
                if nxt.trail_partition is not None:
                    lo = max(a, nxt.trail_offset)
                    hi = min(b, nxt.trail_offset + nxt.trail_bytes)
                    if lo < hi:
                        buf[lo - a : hi - a].zero_()
            else:
                buf.zero_()
                if h <= R - 2 and leg.range.start == 0:  # the next lead
                    lead = self.leads[plan.partition(h + 1)]
                    buf[: lead.numel()].copy_(lead)
        return []


def packed(layout, tensors: dict, device) -> torch.Tensor:
    """``tensors`` packed into a fresh byte buffer in ``layout``."""
    buf = torch.zeros(max(layout.nbytes, 1), dtype=torch.uint8, device=device)
    for name, view in layout.views(buf).items():
        view.copy_(tensors[name])
    return buf


def lead_of(case: Case, problem: RingProblem, data: dict, direction: str, p: int):
    """``(layout, tensors)`` of partition ``p``'s lead in ``direction``'s pass."""
    if case.mode == "expert":
        return weights_layout(problem), expert_slice(data, case, p)
    part = part_of(data, p)
    lay = token_lead(problem, case.tokens, direction == "bwd")
    return lay, {n: part[n] for n in lay.names}


class HopTimer:
    """Stands in for ``executor._hop_range``: the host time of each hop of the pass's loop, on
    the wall clock (``spans``) and as the thread's CPU time (``cpu``: without the time the
    thread was off its core)."""

    def __init__(self):
        self.spans: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, name):
        return _Span(self)


class _Span:
    __slots__ = ("c0", "t0", "timer")

    def __init__(self, timer):
        self.timer = timer

    def __enter__(self):
        self.c0, self.t0 = time.thread_time(), time.perf_counter()

    def __exit__(self, *exc):
        t1, c1 = time.perf_counter(), time.thread_time()
        self.timer.spans.append(t1 - self.t0)
        self.timer.cpu.append(c1 - self.c0)
        return False


# ---------------------------------------------------------------------------------------------
# the passes
# ---------------------------------------------------------------------------------------------
class Ring:
    """Rank 0's forward and backward pass of one case, through the library's pass functions;
    ``check=True``: distinct token partitions and the loopback transport (the CPU check).

    ``config``: the case's options (default the environment's, ``benchmarks.ENV_CONFIG``);
    ``runtime``: the case's ``RingRuntime`` (its recorded hops, streams, lag watch: a fresh one
    per ring, so no case's recorded hops or static buffers count in another's); ``call``: the
    ``RingCall`` its passes get, rebuilt when its ``kernel_choice`` is set."""

    def __init__(self, case: Case, *, group=None, check: bool = False, seed: int = 0,
                 config: RingConfig = ENV_CONFIG):  # fmt: skip
        self.case, self.check = case, check
        self.dev = torch.device(case.device)
        if group is None and config.timeout_s is None:  # no group to take a timeout from
            config = config.replace(timeout_s=60.0)
        self.group, self.config = group, config
        self.runtime = RingRuntime(group)
        self.data = make_data(case, distinct=check, seed=seed)
        self.problem = problem = agreed_problem(case, self.data, config)
        self.kernel_choice = KernelChoice(case.backend, config.kernels)
        own = expert_slice(self.data, case, 0)
        self.experts = LocalExperts(own["w13"], own["w2"])
        self.mine = part_of(self.data, 0)
        fwd, bwd = expert_plans(problem) if case.mode == "expert" else token_plans(problem)
        self.transports = {}
        for direction, plan in (("fwd", fwd), ("bwd", bwd)):
            if check:
                leads = {p: packed(*lead_of(case, problem, self.data, direction, p), self.dev)
                         for p in range(case.ep)}  # fmt: skip
                tr = Emulated(group, plan, leads=leads)
            else:
                lay, tensors = lead_of(case, problem, self.data, direction, plan.partition(1))
                tr = Emulated(group, plan, prefill=lambda s, lay=lay, t=tensors: _fill(lay, s, t))
            self.transports[direction] = tr
        self.index = None
        if case.mode == "expert":  # one routing index over every expert, built once a call
            self.index = build_routing_index(self.mine["idx"], case.E, validate=False)
        self.indices = None  # token mode: each visiting partition's, from a forward

    @property
    def kernel_choice(self) -> KernelChoice:
        """How the passes' hops compute (``hop_library.capturing`` sets ``capture``)."""
        return self.call.kernel_choice

    @kernel_choice.setter
    def kernel_choice(self, choice: KernelChoice) -> None:
        self.call = RingCall.of(self.group, self.runtime, choice, self.config)

    @contextlib.contextmanager
    def _transport(self, direction: str):
        tr = self.transports[direction]
        with mock.patch.object(executor, "transport_of", lambda problem, call: tr):
            yield tr

    def forward(self):
        m, problem, call = self.mine, self.problem, self.call
        with self._transport("fwd"):
            if self.case.mode == "expert":
                return expert_forward(problem, call, m["x"], self.experts, m["probs"], self.index,
                                      FORWARD)  # fmt: skip
            out, self.indices = token_forward(problem, call, m["x"], self.experts, m["probs"],
                                              m["idx"], FORWARD)  # fmt: skip
            return out

    def backward(self):
        m, problem, call = self.mine, self.problem, self.call
        if self.case.mode == "token" and self.indices is None:
            self.forward()
        index = self.index if self.case.mode == "expert" else self.indices
        fn = expert_backward if self.case.mode == "expert" else token_backward
        with self._transport("bwd"):
            return fn(problem, call, m["dy"], m["x"], self.experts, m["probs"], index, FORWARD)

    def run(self, direction: str):
        return self.forward() if direction == "fwd" else self.backward()


def _fill(layout, slot: torch.Tensor, tensors: dict) -> None:
    for name, view in layout.views(slot).items():
        view.copy_(tensors[name])


def hop_outputs(case: Case, seed: int = 0) -> dict:
    """What each hop of rank 0 computed (the loopback transport, distinct token partitions), for
    the tests' oracle: the data, the passes' results and the trails each hop sent
    (``fwd_trails[p]``/``bwd_trails[p]``: byte buffers; ``trail_views`` types them)."""
    ring = Ring(case, check=True, seed=seed)
    out = ring.forward()
    fwd_trails = dict(ring.transports["fwd"].trails)
    dx, dprobs, grads = ring.backward()
    return {"ring": ring, "data": ring.data, "problem": ring.problem, "out": out, "dx": dx,
            "dprobs": dprobs, "grads": grads, "fwd_trails": fwd_trails,
            "bwd_trails": dict(ring.transports["bwd"].trails)}  # fmt: skip


def trail_views(case: Case, problem: RingProblem, direction: str, buf: torch.Tensor) -> dict:
    """A captured trail's typed views: ``dw13``/``dw2`` (expert backward), ``out`` (token
    forward), ``dx``/``dprobs`` (token backward)."""
    if case.mode == "expert":
        return weights_layout(problem, "d").views(buf)
    return token_trail(problem, case.tokens, direction == "bwd").views(buf)


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------
def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def time_host(run, R: int, cuda: bool, n: int) -> dict:
    """``n`` passes, each after a sync: host time per hop (the loop's ranges) and per pass, and
    the pass's span on the GPU (CUDA events around its issue); then ``n`` passes issued back to
    back, as the layers of a step issue theirs (no sync between them), :data:`CHAINS` times:
    the median chain's span per pass on the GPU and the host's time per pass
    (``span_us_per_pass_chained``, ``host_us_per_pass_chained``, and the hops' own
    ``host_us_per_hop_chained``; every chain's span in ``span_us_per_pass_chains``)."""
    timer = HopTimer()
    per_pass, per_hop, per_hop_cpu, spans = [], [], [], []
    chain = {}
    with mock.patch.object(executor, "_hop_range", timer):
        for _ in range(n):
            _sync(cuda)
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            k = len(timer.spans)
            t0 = time.perf_counter()
            run()
            t1 = time.perf_counter()
            if cuda:
                e1.record()
                e1.synchronize()
                spans.append(e0.elapsed_time(e1) * 1e3)
            per_pass.append((t1 - t0) * 1e6)
            hops = timer.spans[k:]
            per_hop.append(sum(hops) / max(len(hops), 1) * 1e6)
            per_hop_cpu.append(sum(timer.cpu[k:]) / max(len(hops), 1) * 1e6)
        chains = []  # CHAINS chains, their median: one host pause (a GC) skews one chain
        for _ in range(CHAINS if cuda else 0):
            _sync(cuda)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            k = len(timer.spans)
            t0 = time.perf_counter()
            for _ in range(n):
                run()
            t1 = time.perf_counter()
            e1.record()
            e1.synchronize()
            hops = timer.spans[k:]
            chains.append((e0.elapsed_time(e1) * 1e3 / n, (t1 - t0) * 1e6 / n,
                           sum(hops) / max(len(hops), 1) * 1e6))  # fmt: skip
        if chains:
            chain = {"span_us_per_pass_chained": round(statistics.median(c[0] for c in chains), 1),
                     "host_us_per_pass_chained": round(statistics.median(c[1] for c in chains), 1),
                     "host_us_per_hop_chained": round(statistics.median(c[2] for c in chains), 1),
                     "span_us_per_pass_chains": [round(c[0], 1) for c in chains]}  # fmt: skip
    return {
        "host_us_per_hop": round(statistics.median(per_hop), 1),
        "host_cpu_us_per_hop": round(statistics.median(per_hop_cpu), 1),
        "host_us_per_pass": round(statistics.median(per_pass), 1),
        "span_us_per_pass": round(statistics.median(spans), 1) if spans else None,
        **chain,
    }


class Ranges:
    """Disjoint host intervals (a pass's hop ranges), for ``t in ranges``."""

    def __init__(self, spans):
        spans = sorted(spans)
        self.starts, self.ends = [a for a, _ in spans], [b for _, b in spans]

    def __len__(self) -> int:
        return len(self.starts)

    def __contains__(self, t: float) -> bool:
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and t <= self.ends[i]


def profile_passes(run, n: int, hop_name: str, hops: int) -> dict:
    """torch.profiler over ``n`` passes (a sync after each): :func:`pass_fields` of them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            run()
            torch.cuda.synchronize()
    return pass_fields(list(prof.events()), n, hop_name, hops)


def pass_fields(events, n: int, hop_name: str, hops: int) -> dict:
    """The pass row's profiler fields of ``n`` passes of ``hops`` hops from the profiler's
    ``events`` (``device_type``, ``name``, ``time_range``; host ops' ``kernels``, the device work
    the profiler links to them; ``id``, the runtime call's and its device work's correlation):
    the pass's device and busy time, and per hop (inside ``hop_name``'s ranges) the device time,
    device ops, launches (kernel and graph launches), graph launches, memcpy and memset calls.

    Device work is given to the hop whose range holds its launch (``gpu_attrib``): ``"hop"``,
    through the host op the profiler links it to, when that link covers 95% of the device time;
    else ``"launch"``, through the launching runtime call of the same correlation id (a graph's
    kernels carry their ``cudaGraphLaunch``'s), when that covers 95%; else ``"hop+graphs"``
    where every graph launch is inside a hop: the linked work by its op's hop and the unlinked
    rest (then the graphs' kernels) to the hops; else ``"hop"`` by the link when it covers half
    (an eager pass: nothing is replayed); else ``"pass"``: the passes' device time over their
    hops. ``gpu_linked_frac``: the share of the device time the chosen link covers."""
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    dev = [e for e in events if e.device_type == DeviceType.CUDA]
    hop_ranges = Ranges((e.time_range.start, e.time_range.end) for e in cpu if e.name == hop_name)

    def dur(e) -> float:
        return e.time_range.end - e.time_range.start

    dev_us = sum(dur(e) for e in dev)
    busy = busy_us([("", e.time_range.start, e.time_range.end) for e in dev])

    def calls(names) -> tuple[int, int]:
        got = [e for e in cpu if e.name.startswith(names)]
        return sum(e.time_range.start in hop_ranges for e in got), len(got)

    graphs = calls(GRAPH_LAUNCHES)

    def share(got) -> float:
        return sum(d for d, _ in got) / dev_us if dev_us else 0.0

    # (duration, launched inside a hop) of the device work linked to the host op that launched
    # it (the profiler's correlation); rest: device time and ops given to the hops unlinked
    linked = [(k.duration, e.time_range.start in hop_ranges) for e in cpu
              for k in getattr(e, "kernels", ())]  # fmt: skip
    attrib, rest = "pass", (0.0, 0)
    if share(linked) >= 0.95:
        attrib = "hop"
    else:
        at = {e.id: e.time_range.start for e in cpu if e.name.startswith(RUNTIME_CALLS)}
        by_call = [(dur(d), at[d.id] in hop_ranges) for d in dev if getattr(d, "id", None) in at]
        if share(by_call) >= 0.95:
            attrib, linked = "launch", by_call
        elif graphs[1] and graphs[0] == graphs[1]:  # every graph launched inside a hop
            attrib = "hop+graphs"
            rest = (max(dev_us * (1 - share(linked)), 0.0), max(len(dev) - len(linked), 0))
        elif share(linked) >= 0.5:
            attrib = "hop"
    by_hop = attrib != "pass"
    hop_dev = sum(d for d, inside in linked if inside) + rest[0]
    hop_ops = sum(inside for _, inside in linked) + rest[1]
    kernels = calls(LAUNCHES)
    memcpy, memset = calls(("cudaMemcpy",)), calls(("cudaMemset",))
    nh = max(len(hop_ranges), 1)
    return {
        "gpu_us_per_hop": round(hop_dev / nh if by_hop else dev_us / (n * hops), 1),
        "gpu_attrib": attrib,
        "gpu_linked_frac": round(share(linked), 3) if dev_us else None,
        "gpu_us_per_pass": round(dev_us / n, 1),
        "busy_us_per_pass": round(busy / n, 1),
        "kernels_per_hop": round(hop_ops / nh if by_hop else len(dev) / (n * hops), 1),
        "launches_per_hop": round((kernels[0] + graphs[0]) / nh, 1),
        "launches_per_pass": round((kernels[1] + graphs[1]) / n, 1),
        "graph_launches_per_hop": round(graphs[0] / nh, 1),
        "memcpy_per_hop": round(memcpy[0] / nh, 1),
        "memset_per_hop": round(memset[0] / nh, 1),
        "hops_profiled": len(hop_ranges),
        "gpu_us_per_pass_by_kernel": kernel_times(dev, n),
    }


def kernel_times(dev_events, n: int, top: int = 12) -> dict[str, float]:
    """Device time a pass of each kernel name (memcpy and memset included), the ``top`` largest,
    from the profiler's device events of ``n`` passes: what tells two trees' hops apart when
    their totals differ (names cut to 80 characters)."""
    total: dict[str, float] = {}
    for e in dev_events:
        name = e.name[:80]
        total[name] = total.get(name, 0.0) + (e.time_range.end - e.time_range.start)
    biggest = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    return {name: round(us / max(n, 1), 1) for name, us in biggest}


def measure_pass(ring: Ring, direction: str, a, *, timed: bool = True,
                 profiled: bool = True) -> dict:  # fmt: skip
    """The eager row's measures of one pass direction: ``timed`` the host times and GPU spans
    (:func:`time_host`, no profiler), ``profiled`` the profiler's fields (:func:`pass_fields`);
    with both, the idle shares (:func:`idle_fields`). ``main`` times every case before it
    profiles any: a finished torch.profiler session leaves the process's host 1.3-1.8x slower
    per hop, so host times taken after one would carry that."""
    case = ring.case
    cuda = case.device == "cuda"

    def run():
        ring.run(direction)

    for _ in range(a.warmup):
        run()
    _sync(cuda)
    row = time_host(run, case.ep, cuda, a.passes) if timed else {}
    if cuda and profiled:
        row.update(profile_passes(run, a.profile_passes,
                                  f"relaymoe.{case.mode}.{direction}.hop", case.ep))  # fmt: skip
    if not cuda:
        row.update(gpu_us_per_hop=None, launches_per_hop=None, idle_frac=None)
    return idle_fields(row)


def idle_fields(row: dict) -> dict:
    """``row`` with its GPU idle shares where it has both the spans and the profiler's busy
    time: ``idle_frac`` of a pass issued after a sync (its set-up before the first kernel
    counts as idle), ``idle_frac_chained`` of passes issued back to back (what a step of many
    layers sees: a pass's set-up overlaps the GPU work queued before it, and only a host slower
    than the GPU leaves it idle)."""
    busy = row.get("busy_us_per_pass")
    for key, span in (("idle_frac", "span_us_per_pass"),
                      ("idle_frac_chained", "span_us_per_pass_chained")):  # fmt: skip
        if busy is not None and row.get(span):
            row[key] = round(max(0.0, 1.0 - busy / row[span]), 3)
    return row


# ---------------------------------------------------------------------------------------------
# one hop's compute in a CUDA graph
# ---------------------------------------------------------------------------------------------
def hop_body(ring: Ring, direction: str):
    """``(body, outputs)``: hop 1's compute of the pass, as the pass's compute calls the hop
    primitives, on static buffers (pair buffers from the bound: ``pairs=None``), and the
    buffers it adds into."""
    case, choice = ring.case, ring.kernel_choice
    problem = replace(ring.problem, pairs=None)
    p = problem.world_size - 1  # hop 1's partition of rank 0 (flat ring)
    if case.mode == "expert":
        m, w = ring.mine, expert_slice(ring.data, case, p)
        rng = (p * case.El, (p + 1) * case.El)
        kw = dict(expert_range=rng, **biases(w),
                  options=hop_options(problem, choice, pair_rows(problem, 0, p)))  # fmt: skip
        if direction == "fwd":
            out = torch.zeros_like(m["x"])

            def body():
                expert_hop_forward(m["x"], w["w13"], w["w2"], m["probs"], ring.index,
                                   out_TH=out, save="none", **kw)  # fmt: skip

            return body, {"out": out}
        dw = weights_layout(problem, "d").views(
            torch.zeros(weights_layout(problem, "d").nbytes, dtype=torch.uint8, device=ring.dev)
        )
        o = {"dx": torch.zeros_like(m["x"]), "dprobs": torch.zeros_like(m["probs"]), **dw}

        def body():  # the trail's weight gradients written over, as the pass's hops do
            expert_hop_backward(m["dy"], m["x"], w["w13"], w["w2"], m["probs"], ring.index,
                                grads=hop_grads(o, dw_accumulate=False), **kw)  # fmt: skip

        return body, o
    s, local = p, expert_slice(ring.data, case, 0)
    part = part_of(ring.data, s)
    kw = dict(expert_range=problem.expert_range, **biases(local),
              options=hop_options(problem, choice, pair_rows(problem, s, 0)))  # fmt: skip
    if direction == "fwd":
        out = torch.zeros_like(part["x"])

        def body():
            index = build_routing_index(part["idx"], case.E, validate=False)
            expert_hop_forward(part["x"], local["w13"], local["w2"], part["probs"], index,
                               out_TH=out, save="none", **kw)  # fmt: skip

        return body, {"out": out}
    index = build_routing_index(part["idx"], case.E, validate=False)
    acc = problem.accum_dtype
    o = {"dx": torch.zeros_like(part["x"]), "dprobs": torch.zeros_like(part["probs"]),
         "dw13": torch.zeros_like(local["w13"], dtype=acc),
         "dw2": torch.zeros_like(local["w2"], dtype=acc)}  # fmt: skip

    def body():  # a hop after the first: the local weight gradients are added into
        expert_hop_backward(part["dy"], part["x"], local["w13"], local["w2"], part["probs"],
                            index, grads=hop_grads(o), **kw)  # fmt: skip

    return body, o


def capture_failure(exc: BaseException) -> dict:
    """``capture_error``: the first error of the chain (a failed capture's own end raises
    another, with the first as its context), then the last one's if it differs;
    ``capture_error_at``: where the first was raised (:func:`_where`)."""
    chain = [exc]
    while chain[-1].__context__ is not None and len(chain) < 8:
        chain.append(chain[-1].__context__)
    first = chain[-1]

    def text(e):
        return f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"

    msg = text(first) if first is exc else f"{text(first)} (then {text(exc)})"
    return {"capture_error": msg, "capture_error_at": _where(first) or _where(exc)}


def _where(exc: BaseException) -> str | None:
    """The innermost relaymoe (else benchmark) frame of ``exc``'s traceback, ``path:line``."""
    frames = traceback.extract_tb(exc.__traceback__)
    root = str(Path(__file__).resolve().parents[2]) + "/"
    for pick in ("relaymoe/", "benchmarks/"):
        ours = [f for f in frames if f.filename.startswith(root + pick)]
        if ours:
            f = ours[-1]
            return f"{f.filename[len(root) :]}:{f.lineno} ({(f.line or '').strip()[:80]})"
    return None


def measure_captured(ring: Ring, direction: str, a) -> dict:
    """Capture hop 1's compute in a CUDA graph and replay it; ``capture_error`` if it cannot."""
    from torch.profiler import ProfilerActivity, profile

    if ring.case.device != "cuda":
        return {"capture_error": "CUDA graphs need a CUDA device"}
    body, outs = hop_body(ring, direction)

    def zero():
        for t in outs.values():
            t.zero_()

    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm: compiled, tuned, allocator primed
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(side)
        zero()
        body()
        want = {k: t.clone() for k, t in outs.items()}
        zero()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            body()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # what blocks capture, named in the row
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return capture_failure(exc)
    diff = max((outs[k].double() - want[k].double()).abs().max().item() for k in outs)
    n = a.replays
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spans = []
    for _ in range(3):  # one replay on an idle GPU: its span
        torch.cuda.synchronize()
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        spans.append(e0.elapsed_time(e1) * 1e3)
    span = statistics.median(spans)
    k = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(k):
            graph.replay()
            torch.cuda.synchronize()
    del graph
    return {
        "host_us_per_hop": round(host, 1),
        **replay_fields(list(prof.events()), k, span),
        "capture_error": None,
        "capture_max_abs_diff": diff,
    }


def replay_fields(events, k: int, span: float) -> dict:
    """The row fields of ``k`` profiled graph replays from the profiler's ``events`` (each with
    ``device_type``, ``name`` and ``time_range.start/end`` in us) and one replay's ``span`` (us,
    CUDA events): device time (the kernels' sum), launches, kernels and the idle share of the
    span (the kernels' union against it). No device event: the span stands for the GPU time."""
    from torch.autograd import DeviceType

    dev = [("", e.time_range.start, e.time_range.end) for e in events
           if e.device_type == DeviceType.CUDA]  # fmt: skip
    gl = sum(1 for e in events if e.device_type == DeviceType.CPU and "GraphLaunch" in e.name)
    gpu = sum(b - a_ for _, a_, b in dev) / k if dev else span
    busy = busy_us(dev) / k if dev else span
    return {
        "gpu_us_per_hop": round(gpu, 1),
        "gpu_attrib": "graph" if dev else "events",
        "span_us_per_pass": None,
        "replay_span_us": round(span, 1),
        "launches_per_hop": round(gl / k, 1),
        "kernels_per_hop": round(len(dev) / k, 1),
        "idle_frac": round(max(0.0, 1.0 - busy / span), 3) if span else None,
    }


# ---------------------------------------------------------------------------------------------
# the plan and main
# ---------------------------------------------------------------------------------------------
def cases(a) -> list[Case]:
    dims = TINY if a.tiny else QWEN3
    grid = TINY_GRID if a.tiny else (QUICK if a.quick else FULL)
    eps, toks = a.ep or grid["ep"], a.tokens or grid["tokens"]
    dev = "cpu" if a.tiny else "cuda"
    dtype = torch.float32 if a.tiny else torch.bfloat16
    backend = a.backend if a.backend != "auto" else ("triton" if dev == "cuda" else "torch")
    out = []
    for ep in eps:
        if dims["E"] % ep:
            raise SystemExit(f"EP {ep} does not divide E={dims['E']}")
        for T in toks:
            for mode in a.modes:
                out.append(Case(mode, ep, T, dims["H"], dims["I"], dims["E"], dims["K"], dtype,
                                dev, backend))  # fmt: skip
    return out


def passes_of(a, cuda: bool) -> tuple[int, int]:
    """Passes of one (case, direction): the eager row's (warm-up, timed, profiled on CUDA) and
    at most the library row's (the eager compare pass, the recording pass, the replayed compare
    pass, up to ``hop_library.STEADY_PASSES`` settling ones, then the eager row's again; 0
    without ``--library``)."""
    eager = a.warmup + a.passes + (a.profile_passes if cuda else 0)
    return eager, (3 + hop_library.STEADY_PASSES + eager if a.library else 0)


def print_plan(plan: list[Case], a) -> None:
    extra = [w for w, on in (("hop_graph", a.captured), ("library", a.library)) if on]
    print(f"[hop_cost] {len(plan)} cases x {len(DIRECTIONS)} directions"
          f"{' (+ ' + ', '.join(extra) + ')' if extra else ''}; {a.warmup} warm-up, "
          f"{a.passes} timed, {a.profile_passes} profiled passes each")  # fmt: skip
    mib = ENV_CONFIG.kernels.pair_buffer_mib
    bounded = {c: _bounded(agreed_problem(c, None)) for c in plan}  # the library's own test
    refused = {c: hop_library.plan_note(c, bounded[c]) for c in plan}
    for c in plan:
        print(f"  {c.mode:6s} EP {c.ep:3d} T {c.tokens:6d}: {c.ep} hops of {c.El} experts, "
              f"~{c.tokens * c.K // c.ep} pairs a hop, pair buffers "
              f"{'bound ' + str(c.pair_bound) if bounded[c] else 'exact (bound over budget)'}, "
              f"{c.device}/{c.backend}"
              f"{'; library: ' + (refused[c] or 'captured') if a.library else ''}")  # fmt: skip
    eager, lib = passes_of(a, bool(plan) and plan[0].device == "cuda")
    runs = [(c, eager + (0 if refused[c] else lib)) for c in plan]
    print(f"  pair_buffer_mib {mib}; {len(DIRECTIONS) * sum(k for _, k in runs)} passes "
          f"({len(DIRECTIONS) * sum(c.ep * k for c, k in runs)} hops) in all: {eager} eager a "
          f"case and direction{f', {lib} library where captured' if lib else ''}")  # fmt: skip
    need = max((hop_library.needed_mib(c) for c in plan if not bounded[c]), default=0)
    if a.library and need:
        print(
            f"  exact pair counts above the budget refuse capture: RELAYMOE_PAIR_BUFFER_MIB="
            f"{need} sizes every case's pair buffers from the bound (the eager rows' too)"
        )


def init_group():
    """A gloo group of one: the executor's bounded-wait bookkeeping (PeerWatch) reads it."""
    import torch.distributed as dist

    from benchmarks.numerics import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)  # fmt: skip
    return dist.group.WORLD


def _library(ring: Ring, direction: str, a, *, timed: bool) -> dict:
    """The library row's fields (``hop_library.library_row``): ``timed`` its outputs against
    eager's and the timed passes, else the profiled ones; what blocks the library's capture is
    named in the row."""
    measure = partial(measure_pass, timed=timed, profiled=not timed)
    try:
        return hop_library.library_row(ring, direction, a, measure, trail_views, compare=timed)
    except Exception as exc:
        with contextlib.suppress(Exception):
            _sync(ring.case.device == "cuda")
        return capture_failure(exc)


def merged(timed_row: dict, profiled_row: dict) -> dict:
    """One row of a (case, direction, path) from its timed and its profiled measures: the timed
    one's fields where both have one, the idle shares from the two; a profiled run that failed
    where the timed one did not is named in ``profile_error``."""
    row = {**profiled_row, **timed_row}
    if profiled_row.get("capture_error") and not timed_row.get("capture_error"):
        row["profile_error"] = profiled_row["capture_error"]
    return idle_fields(row)


def _release() -> None:
    """After a case's ``Ring`` (and its runtime: recorded hops, static buffers) is dropped."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="EP {2, 64} x T {4096}")
    ap.add_argument("--captured", action="store_true", help="also one hop in a CUDA graph")
    ap.add_argument(
        "--library",
        action="store_true",
        help="also the pass with the library's capture (RingConfig.capture_hops)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan; no GPU")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny widths (the tests)")
    ap.add_argument("--ep", type=int, nargs="+")
    ap.add_argument("--tokens", type=int, nargs="+")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--passes", type=int, default=5, help="timed passes (host, span)")
    ap.add_argument("--profile-passes", type=int, default=2)
    ap.add_argument("--replays", type=int, default=20, help="graph replays timed (--captured)")
    ap.add_argument("--out", default=None, help="JSONL (default benchmarks/results/...)")
    a = ap.parse_args(argv)
    if a.tiny:
        a.warmup, a.passes = min(a.warmup, 1), min(a.passes, 2)
    plan = cases(a)
    print_plan(plan, a)
    if a.dry_run:
        return 0
    if not a.tiny and not torch.cuda.is_available():
        print("hop_cost needs CUDA (or --tiny on CPU)")
        return 1
    env = environment()
    writer = JsonlWriter(a.out or f"benchmarks/results/hop_cost_{env['date']}.jsonl", env=env)
    group = init_group()
    # Every case's timed passes first, then the profiled ones (measure_pass: a finished
    # profiler session slows the host for the rest of the process)
    timed: dict[tuple, dict] = {}
    for case in plan:  # a Ring's own runtime: no case's recorded hops count in another's
        ring = Ring(case, group=group)
        for direction in DIRECTIONS:
            timed[case, direction, "eager"] = measure_pass(ring, direction, a, profiled=False)
            if a.library:
                timed[case, direction, "library"] = _library(ring, direction, a, timed=True)
        del ring
        _release()
    rows = []
    for case in plan:
        ring = Ring(case, group=group)
        pairs = hop_pairs(case, ring.data)
        tag = {"bench": "hop_cost", "shape": "tiny" if a.tiny else "qwen3_30b_a3b",
               "mode": case.mode, "ep": case.ep, "tokens": case.tokens,
               "experts_per_hop": case.El, "pairs_per_hop": round(pairs, 1),
               "pair_bound": case.pair_bound,
               "pair_buffers": "bound" if ring.problem.pairs is None else "exact",
               "hops": case.ep, "H": case.H, "I": case.I, "E": case.E, "K": case.K,
               "dtype": str(case.dtype).removeprefix("torch."), "backend": case.backend,
               "grad_dtype": str(ring.problem.accum_dtype).removeprefix("torch."),
               "pair_buffer_mib": ring.problem.pair_buffer_mib}  # fmt: skip
        for direction in DIRECTIONS:
            head = {**tag, "direction": direction}
            r = merged(timed[case, direction, "eager"],
                       measure_pass(ring, direction, a, timed=False))  # fmt: skip
            rows.append(writer.write({**head, "captured": False, "capture_path": "eager", **r}))
            if a.captured:
                r = measure_captured(ring, direction, a)
                rows.append(writer.write({**head, "captured": True, "capture_path": "hop_graph",
                                          **NOT_MEASURED, **r}))  # fmt: skip
            if a.library:
                r = merged(timed[case, direction, "library"],
                           _library(ring, direction, a, timed=False))  # fmt: skip
                rows.append(writer.write({**head, "captured": True, "capture_path": "library",
                                          **NOT_MEASURED, **r}))  # fmt: skip
        del ring
        _release()
    cols = ["mode", "direction", "ep", "tokens", "capture_path", "host_us_per_hop",
            "host_cpu_us_per_hop", "host_us_per_hop_chained",
            "gpu_us_per_hop", "launches_per_hop", "idle_frac", "idle_frac_chained",
            "capture_error"]  # fmt: skip
    print_table(rows, cols)
    print(f"[hop_cost] {len(rows)} rows -> {writer.path}")
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
