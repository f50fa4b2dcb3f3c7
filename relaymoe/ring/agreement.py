"""The agreement protocol: every rank validates its inputs and agrees on the problem before any
P2P (so nothing hangs).

Each rank checks its own inputs without raising, writes a row of integers (error code, sizes,
dtypes, device, requested mode/transport, host, a validity marker, the expert MLP (every field of
the activation, which biases the experts carry: see below), then its pair count per
expert owner) into an ``(R, F + R)`` matrix and one all-reduce (sum) gives every rank every row.
Every rank then applies the same checks to the same matrix and raises the same ``ValueError``, or
returns the same :class:`RingProblem`: the sizes of all partitions, the resolved mode and
transport, and (where a hop's buffers are sized exactly) the pair counts.

The all-reduce is waited for with the group's timeout and the matrix is read only when it
completed and every rank's marker (1 in its own row) is there: a dead or stalled peer raises
:class:`~relaymoe.ring.faults.RingPeerError` naming it, never a wrong diagnosis from a partial
sum. The sizes are also checked against the int32 limits of the kernels and the routing index
(:func:`relaymoe.kernels.check_problem_limits`): the same ``ValueError`` on every rank.

**Trusted callers** (``trusted=True``: the ids come from a router, as in Megatron, and every rank
changes its input signature in the same call) skip the id validation and reuse the agreement of
the same signature (shapes, dtypes, device, mode, transport, whether a backward follows): a call
in steady state neither communicates nor synchronizes with the host here. The hops then size
their pair buffers from an upper bound (``T * min(K, E_local)`` pairs) as long as that stays
under the pair-buffer budget (``pair_buffer_mib``); above it, one all-reduce of the pair counts
per call (a host sync) keeps the buffers exact. ``RingConfig(agree="every_call")`` turns the
cache off (debugging a caller that breaks the contract). The cache is the call's runtime's
(``RingRuntime.agreements``): a dispatcher's agreements are its own, and a ``ring_moe`` call
without a runtime agrees afresh.

**Options that decide collectives.** ``RingConfig.agree`` decides whether a trusted call enters
the agreement's all-reduce, and ``KernelOptions.pair_buffer_mib`` whether it enters the pair
counts' all-reduce. Both are the call's (its ``RingConfig``, which an entry point may build
from the ``RELAYMOE_*`` environment), carried in the request, written into every agreement's
row and required equal on every rank: ranks launched with different values all raise the same
``ValueError`` naming the option and every rank's value, in the agreement they all enter on
their first call (no agreement is cached then). They are part of the cached signature, so a
call with other values agrees again. The call decides from the agreed values
(``RingProblem.pair_buffer_mib``); the expert kernels' own column chunks follow the call's
``KernelOptions``: a local choice no peer depends on.

**Each rank's own checks** (:func:`local_check`) return an error code and a message, never a
raise: the agreement writes the code into this rank's row, so that every rank raises the same
``ValueError`` for the first rank whose inputs fail. J, the fc1 rows of one expert
(``activation.fc1_rows(I)``: 2I for a gated activation, I otherwise), is checked against the
request's activation.

**The expert MLP in the row.** Every rank computes every expert (expert mode: the visiting
experts; token mode: the visiting tokens on its own experts), so a rank whose activation or bias
presence differs from its peers' would compute another layer, and in expert mode send a weight
partition of another layout. Each rank writes its activation (every field of it,
:func:`activation_fields`) and its bias presence (:func:`bias_code`) into its row as integers, and
a difference is refused with a ``ValueError`` naming each rank's value
(:func:`same_expert_mlp`), raised the same on every rank before any P2P.

What the ranks agree on, the request and the problem, is ``plan.py``'s (:class:`RingRequest`,
:class:`RingProblem`), and so is the schedule they resolve from the hosts
(:func:`~relaymoe.ring.plan.resolve_schedule`).
"""

from __future__ import annotations

import struct
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from relaymoe import options
from relaymoe.activation import FNS, ExpertActivation
from relaymoe.cost import choose_mode, grad_accum_bytes
from relaymoe.experts import resolve_backend
from relaymoe.kernels import check_problem_limits
from relaymoe.options import (
    AGREE_CHOICES,
    GRAD_ACCUM_CHOICES,
    INT64_MAX,
    MODE_CHOICES,
    NODE_BATCHED,
    SCHEDULE_CHOICES,
    TRANSPORT_CHOICES,
)
from relaymoe.ring.executor import copy_engine_available, copy_engine_works
from relaymoe.ring.faults import all_reduce_checked, check_markers
from relaymoe.ring.hop_graphs import check_captured
from relaymoe.ring.plan import RingProblem, RingRequest, host_hash, resolve_schedule
from relaymoe.routing import validate_topk_idx

__all__ = [
    "activation_fields",
    "activation_of",
    "agree",
    "bias_code",
    "local_check",
    "pair_counts",
    "same_expert_mlp",
    "weight_meta",
]

MODES = MODE_CHOICES  # the names live in relaymoe.options
TRANSPORTS = TRANSPORT_CHOICES
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DEVICE_TYPES = ("cpu", "cuda")

# Row fields
(
    F_ERR,
    F_EL,
    F_H,
    F_I,
    F_K,
    F_DTYPE,
    F_PDTYPE,
    F_DEV,
    F_T,
    F_HOST,
    F_MODE,
    F_TRANSPORT,
    F_GRAD,
    F_CE,
    F_LIVE,
    F_SCHED,
    F_GPN,
    F_GACC,
    F_AGREE,
    F_PAIRBUF,
    F_ACT_FN,
    F_ACT_GATED,
    F_ACT_ALPHA,
    F_ACT_LIMIT,
    F_ACT_OFFSET,
    F_BIAS,
    F_CAPTURE,
) = range(27)
NUM_FIELDS = 27
RING_MODES = ("expert", "token")  # the modes a captured call can run (``hop_graphs.py``)

_ERRORS = {
    1: "an input is not a tensor (or, for w13/w2/b13/b2, not a list of per-expert tensors; a bias "
    "in another form than the weights')",
    2: "mode, transport, schedule, gpus_per_node or grad_accum is not one of the accepted values",
    3: "input shapes are inconsistent (x (T, H), w13 (E_local, J, H) with J the activation's "
    "fc1 rows, w2 (E_local, H, I), b13 (E_local, J), b2 (E_local, H), topk_idx/topk_probs (T, K))",
    4: "dtypes are wrong (x, w13, w2 and the biases one float dtype; topk_probs float; "
    "topk_idx integer)",
    5: "inputs are on different devices",
    6: "topk_idx is invalid (an expert id outside [0, E), a repeated id in a row, or K > E)",
    7: "the device type is neither cpu nor cuda",
    8: "the hop backend cannot run these inputs (backend='triton' needs CUDA or "
    "TRITON_INTERPRET=1, and float16, bfloat16 or float32)",
    9: "the activation is not an ExpertActivation nor one of its names",
    10: "main_grads (the accumulators of the weight gradients) do not fit the weights",
}


# ---------------------------------------------------------------------------------------------
# each rank's own checks: an error code and a message, never a raise
# ---------------------------------------------------------------------------------------------
class _Meta:
    """Shape/dtype/device of an expert-weight input in either form (tensor, or a list of
    per-expert tensors read as ``(len, *element_shape)``)."""

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device

    def dim(self) -> int:
        return len(self.shape)


def weight_meta(name: str, w, want: str, ndim: int = 2) -> tuple[_Meta | None, str]:
    """(meta, "") of a weight (``ndim=2`` per expert) or bias (``ndim=1``) input, or (None,
    error message)."""
    if isinstance(w, Tensor):
        return _Meta(w.shape, w.dtype, w.device), ""
    if not isinstance(w, (list, tuple)):
        return None, (
            f"{name} must be a torch.Tensor {want.replace('El', 'E_local')} or a list of E_local "
            f"per-expert tensors, got {type(w).__name__}"
        )
    if len(w) == 0:
        return None, f"{name} is an empty list; pass E_local >= 1 per-expert tensors"
    for j, t in enumerate(w):
        if not isinstance(t, Tensor):
            return None, f"{name}[{j}] must be a torch.Tensor, got {type(t).__name__}"
    w0 = w[0]
    for j, t in enumerate(w):
        if t.dim() != ndim or t.shape != w0.shape or t.dtype != w0.dtype or t.device != w0.device:
            return None, (
                f"{name} list elements must all be {ndim}-D with one shape, dtype and device; "
                f"element 0 is {tuple(w0.shape)} {w0.dtype} {w0.device}, element {j} is "
                f"{tuple(t.shape)} {t.dtype} {t.device}"
            )
    return _Meta((len(w), *w0.shape), w0.dtype, w0.device), ""


def local_check(
    x,
    w13,
    w2,
    topk_idx,
    topk_probs,
    req: RingRequest,
    world: int,
    validate_ids: bool = True,
    b13=None,
    b2=None,
    main_grads_error: str | None = None,
) -> tuple[int, str]:
    """(error code, message) of this rank's inputs; (0, "") when they are fine. ``b13``/``b2``:
    the optional expert biases, in the weights' form (tensors, or lists of per-expert 1-D
    tensors). The checks run in order, the first failure is the answer: the inputs' forms
    (code 1), the request's options (9, 10, 2), shapes (3), dtypes and devices (4, 5, 7), the
    hop backend (8), the expert ids (4, 6), this rank's ``main_grads`` (10: the message of
    ``main_grads.main_grads_problem``, checked by the caller)."""
    m13, m2, biases, failed = _input_forms(x, w13, w2, topk_idx, topk_probs, b13, b2)
    if failed is not None:
        return failed
    return (
        _check_request(req)
        or _check_shapes(x, m13, m2, biases, topk_idx, topk_probs, req.activation)
        or _check_dtypes_devices(x, m13, m2, biases, topk_idx, topk_probs, req.backend)
        or _check_ids(topk_idx, m13.shape[0], world, validate_ids)
        or ((10, main_grads_error) if main_grads_error else None)
        or (0, "")
    )


def _input_forms(x, w13, w2, topk_idx, topk_probs, b13, b2):
    """``(m13, m2, biases, None)``: the weights' metas and the given biases' by name, or
    ``(None, None, None, (1, message))`` when an input is not in an accepted form."""
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_probs", topk_probs)):
        if not isinstance(t, Tensor):
            return None, None, None, (1, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    m13, msg = weight_meta("w13", w13, "(El, J, H)")
    if m13 is None:
        return None, None, None, (1, msg)
    m2, msg = weight_meta("w2", w2, "(El, H, I)")
    if m2 is None:
        return None, None, None, (1, msg)
    if isinstance(w13, Tensor) != isinstance(w2, Tensor):
        return None, None, None, (
            1, "w13 and w2 must both be tensors or both be lists of per-expert tensors"
        )  # fmt: skip
    biases = {}
    for name, b, want in (("b13", b13, "(El, J)"), ("b2", b2, "(El, H)")):
        if b is None:
            continue
        meta, msg = weight_meta(name, b, want, ndim=1)
        if meta is None:
            return None, None, None, (1, msg)
        if isinstance(b, Tensor) != isinstance(w13, Tensor):
            form, fix = ("tensors", f"a tensor {want}") if isinstance(w13, Tensor) else (
                "lists of per-expert tensors", "a list of E_local 1-D tensors")  # fmt: skip
            return None, None, None, (
                1, f"{name} must come in the weights' form: w13/w2 are {form}, pass {fix}"
            )  # fmt: skip
        biases[name] = meta
    return m13, m2, biases, None


def _check_request(req: RingRequest) -> tuple[int, str] | None:
    """The request's activation and ring options (None: fine)."""
    if isinstance(req.activation, str):  # request_activation's message of a bad activation
        return 9, req.activation
    mode, transport, schedule, gpus_per_node = (
        req.mode, req.transport, req.schedule, req.gpus_per_node
    )  # fmt: skip
    if mode not in MODES:
        return 2, f"mode must be one of {MODES}, got {mode!r}"
    if req.capturable and mode == "alltoall":
        return 2, (
            "mode='alltoall' sizes its messages on the host, which a captured CUDA graph cannot "
            "replay (capturable=True); use mode 'expert', 'token' or 'auto' (the ring modes)"
        )
    if transport not in TRANSPORTS:
        return 2, f"transport must be one of {TRANSPORTS}, got {transport!r}"
    if schedule not in SCHEDULE_CHOICES:
        return 2, f"schedule must be one of {SCHEDULE_CHOICES}, got {schedule!r}"
    if req.grad_accum not in GRAD_ACCUM_CHOICES:
        return 2, f"grad_accum must be one of {GRAD_ACCUM_CHOICES}, got {req.grad_accum!r}"
    if gpus_per_node is not None and (
        isinstance(gpus_per_node, bool)
        or not isinstance(gpus_per_node, int)
        or not 1 <= gpus_per_node <= INT64_MAX
    ):
        return 2, (
            f"gpus_per_node must be an int in [1, {INT64_MAX}] (the GPUs of one node in the EP "
            f"group) or None (from the ranks' hosts), got {gpus_per_node!r}"
        )
    return None


def _check_shapes(x, m13, m2, biases, topk_idx, topk_probs, act) -> tuple[int, str] | None:
    """x, the weights (w13's rows against the activation), the biases and the routing agree
    in shape (None: fine)."""
    if x.dim() != 2 or m13.dim() != 3 or m2.dim() != 3:
        return 3, (
            f"x must be (T, H), w13 (E_local, J, H), w2 (E_local, H, I); got x "
            f"{tuple(x.shape)}, w13 {m13.shape}, w2 {m2.shape}"
        )
    num_tokens, hidden = x.shape
    n_local, rows, h13 = m13.shape
    ffn = m2.shape[2]
    J = act.fc1_rows(ffn)
    if n_local < 1 or m2.shape[:2] != (n_local, hidden) or (rows, h13) != (J, hidden):
        fc1_rule = "2I: gated" if act.gated else "I: not gated"
        return 3, (
            f"shapes disagree: x {tuple(x.shape)}, w2 {m2.shape} (want (E_local >= 1, "
            f"{hidden}, I)), w13 {m13.shape} (want ({n_local}, J={J}, {hidden}): J is "
            f"{fc1_rule}, activation {act})"
        )
    for name, want in (("b13", (n_local, J)), ("b2", (n_local, hidden))):
        if name in biases and biases[name].shape != want:
            return 3, (
                f"{name} has shape {biases[name].shape}, want {want} (E_local, "
                f"{'J' if name == 'b13' else 'H'}) for w13 {m13.shape} and w2 {m2.shape}"
            )
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        return 3, f"topk_idx must be (T={num_tokens}, K), got {tuple(topk_idx.shape)}"
    if topk_probs.shape != topk_idx.shape:
        return 3, (
            f"topk_probs shape {tuple(topk_probs.shape)} must equal topk_idx's "
            f"{tuple(topk_idx.shape)}"
        )
    return None


def _check_dtypes_devices(x, m13, m2, biases, topk_idx, topk_probs,
                          backend) -> tuple[int, str] | None:  # fmt: skip
    """One float dtype for x, the weights and biases, one device, and a hop backend that runs
    them (None: fine)."""
    if x.dtype not in FLOATS or not (x.dtype == m13.dtype == m2.dtype):
        return 4, (
            f"x, w13, w2 must share one float dtype of {FLOATS}; got {x.dtype}, {m13.dtype}, "
            f"{m2.dtype}"
        )
    for name, meta in biases.items():
        if meta.dtype != x.dtype:
            return 4, f"{name} must have the weights' dtype {x.dtype}, got {meta.dtype}"
    if topk_probs.dtype not in FLOATS:
        return 4, f"topk_probs must be a float tensor, got {topk_probs.dtype}"
    devices = {t.device for t in (x, topk_idx, topk_probs)} | {m13.device, m2.device}
    devices |= {meta.device for meta in biases.values()}
    if len(devices) != 1:
        return 5, f"inputs are on different devices: {sorted(map(str, devices))}; move them to one"
    if x.device.type not in DEVICE_TYPES:
        return 7, f"ring_moe runs on cpu or cuda tensors, got {x.device}"
    try:
        resolve_backend(backend, x.device, x.dtype)
    except ValueError as err:
        return 8, str(err)
    return None


def _check_ids(topk_idx, n_local: int, world: int, validate_ids: bool) -> tuple[int, str] | None:
    """The expert ids: integer, K in [1, E]; validated in full (a host sync) unless trusted."""
    if not validate_ids:  # a trusted caller (a router): shapes only, no host sync
        if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool:
            return 4, f"topk_idx must hold integer expert ids, got dtype {topk_idx.dtype}"
        if not 1 <= topk_idx.shape[1] <= n_local * world:
            return 6, f"top-k K={topk_idx.shape[1]} must be in [1, E={n_local * world}]"
        return None
    try:
        validate_topk_idx(topk_idx, n_local * world)  # host sync
    except ValueError as err:
        return 6, f"{err} (E = E_local * world_size = {n_local} * {world})"
    return None


# ---------------------------------------------------------------------------------------------
# the expert MLP in the row
# ---------------------------------------------------------------------------------------------
_BIAS_NAMES = {1: "none", 2: "b13", 3: "b2", 4: "b13 and b2"}


def _float_bits(v: float) -> int:
    """The IEEE-754 bits of ``v`` as an int64: an agreement row holds integers, and its sum
    (one nonzero row per rank) moves them exactly."""
    return struct.unpack("<q", struct.pack("<d", v))[0]


def _bits_float(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", n))[0]


def activation_fields(act: ExpertActivation) -> list[int]:
    """Every field of ``act`` as five row integers: fn (1-based in ``FNS``), gated (1 no, 2
    yes), the bits of alpha, of limit (0: None; a limit is > 0, so its bits are not 0) and of
    linear_offset."""
    limit = 0 if act.limit is None else _float_bits(act.limit)
    return [FNS.index(act.fn) + 1, int(act.gated) + 1, _float_bits(act.alpha), limit,
            _float_bits(act.linear_offset)]  # fmt: skip


def activation_of(fields) -> ExpertActivation:
    """The ``ExpertActivation`` of :func:`activation_fields`' five integers."""
    fn, gated, alpha, limit, offset = fields
    return ExpertActivation(fn=FNS[fn - 1], gated=gated == 2, alpha=_bits_float(alpha),
                            limit=None if limit == 0 else _bits_float(limit),
                            linear_offset=_bits_float(offset))  # fmt: skip


def bias_code(has_b13: bool, has_b2: bool) -> int:
    """The row integer of a rank's bias presence: 1 none, 2 b13, 3 b2, 4 both."""
    return 1 + int(has_b13) + 2 * int(has_b2)


def same_expert_mlp(act_fields, bias_codes) -> tuple[ExpertActivation, bool, bool]:
    """``(activation, has_b13, has_b2)`` of the group from every rank's
    :func:`activation_fields` and :func:`bias_code`; ``ValueError`` naming each rank's value
    when they differ."""
    acts = [activation_of(f) for f in act_fields]
    if len(set(acts)) != 1:
        shown = ", ".join(f"rank {r}: {a} = {a!r}" for r, a in enumerate(acts))
        raise ValueError(
            f"ring_moe: the expert activation differs across ranks ({shown}); every rank of "
            "the group computes every expert, so pass the same activation= on every rank"
        )
    if len(set(bias_codes)) != 1:
        shown = ", ".join(f"rank {r}: {_BIAS_NAMES[c]}" for r, c in enumerate(bias_codes))
        raise ValueError(
            f"ring_moe: the expert biases differ across ranks ({shown}); every rank's experts "
            "must carry the same biases (Megatron's add_bias_linear): pass the same of b13/b2 "
            "on every rank"
        )
    code = bias_codes[0]
    return acts[0], code in (2, 4), code in (3, 4)


# ---------------------------------------------------------------------------------------------
# the protocol: one all-reduce of every rank's row, the same answer everywhere
# ---------------------------------------------------------------------------------------------
def _pairs_per_owner(topk_idx: Tensor, num_local_experts: int, world: int) -> Tensor:
    """(R,) int64 on topk_idx's device: this rank's pairs per expert owner (no host sync;
    ``bincount`` would sync to size its output)."""
    owner = topk_idx.reshape(-1).to(torch.int64) // num_local_experts
    counts = torch.zeros(world, dtype=torch.int64, device=topk_idx.device)
    return counts.index_add_(0, owner, torch.ones_like(owner))


def _comm_device(group: dist.ProcessGroup, x) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and "cpu" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree_collective(
    inputs: tuple,
    *,
    group,
    rank: int,
    world: int,
    req: RingRequest,
    validate_ids: bool,
    with_pairs: bool,
    runtime=None,
    main_grads_error: str | None = None,
) -> RingProblem:
    """Validate on every rank at once; raise the same ``ValueError`` everywhere or agree.
    ``inputs``: ``(x, w13, w2, topk_idx, topk_probs)`` as ``ring_moe`` got them, optionally
    followed by ``(b13, b2)`` (None: no bias). ``runtime``: the call's ``RingRuntime`` (its
    copy-engine probe; None, or one made for this call only: no copy engines). The
    collectives wait ``req.timeout_s`` for a peer (None: the group's timeout).
    ``main_grads_error``: what is wrong with this rank's ``main_grads`` (None: nothing)."""
    x, w13, w2, topk_idx, topk_probs, *biases = inputs
    b13, b2 = biases or (None, None)
    code, msg = local_check(x, w13, w2, topk_idx, topk_probs, req, world, validate_ids, b13, b2,
                            main_grads_error)  # fmt: skip
    keeps = runtime is not None and runtime.persistent  # a workspace that outlives the call
    row = _encode_row(code, x, w2, topk_idx, topk_probs, req, b13, b2, keeps)
    counts = _pairs_per_owner(topk_idx, row[F_EL], world) if code == 0 and with_pairs else None
    rows = _exchange_rows(row, counts, x, group=group, rank=rank, world=world, req=req)
    _raise_input_errors(rows, rank, code, msg)
    act, has_b13, has_b2 = _check_same_across_ranks(rows)
    mode, batched = _resolve_mode(rows, world, act, has_b13, has_b2)
    _check_limits(rows, mode)
    transport = _resolve_transport(rows, world, mode, batched, group, x, runtime, req.timeout_s)
    schedule, gpus_per_node = "flat", None
    if world > 1 and mode != "alltoall":
        requested = SCHEDULE_CHOICES[rows[0][F_SCHED] - 1]
        hosts = [rw[F_HOST] for rw in rows]
        schedule, gpus_per_node = resolve_schedule(requested, rows[0][F_GPN] or None, hosts)
    return RingProblem(
        rank=rank,
        world_size=world,
        num_local_experts=rows[0][F_EL],
        hidden=rows[0][F_H],
        ffn=rows[0][F_I],
        topk=rows[0][F_K],
        dtype=FLOATS[rows[0][F_DTYPE] - 1],
        prob_dtype=FLOATS[rows[0][F_PDTYPE] - 1],
        tokens=tuple(rw[F_T] for rw in rows),
        mode=mode,
        transport=transport,
        needs_grad=rows[0][F_GRAD] == 2,
        pairs=tuple(tuple(rw[NUM_FIELDS:]) for rw in rows) if with_pairs else None,
        schedule=schedule,
        gpus_per_node=gpus_per_node,
        grad_dtype=_grad_dtype(rows[0], world),
        pair_buffer_mib=rows[0][F_PAIRBUF],
        activation=act,
        has_b13=has_b13,
        has_b2=has_b2,
    )


def _encode_row(code: int, x, w2, topk_idx, topk_probs, req: RingRequest, b13, b2,
                keeps: bool) -> list[int]:  # fmt: skip
    """This rank's row of the agreement: its error code, and when its inputs are valid, their
    sizes, dtypes, device and the requested options; always its host and validity marker.
    ``keeps``: the call's runtime outlives it (a copy-engine workspace can persist)."""
    row = [0] * NUM_FIELDS
    row[F_ERR] = code
    if code == 0:
        m2 = weight_meta("w2", w2, "")[0]
        row[F_EL], row[F_I], row[F_H] = m2.shape[0], m2.shape[2], x.shape[1]
        row[F_K], row[F_T] = topk_idx.shape[1], x.shape[0]
        row[F_DTYPE] = FLOATS.index(x.dtype) + 1
        row[F_PDTYPE] = FLOATS.index(topk_probs.dtype) + 1
        row[F_DEV] = DEVICE_TYPES.index(x.device.type) + 1
        row[F_MODE] = MODES.index(req.mode) + 1
        row[F_TRANSPORT] = TRANSPORTS.index(req.transport) + 1
        row[F_GRAD] = int(req.needs_grad) + 1
        row[F_CE] = int(x.is_cuda and keeps and copy_engine_available()) + 1
        row[F_SCHED] = SCHEDULE_CHOICES.index(req.schedule) + 1
        row[F_GPN] = req.gpus_per_node or 0
        row[F_GACC] = GRAD_ACCUM_CHOICES.index(req.grad_accum) + 1
        row[F_AGREE] = AGREE_CHOICES.index(req.agree) + 1
        row[F_PAIRBUF] = req.pair_buffer_mib
        row[F_ACT_FN : F_ACT_OFFSET + 1] = activation_fields(req.activation)
        row[F_BIAS] = bias_code(b13 is not None, b2 is not None)
        row[F_CAPTURE] = int(req.capturable) + 1
    row[F_HOST] = host_hash()
    row[F_LIVE] = 1  # the validity marker: a sum missing a rank's row lacks its 1
    return row


def _exchange_rows(row: list[int], counts: Tensor | None, x, *, group, rank: int, world: int,
                   req: RingRequest) -> list[list[int]]:  # fmt: skip
    """Every rank's row followed by its pairs per expert owner (zeros without ``counts``): one
    all-reduce of the ``(R, F + R)`` matrix, read once every rank's marker is in."""
    if group is None or world <= 1:
        return [row + (counts.tolist() if counts is not None else [0] * world)]  # host sync
    mat = torch.zeros(world, NUM_FIELDS + world, dtype=torch.int64, device=_comm_device(group, x))
    mat[rank, :NUM_FIELDS] = torch.tensor(row, dtype=torch.int64)
    if counts is not None:
        mat[rank, NUM_FIELDS:] = counts.to(mat.device)
    # completes within the timeout or raises RingPeerError (the buffer is then never read)
    watch = all_reduce_checked(
        mat, group, mode=_mode_name(req.mode), phase="agree", timeout_s=req.timeout_s
    )
    rows = mat.tolist()  # host sync
    check_markers(watch, [rw[F_LIVE] for rw in rows], what="the agreement's all-reduce")
    return rows


def _raise_input_errors(rows: list[list[int]], rank: int, code: int, msg: str) -> None:
    """A rank whose inputs are invalid raises its own message; the others name it."""
    bad = [(r, rw[F_ERR]) for r, rw in enumerate(rows) if rw[F_ERR]]
    if not bad:
        return
    if code:
        raise ValueError(f"ring_moe: invalid input on rank {rank}: {msg}")
    r0, c0 = bad[0]
    raise ValueError(
        f"ring_moe: invalid input on rank {r0}: {_ERRORS.get(c0, 'unknown error')}; "
        f"see rank {r0}'s error for the details (every rank raises)"
    )


def _check_same_across_ranks(rows: list[list[int]]):
    """The sizes, dtypes, device and options every rank must share; returns the agreed expert
    MLP ``(activation, has_b13, has_b2)``."""

    def same(field: int, what: str, fix: str) -> None:
        vals = [rw[field] for rw in rows]
        if len(set(vals)) != 1:
            raise ValueError(f"ring_moe: {what} differs across ranks: {vals}; {fix}")

    same(F_EL, "E_local (w13.shape[0])", "every rank must hold the same number of experts")
    same(F_H, "the hidden size H", "every rank must use the same model")
    same(F_I, "the expert FFN width I", "every rank must use the same model")
    same(F_K, "top-k K (topk_idx.shape[1])", "every rank must route with the same K")
    dcodes = [rw[F_DTYPE] for rw in rows]
    if len(set(dcodes)) != 1:
        raise ValueError(
            "ring_moe: the x/w13/w2 dtype differs across ranks: "
            f"{[str(FLOATS[c - 1]) for c in dcodes]}; use one dtype on every rank"
        )
    pcodes = [rw[F_PDTYPE] for rw in rows]
    if len(set(pcodes)) != 1:
        raise ValueError(
            "ring_moe: the topk_probs dtype differs across ranks: "
            f"{[str(FLOATS[c - 1]) for c in pcodes]}; use one dtype on every rank"
        )
    same(F_DEV, "the device type (1 cpu, 2 cuda)", "put every rank's inputs on the same kind")
    same(F_MODE, "the requested mode (1 auto, 2 expert, 3 token, 4 alltoall)", "pass the same mode")
    same(F_TRANSPORT, "the requested transport (1 auto, 2 nccl, 3 copy_engine)", "pass the same")
    same(
        F_GRAD,
        "whether a backward is needed (1 no, 2 yes: grad enabled and an input requires grad)",
        "every rank must run the backward of ring_moe, or none",
    )
    same(F_SCHED, f"the requested schedule ({_codes(SCHEDULE_CHOICES)})", "pass the same schedule")
    same(F_GPN, "gpus_per_node (0: from the hosts)", "pass the same gpus_per_node on every rank")
    same(F_GACC, f"the requested grad_accum ({_codes(GRAD_ACCUM_CHOICES)})",
         "pass the same grad_accum on every rank")  # fmt: skip
    _same_setting(rows, F_AGREE, "RingConfig.agree (RELAYMOE_RING_AGREE)",
                  lambda c: AGREE_CHOICES[c - 1])  # fmt: skip
    _same_setting(rows, F_PAIRBUF, "KernelOptions.pair_buffer_mib (RELAYMOE_PAIR_BUFFER_MIB)",
                  lambda v: v)  # fmt: skip
    same(F_CAPTURE, "capturable (1 no, 2 yes: the step is captured in a CUDA graph)",
         "every rank must capture its step, or none")  # fmt: skip
    return same_expert_mlp(
        [rw[F_ACT_FN : F_ACT_OFFSET + 1] for rw in rows], [rw[F_BIAS] for rw in rows]
    )


def _grad_dtype(r0: list[int], world: int) -> torch.dtype:
    """The weight gradients' dtype: fp32 where the agreed grad_accum accumulates wider."""
    dtype = FLOATS[r0[F_DTYPE] - 1]
    grad_accum = GRAD_ACCUM_CHOICES[r0[F_GACC] - 1]
    return torch.float32 if grad_accum_bytes(grad_accum, world, dtype) > dtype.itemsize else dtype


def _resolve_mode(rows: list[list[int]], world: int, act, has_b13: bool,
                  has_b2: bool) -> tuple[str, bool]:  # fmt: skip
    """The agreed mode (``auto``: the time model's choice, the same floats on every rank) and
    whether the node-batched schedule runs (expert mode over the group's P2P only)."""
    r0 = rows[0]
    mode_req, tr_req = MODES[r0[F_MODE] - 1], TRANSPORTS[r0[F_TRANSPORT] - 1]
    mode = mode_req
    if mode_req == "auto":  # the time model (relaymoe.cost)
        dtype, prob_dtype = FLOATS[r0[F_DTYPE] - 1], FLOATS[r0[F_PDTYPE] - 1]
        mode = choose_mode(
            tokens=tuple(rw[F_T] for rw in rows), hidden=r0[F_H], ffn=r0[F_I],
            num_local_experts=r0[F_EL], topk=r0[F_K], world=world, act_bytes=dtype.itemsize,
            prob_bytes=prob_dtype.itemsize, training=r0[F_GRAD] == 2,
            transport="nccl" if tr_req == "nccl" else "copy_engine",
            grad_accum=GRAD_ACCUM_CHOICES[r0[F_GACC] - 1], gated=act.gated, b13=has_b13,
            b2=has_b2, modes=RING_MODES if r0[F_CAPTURE] == 2 else options.MODES,
        )  # fmt: skip
    sched_req = SCHEDULE_CHOICES[r0[F_SCHED] - 1]
    batched = sched_req == NODE_BATCHED and world > 1 and mode_req != "alltoall"
    if batched:
        if mode_req == "token":
            raise ValueError(
                "ring_moe: schedule='node_batched' batches expert partitions (expert mode only), "
                "but mode='token'; use mode='expert' (or 'auto'), or schedule 'flat'/'two_level'"
            )
        if tr_req == "copy_engine":
            raise ValueError(
                "ring_moe: schedule='node_batched' exchanges over the group's P2P (NCCL), not "
                "the copy engine; use transport='nccl' (or 'auto')"
            )
        mode = "expert"  # "auto": the schedule's only mode
    return mode, batched


def _resolve_transport(rows: list[list[int]], world: int, mode: str, batched: bool, group, x,
                       runtime, timeout_s: float | None) -> str:  # fmt: skip
    """The agreed transport: ``copy_engine`` only for CUDA ranks on one host whose runtimes
    keep a workspace (``auto``: where the copy engines also work, probed collectively); the
    all-to-all mode and the node-batched schedule use the group's own P2P."""
    r0 = rows[0]
    tr_req = TRANSPORTS[r0[F_TRANSPORT] - 1]
    on_cuda = r0[F_DEV] == 2
    one_host = len({rw[F_HOST] for rw in rows}) == 1
    ce_ok = on_cuda and one_host and all(rw[F_CE] == 2 for rw in rows)
    if world == 1:
        return "local"
    if tr_req == "copy_engine":
        if not ce_ok:
            why = (
                "inputs are not on CUDA"
                if not on_cuda
                else "ranks span several hosts"
                if not one_host
                else "symmetric memory is unavailable on a rank (or a rank's call has no "
                "runtime: ring_moe(..., runtime=RingRuntime(group)) keeps the workspace)"
            )
            raise ValueError(
                f"ring_moe: transport='copy_engine' needs CUDA ranks on one node with symmetric "
                f"memory, but {why}; use transport='nccl' (or 'auto')"
            )
        return "copy_engine" if mode != "alltoall" else "nccl"
    if mode == "alltoall" or batched:  # collectives over the group's own backend
        return "nccl"
    if tr_req == "auto":
        g = group if group is not None else dist.group.WORLD
        ok = ce_ok and copy_engine_works(g, x.device, runtime, timeout_s)
        return "copy_engine" if ok else "nccl"
    return "nccl"


def _same_setting(rows, field: int, name: str, decode) -> None:
    """Every rank's value of the collective-deciding option ``name`` must be the same: the
    error names the option and each rank's value."""
    values = [decode(rw[field]) for rw in rows]
    if len(set(values)) != 1:
        shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
        raise ValueError(
            f"ring_moe: the option {name} differs across the ranks of the group ({shown}); it "
            f"decides which collectives a call issues, so every rank must run with the same "
            f"value: set (or unset) it identically on every node"
        )


def _codes(names) -> str:
    return ", ".join(f"{i + 1} {n}" for i, n in enumerate(names))


def _mode_name(mode) -> str:
    return mode if isinstance(mode, str) and mode in MODES else "ring"


def _check_limits(rows, mode: str) -> None:
    """int32 limits on the agreed sizes (every rank raises the same ``ValueError``). A hop of a
    ring mode computes one partition (``max T`` tokens); in the all-to-all mode a rank may
    receive every rank's tokens (``sum T`` rows)."""
    Ts = [rw[F_T] for rw in rows]
    r0 = rows[0]
    check_problem_limits(
        tokens=sum(Ts) if mode == "alltoall" else max(Ts), topk=r0[F_K], hidden=r0[F_H],
        ffn=r0[F_I], num_local_experts=r0[F_EL], where=f"ring_moe (mode={mode!r}, T per rank {Ts})",
    )  # fmt: skip


def _signature(x, w13, w2, topk_idx, topk_probs, req: RingRequest, b13=None, b2=None) -> tuple:
    def meta(t):
        if isinstance(t, Tensor):
            return (tuple(t.shape), t.dtype, t.device.type)
        if isinstance(t, (list, tuple)) and t and isinstance(t[0], Tensor):
            return (len(t), tuple(t[0].shape), t[0].dtype, t[0].device.type)
        return (type(t).__name__,)  # not an input the agreement accepts: it raises there

    # the collective-deciding options are in ``req`` (the kernels' options and the timeout are
    # this rank's: not in its comparison)
    return (meta(x), meta(w13), meta(w2), meta(topk_idx), meta(topk_probs), req,
            meta(b13), meta(b2))  # fmt: skip


def _bounded(problem: RingProblem) -> bool:
    """Whether every hop's pair buffers fit the budget when sized from the bound (the largest is
    the backward's pre-activation, ``(P, J)`` in the activations' dtype). The budget is the
    agreed ``pair_buffer_mib``, the same on every rank: this decides a collective."""
    budget = problem.pair_buffer_mib * 2**20
    esize = torch.empty((), dtype=problem.dtype).element_size()
    bound = max(problem.tokens) * min(problem.topk, problem.num_local_experts)
    return bound * problem.fc1_rows * esize <= budget


def pair_counts(
    topk_idx: Tensor, problem: RingProblem, group, timeout_s: float | None = None
) -> tuple[tuple[int, ...], ...]:
    """Every rank's pairs per expert owner (one all-reduce and a host sync): ``pairs[r][q]``.
    Column ``R`` of the reduced matrix is the validity marker (as in the agreement)."""
    R = problem.world_size
    counts = _pairs_per_owner(topk_idx, problem.num_local_experts, R)
    if group is None or R == 1:
        return (tuple(counts.tolist()),)  # host sync
    mat = torch.zeros(R, R + 1, dtype=torch.int64, device=_comm_device(group, topk_idx))
    mat[problem.rank, :R] = counts.to(mat.device)
    mat[problem.rank, R] = 1
    watch = all_reduce_checked(
        mat, group, mode=problem.mode, phase="pair counts", timeout_s=timeout_s
    )
    rows = mat.tolist()  # host sync
    check_markers(watch, [r[R] for r in rows], what="the pair counts' all-reduce")
    return tuple(tuple(r[:R]) for r in rows)


def agree(
    x,
    w13,
    w2,
    topk_idx,
    topk_probs,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    world: int,
    request: RingRequest,
    runtime,
    trusted: bool = False,
    b13=None,
    b2=None,
    captured: bool = False,
    main_grads_error: str | None = None,
) -> RingProblem:
    """The :class:`RingProblem` every rank agrees on, or the same ``ValueError`` on every rank.

    ``trusted=False``: one all-reduce and a host sync per call (ids validated, pair counts
    exact). ``trusted=True``: see the module doc (cached per signature in ``runtime``, the
    call's ``RingRuntime``; ids not validated).
    ``b13``/``b2``: the experts' optional biases (their presence is agreed, their shapes
    checked); the activation is the request's. ``captured``: the call is being captured in a
    CUDA graph (``hop_graphs.py``): the agreement of an eager call with the same signature, the
    hops sized from the worst-case bound, no collective and no host read here.
    ``main_grads_error``: what is wrong with this rank's ``main_grads`` (None: nothing): every
    rank raises where the ranks agree; a trusted call whose agreement is cached raises it on
    this rank alone (its peers then meet a ``RingPeerError``, as with a rank that dies).
    ``request`` carries the call's options (its ``RingConfig``'s, ``plan.ring_request``),
    its collectives' timeout among them.
    """
    args = (x, w13, w2, topk_idx, topk_probs, b13, b2)
    where = dict(group=group, rank=rank, world=world, req=request, runtime=runtime,
                 main_grads_error=main_grads_error)  # fmt: skip
    if captured:
        check_captured(trusted=trusted, agree_mode=request.agree)
    if trusted and request.agree != "every_call":
        key = (getattr(group, "group_name", None) or id(group), rank, world,
               _signature(*args[:5], request, b13, b2))  # fmt: skip
        cache = runtime.agreements
        problem = cache.get(key)
        if problem is not None and main_grads_error:
            raise ValueError(f"ring_moe: invalid input on rank {rank}: {main_grads_error}")
        if problem is None:
            if captured:
                raise ValueError(
                    "ring_moe is being captured into a CUDA graph before any eager call with "
                    "these inputs' shapes, dtypes and options agreed across the group (the "
                    "agreement is an all-reduce read on the host); fix: run one eager step "
                    "first with the same runtime (ring_moe's runtime=; Megatron: "
                    "--cuda-graph-warmup-steps 1 or more)"
                )
            problem = _agree_collective(args, **where, validate_ids=False, with_pairs=False)
            cache[key] = problem
        if captured and problem.mode == "alltoall":
            raise ValueError(
                "ring_moe is being captured into a CUDA graph, but its agreed mode is 'alltoall' "
                "(messages sized on the host); fix: capturable=True (Megatron's dispatcher "
                "passes it when the step is captured), or mode='expert'/'token'"
            )
        # the bound is a proof for a captured call (hop_graphs.py), and a capturable call's eager
        # steps run the captured one's code
        if captured or request.capturable or _bounded(problem):
            return problem
        return replace(problem, pairs=pair_counts(topk_idx, problem, group, request.timeout_s))
    return _agree_collective(args, **where, validate_ids=True, with_pairs=True)
