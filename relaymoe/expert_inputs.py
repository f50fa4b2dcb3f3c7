"""The input contract of ``moe_experts``: every argument checked at call time, before any work.

Shape legend: T tokens, H hidden, I expert FFN width, E experts (of ``w13``/``w2``), K top-k.

Each check raises ``ValueError`` naming the argument, the value, the limit and the fix; nothing
here touches device memory except the one comparison of a prebuilt index against ``topk_idx``
when that index was not built from the ``topk_idx`` tensor itself (:func:`check_index`). What
is accepted (layouts, dtypes) is stated in ``moe_experts``' docstring; this module is the code
behind it. The hop primitives' own host-side checks (the bias-gradient buffers, w13's rows
against the activation) live here too.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from relaymoe.activation import SWIGLU
from relaymoe.routing import RoutingIndex

__all__ = [
    "check_bias_grads",
    "check_fc1_rows",
    "check_index",
    "check_moe_inputs",
    "expert_range_of",
    "stack_experts",
]

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
          torch.float64: "float64"}  # fmt: skip
_FLOAT_LIST = ", ".join(_NAMES.values())


def _desc(t) -> str:
    if isinstance(t, Tensor):
        return f"a {tuple(t.shape)} {t.dtype} tensor"
    return f"a {type(t).__name__}"


def _is_int_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def stack_experts(name: str, w, want: str, ndim: int = 2) -> Tensor:
    """``w`` itself when a tensor; a list (or tuple) of per-expert ``ndim``-D tensors (weights
    2-D, biases 1-D) stacked into one (E, ...) tensor (``torch.stack``: one copy, differentiable
    into each element). Anything else raises ``ValueError``."""
    if isinstance(w, Tensor):
        return w
    if not isinstance(w, (list, tuple)):
        raise ValueError(
            f"moe_experts: {name} must be a tensor {want} or a list of E per-expert tensors, got "
            f"{_desc(w)}"
        )
    if len(w) == 0:
        raise ValueError(
            f"moe_experts: {name} is an empty list; pass E >= 1 per-expert tensors, or a "
            f"tensor {want} (an empty expert range is w[e0:e0])"
        )
    w0 = w[0]
    for j, t in enumerate(w):
        if not isinstance(t, Tensor):
            raise ValueError(f"moe_experts: {name}[{j}] must be a tensor, got {_desc(t)}")
        if t.dim() != ndim or t.shape != w0.shape or t.dtype != w0.dtype or t.device != w0.device:
            raise ValueError(
                f"moe_experts: the elements of {name} must be {ndim}-D with one shape, dtype and "
                f"device; element 0 is {tuple(w0.shape)} {w0.dtype} {w0.device}, element {j} "
                f"is {tuple(t.shape)} {t.dtype} {t.device}"
            )
    return torch.stack(list(w))


def _check_float(name: str, t: Tensor, also: str = "") -> None:
    if t.dtype not in FLOATS:
        kind = "integer" if _is_int_dtype(t.dtype) else str(t.dtype).removeprefix("torch.")
        raise ValueError(
            f"moe_experts: {name} has dtype {t.dtype} ({kind}); moe_experts computes in "
            f"{_FLOAT_LIST}: cast {name}{also} (e.g. {name}.float())"
        )


def _span(t: Tensor) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` of ``t``'s elements inside its storage (empty: ``lo == hi``)."""
    if t.numel() == 0:
        return 0, 0
    elt = t.element_size()
    lo = t.storage_offset() * elt
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return lo, lo + (extent + 1) * elt


def _overlaps(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory (same storage and intersecting byte ranges)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _check_out(out, x: Tensor, others: dict[str, Tensor]) -> None:
    if not isinstance(out, Tensor):
        raise ValueError(f"moe_experts: out must be a tensor (T, H) or None, got {_desc(out)}")
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"moe_experts: out must be a {tuple(x.shape)} {x.dtype} tensor on {x.device} (x's), "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if any(s == 0 and n > 1 for n, s in zip(out.shape, out.stride(), strict=True)):
        raise ValueError(
            f"moe_experts: out has stride {out.stride()}: several of its elements share one "
            "memory location (an expanded tensor), so it cannot be accumulated into; pass a "
            "buffer of its own, e.g. out.clone()"
        )
    if out.requires_grad and out.is_leaf:
        raise ValueError(
            "moe_experts: out is a leaf tensor that requires grad, which may not be written in "
            "place; pass a buffer that does not require grad (e.g. out.detach().clone())"
        )
    for name, t in others.items():
        if _overlaps(out, t):
            raise ValueError(
                f"moe_experts: out shares memory with {name}; the experts read {name} while "
                "out is written, so pass a separate out buffer"
            )


def expert_range_of(expert_range) -> tuple[int, int] | None:
    """``expert_range`` as a pair of Python ints (any integer type: numpy's, a 0-d integer
    tensor), None as None; anything else raises ``ValueError``."""
    if expert_range is None:
        return None
    try:
        if isinstance(expert_range, (str, bytes)) or len(expert_range) != 2:
            raise TypeError
        if any(isinstance(e, bool) for e in expert_range):
            raise TypeError
        e0, e1 = (operator.index(e) for e in expert_range)
    except TypeError:
        raise ValueError(
            f"moe_experts: expert_range must be a pair of ints (e0, e1), got {expert_range!r}"
        ) from None
    return e0, e1


def _check_range(expert_range: tuple[int, int], n_local: int, index) -> None:
    e0, e1 = expert_range
    if e1 - e0 != n_local:
        raise ValueError(
            f"moe_experts: expert_range {tuple(expert_range)} spans {e1 - e0} experts but "
            f"w13/w2 hold {n_local}; pass the weights of experts [e0, e1) only"
        )
    if index is None:
        raise ValueError(
            "moe_experts: expert_range needs a prebuilt index over all experts: "
            "pass index=build_routing_index(topk_idx, num_experts)"
        )
    if not 0 <= e0 <= e1 <= index.num_experts:
        raise ValueError(
            f"moe_experts: expert_range {tuple(expert_range)} is outside [0, "
            f"{index.num_experts}] (the index's experts)"
        )


def _check_bias(name: str, b, want: tuple[int, int], like: Tensor, of: str) -> None:
    """``b`` must be a ``want`` tensor of ``like``'s dtype and device (the weight it biases)."""
    if not isinstance(b, Tensor):
        raise ValueError(
            f"moe_experts: {name} must be a tensor {want}, a list of E 1-D tensors, or None; "
            f"got {_desc(b)}"
        )
    if tuple(b.shape) != want:
        raise ValueError(
            f"moe_experts: {name} has shape {tuple(b.shape)}, want {want} (one bias row per "
            f"expert of {of}, {of}'s rows); pass a bias of that shape"
        )
    if b.dtype != like.dtype or b.device != like.device:
        raise ValueError(
            f"moe_experts: {name} is {b.dtype} on {b.device} but {of} is {like.dtype} on "
            f"{like.device}; cast and move {name} to {of}'s (e.g. {name}.to({of}))"
        )


def check_moe_inputs(x, w13, w2, topk_idx, topk_probs, index, expert_range, out,
                     activation=SWIGLU, b13=None, b2=None) -> None:  # fmt: skip
    """Every check of ``moe_experts``' tensors and their agreement (``w13``/``w2`` and the
    biases already stacked; ``activation`` an ``ExpertActivation``: it sets w13's rows).
    Metadata only: no device work, no host sync."""
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_probs", topk_probs)):
        if not isinstance(t, Tensor):
            raise ValueError(f"moe_experts: {name} must be a torch.Tensor, got {_desc(t)}")
    if x.dim() != 2:
        raise ValueError(f"moe_experts: x must be (T, H), got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"moe_experts: w13 must be (E, J, H) (J = 2I gated, I not) and w2 (E, H, I); got "
            f"{tuple(w13.shape)} and "
            f"{tuple(w2.shape)}"
        )
    n_local, rows, h13 = w13.shape
    ffn = w2.shape[2]
    if h13 != hidden or w2.shape[:2] != (n_local, hidden):
        raise ValueError(
            f"moe_experts: shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)} "
            f"(want (E, J, {hidden})), w2 {tuple(w2.shape)} (want ({n_local}, {hidden}, I))"
        )
    if rows != activation.fc1_rows(ffn):
        kind = "gated: [gate; linear] rows" if activation.gated else "not gated"
        raise ValueError(
            f"moe_experts: shapes disagree: w13 {tuple(w13.shape)} has {rows} rows per expert "
            f"but activation "
            f"{activation.name} ({kind}) with w2 {tuple(w2.shape)} (I={ffn}) needs "
            f"{activation.fc1_rows(ffn)}; pass w13 ({n_local}, {activation.fc1_rows(ffn)}, "
            f"{hidden}), or the activation your fc1 was built for (gated=True for 2I rows)"
        )
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        raise ValueError(
            f"moe_experts: topk_idx must be (T={num_tokens}, K), got {tuple(topk_idx.shape)}"
        )
    if topk_probs.shape != topk_idx.shape:
        raise ValueError(
            f"moe_experts: topk_probs shape {tuple(topk_probs.shape)} must equal "
            f"topk_idx's {tuple(topk_idx.shape)}"
        )
    _check_float("x", x, ", w13 and w2")
    if not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(
            f"moe_experts: x, w13, w2 dtypes differ: {x.dtype}, {w13.dtype}, {w2.dtype}; cast "
            "them to one float dtype"
        )
    if not _is_int_dtype(topk_idx.dtype):
        raise ValueError(
            f"moe_experts: topk_idx must hold integer expert ids, got dtype {topk_idx.dtype}; "
            "pass the router's top-k indices (e.g. torch.topk(...).indices)"
        )
    _check_float("topk_probs", topk_probs)
    devices = {t.device for t in (x, w13, w2, topk_idx, topk_probs)}
    if len(devices) != 1:
        raise ValueError(
            f"moe_experts: inputs are on different devices: {sorted(map(str, devices))}; move "
            "x, w13, w2, topk_idx and topk_probs to one device"
        )
    if b13 is not None:
        _check_bias("b13", b13, (n_local, rows), w13, "w13")
    if b2 is not None:
        _check_bias("b2", b2, (n_local, hidden), w2, "w2")
    if expert_range is not None:
        _check_range(expert_range, n_local, index)
    elif index is not None and isinstance(index, RoutingIndex) and index.num_experts != n_local:
        raise ValueError(
            f"moe_experts: index has {index.num_experts} experts but w13 holds {n_local}; "
            "pass expert_range=(e0, e1) for a slice of the experts"
        )
    if out is not None:
        others = {"x": x, "w13": w13, "w2": w2, "topk_probs": topk_probs, "topk_idx": topk_idx}
        others.update({n: b for n, b in (("b13", b13), ("b2", b2)) if b is not None})
        _check_out(out, x, others)


def check_index(index, topk_idx: Tensor) -> None:
    """A prebuilt ``index`` must be the routing of ``topk_idx``.

    Checked for free when the index was built from the ``topk_idx`` tensor object itself and
    that tensor was not modified since (``RoutingIndex.built_from``); otherwise (a copy, a
    view, an index built another way) its expert ids are compared with ``topk_idx`` on the
    device, one host sync. What stays trusted: that the index's arrays are the build of its
    own expert ids (true of ``build_routing_index``), and, when it was built with
    ``validate=False``, that those ids were valid."""
    if not isinstance(index, RoutingIndex):
        raise ValueError(
            f"moe_experts: index must be a RoutingIndex (build_routing_index(topk_idx, E)) or "
            f"None, got {_desc(index)}"
        )
    if (index.num_tokens, index.topk) != tuple(topk_idx.shape):
        raise ValueError(
            f"moe_experts: index was built for (T, K)=({index.num_tokens}, {index.topk}), "
            f"topk_idx is {tuple(topk_idx.shape)}; rebuild it from this topk_idx"
        )
    if index.token_expert_indices.device != topk_idx.device:
        raise ValueError(
            f"moe_experts: index is on {index.token_expert_indices.device} but the inputs on "
            f"{topk_idx.device}; build it on the inputs' device"
        )
    if index.built_from(topk_idx):
        return
    same = torch.equal(index.token_expert_indices.long(), topk_idx.reshape(-1).long())
    if not same:  # host sync (torch.equal): only for an index of another tensor object
        raise ValueError(
            "moe_experts: index holds another routing than topk_idx (its expert ids differ); "
            "pass index=build_routing_index(topk_idx, E), or index=None to build it here"
        )


def check_bias_grads(b13, b2, db13, db2) -> None:
    """A bias's gradient is added into a caller-owned buffer: one must come with the bias."""
    for name, b, db in (("b13", b13, db13), ("b2", b2, db2)):
        if b is not None and db is None:
            raise ValueError(
                f"expert_hop_backward: {name} is given but grads.d{name} is None; pass a "
                f"buffer shaped like {name} {tuple(b.shape)} (any float dtype, e.g. an fp32 "
                f"torch.zeros) that the gradient is added into: HopGrads(d{name}=...)"
            )
        if b is not None and db.shape != b.shape:
            raise ValueError(
                f"expert_hop_backward: grads.d{name} has shape {tuple(db.shape)}, want {name}'s "
                f"{tuple(b.shape)}"
            )


def check_fc1_rows(where: str, w13, w2, act) -> None:
    """w13's rows must be the activation's fc1 rows for w2's width (a host-side shape check: a
    mismatch would otherwise read past the weights in the kernels)."""
    if w13.shape[1] != act.fc1_rows(w2.shape[2]):
        raise ValueError(
            f"{where}: w13 has {w13.shape[1]} rows per expert but activation {act.name} with "
            f"I={w2.shape[2]} (w2's last dim) needs {act.fc1_rows(w2.shape[2])}; pass the "
            "activation the weights were built for"
        )
