"""Triton hop primitives: the fused expert forward and backward of one expert range.

Shape legend: T tokens, H hidden, I expert FFN width, J fc1 rows (2I gated, I not), El local
experts (``e1 - e0``), K top-k, P pairs of the range in expert-grouped order
(``index.offsets_for(e0, e1)``).

Forward:  up_swiglu (x rows gathered on load, gate+up tiles together, b13 and the activation in
          the epilogue, router probability folded into ``a``) -> rows_gemm ``y = a @ w2[e]^T`` ->
          combine (gather-reduce into out through ``token_index_map``, plus ``p * b2[e]``,
          deterministic, no atomics). On sm90 up_swiglu (SwiGLU without bias) and the backward's
          gathered rows_gemm run as the persistent Gluon kernel of ``gather_ws``.
Backward: rows_gemm ``g = dy[tok] @ w2[e]`` (dy rows gathered on load, plain epilogue, g written
          into the (P, I) buffer that later holds ``p*a``) -> swiglu_backward (memory-bound: the
          activation recomputed from h, dprob as the row-wise dot of g with a, dh written over h
          in act mode, ``p*a`` over g) -> the b2 terms (``dprob += dy[tok] . b2[e]``,
          ``db2[e] += sum p * dy[tok]``) -> wgrad dw2 (dy gathered) -> ``db13[e] += sum dh`` ->
          wgrad dw13 (x gathered) -> ``dh @ w13[e]`` -> combine into dx.
The activation is any ``ExpertActivation`` (``grouped.activation``: one set of compile-time
constants for every kernel); the bias sums are segment sums in a fixed order (``grouped.bias``).
Which GEMM runs where (``torch._grouped_mm`` for contiguous operands on sm90, the gathered
row copy or gather-on-load, the weight gradients' grouped GEMM or Triton kernel, the Gluon
kernels) is ``select.py``'s choice from the call's ``KernelOptions``; (P, H) outputs of the down
projection and of the dgrad are produced in column chunks of at most ``pair_buffer_mib`` MiB.

Slices: a range of more pairs than ``KernelOptions.hop_slice_mib`` allows
(``select.hop_slice_rows``) runs the passes above once per slice of consecutive pairs
(:func:`pair_slices`), each slice's intermediates freed before the next: the range's offsets
clamped to the slice on the device (no host sync, capturable), out and dx added into from the
second slice on, the weight gradients likewise (an expert cut by a slice's end gets two
additions; one absent from a slice is not touched: the weight-gradient kernel skips it). The
transient memory is then one slice's whatever T*K; the result differs from one pass only by
the order of the roundings of the 16-bit sums (as over a ring's hops).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from relaymoe.activation import ExpertActivation, as_activation
from relaymoe.kernels import check_int32, grouped, pairs, select, unit_cols
from relaymoe.options import KernelOptions

__all__ = [
    "HopGrads",
    "HopGroups",
    "HopOptions",
    "check_hop_sizes",
    "combine_chunks",
    "gathered_rows_times_weight",
    "hop_wgrad",
    "pair_count",
    "pair_slices",
    "triton_hop_backward",
    "triton_hop_forward",
    "wgrad_gmm",
    "zero_weight_grads",
]


@dataclass(frozen=True)
class HopOptions:
    """How one call of a hop primitive computes, besides its tensors: one object for the options
    that travel together from the caller to the kernels (the same for a hop's forward and its
    backward, but for the pair count of its range).

    ``backend``: ``"auto"``, ``"triton"`` or ``"torch"`` (``relaymoe.experts.resolve_backend``;
    the Triton primitives here ignore it). ``kernels``: how the Triton kernels run (None:
    ``KernelOptions()``). ``activation``: an ``ExpertActivation`` or a name (None: SwiGLU).
    ``n_pairs``: the range's pair count when the caller knows it (it spares the host sync that
    sizes a partial range's buffers); else ``max_pairs``: an upper bound on it, which does the
    same (buffers sized from the bound, rows past the count never read). ``grad_dtype``: the
    dtype of the weight gradients a backward allocates (None: the weights')."""

    backend: str = "auto"
    kernels: KernelOptions | None = None
    activation: ExpertActivation | str | None = None
    n_pairs: int | None = None
    max_pairs: int | None = None
    grad_dtype: torch.dtype | None = None


@dataclass(frozen=True, eq=False)
class HopGrads:
    """The buffers a hop backward writes its gradients into, by name (None: allocated and
    written). ``dx_TH``, ``dprobs_TK``, ``dw13``, ``dw2`` are ADDED into, unless
    ``dw_accumulate=False``: then ``dw13``/``dw2`` are written over (their old values never
    read), bitwise what fresh buffers would get. ``db13``/``db2``: the bias gradients, ADDED into
    (any float dtype), each required when its bias is given. ``dw_reversed``: the given
    ``dw13``/``dw2`` hold the range's experts in reverse row order (expert ``e0 + j`` at row
    ``El-1-j``), as a caller's accumulators laid out in reverse expert order do (Megatron's
    ``main_grad``); written there in place. Compared by identity: it holds tensors."""

    dx_TH: Tensor | None = None
    dprobs_TK: Tensor | None = None
    dw13: Tensor | None = None
    dw2: Tensor | None = None
    db13: Tensor | None = None
    db2: Tensor | None = None
    dw_accumulate: bool = True
    dw_reversed: bool = False


HOP_DEFAULTS = HopOptions()  # a call without options
GRAD_DEFAULTS = HopGrads()  # a backward that allocates every gradient


def pair_count(
    index, e0: int, e1: int, known: int | None = None, bound: int | None = None
) -> tuple[int, bool]:
    """``(rows, exact)``: rows of the range's pair buffers and whether that is the pair count.
    Host sync unless the range is every expert or the caller passed the count (``known``, e.g. a
    ring pass that read all its counts at once) or an upper bound on it (``bound``: the buffers
    are sized from it, rows past the count are never read)."""
    if known is not None:
        return known, True
    if (e0, e1) == (0, index.num_experts):
        return index.num_pairs, True
    if bound is not None:
        return min(bound, index.num_pairs), False
    start, stop = index.pair_range(e0, e1)  # host sync (buffer sizes of a partial range)
    return stop - start, True


def _hop_inputs(where: str, w13, w2, options: HopOptions, b13, b2) -> tuple:
    """``(act, k, b13, b2)`` of a hop call: the options' activation (None: SwiGLU) and
    ``KernelOptions`` (None: ``KernelOptions()``), and the biases at unit column stride (a copy
    only for other strides), shapes checked against the range's weights: ``b13 (El, J)``,
    ``b2 (El, H)``."""
    act = as_activation(options.activation)
    k = select.kernel_options(options.kernels)
    for name, b, want in (("b13", b13, w13.shape[:2]), ("b2", b2, w2.shape[:2])):
        if b is not None and tuple(b.shape) != tuple(want):
            raise ValueError(f"{where}: {name} has shape {tuple(b.shape)}, want {tuple(want)}")
    b13 = None if b13 is None else unit_cols(b13)
    return act, k, b13, (None if b2 is None else unit_cols(b2))


def check_hop_sizes(num_tokens: int, n_pairs: int, where: str) -> None:
    """int32 limits of a hop (see ``relaymoe.kernels.INT32_LIMIT``): token ids in the routing
    index, and the range's pair count (torch._grouped_mm's int32 group ends, row ids)."""
    check_int32("T (tokens)", num_tokens, where=where,
                fix="split the micro-batch so one call holds fewer tokens")  # fmt: skip
    check_int32("the pairs of the expert range", n_pairs, where=where,
                fix="use fewer tokens per call, or fewer experts per rank")  # fmt: skip


class HopGroups:
    """Device values that several GEMMs of one hop share, each built on its first use: the
    group ends of ``torch._grouped_mm`` and the token of every pair row (the weight gradients'
    gathers). Built once per hop instead of once per GEMM and column chunk: the hop is
    host-bound at small T, each op costing the host tens of microseconds."""

    def __init__(self, idx_P: Tensor, offs: Tensor, n_pairs: int, exact: bool):
        self.idx_P, self.offs, self.n_pairs, self.exact = idx_P, offs, n_pairs, exact

    @functools.cached_property
    def ends(self) -> Tensor:
        return (self.offs[1:] - self.offs[0]).to(torch.int32)

    @functools.cached_property
    def tok(self) -> Tensor:
        rows = self.offs[0].to(torch.int64) + torch.arange(self.n_pairs, device=self.offs.device)
        if not self.exact:  # buffers sized from a bound: rows past the index's end are never read
            rows.clamp_(max=self.idx_P.shape[0] - 1)
        return self.idx_P.index_select(0, rows).to(torch.int64)


def wgrad_gmm(a, b, c_EMN, groups: HopGroups, *, a_gather: bool, accumulate: bool,
              k: KernelOptions | None = None, out_like: Tensor | None = None,
              reverse: bool = False) -> Tensor:  # fmt: skip
    """``c[e] (+)= sum_q a[row]^T b[row]`` as one K-grouped ``torch._grouped_mm`` per column
    chunk of the gathered operand: the chunk (P, <= k.pair_buffer_mib) is gathered through
    the pair indices, never the whole (P, H), and the (El, M, chunk) result is added into ``c``.
    Groups of zero pairs give exact zeros. No host sync (the range's rows are indexed on device).

    Returns the gradient: ``c_EMN`` written (added into with ``accumulate``), or with ``c_EMN``
    None a new one shaped and typed like ``out_like`` (a meta tensor will do). That new one is
    torch's result itself when one chunk covers it in the gradient's dtype: no copy, and no
    second (El, M, N) buffer at the peak. ``k``: the ``KernelOptions`` (default: ``KernelOptions()``).
    ``reverse``: ``c_EMN``'s rows hold the experts in reverse order (each chunk's result is
    flipped over the experts before it is added: one transient copy of the chunk)."""
    k = select.kernel_options(k)
    ref = c_EMN if c_EMN is not None else out_like
    _, m, n = ref.shape
    gathered = a if a_gather else b
    chunks = select.col_chunks(groups.n_pairs, m if a_gather else n, a.element_size(), k)
    for c0, c1 in chunks:
        g_PC = gathered[:, c0:c1].index_select(0, groups.tok)  # (P, chunk): this chunk only
        if a_gather:
            res = torch._grouped_mm(g_PC.t(), b, offs=groups.ends)
        else:
            res = torch._grouped_mm(a.t(), g_PC, offs=groups.ends)
        del g_PC
        if c_EMN is None and len(chunks) == 1 and res.dtype == ref.dtype:
            return res
        if c_EMN is None:
            c_EMN = torch.empty(ref.shape, dtype=ref.dtype, device=a.device)
        dst = c_EMN[:, c0:c1, :] if a_gather else c_EMN[:, :, c0:c1]
        if reverse:
            res = res.flip(0)
        if accumulate:
            dst.add_(res)
        else:
            dst.copy_(res)
        del res
    return c_EMN


def hop_wgrad(a, b, idx_P, offs, c_EMN, groups: HopGroups, *, a_gather, b_gather, like: Tensor,
              grad_dtype: torch.dtype | None, k, accumulate: bool = True,
              reverse: bool = False) -> Tensor:  # fmt: skip
    """Weight gradient of the range: torch's grouped GEMM over gathered chunks where
    ``select.wgrad_by_gmm`` takes it, else the Triton kernel. Added into ``c_EMN`` (written
    over with ``accumulate=False``; its rows in reverse expert order with ``reverse``); with
    None, a new gradient shaped like ``like`` in ``grad_dtype`` (default ``like``'s). Returns
    it."""
    accumulate = accumulate and c_EMN is not None
    reverse = reverse and c_EMN is not None
    if c_EMN is None:  # a shape and dtype to check and allocate from
        c_ref = torch.empty(like.shape, dtype=grad_dtype or like.dtype, device="meta")
    else:
        c_ref = c_EMN
    if select.wgrad_by_gmm(a, b, c_ref, groups.n_pairs, a_gather=a_gather, b_gather=b_gather,
                           k=k):  # fmt: skip
        return wgrad_gmm(a, b, c_EMN, groups, a_gather=a_gather, accumulate=accumulate, k=k,
                          out_like=c_ref, reverse=reverse)  # fmt: skip
    if c_EMN is None:
        c_EMN = torch.empty(c_ref.shape, dtype=c_ref.dtype, device=a.device)
    grouped.wgrad(a, b, idx_P, offs, c_EMN, a_gather=a_gather, b_gather=b_gather,
                  accumulate=accumulate, kernels=k, reverse=reverse)  # fmt: skip
    return c_EMN


def gathered_rows_times_weight(x_TK: Tensor, w_EKN: Tensor, groups: HopGroups) -> Tensor:
    """(P, N) = x[tok[q]] @ w[e] over the range's pairs: the rows gathered into one (P, K) copy
    (freed on return), then one grouped GEMM. Rows past the pair count (buffers sized from a
    bound) are not written and never read."""
    x_PK = x_TK.index_select(0, groups.tok)
    return torch._grouped_mm(x_PK, w_EKN, offs=groups.ends)


def _pair_rows_times_weight(a_PK: Tensor, b_EKN: Tensor, offs: Tensor, groups: HopGroups, k):
    """(P, N) = a[q] @ b[e] over the range's pairs (a contiguous in expert order)."""
    n_pairs, ncols = a_PK.shape[0], b_EKN.shape[2]
    if select.use_torch_grouped_mm(a_PK, b_EKN, k):
        return torch._grouped_mm(a_PK, b_EKN, offs=groups.ends)
    out_PN = a_PK.new_empty(n_pairs, ncols)
    grouped.rows_gemm(a_PK, b_EKN, offs, out_PN, kernels=k)
    return out_PN


def combine_chunks(product, n_pairs: int, elt: int, index, offs: Tensor, out_TH: Tensor,
                   accumulate: bool, k, bias=None) -> None:  # fmt: skip
    """Write (add, with ``accumulate``) into ``out_TH[t]`` the sum over token t's pairs q of
    ``product(c0, c1)[q]``, the (P, c1 - c0) products of one column chunk, made and reduced
    chunk by chunk (at most ``k.pair_buffer_mib`` alive; ``elt`` bytes a product element).
    The forward's down projection and the dgrad. ``bias``: None or ``(b2_EH, probs_TK, e0)``:
    the combine also adds ``p * b2[e]`` for every pair.

    The combine kernel stores rows at unit column stride. An ``out_TH`` with other column
    strides (a caller's transposed buffer) is written through one row-major (T, chunk) buffer
    per chunk, then copied or added into it once; a row-major ``out_TH`` is written directly."""
    direct = unit_cols(out_TH) is out_TH
    for c0, c1 in select.col_chunks(n_pairs, out_TH.shape[1], elt, k):
        y_PH = product(c0, c1)
        dst = out_TH[:, c0:c1]
        chunk_bias = None
        if bias is not None:
            b2, probs, e0 = bias
            chunk_bias = (b2[:, c0:c1], probs, index.token_expert_indices, e0)
        if direct:
            grouped.combine(y_PH, index.token_index_map, offs, dst, index.topk,
                            accumulate=accumulate, bias=chunk_bias)  # fmt: skip
        else:
            rows = dst.new_empty(dst.shape)
            grouped.combine(y_PH, index.token_index_map, offs, rows, index.topk,
                            accumulate=False, bias=chunk_bias)  # fmt: skip
            dst.add_(rows) if accumulate else dst.copy_(rows)
            del rows
        del y_PH


def _combine_pair_products(
    a_PK: Tensor, b_EKN: Tensor, index, offs: Tensor, out_TH: Tensor, accumulate: bool,
    groups: HopGroups, k, bias=None,
) -> None:  # fmt: skip
    """:func:`combine_chunks` of ``a[q] @ b[e]`` (a contiguous in expert order)."""

    def product(c0, c1):
        return _pair_rows_times_weight(a_PK, b_EKN[:, :, c0:c1], offs, groups, k)

    combine_chunks(product, a_PK.shape[0], a_PK.element_size(), index, offs, out_TH, accumulate,
                   k, bias)  # fmt: skip


def triton_hop_forward(
    x_TH: Tensor,
    w13: Tensor,
    w2: Tensor,
    probs_TK: Tensor,
    index,
    e0: int,
    e1: int,
    out_TH: Tensor | None,
    save_act: bool,
    *,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
    options: HopOptions | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Add experts ``[e0, e1)``'s pairs into ``out_TH`` (written, not added, when None).

    Returns ``(out_TH, h_PJ)``; ``h_PJ`` is the range's pre-activation (fc1 bias included) when
    ``save_act``. ``b13 (El, J)``, ``b2 (El, H)``: as ``relaymoe.experts.expert_hop_forward``'s
    (None: no bias). ``options`` (:class:`HopOptions`, None: the defaults): the kernels, the
    activation and the pair count (``n_pairs``; else ``max_pairs``, an upper bound: buffers
    sized from it, no host sync; else read from the index, a host sync for a partial range).
    A range of more pairs than one slice runs slice by slice (module docstring).
    """
    options = HOP_DEFAULTS if options is None else options
    act, k, b13, b2 = _hop_inputs("triton_hop_forward", w13, w2, options, b13, b2)
    num_tokens = x_TH.shape[0]
    n_local, rows_e, _ = w13.shape
    x_TH = unit_cols(x_TH)  # no copy for row-major x (moe_experts and the ring pass such)
    accumulate = out_TH is not None
    if out_TH is None:  # row-major whatever x's strides (the combine writes every row)
        out_TH = x_TH.new_empty(x_TH.shape)
    offs = index.offsets_for(e0, e1)
    n_pairs, exact = pair_count(index, e0, e1, options.n_pairs, options.max_pairs)
    check_hop_sizes(num_tokens, n_pairs, "triton_hop_forward")
    if save_act and not exact:
        raise ValueError("save_act needs the exact pair count (n_pairs), not max_pairs")
    if n_pairs == 0 or n_local == 0 or num_tokens == 0 or x_TH.shape[1] == 0:
        # nothing to compute (with H = 0 every product is an empty sum: h is the bias, or 0)
        if not accumulate:
            out_TH.zero_()
        if not save_act:
            return out_TH, None
        h = x_TH.new_zeros(n_pairs, rows_e)
        if b13 is not None and n_pairs:  # H = 0: h = b13[e] of each pair's expert
            h.copy_(b13.repeat_interleave(index.tokens_per_expert()[e0:e1], 0))
        return out_TH, h
    rows = select.hop_slice_rows(k, rows_e, w2.shape[2], x_TH.shape[1], x_TH.element_size())
    slices = pair_slices(offs, n_pairs, rows)
    if len(slices) == 1:
        return out_TH, _forward_slice(x_TH, w13, w2, probs_TK, index, offs, n_pairs, exact,
                                      out_TH, accumulate, save_act, None, act, k, b13, b2, e0)  # fmt: skip
    h_PJ = x_TH.new_empty(n_pairs, rows_e) if save_act else None
    for offs_s, n_s, r0 in slices:
        h_s = None if h_PJ is None else h_PJ[r0 : r0 + n_s]
        _forward_slice(x_TH, w13, w2, probs_TK, index, offs_s, n_s, exact, out_TH,
                       accumulate or r0 > 0, save_act, h_s, act, k, b13, b2, e0)  # fmt: skip
    return out_TH, h_PJ


def pair_slices(offs: Tensor, n_pairs: int, rows: int | None) -> list[tuple[Tensor, int, int]]:
    """``(offs_s, n_s, r0)`` of each slice of a range of ``n_pairs`` pairs (its exact count, or
    the bound its buffers are sized from) at ``offs`` (El+1 device offsets), at most ``rows``
    pairs a slice (None: one slice, the range itself): the range's offsets clamped to pairs
    ``[offs[0] + r0, offs[0] + r0 + n_s)`` on the device (no host sync), a slice's own pair
    count (or bound) ``n_s``, and its first row ``r0`` in the range's pair buffers. A slice past
    the range's real end (a bound above the count) has every offset equal: no pairs."""
    if rows is None or n_pairs <= rows:
        return [(offs, n_pairs, 0)]
    base = offs[:1]
    out = []
    for r0 in range(0, n_pairs, rows):
        n_s = min(rows, n_pairs - r0)
        out.append((torch.clamp(offs, min=base + r0, max=base + (r0 + n_s)), n_s, r0))
    return out


def _forward_slice(x_TH, w13, w2, probs_TK, index, offs, n_pairs: int, exact: bool, out_TH,
                   accumulate: bool, save_act: bool, h_into, act, k, b13, b2,
                   e0: int) -> Tensor | None:  # fmt: skip
    """One slice of :func:`triton_hop_forward` (the whole range when unsliced): its pairs
    (``offs``, ``n_pairs``) added into ``out_TH`` (written with ``accumulate=False``). Returns
    the pre-activation with ``save_act``: written into ``h_into`` (the slice's rows of the
    range's buffer) when given, else a new (P, J) buffer."""
    rows_e, ffn = w13.shape[1], w2.shape[2]
    prob_P = pairs.pair_probs(probs_TK, index.token_index_map, offs, n_pairs)
    idx_P = index.expert_token_indices
    groups = HopGroups(idx_P, offs, n_pairs, exact)
    a_PI = x_TH.new_empty(n_pairs, ffn)
    w13_EHJ = w13.transpose(1, 2)
    if select.gather_then_gmm(x_TH, w13_EHJ, n_pairs, k):  # h from the GEMM, a from h (bf16 h)
        h = gathered_rows_times_weight(x_TH, w13_EHJ, groups)
        grouped.swiglu_forward(h, prob_P, a_PI, activation=act, b13_EJ=b13, offs=offs,
                               store_h=save_act)  # fmt: skip
        h_PJ = None
        if save_act:
            h_PJ = h if h_into is None else h_into.copy_(h)
        del h
    else:  # one kernel: h stored when saved, a from its epilogue (from h rounded on sm90)
        h_PJ = None
        if save_act:
            h_PJ = x_TH.new_empty(n_pairs, rows_e) if h_into is None else h_into
        grouped.up_swiglu(x_TH, w13, idx_P, offs, prob_P, h_PJ, a_PI, kernels=k,
                          activation=act, b13_EJ=b13)  # fmt: skip
    bias = None if b2 is None else (b2, probs_TK.contiguous(), e0)
    _combine_pair_products(a_PI, w2.transpose(1, 2), index, offs, out_TH, accumulate, groups, k,
                           bias)  # fmt: skip
    return h_PJ


def triton_hop_backward(
    dy_TH: Tensor,
    x_TH: Tensor,
    w13: Tensor,
    w2: Tensor,
    probs_TK: Tensor,
    index,
    e0: int,
    e1: int,
    saved_h: Tensor | None,
    *,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
    consume_saved_h: bool = False,
    grads: HopGrads | None = None,
    options: HopOptions | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of experts ``[e0, e1)``'s pairs into ``grads`` (:class:`HopGrads`: ADDED into
    the buffers given, or written over with ``dw_accumulate=False``); a buffer left None is
    allocated and written (no zero fill). Returns ``(dx, dprobs, dw13, dw2)``.

    ``consume_saved_h=True`` lets the kernel overwrite ``saved_h`` with its gradient (saves a
    (P, J) buffer); the caller must not use ``saved_h`` afterwards. ``b13``, ``b2`` and the bias
    gradients ``grads.db13``/``db2``: as ``relaymoe.experts.expert_hop_backward``'s (each
    gradient buffer required with its bias). ``options``: as :func:`triton_hop_forward`'s, and
    ``options.grad_dtype`` the dtype of weight-gradient buffers allocated here (default the
    weights'; e.g. fp32 accumulators).
    """
    options = HOP_DEFAULTS if options is None else options
    grads = GRAD_DEFAULTS if grads is None else grads
    act, k, b13, b2 = _hop_inputs("triton_hop_backward", w13, w2, options, b13, b2)
    _check_bias_grads(b13, b2, grads)
    x_TH, dy_TH = unit_cols(x_TH), unit_cols(dy_TH)  # no copy for row-major operands
    acc_dx = grads.dx_TH is not None
    dx_TH = x_TH.new_empty(x_TH.shape) if grads.dx_TH is None else grads.dx_TH  # row-major
    dprobs_TK = grads.dprobs_TK
    if dprobs_TK is None:  # contiguous: the dprob kernel adds at flat (t*K + k)
        dprobs_TK = torch.zeros(probs_TK.shape, dtype=probs_TK.dtype, device=probs_TK.device)
    offs = index.offsets_for(e0, e1)
    n_pairs, exact = (pair_count(index, e0, e1, options.n_pairs, options.max_pairs)
                      if w13.shape[0] > 0 else (0, True))  # fmt: skip
    check_hop_sizes(x_TH.shape[0], n_pairs, "triton_hop_backward")
    if n_pairs == 0 or x_TH.shape[0] == 0 or x_TH.shape[1] == 0:  # H = 0: every gradient is 0
        if not acc_dx:
            dx_TH.zero_()
        return (dx_TH, dprobs_TK, *zero_weight_grads(w13, w2, grads, options.grad_dtype))
    _check_saved_h(saved_h, exact, n_pairs, w13.shape[1], (e0, e1))
    rows = select.hop_slice_rows(k, w13.shape[1], w2.shape[2], x_TH.shape[1],
                                 x_TH.element_size())  # fmt: skip
    dw = _SliceGrads.of(grads)
    for offs_s, n_s, r0 in pair_slices(offs, n_pairs, rows):
        saved_s = None if saved_h is None else saved_h[r0 : r0 + n_s]
        groups = HopGroups(index.expert_token_indices, offs_s, n_s, exact)
        _backward_slice(dy_TH, x_TH, w13, w2, probs_TK, index, e0, saved_s, consume_saved_h,
                        groups, b13, b2, grads, dw, dx_TH, acc_dx or r0 > 0, dprobs_TK, act, k,
                        options.grad_dtype)  # fmt: skip
    return dx_TH, dprobs_TK, dw.dw13, dw.dw2


@dataclass
class _SliceGrads:
    """The weight gradients across a backward's slices: the caller's buffers (or None), then
    after the first slice the buffers it wrote, added into by the next slices. A caller's
    buffer keeps its row order (``reversed13``/``reversed2``: the caller's ``dw_reversed``); a
    buffer the first slice allocated holds the experts in order."""

    dw13: Tensor | None
    dw2: Tensor | None
    accumulate: bool
    reversed13: bool
    reversed2: bool

    @classmethod
    def of(cls, grads: HopGrads) -> _SliceGrads:
        rev = grads.dw_reversed
        return cls(grads.dw13, grads.dw2, grads.dw_accumulate, rev and grads.dw13 is not None,
                   rev and grads.dw2 is not None)  # fmt: skip

    def written(self, dw13: Tensor, dw2: Tensor) -> None:
        """After a slice: its buffers are the ones the next slice adds into."""
        self.dw13, self.dw2, self.accumulate = dw13, dw2, True


def _check_saved_h(saved_h, exact: bool, n_pairs: int, rows_e: int, experts) -> None:
    """A saved pre-activation must be the exact range's: (P, J) of the forward of that range."""
    if saved_h is None:
        return
    if not exact:
        raise ValueError("saved_h needs the exact pair count (n_pairs), not max_pairs")
    if saved_h.shape != (n_pairs, rows_e):
        e0, e1 = experts
        raise ValueError(
            f"saved_h has shape {tuple(saved_h.shape)}, expected ({n_pairs}, {rows_e}) for "
            f"experts [{e0}, {e1}); pass the h returned by the forward of the same range"
        )


def _backward_slice(dy_TH, x_TH, w13, w2, probs_TK, index, e0: int, saved_h, consume_saved_h,
                    groups: HopGroups, b13, b2, grads: HopGrads, dw: _SliceGrads, dx_TH,
                    acc_dx: bool, dprobs_TK, act, k, grad_dtype) -> None:  # fmt: skip
    """One slice of :func:`triton_hop_backward` (the whole range when unsliced): its pairs'
    dx and dprobs added into ``dx_TH`` (written with ``acc_dx=False``) and ``dprobs_TK``, the
    bias gradients into ``grads``' buffers, the weight gradients into ``dw``'s."""
    offs = groups.offs
    prob_P = pairs.pair_probs(probs_TK, index.token_index_map, offs, groups.n_pairs)
    h_PJ, dh_PJ, h_bias = _backward_pre_activation(x_TH, w13, b13, saved_h, consume_saved_h,
                                                   groups, act, k)  # fmt: skip
    pa_PI, dprob_P = _activation_backward(x_TH, dy_TH, w2, h_PJ, dh_PJ, h_bias, prob_P, groups,
                                          act, k)  # fmt: skip
    pairs.add_pair_dprobs(dprob_P, index.token_index_map, offs, dprobs_TK)
    if b2 is not None:  # y = a @ w2^T + b2: dprob += dy[tok] . b2[e], db2[e] += sum p * dy[tok]
        _add_bias_dprobs(dy_TH, b2, index, offs, e0, dprobs_TK)
        _segment_sum(dy_TH, offs, grads.db2, idx_P=groups.idx_P, scale_P=prob_P)
    # dw2[e] (H, I) = sum_q dy[tok]^T (p*a)[q]
    dw2 = hop_wgrad(dy_TH, pa_PI, groups.idx_P, offs, dw.dw2, groups, a_gather=True,
                    b_gather=False, like=w2, grad_dtype=grad_dtype, k=k,
                    accumulate=dw.accumulate, reverse=dw.reversed2)  # fmt: skip
    del pa_PI
    if b13 is not None:  # db13[e] += sum of e's dh rows
        _segment_sum(dh_PJ, offs, grads.db13)
    # dw13[e] (J, H) = sum_q dh[q]^T x[tok]
    dw13 = hop_wgrad(dh_PJ, x_TH, groups.idx_P, offs, dw.dw13, groups, a_gather=False,
                     b_gather=True, like=w13, grad_dtype=grad_dtype, k=k,
                     accumulate=dw.accumulate, reverse=dw.reversed13)  # fmt: skip
    dw.written(dw13, dw2)
    _combine_pair_products(dh_PJ, w13, index, offs, dx_TH, acc_dx, groups, k)


def _check_bias_grads(b13, b2, grads: HopGrads) -> None:
    """A backward with a bias needs its gradient's buffer (``grads.db13``/``db2``), shaped as
    the bias: the bias gradients are only ever added into a caller's buffer."""
    for name, b, db in (("b13", b13, grads.db13), ("b2", b2, grads.db2)):
        if b is not None and (db is None or db.shape != b.shape):
            got = None if db is None else tuple(db.shape)
            raise ValueError(f"triton_hop_backward: {name} is given, so grads.d{name} must be a "
                             f"buffer shaped {tuple(b.shape)} (got {got})")  # fmt: skip


def zero_weight_grads(w13, w2, grads: HopGrads, grad_dtype) -> tuple[Tensor, Tensor]:
    """``(dw13, dw2)`` of a range without pairs (or without tokens, or H = 0): zeros, allocated
    where ``grads`` gives no buffer, written over a given one with ``dw_accumulate=False``,
    left as they are (nothing added) otherwise."""
    dw13 = torch.zeros_like(w13, dtype=grad_dtype) if grads.dw13 is None else grads.dw13
    dw2 = torch.zeros_like(w2, dtype=grad_dtype) if grads.dw2 is None else grads.dw2
    if not grads.dw_accumulate:
        dw13.zero_()
        dw2.zero_()
    return dw13, dw2


def _backward_pre_activation(x_TH, w13, b13, saved_h, consume_saved_h: bool,
                             groups: HopGroups, act, k) -> tuple:  # fmt: skip
    """``(h_PJ, dh_PJ, h_bias)`` of a backward: the pre-activation ``h`` (the forward's saved
    one, or rebuilt from x and w13 with ``recompute="fc1"``), the (P, J) buffer its gradient is
    written into (``h`` itself where it may be consumed), and ``b13`` where the rebuilt ``h``
    lacks it (the grouped GEMM path: the activation backward adds it on load), else None."""
    n_pairs, rows_e = groups.n_pairs, w13.shape[1]
    if saved_h is None:  # recompute="fc1": rebuild h alone (a comes from it below)
        w13_EHJ = w13.transpose(1, 2)
        if select.gather_then_gmm(x_TH, w13_EHJ, n_pairs, k):
            h_PJ = gathered_rows_times_weight(x_TH, w13_EHJ, groups)
            return h_PJ, h_PJ, b13
        h_PJ = x_TH.new_empty(n_pairs, rows_e)
        grouped.up_swiglu(x_TH, w13, groups.idx_P, groups.offs, None, h_PJ, None, kernels=k,
                          activation=act, b13_EJ=b13)  # fmt: skip
        return h_PJ, h_PJ, None
    return saved_h, (saved_h if consume_saved_h else torch.empty_like(saved_h)), None


def _activation_backward(x_TH, dy_TH, w2, h_PJ, dh_PJ, h_bias, prob_P, groups: HopGroups, act,
                         k) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(pa_PI, dprob_P)``: ``g = dy[tok] @ w2[e]`` into a (P, I) buffer (x's dtype), then one
    memory pass turns it into ``p*a`` (the activation recomputed from ``h``; ``h_bias`` added on
    load), writes ``dh`` into ``dh_PJ`` and returns each pair's probability gradient (fp32)."""
    n_pairs = groups.n_pairs
    if select.gather_then_gmm(dy_TH, w2, n_pairs, k):
        pa_PI = gathered_rows_times_weight(dy_TH, w2, groups)
    else:
        pa_PI = x_TH.new_empty(n_pairs, w2.shape[2])
        grouped.rows_gemm(dy_TH, w2, groups.offs, pa_PI, a_idx=groups.idx_P, kernels=k)
    dprob_P = torch.empty(n_pairs, dtype=torch.float32, device=x_TH.device)
    grouped.swiglu_backward(h_PJ, pa_PI, prob_P, dh_PJ, dprob_P, activation=act,
                            b13_EJ=h_bias, offs=groups.offs)  # fmt: skip
    return pa_PI, dprob_P


def _add_bias_dprobs(dy_TH, b2_EH, index, offs, e0: int, dprobs_TK) -> None:
    """``dprobs_TK[t, k] += dy[t] . b2[e]`` for the range's pairs (through a contiguous fp32
    buffer when ``dprobs_TK`` is a strided view)."""
    if dprobs_TK.is_contiguous():
        grouped.add_bias_dprobs(dy_TH, b2_EH, index.token_expert_indices, index.token_index_map,
                                offs, e0, dprobs_TK)  # fmt: skip
        return
    flat = torch.zeros(dprobs_TK.shape, dtype=torch.float32, device=dprobs_TK.device)
    _add_bias_dprobs(dy_TH, b2_EH, index, offs, e0, flat)
    dprobs_TK.add_(flat.to(dprobs_TK.dtype))


def _segment_sum(src, offs, out_EN, **kw) -> None:
    """``grouped.segment_sum`` into a caller's bias-gradient buffer of any strides (through a
    row-major fp32 one when its columns are not at unit stride)."""
    if unit_cols(out_EN) is out_EN:
        grouped.segment_sum(src, offs, out_EN, **kw)
        return
    rows = torch.zeros(out_EN.shape, dtype=torch.float32, device=out_EN.device)
    grouped.segment_sum(src, offs, rows, **kw)
    out_EN.add_(rows.to(out_EN.dtype))
