"""``ring_moe``: MoE experts over an expert-parallel group by circulating experts or tokens.

Shape legend: T tokens of this rank, H hidden, I expert FFN width, J fc1 rows per expert
(``activation.fc1_rows(I)``: 2I gated, I not), El experts per rank, E = El*R all experts, K
top-k, R ranks of the group.

**Expert mode** (tokens stay, expert weights travel). Forward hop ``h``: rank ``r`` adds its
tokens' pairs with the visiting experts of rank ``o = (r-h) mod R`` (the contiguous range
``[o*El, (o+1)*El)`` of a routing index built once per call over all E experts) while the next
partition is in flight. Saved for backward: x, topk_idx, topk_probs, the index (no
activations) and the weights as given (list form: the caller's per-expert tensors, no copy).
Every pass packs the rank's own experts into slot 0 (per expert in list form) and hop 0
computes from that slot. Backward hop ``h`` recomputes that hop's intermediates
(``expert_hop_backward`` with ``saved_h=None``), adds into the local dx/dprobs, and computes
the visiting partition's weight-gradient share; the gradient buffer of a partition travels one
hop behind its weights, merged into the same transfer, and returns to its owner after the last
hop (RelayMoE Fig. 5).

**Token mode** (experts stay, tokens travel). Forward hop ``h``: rank ``r`` receives the tokens
of rank ``s = (r-h) mod R`` with their routing metadata (int32 ids, probabilities), builds their
routing index and adds the pairs of its own experts into the partition's output accumulator,
which travels one hop behind its tokens and returns home after the last hop. Backward
circulates x, dy and the metadata, with dx/dprobs accumulators trailing; weight gradients stay
local. Ranks may hold different T (including 0): every rank knows every T from the agreement
step, so each hop sends and receives exactly the partition's bytes.

**Memory bound** (besides inputs, outputs and gradients; ``W = El*(J*H + H*I)`` elements, plus
``El*J`` with fc1 biases and ``El*H`` with fc2 biases: they travel and accumulate with their
weights; ``b`` bytes per element, ``gb`` bytes of a weight-gradient accumulator element (``b``,
or 4 with fp32 accumulators: ``grad_accum``), ``Tm`` the largest T of the group,
``m = K*(4+pb)`` metadata bytes per token; ``cost.memory_bytes`` is this list):

* expert forward: two weight slots ``2*W*b``, plus one hop's compute intermediates;
* expert backward: two slots of weights + trailing gradient ``2*W*(b + gb)``, one gradient
  scratch ``W*gb``, the returned gradient ``W*gb`` (and its cast ``W*b`` when ``gb != b``),
  plus one hop's intermediates (recomputed per hop, freed before the next);
* token forward: two slots ``2*Tm*(2*H*b + m)``, one output scratch ``Tm*H*b``, plus one hop's
  intermediates and routing index;
* token backward: two slots ``2*Tm*(3*H*b + m + K*pb)``, one dx/dprobs scratch, the local
  weight-gradient accumulator ``W*gb`` (and its cast), plus one hop's intermediates and routing
  index;
* list-form weights (``weights.py``): nothing more in expert mode; in token mode (and in a world
  of one) ``W*b`` more for the duration of each pass when the per-expert tensors are not back
  to back in one storage (in expert order or its reverse), else nothing (a zero-copy view).
* with ``main_grads`` added into in place (``main_grads.py``: token and all-to-all modes, a
  world of one, the accumulators one span each) no weight-gradient accumulator and no cast
  exist (``W*gb`` less, and ``W*b``); expert mode over a ring keeps its bound but the cast (the
  gradient arrives home complete, then is added in its accumulator dtype);
* from forward to backward: expert mode keeps the call's routing index, token mode the routing
  index of every visiting partition (``12*T*K`` bytes each: built once per call, no ids travel
  backward), nothing else.
* "one hop's intermediates" are at most one slice's (``KernelOptions.hop_slice_mib``, 8 GiB by
  default; the Triton hops): a hop over more pairs computes them slice by slice
  (``relaymoe.kernels.experts``), so no term above grows as T*K beyond that budget.

**Node-batched rounds** (``schedule="node_batched"``, expert mode, ``expert_mode.py``): the
expert pass over the column ring of each local rank (``N`` nodes, one hop per node); each hop
all-gathers the node's ``G`` partitions and computes the node's ``G*El`` experts at once, and
the backward reduce-scatters their gradients inside the node before they travel. Memory: the
gathered experts (and their gradients) of one hop, ``G`` times a flat hop's, on top of the
expert bounds above.

**All-to-all mode** (``mode="alltoall"``, ``token_mode.py``): the same hop primitives behind one
all-to-all of index-dispatched tokens, for the small-T regime where the ring's per-hop host cost
dominates. ``mode="auto"`` picks among the three with ``relaymoe.cost.choose_mode`` (a time
model calibrated on measured rows), identically on every rank.

No ``(T*K, H)`` buffer exists at any time (the hop primitives read tokens through the index).
With ``transport="copy_engine"`` the two slots are a persistent symmetric-memory workspace per
(group, device) held by the call's runtime (``runtime.py``: a dispatcher's, shared by the calls
it makes), sized by the largest pass so far.

**Options and state.** A call's options are one ``RingConfig`` (``config=``; default
``RingConfig()``, the documented defaults), read from nothing else; what a call keeps for the next
(agreements, workspace, recorded hops, the lag watch) is its ``RingRuntime`` (``runtime=``;
default: a fresh one for this call and its backward). Nothing is read from process state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from relaymoe.activation import ExpertActivation
from relaymoe.options import NODE_BATCHED, RingConfig
from relaymoe.ring.agreement import agree
from relaymoe.ring.expert_mode import (
    batched_expert_backward,
    batched_expert_forward,
    expert_backward,
    expert_forward,
)
from relaymoe.ring.fp8_experts import fp8_ring_config, fp8_ring_moe
from relaymoe.ring.hop_graphs import capturing
from relaymoe.ring.main_grads import MainGrads, handed_back, main_grads_problem
from relaymoe.ring.plan import IDX, RingProblem, ring_request
from relaymoe.ring.runtime import KernelChoice, RingCall, RingRuntime
from relaymoe.ring.token_mode import (
    alltoall_backward,
    alltoall_forward,
    token_backward,
    token_forward,
)
from relaymoe.ring.weights import FORWARD, REVERSED, LocalExperts, reverse_local_ids
from relaymoe.routing import build_routing_index

__all__ = ["ring_moe", "resolved_problem"]

# The ring modes' passes by (mode, schedule kind): (forward, backward). All-to-all mode is one
# exchange each way (``token_mode.alltoall_forward``/``alltoall_backward``), not a ring pass.
PASSES = {
    ("expert", "ring"): (expert_forward, expert_backward),
    ("expert", NODE_BATCHED): (batched_expert_forward, batched_expert_backward),
    ("token", "ring"): (token_forward, token_backward),
}


def _passes(problem: RingProblem):
    kind = NODE_BATCHED if problem.schedule == NODE_BATCHED else "ring"
    return PASSES[problem.mode, kind]


def _resolve_group(group, runtime: RingRuntime | None = None):
    """``(group, rank, world)``: ``group``, else the runtime's, else the default group (None
    and a world of one without an initialized process group)."""
    if runtime is not None and runtime.group is not None:
        if group is not None and group is not runtime.group:
            raise ValueError(
                f"ring_moe: group={group!r} is not the group of the runtime passed "
                f"({runtime!r}); pass the runtime's group, or a runtime made for this group "
                "(RingRuntime(group))"
            )
        group = runtime.group
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


# ---------------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------------
# A backward with create_graph=True would return gradients whose own graph leaves out the ring
# (a gradient penalty's term silently dropped): refused at once, before any transfer of the
# backward (every rank of a program that asks for it raises the same error).
SECOND_ORDER_ERROR = (
    "ring_moe: second-order gradients (create_graph=True: a gradient penalty, a Hessian-vector "
    "product) are not supported: its backward is hand-written. Take first-order gradients "
    "without create_graph=True"
)


# autograd inputs before the experts' tensors: x, probs, topk_idx, problem, call, listed,
# main_grads
N_LEADING = 7


class _RingMoE(torch.autograd.Function):
    """Inputs ``(x, probs, topk_idx, problem, call, listed, main_grads, *ws)`` (``call``: the
    :class:`~relaymoe.ring.runtime.RingCall`: group, runtime, how a hop computes, this rank's
    options; kept until the backward; ``main_grads``: the caller's accumulators of the weight
    gradients, or None) with ``ws``
    ``(w13, w2[, b13][, b2])`` (tensor form) or ``(*w13_list, *w2_list[, *b13_list][,
    *b2_list])`` (list form; which biases: ``problem.has_b13``/``has_b2``). Saves x, probs, the
    int32 ids and ``ws`` themselves (list form: the caller's tensors, no copy)."""

    @staticmethod
    def forward(ctx, x, probs, topk_idx, problem, call, listed, main_grads, *ws):
        x, probs = x.contiguous(), probs.contiguous()
        if not listed:
            ws = tuple(w.contiguous() for w in ws)
        experts = LocalExperts.from_inputs(
            listed, ws, problem.has_b13, problem.has_b2, call.runtime
        )
        idx32 = topk_idx.to(IDX).contiguous()
        ctx.problem, ctx.call = problem, call
        ctx.listed, ctx.main_grads = listed, main_grads
        # the row order of the local experts' stacked form where a pass uses it (token mode, a
        # world of one); expert mode with R > 1 packs slot 0 in expert order and needs none
        order = experts.preferred_order()
        ctx.order = order
        if problem.mode == "alltoall":
            out, ctx.index = alltoall_forward(problem, call, x, experts, probs, idx32, order)
        elif problem.mode == "expert":  # one routing index over every expert, built once a call
            ids = idx32
            if problem.world_size == 1 and order == REVERSED:
                ids = reverse_local_ids(idx32, problem.num_local_experts)
            ctx.index = build_routing_index(ids, problem.num_experts, validate=False)
            out = _passes(problem)[0](problem, call, x, experts, probs, ctx.index, order)
        else:  # token mode builds the index of each visiting partition
            out, ctx.index = _passes(problem)[0](problem, call, x, experts, probs, idx32, order)
        ctx.save_for_backward(x, probs, idx32, *ws)
        return out

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():  # only under create_graph=True: refused before any transfer
            raise NotImplementedError(SECOND_ORDER_ERROR)
        x, probs, idx32, *ws = ctx.saved_tensors
        problem, order = ctx.problem, ctx.order
        experts = LocalExperts.from_inputs(
            ctx.listed, ws, problem.has_b13, problem.has_b2, ctx.call.runtime
        )
        dy = dy.to(problem.dtype).contiguous()
        need = ctx.needs_input_grad
        n_weights = 2 * experts.num_local if ctx.listed else 2  # w13's then w2's inputs
        # the weights' gradients go into the caller's accumulators (main_grads.py)
        into = ctx.main_grads if any(need[N_LEADING : N_LEADING + n_weights]) else None
        if problem.mode == "alltoall":
            dx, dprobs, g = alltoall_backward(
                problem, ctx.call, dy, x, experts, probs, ctx.index, order, into
            )
        else:
            dx, dprobs, g = _passes(problem)[1](
                problem, ctx.call, dy, x, experts, probs, ctx.index, order, into
            )
        # the weight gradients' rows: expert mode over several ranks packs slot 0 in expert
        # order; token mode and a world of one use the stacked form's order
        rows = FORWARD if problem.mode == "expert" and problem.world_size > 1 else order
        # views of the returned gradients, no copy (None for the weights' with ``into``)
        wgrads = experts.split(g.get("w13"), g.get("w2"), rows, g.get("b13"), g.get("b2"))
        if into is not None:  # what autograd gets instead: the caller's (Megatron's dummies)
            wgrads = handed_back(into, tuple(ws[:n_weights])) + wgrads[n_weights:]
        wgrads = tuple(g if need[N_LEADING + j] else None for j, g in enumerate(wgrads))
        return (
            dx if need[0] else None,
            dprobs if need[1] else None,
            *([None] * (N_LEADING - 2)),
            *wgrads,
        )


def ring_moe(
    x: Tensor,
    w13: Tensor | Sequence[Tensor],
    w2: Tensor | Sequence[Tensor],
    topk_idx: Tensor,
    topk_probs: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    trusted: bool = False,
    activation: ExpertActivation | str | None = None,
    b13: Tensor | Sequence[Tensor] | None = None,
    b2: Tensor | Sequence[Tensor] | None = None,
    capturable: bool = False,
    config: RingConfig | None = None,
    runtime: RingRuntime | None = None,
    main_grads: MainGrads | None = None,
    fp8=None,
) -> Tensor:
    """MoE experts over the expert-parallel ``group`` by ring execution (RelayMoE §3.1-3.3).

    ``x (T, H)`` this rank's tokens; ``w13 (E_local, J, H)`` / ``w2 (E_local, H, I)`` this rank's
    experts, global experts ``[rank*E_local, (rank+1)*E_local)``, J the fc1 rows of the
    activation (``activation.fc1_rows(I)``: 2I gated, I not); ``topk_idx (T, K)`` global
    expert ids, ``topk_probs (T, K)``. Returns ``(T, H)`` equal to the oracle over all experts,
    differentiable in x, w13, w2, topk_probs (and the biases). Ranks may hold different T
    (including 0).

    ``activation``: the expert MLP (a ``relaymoe.activation.ExpertActivation`` or a name,
    ``as_activation``; None: SwiGLU). ``b13 (E_local, J)`` / ``b2 (E_local, H)``: this rank's
    experts' optional fc1 / fc2 biases (Megatron's ``add_bias_linear``), in the weights' form:
    ``out[t] = sum_k p * (act(x @ w13[e]^T + b13[e]) @ w2[e]^T + b2[e])``. Every rank must pass
    the same activation and the same biases (the agreement refuses otherwise, naming each
    rank's). Expert mode: the biases travel in their weights' partition (one transfer per hop)
    and their gradients trail home with the weight gradients (``config.grad_accum``'s dtype);
    token and all-to-all modes: they stay with their experts and their gradients accumulate
    there.

    ``w13``/``w2`` may instead be lists (or tuples) of ``E_local`` per-expert tensors ``(J, H)``
    / ``(H, I)`` (e.g. a Megatron experts module's parameters), each differentiable on its own,
    and then ``b13``/``b2`` lists of ``E_local`` 1-D tensors ``(J,)`` / ``(H,)``.
    Then no stacked copy of the experts is kept from forward to backward: the ring saves the
    elements themselves, packs them into its send slot per pass (expert mode) or uses a
    zero-copy view (elements back to back in one storage, in list order or in reverse list
    order) or a stack that lives for one pass only (token mode). See ``weights.py``.

    ``config``: the call's options, one ``relaymoe.options.RingConfig`` (None: ``RingConfig()``,
    every field's documented default); no keyword of this function overrides a field of it (to
    change one option for a call, pass ``config.replace(mode="token")`` or
    ``dataclasses.replace(config, ...)``). Its fields, each defined in ``options.py``:

    * ``mode``: ``"expert"``, ``"token"``, ``"alltoall"`` or ``"auto"`` (the fastest by
      :func:`relaymoe.cost.choose_mode`, identical on every rank);
    * ``transport``: ``"nccl"`` (``batch_isend_irecv``; gloo on CPU; the all-to-all mode always
      uses the group's collectives), ``"copy_engine"`` (symmetric-memory pulls, CUDA within a
      node) or ``"auto"`` (copy engine when every rank is a CUDA device of one node with
      symmetric memory, else nccl);
    * ``schedule``: the hop order (``plan.py``): ``"flat"`` (one ring), ``"two_level"`` (rings
      inside each node of ``gpus_per_node`` consecutive ranks, joined by hops that every GPU of
      a node makes to the same local rank of the next node at once) or ``"auto"`` (two-level
      when the group spans several nodes of several GPUs); or ``"node_batched"`` (expert mode,
      asked for by name: one hop per node over the node's experts, all-gathered inside it;
      ``expert_mode.py``);
    * ``gpus_per_node``: the GPUs per node of the group; None reads the nodes from the ranks'
      hosts (exchanged in the agreement);
    * ``grad_accum``: the dtype of the ring's weight-gradient accumulators: ``"param"`` (the
      weights'), ``"fp32"``, or ``"auto"`` (fp32 from ``options.FP32_GRAD_ACCUM_MIN_EP`` ranks,
      where the per-hop rounding of 16-bit accumulators would take the weight-gradient error
      past twice an all-to-all's; in expert mode the travelling gradients then cost 2x the
      bytes);
    * ``kernels``: how the hop primitives' kernels run (a ``relaymoe.options.KernelOptions``;
      this rank's choice, except ``pair_buffer_mib``, which is agreed);
    * ``agree`` (how often trusted ranks agree), ``host_wait`` and ``timeout_s`` (how the host
      waits for a peer, ``faults.py``), ``overlap`` (False runs each hop's transfer after its
      compute: the ablation's sequential ring) and ``capture_hops`` (each hop's compute
      recorded once per shape and replayed: ``hop_graphs.py``).

    ``runtime``: what the ring keeps from call to call (a ``relaymoe.ring.RingRuntime``: the
    agreements of trusted calls, the copy engines' workspace, recorded hops, the lag watch;
    ``runtime.py``). Pass the same one to every call of a layer or model (Megatron's dispatcher
    keeps one); None makes a fresh one for this call and its backward, which is correct but
    agrees at every call, records hops again and leaves the copy engines out of
    ``transport="auto"`` (an explicit ``"copy_engine"`` then raises, naming ``runtime=``).
    ``group``: the EP group (default: the runtime's group, else the default group; without an
    initialized process group a world of one).
    ``backend``: the hop primitives' backend (``"auto"``, ``"triton"``, ``"torch"``).

    Every rank of the group must call it (and its backward) with the same agreed options (those
    ``RingConfig``'s docstring names); bad input raises ``ValueError`` on every rank before any
    P2P. Ranks may mix the two weight forms. A peer that dies or stalls raises
    :class:`relaymoe.ring.faults.RingPeerError` (naming the call, the group, the peer and the
    timeout) on the surviving ranks within the group's timeout; no data is returned from a
    failed transfer (``faults.py``).

    ``capturable=True``: the caller captures this call (and its backward) in a CUDA graph, in
    some steps or all (megatron-core's ``--cuda-graph-impl full_iteration``): ``mode="auto"``
    picks among the ring modes only, ``"alltoall"`` is refused, and the hops are sized from the
    worst-case bound in eager calls too, so eager and captured steps run the same code. A call
    made while its stream is captured needs ``trusted=True`` and an eager call of the same
    signature before it, made with the same ``runtime``; it then makes no host sync and no host
    wait (``hop_graphs.py``).

    ``main_grads``: the caller's accumulators of this rank's ``w13``/``w2`` gradients (a
    :class:`relaymoe.ring.MainGrads`: Megatron's ``param.main_grad`` under
    ``gradient_accumulation_fusion``); the backward ADDS the weights' gradients there, in the
    weight-gradient kernel itself where the pass computes this rank's experts and the
    accumulators are one span (forward or reverse expert order), else once they are complete,
    and autograd gets ``main_grads.finish(weights)`` for the weights instead (None: nothing).
    The biases' gradients are returned as without it. This rank's choice: ranks may differ
    (``main_grads.py``).

    ``fp8``: None (the GEMMs in the inputs' dtype), or a ``relaymoe.Fp8State`` (the layer's:
    its recipe, delayed-scaling histories and the fp8 copy of this rank's experts, quantised once
    per optimizer step): the expert GEMMs in fp8 and the experts' fp8 copies travelling instead
    of their weights (``fp8_experts.py``: expert mode only, no biases, not captured, no
    ``main_grads``). Every rank passes a state of the same recipe (not agreed: a trusted
    caller's configuration).

    ``trusted=True`` (Megatron's dispatcher): ``topk_idx`` comes from a router and is not
    validated, and every rank changes its input signature (shapes, dtypes, mode, transport,
    whether a backward follows, the collective-deciding options ``agree`` and
    ``pair_buffer_mib``) in the same call; the ranks' agreement is then reused per
    signature (in ``runtime``), so a call in steady state has no host synchronisation
    (``agreement.py``).

    Dtypes: x, w13 and w2 share one of float16, bfloat16, float32, float64 (float64 runs on the
    torch hops: ``backend="triton"`` refuses it, ``"auto"`` keeps it); topk_probs any of those;
    topk_idx any integer dtype. The output has x's dtype, the gradients their inputs' dtypes.
    Layouts: any strides for every tensor (and list element) and for the upstream gradient;
    x, topk_probs, tensor-form weights and dy are made contiguous once per call (a no-op for
    contiguous ones), topk_idx is converted to contiguous int32 (T*K elements).

    Validated on every rank before any P2P, the same ``ValueError`` raised on every rank
    (``agreement.py``): types, shapes, dtypes and devices of every input on every rank, and their
    agreement across ranks (E_local, H, I, K, dtypes, device type, mode, transport, schedule,
    gpus_per_node, grad_accum, agree, kernels.pair_buffer_mib, whether a backward follows, every
    field of the activation, which biases are given; w13's rows against the activation); this
    rank's ``main_grads`` (their form, shapes, dtypes and device against its weights); that
    the hop backend can run the inputs; the int32 limits; the expert ids (in ``[0, E)``,
    distinct per row: one host sync). ``config`` itself was validated when it was made
    (``RingConfig``); one that is not a ``RingConfig`` raises ``ValueError`` on this rank.
    ``trusted=True`` skips the id check and, for a signature already agreed, the whole
    agreement: inputs that change without the signature changing are not checked again.
    """
    config = RingConfig() if config is None else config
    if not isinstance(config, RingConfig):
        raise ValueError(
            f"ring_moe: config={config!r} must be a relaymoe.options.RingConfig or None (None: "
            "RingConfig(), the documented defaults); pass RingConfig(...)"
        )
    group, rank, world = _resolve_group(group, runtime)
    captured = isinstance(x, Tensor) and capturing(x)
    if runtime is None:
        if captured:
            raise ValueError(
                "ring_moe is being captured into a CUDA graph without a runtime: the captured "
                "call reuses the agreement its eager warm-up made in the runtime they share; "
                "fix: make one RingRuntime(group) and pass it (runtime=) to the eager calls and "
                "the captured one"
            )
        runtime = RingRuntime(group, persistent=False)  # this call's and its backward's
    if fp8 is not None and main_grads is not None:
        raise ValueError(
            "ring_moe(fp8=..., main_grads=...): the fp8 ring returns the weight gradients to "
            "autograd and does not add them into main_grads yet; pass main_grads=None"
        )
    if fp8 is not None:  # refused here on every rank; auto resolves to expert mode
        config = fp8_ring_config(config, fp8, x=x, w2=w2, backend=backend, capturable=capturable,
                                 b13=b13, b2=b2)  # fmt: skip
    listed = isinstance(w13, (list, tuple)) and isinstance(w2, (list, tuple))
    # the autograd inputs of the experts, weights then biases (LocalExperts.inputs' order);
    # a bias in the wrong form is refused by the agreement before they are used
    parts = [p for p in (w13, w2, b13, b2) if p is not None]
    ws = tuple(t for p in parts for t in (p if isinstance(p, (list, tuple)) else (p,)))
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in (x, topk_probs, *ws)
    )
    req = ring_request(config, needs_grad=needs_grad, backend=backend, activation=activation,
                       capturable=capturable)  # fmt: skip
    with torch.profiler.record_function("relaymoe.agree"):
        problem = agree(
            x, w13, w2, topk_idx, topk_probs, group=group, rank=rank, world=world, request=req,
            runtime=runtime, trusted=trusted, b13=b13, b2=b2, captured=captured,
            main_grads_error=main_grads_problem(main_grads, w13, w2),
        )  # fmt: skip
    # a captured step already holds every hop, so no hop graphs are recorded inside it
    kernel_choice = KernelChoice(backend, config.kernels, config.capture_hops and not captured)
    call = RingCall.of(group, runtime, kernel_choice, config)
    if fp8 is not None:
        return fp8_ring_moe(x, topk_probs, topk_idx, problem, call, fp8, listed, ws)
    return _RingMoE.apply(x, topk_probs, topk_idx, problem, call, listed, main_grads, *ws)


def resolved_problem(
    x: Tensor,
    w13: Tensor | Sequence[Tensor],
    w2: Tensor | Sequence[Tensor],
    topk_idx: Tensor,
    topk_probs: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    trusted: bool = False,
    activation: ExpertActivation | str | None = None,
    b13: Tensor | Sequence[Tensor] | None = None,
    b2: Tensor | Sequence[Tensor] | None = None,
    capturable: bool = False,
    config: RingConfig | None = None,
    runtime: RingRuntime | None = None,
    main_grads: MainGrads | None = None,
    needs_grad: bool = True,
) -> RingProblem:
    """The agreed :class:`RingProblem` (mode, transport, sizes, expert MLP) ``ring_moe`` would
    run with these arguments (``ring_moe``'s, options in ``config``), without running it:
    ``needs_grad`` says whether a backward follows instead of the inputs' requires_grad. A
    ``runtime`` passed keeps a trusted call's agreement, as in ``ring_moe``; ``main_grads``
    decides nothing that is agreed (taken so that ``ring_moe``'s keywords pass as they are)."""
    config = RingConfig() if config is None else config
    group, rank, world = _resolve_group(group, runtime)
    if runtime is None:
        runtime = RingRuntime(group, persistent=False)
    req = ring_request(config, needs_grad=needs_grad, backend=backend, activation=activation,
                       capturable=capturable)  # fmt: skip
    return agree(x, w13, w2, topk_idx, topk_probs, group=group, rank=rank, world=world,
                 request=req, runtime=runtime, trusted=trusted, b13=b13, b2=b2)  # fmt: skip
