"""The modes where the tokens travel and the experts stay: the token ring's forward and backward
passes, and the all-to-all.

**The token ring** (``mode="token"``): the tokens travel with their routing metadata, hop by hop
around the ring (``engine.py`` describes the passes). The experts' biases stay with them and
their gradients accumulate here, beside the weights' (in ``problem.accum_dtype``). A hop's compute
is a body over named tensors (``run_hop``), called on the live ones or replayed from
``hop_graphs.py``'s cache with ``RingConfig.capture_hops``.

**The all-to-all** (``mode="alltoall"``, :func:`alltoall_forward`, :func:`alltoall_backward`):
the ring's fused kernels behind one all-to-all of index-dispatched tokens, for the small-T
regime where the ring's per-hop host cost dominates. Tokens travel to the ranks that own
their experts and their outputs come back; the experts stay.

Its shape legend: T tokens of this rank, H hidden, K top-k, R ranks, El experts per rank, S rows
this rank sends (one per (token, destination rank) that owns at least one of the token's experts,
so a token goes to a rank once however many of its experts live there: ``S <= T * min(K, R)``),
N rows it receives.

Forward on rank ``r``:

1. ``hit_TR``: token ``t`` has an expert on rank ``q``. Rows go out destination-major, tokens
   ascending within a destination (``tok_S``, ``dest_S``). One all-to-all of the row and pair
   counts, read on the host (the one host sync of the call: it sizes the messages).
2. An all-to-all of the rows of x and one of their metadata (int32 ids, probabilities).
3. One routing index over the N received rows (global ids), one call of the hop primitive for
   this rank's experts; its output rows go back by the reverse all-to-all.
4. ``out[t]`` sums the returned rows of ``t`` through ``pos_TR`` (row of ``t`` from ``q``, or -1):
   a deterministic gather-reduce, no atomics.

The experts' biases stay with their experts (as in the token ring): the hop primitive adds them,
and their gradients are this rank's, like the weight gradients.

Backward: x and dy rows go out again (nothing ``(S, H)`` is kept from the forward), the forward's
routing index and probabilities of the received rows are reused (no ids travel), the hop
primitive gives dx/dprobs rows and this rank's weight gradients, and dx/dprobs rows return and
are summed as in the forward. Kept from forward to backward: ``tok_S``, ``pos_TR``, the counts,
the received rows' index and probabilities (``O(S + N*K)`` integers and floats).

Faults (``faults.py``): every all-to-all is waited for with the group's timeout (on CPU at once;
on CUDA the counts' exchange at once, the row exchanges at the end of the forward/backward), and
the counts carry a validity marker per source rank, so a dead or stalled peer raises
``RingPeerError`` instead of sizing messages from a partial exchange.

Memory (transient, besides inputs and outputs): forward ``S + N`` rows of x and metadata, ``N + S``
rows of output, one hop's intermediates over N rows; backward ``2*(S + N)`` rows of x and dy,
``N + S`` rows of dx, the local weight gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from relaymoe.experts import expert_hop_backward, expert_hop_forward, resolve_backend
from relaymoe.ring.executor import PassWork, ring_pass
from relaymoe.ring.faults import PeerWatch, check_markers
from relaymoe.ring.hop_graphs import (
    INDEX_FIELDS,
    PackedIndex,
    hop_graphs_of,
    hop_head,
    hop_key,
    index_from,
    index_inputs,
    index_layout,
    index_sizes,
    packed_index,
    run_hop,
)
from relaymoe.ring.main_grads import add_home, direct_targets
from relaymoe.ring.plan import RingProblem, capacity, pair_rows, token_layouts, token_plans
from relaymoe.ring.weights import (
    REVERSED,
    LocalExperts,
    biases,
    home_grads,
    hop_grads,
    hop_options,
    local_parts,
    present,
    reverse_local_ids,
)
from relaymoe.routing import RoutingIndex, build_routing_index

__all__ = [
    "BWD_TRAVELLING",
    "FWD_TRAVELLING",
    "Dispatch",
    "alltoall_backward",
    "alltoall_forward",
    "token_backward",
    "token_forward",
    "token_ids",
]

# What a recorded hop binds by address besides the weights (hop_graphs.run_hop): the visiting
# partition and the trail, views of the ring's slots and trail scratch (a world of one: the
# caller's own tensors, copied)
FWD_TRAVELLING = ("x", "idx", "probs", "out")
BWD_TRAVELLING = ("x", "probs", "dy", "dx", "dprobs")


def _arrays(index) -> tuple[Tensor, ...]:
    return tuple(getattr(index, f) for f in INDEX_FIELDS)


def token_ids(ids: Tensor, problem: RingProblem, order: str) -> Tensor:
    """A visiting partition's expert ids in the row order of the local stacked experts."""
    return reverse_local_ids(ids, problem.num_local_experts) if order == REVERSED else ids


def token_forward(problem, call, x, experts, probs, idx32, order):
    """Returns ``(out, indices)``: ``indices[p]`` is the routing index of partition ``p``'s
    tokens (built once, when it visits; the backward reuses it), a ``PackedIndex`` where the
    hops are recorded."""
    kernel_choice = call.kernel_choice
    E, Ts, own = problem.num_experts, problem.tokens, problem.expert_range
    # local experts compute every hop: their (El, ...) form for this pass only (a zero-copy view
    # when the list form is back to back, else a transient stack dropped when the pass ends)
    local = local_parts(experts, order)
    indices: dict[int, object] = {}
    graphs = hop_graphs_of(problem, call, x.device)
    weights = present(local)
    head = graphs and hop_head(problem, call, "fwd")

    def compute(hop, part, lead, trail):
        if Ts[part] == 0:
            return
        xs, ids, ps = (x, idx32, probs) if lead is None else (lead["x"], lead["idx"], lead["probs"])
        rows = pair_rows(problem, part, problem.rank)
        sizes = (Ts[part], problem.topk, E)
        lay = index_layout(sizes)

        def body(t):  # the index is built in the hop: it is among what the body returns
            if graphs is not None:  # the trail share, zeroed in the graph (zero_trail=False)
                t["out"].zero_()
            ids = token_ids(t["idx"], problem, order)
            if graphs is None:
                index = build_routing_index(ids, E, validate=False)
            else:  # recorded: built into one buffer, returned (and cloned) as one tensor
                buf = torch.empty(lay.nbytes, dtype=torch.uint8, device=ids.device)
                index = packed_index(buf, sizes)
                build_routing_index(ids, E, validate=False, out=_arrays(index))
            expert_hop_forward(
                t["x"], t["w13"], t["w2"], t["probs"], index, expert_range=own, **biases(t),
                out_TH=t["out"], save="none", options=hop_options(problem, kernel_choice, rows),
            )  # fmt: skip
            return index_inputs(index)

        key = graphs and hop_key(head, own, rows) + (order,)  # only a cache reads it
        made = run_hop(graphs, key, body, {"x": xs, "idx": ids, "probs": ps, **weights},
                       {"out": trail["out"]}, () if lead is None else FWD_TRAVELLING)  # fmt: skip
        packed = made.get("index.packed")  # recorded: the arrays' views only where read
        indices[part] = index_from(made, sizes) if packed is None else PackedIndex(packed, sizes)

    fwd, bwd = token_plans(problem)
    work = PassWork(
        **token_layouts(problem, False), own_lead={"x": x, "idx": idx32, "probs": probs},
        compute=compute, capacity=capacity(fwd, bwd, problem), zero_trail=graphs is None,
    )  # fmt: skip
    result = ring_pass(problem, call, x.device, "fwd", fwd, work)
    return result["out"], indices


def _weight_accumulators(problem, local, graphs, into, order) -> tuple[dict, list, bool | None]:
    """Token backward's accumulators of this rank's experts: ``(dw, written, into_rows)``.

    Eager, the first hop with pairs writes the local weight gradients and later hops add (no
    zero fill): ``dw13``/``dw2`` None until then. Accumulators wider than the weights start as
    zeros that every hop adds to. Recorded hops get their accumulators bound (added into at
    their address: nothing of their size is returned from the graphs' pool and cloned), and the
    first hop with pairs writes over them (dw_accumulate=False) as the eager one writes fresh
    ones: no zero fill, and the same sums bitwise. A caller's accumulators (``into``, where they
    allow: ``main_grads.direct_targets``) are what every hop adds into: they hold the sum so
    far (``into_rows``: whether their rows run opposite to ``order``; None when the accumulators
    are not the caller's). The bias gradients are added into (the hop primitives' contract):
    zeros from the start. ``written[0]``: whether ``dw`` holds a sum yet (zeros, or a caller's,
    count as one)."""
    w13, w2 = local["w13"], local["w2"]
    wide = problem.accum_dtype != problem.dtype
    direct = direct_targets(into, order, problem.accum_dtype) if into is not None else None
    dw: dict[str, Tensor | None] = {"dw13": None, "dw2": None}
    if direct is not None:
        dw = dict(direct[0])
    elif wide or graphs is not None:
        new = torch.zeros_like if wide else torch.empty_like
        dw = {
            "dw13": new(w13, dtype=problem.accum_dtype),
            "dw2": new(w2, dtype=problem.accum_dtype),
        }
    for name in ("b13", "b2"):
        if local[name] is not None:
            dw["d" + name] = torch.zeros_like(local[name], dtype=problem.accum_dtype)
    return dw, [wide or direct is not None], None if direct is None else direct[1]


def token_backward(problem, call, dy, x, experts, probs, indices, order, into=None):
    """Returns ``(dx, dprobs, grads)``, ``grads`` this rank's experts' gradients by part name
    (rows in ``order``). ``indices``: the forward's routing index of every visiting partition.
    ``into``: the call's ``MainGrads`` (None: none): the weight gradients are added there (by
    every hop in place where the accumulators allow, ``main_grads.py``) and left out of
    ``grads``."""
    kernel_choice = call.kernel_choice
    Ts, own = problem.tokens, problem.expert_range
    local = local_parts(experts, order)  # again for this pass only
    w13, w2 = local["w13"], local["w2"]
    graphs = hop_graphs_of(problem, call, x.device)
    dw, written, into_rows = _weight_accumulators(problem, local, graphs, into, order)
    direct, reverse = into_rows is not None, bool(into_rows)
    weights = present(local)
    head = graphs and hop_head(problem, call, "bwd")

    def compute(hop, part, lead, trail):
        if Ts[part] == 0:
            return
        if lead is None:
            xs, ps, dys = x, probs, dy
        else:
            xs, ps, dys = lead["x"], lead["probs"], lead["dy"]
        rows, first = pair_rows(problem, part, problem.rank), dw["dw13"] is None
        over = not written[0]  # this hop's weight gradients write over the accumulators
        written[0] = True
        sizes = index_sizes(indices[part])

        def body(t):  # eager, the first hop's weight gradients are written, not added: returned
            if graphs is not None:  # the trail share, zeroed in the graph (zero_trail=False)
                t["dx"].zero_()
                t["dprobs"].zero_()
            _, _, dw13, dw2 = expert_hop_backward(
                t["dy"], t["x"], t["w13"], t["w2"], t["probs"], index_from(t, sizes),
                expert_range=own, **biases(t),
                grads=hop_grads(t, dw_accumulate=not over, dw_reversed=reverse),
                options=hop_options(problem, kernel_choice, rows),
            )  # fmt: skip
            return {"dw13": dw13, "dw2": dw2} if first else None

        key = graphs and hop_key(head, own, rows) + (over, reverse)
        inputs = {"dy": dys, "x": xs, "probs": ps, **index_inputs(indices[part]), **weights}
        made = run_hop(graphs, key, body, inputs, {**trail, **present(dw)},
                       () if lead is None else BWD_TRAVELLING)  # fmt: skip
        dw.update(made)

    _, bwd = token_plans(problem)
    work = PassWork(
        **token_layouts(problem, True), own_lead={"x": x, "probs": probs, "dy": dy},
        compute=compute, zero_trail=graphs is None,
    )  # fmt: skip
    result = ring_pass(problem, call, x.device, "bwd", bwd, work)
    if direct:  # added in place: nothing to return (no pairs: nothing added)
        del dw["dw13"], dw["dw2"]
    elif dw["dw13"] is None:  # no hop had pairs
        dw["dw13"], dw["dw2"] = torch.zeros_like(w13), torch.zeros_like(w2)
    elif not written[0]:  # recorded hops' accumulators, and no hop had pairs to write them
        dw["dw13"].zero_()
        dw["dw2"].zero_()
    add_home(into, dw, order)
    return result["dx"], result["dprobs"], home_grads(problem, dw)


# ---------------------------------------------------------------------------------------------
# the all-to-all: index-dispatched tokens to the experts' ranks and back
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dispatch:
    """What the forward's dispatch decided, handed to the backward."""

    tok_S: Tensor  # (S,) int64 token of every sent row, destination-major
    pos_TR: Tensor  # (T, R) row of token t sent to rank q, -1 if none (int32; int64 if S >= 2^31)
    send_rows: tuple[int, ...]  # rows to each rank
    recv_rows: tuple[int, ...]  # rows from each rank
    n_pairs: int  # pairs of the received rows on this rank's experts
    index: RoutingIndex | None  # routing index of the received rows (None: none received)
    probs_NK: Tensor  # probabilities of the received rows


def _exchange(
    send: Tensor, send_rows, recv_rows, group, world: int, watch: PeerWatch | None,
    now: bool = False,
) -> Tensor:  # fmt: skip
    """Rows of ``send`` (destination-major) to every rank; the received rows, source-major.

    Waited for (bounded by the timeout) before returning on CPU or with ``now`` (the host reads
    the result next); on CUDA otherwise ordered on the stream and waited for in
    ``watch.finish``."""
    if world == 1:
        return send
    shape = (sum(recv_rows), *send.shape[1:])
    recv = send.new_zeros(shape) if now else send.new_empty(shape)  # zeros: a missing row reads 0
    with watch.issuing(op="all_to_all"):
        work = dist.all_to_all_single(
            recv, send.contiguous(), list(recv_rows), list(send_rows), group=group, async_op=True
        )
    if now or not recv.is_cuda:
        watch.wait([work], op="all_to_all")
    else:
        work.wait()  # stream order only
        watch.defer([work], op="all_to_all")
    return recv


def _watch(call, world: int, phase: str) -> PeerWatch | None:
    return call.watch(mode="alltoall", phase=phase) if world > 1 else None


def _gather_sum(rows_SN: Tensor, pos_TR: Tensor, out_TN: Tensor, backend: str) -> Tensor:
    """``out[t] = sum_q rows[pos[t, q]]`` over ``q`` in order (``pos`` -1: nothing)."""
    T, R = pos_TR.shape
    if T == 0:
        return out_TN
    if backend == "triton":
        from relaymoe.kernels.grouped import combine

        # [0, S] made on the device (a Python scalar written into a CUDA tensor is a sync)
        offs = torch.arange(2, dtype=torch.int64, device=rows_SN.device) * rows_SN.shape[0]
        combine(rows_SN, pos_TR.reshape(-1), offs, out_TN, R, accumulate=False)
        return out_TN
    pad = torch.cat([rows_SN, rows_SN.new_zeros(1, rows_SN.shape[1])])
    sel = torch.where(pos_TR < 0, rows_SN.shape[0], pos_TR).to(torch.int64)
    acc = torch.promote_types(rows_SN.dtype, torch.float32)
    out_TN.copy_(pad[sel].to(acc).sum(1))  # a fixed-order reduction over q: deterministic
    return out_TN


def _columns_as(rows_NB: Tensor, lo: int, hi: int, dtype: torch.dtype) -> Tensor:
    """Byte columns ``[lo, hi)`` of a uint8 row buffer as a fresh, aligned ``dtype`` tensor."""
    out = torch.empty((rows_NB.shape[0], hi - lo), dtype=torch.uint8, device=rows_NB.device)
    out.copy_(rows_NB[:, lo:hi])
    return out.view(dtype)


def alltoall_forward(
    problem: RingProblem, call, x: Tensor, experts: LocalExperts, probs: Tensor,
    idx32: Tensor, order: str,
) -> tuple[Tensor, Dispatch]:  # fmt: skip
    """``(out (T, H), dispatch)`` of this rank's tokens; see the module doc. ``call``: the
    ``RingCall`` (group, runtime, ``hop``: backend and kernels, waits)."""
    group, kernel_choice = call.group, call.kernel_choice
    R, El, K = problem.world_size, problem.num_local_experts, problem.topk
    T, dev = x.shape[0], x.device
    local = local_parts(experts, order)
    watch = _watch(call, R, "fwd")
    owner_TK = idx32.to(torch.int64) // El
    hit_TR = torch.zeros(T, R, dtype=torch.bool, device=dev)
    hit_TR.scatter_(1, owner_TK, True)
    # per destination: [rows, pairs, 1]; the 1 is the validity marker of the sending rank
    counts = torch.stack([hit_TR.sum(0), torch.zeros(R, dtype=torch.int64, device=dev),
                          torch.ones(R, dtype=torch.int64, device=dev)], 1)  # fmt: skip
    counts[:, 1].index_add_(0, owner_TK.reshape(-1), torch.ones_like(owner_TK.reshape(-1)))
    recv_counts = _exchange(counts, [1] * R, [1] * R, group, R, watch, now=True)
    both = torch.cat([counts[:, 0], recv_counts.reshape(-1)]).tolist()  # host sync: the sizes
    if watch is not None:
        check_markers(watch, both[R + 2 :: 3], what="the all-to-all of the counts")
    send_rows, recv_rows = tuple(both[:R]), tuple(both[R::3])
    n_pairs = sum(both[R + 1 :: 3])
    S = sum(send_rows)
    nz = torch.nonzero_static(hit_TR.t(), size=S)  # (S, 2): (destination, token), sorted
    dest_S, tok_S = nz[:, 0], nz[:, 1]
    pos_dtype = torch.int32 if S < 2**31 else torch.int64
    pos_TR = torch.full((T, R), -1, dtype=pos_dtype, device=dev)
    pos_TR[tok_S, dest_S] = torch.arange(S, dtype=pos_dtype, device=dev)
    pb = probs.element_size()
    meta_S = torch.cat(
        [idx32.index_select(0, tok_S).view(torch.uint8).view(S, 4 * K),
         probs.index_select(0, tok_S).view(torch.uint8).view(S, pb * K)], 1,
    )  # fmt: skip
    x_N = _exchange(x.index_select(0, tok_S), send_rows, recv_rows, group, R, watch)
    meta_N = _exchange(meta_S, send_rows, recv_rows, group, R, watch)
    N = x_N.shape[0]
    ids_NK = _columns_as(meta_N, 0, 4 * K, torch.int32)
    probs_NK = _columns_as(meta_N, 4 * K, meta_N.shape[1], probs.dtype)
    index = None
    y_N = x_N.new_empty(N, x.shape[1])
    if N > 0:  # every received row has a pair here: the output writes every row
        ids_NK = token_ids(ids_NK, problem, order)
        index = build_routing_index(ids_NK, problem.num_experts, validate=False)
        y_N, _ = expert_hop_forward(
            x_N, local["w13"], local["w2"], probs_NK, index, expert_range=problem.expert_range,
            **biases(local), out_TH=None, save="none",
            options=hop_options(problem, kernel_choice, {"n_pairs": n_pairs}),
        )  # fmt: skip
    del x_N, meta_N
    back_S = _exchange(y_N, recv_rows, send_rows, group, R, watch)
    be = resolve_backend(kernel_choice.backend, dev, x.dtype)
    out = _gather_sum(back_S, pos_TR, torch.empty_like(x), be)
    if watch is not None:
        watch.finish(dev)
    return out, Dispatch(tok_S, pos_TR, send_rows, recv_rows, n_pairs, index, probs_NK)


def alltoall_backward(
    problem: RingProblem, call, dy: Tensor, x: Tensor, experts: LocalExperts,
    probs: Tensor, d: Dispatch, order: str, into=None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dx, dprobs, grads)``, ``grads`` this rank's experts' gradients by part name (rows in
    ``order``; the biases' summed in ``problem.accum_dtype``). ``into``: as
    :func:`token_backward`'s."""
    group, kernel_choice = call.group, call.kernel_choice
    R = problem.world_size
    local = local_parts(experts, order)
    w13, w2 = local["w13"], local["w2"]
    dw = {"d" + n: torch.zeros_like(local[n], dtype=problem.accum_dtype)
          for n in ("b13", "b2") if local[n] is not None}  # fmt: skip
    direct = direct_targets(into, order, problem.accum_dtype) if into is not None else None
    targets, reverse = direct or ({}, False)
    watch = _watch(call, R, "bwd")
    x_N = _exchange(x.index_select(0, d.tok_S), d.send_rows, d.recv_rows, group, R, watch)
    dy_N = _exchange(dy.index_select(0, d.tok_S), d.send_rows, d.recv_rows, group, R, watch)
    N = x_N.shape[0]
    if N > 0:
        dx_N, dp_NK, dw["dw13"], dw["dw2"] = expert_hop_backward(
            dy_N, x_N, w13, w2, d.probs_NK, d.index, expert_range=problem.expert_range,
            **biases(local), grads=hop_grads({**dw, **targets}, dw_reversed=reverse),
            options=hop_options(problem, kernel_choice, {"n_pairs": d.n_pairs}),
        )  # fmt: skip
    else:
        dx_N, dp_NK = x_N.new_empty(0, x.shape[1]), d.probs_NK.new_empty(0, problem.topk)
        dw["dw13"], dw["dw2"] = torch.zeros_like(w13), torch.zeros_like(w2)
    if direct is not None:  # added in place (no rows: nothing to add)
        del dw["dw13"], dw["dw2"]
    add_home(into, dw, order)
    del x_N, dy_N
    be = resolve_backend(kernel_choice.backend, x.device, x.dtype)
    back_dx = _exchange(dx_N, d.recv_rows, d.send_rows, group, R, watch)
    back_dp = _exchange(dp_NK.to(probs.dtype), d.recv_rows, d.send_rows, group, R, watch)
    dx = _gather_sum(back_dx, d.pos_TR, torch.empty_like(x), be)
    dprobs = _gather_sum(back_dp, d.pos_TR, torch.empty_like(probs), be)
    if watch is not None:
        watch.finish(x.device)
    return dx, dprobs, home_grads(problem, dw)
