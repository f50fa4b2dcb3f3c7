"""Memory of the language-model loss: relaymoe's chunked linear + cross-entropy against Megatron's.

Pure Python (no torch): ``relaymoe.linear_cross_entropy`` takes its default chunk from here and
the planner sizes the last pipeline stage from here, so the two cannot disagree.

Legend: ``T`` tokens on this rank, ``H`` hidden, ``Vl`` vocabulary rows on this rank (the
vocab-parallel shard, ``V/TP``), ``C`` tokens per chunk, ``b`` bytes of an activation element.

The fused loss never holds a ``(T, Vl)`` tensor. One chunk's working set is ``C*Vl`` elements
at ``logit_bytes(impl, b)`` bytes each: the logits in the activations' dtype (their gradient is
written over them), plus, on the torch path, one fp32 working copy that every elementwise step
updates in place (fp64 for fp64 activations). The Triton path (the default on CUDA) needs only
the first ``b`` bytes. What it keeps across chunks depends on where the weight gradient goes
(``wgrad``):

* ``"kept"`` (the default mode): the hidden gradient ``(T, H)`` in the activations' dtype and
  the weight gradient ``(Vl, H)`` in fp32, both computed during the forward; the backward then
  returns ``dW`` in the weight's dtype beside them;
* ``"accumulate"`` (``weight_grad_into`` with ``expected_grad``): the weight gradient goes into
  the caller's accumulator during the forward; the forward keeps the hidden gradient ``(T, H)``,
  which the backward returns itself (no copy);
* ``"recompute"`` (``weight_grad_into`` without ``expected_grad``): the forward keeps no
  gradient; the backward's pass holds one chunk and writes the returned hidden gradient.

``transient`` is what the op adds beyond its inputs, the gradients that existed before the call
(the accumulator, or a ``weight.grad`` being accumulated into) and the hidden gradient it
returns: what ``benchmarks/bench_loss.py`` measures as ``transient_MiB``.

The default chunk (``default_chunk_tokens``, a multiple of ``CHUNK_QUANTUM`` tokens) by mode:

* ``"accumulate"`` and ``"recompute"``: the chunk's working set is the op's whole transient, so
  it stays within ``ACCUMULATE_CHUNK_BUDGET_BYTES`` at the bytes a logit of the impl that runs
  (at V 151,936 in bf16: 1,664 tokens on Triton, 512 on the torch path);
* ``"kept"``: the transient is mostly the fp32 ``(Vl, H)`` weight gradient (3.6 times a
  Triton chunk of 2,304 tokens at H 4,096), so the chunk is sized for time, not memory, and is
  the same on either impl: ``KEPT_CHUNK_BUDGET_BYTES`` at the torch path's bytes a logit (2,304
  tokens at V 151,936 in bf16). Fewer, larger chunks make fewer read-modify-write passes over
  the fp32 weight gradient (each chunk adds into all of it); the accumulate budget there would
  save about 5% of the transient for about 5% more time.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ACCUMULATE_CHUNK_BUDGET_BYTES",
    "CHUNK_QUANTUM",
    "IMPLS",
    "KEPT_CHUNK_BUDGET_BYTES",
    "WGRAD_MODES",
    "FusedLossBytes",
    "default_chunk_tokens",
    "fused_loss_bytes",
    "logit_bytes",
]

# one chunk's working set by default (module doc): the whole transient where the weight gradient
# goes into an accumulator; the kept mode's, counted at the torch path's bytes a logit
ACCUMULATE_CHUNK_BUDGET_BYTES = 512 * 2**20
KEPT_CHUNK_BUDGET_BYTES = 2 * 2**30
CHUNK_QUANTUM = 128  # chunks are multiples of this many tokens (GEMM tiles), but never above T
WGRAD_MODES = ("kept", "accumulate", "recompute")  # where the weight gradient goes (module doc)
IMPLS = ("triton", "torch")  # linear_cross_entropy's resolved impl


def logit_bytes(impl: str, act_bytes: int = 2) -> int:
    """Bytes one logit of a chunk's working set takes: ``"triton"``, the logits in the
    activations' dtype (``act_bytes``; their gradient written over them); ``"torch"``, those
    plus the working copy in the statistics' dtype (fp32, or fp64 for 8-byte activations)."""
    if impl not in IMPLS:
        raise ValueError(f"logit_bytes: impl={impl!r}; use one of {IMPLS}")
    if act_bytes not in (2, 4, 8):
        raise ValueError(f"logit_bytes: act_bytes={act_bytes!r}; use 2, 4 or 8 (the dtype's size)")
    if impl == "triton":
        return act_bytes
    return act_bytes + (8 if act_bytes == 8 else 4)


def default_chunk_tokens(
    tokens: int,
    vocab_local: int,
    *,
    wgrad: str = "kept",
    impl: str = "torch",
    act_bytes: int = 2,
) -> int:
    """Tokens per chunk by default (module doc): the largest multiple of ``CHUNK_QUANTUM``
    whose working set fits the mode's budget (at least ``CHUNK_QUANTUM``, at most ``tokens``; 1
    when ``tokens`` is 0). ``wgrad``: ``WGRAD_MODES``; ``impl``: the one that runs (``IMPLS``);
    ``act_bytes``: bytes of an activation element."""
    if tokens < 0 or vocab_local < 1:
        raise ValueError(
            f"default_chunk_tokens: tokens={tokens} must be >= 0 and vocab_local={vocab_local} >= 1"
        )
    if wgrad not in WGRAD_MODES:
        raise ValueError(f"default_chunk_tokens: wgrad={wgrad!r}; use one of {WGRAD_MODES}")
    if wgrad == "kept":
        budget, per_logit = KEPT_CHUNK_BUDGET_BYTES, logit_bytes("torch", act_bytes)
    else:
        budget, per_logit = ACCUMULATE_CHUNK_BUDGET_BYTES, logit_bytes(impl, act_bytes)
    fit = budget // (vocab_local * per_logit)
    c = max(CHUNK_QUANTUM, fit // CHUNK_QUANTUM * CHUNK_QUANTUM)
    return max(1, min(c, tokens))


@dataclass(frozen=True)
class FusedLossBytes:
    chunk: int  # one chunk's working set (transient)
    dhidden: int  # the hidden gradient made in the forward and kept to the backward
    dweight: int  # the fp32 weight gradient kept from the forward to the backward ("kept")
    wgrad: str = "kept"  # WGRAD_MODES
    returned_dhidden: int = 0  # the hidden gradient the backward returns
    returned_dweight: int = 0  # the weight gradient the backward returns ("kept")

    @property
    def total(self) -> int:
        """The forward's peak over the inputs."""
        return self.chunk + self.dhidden + self.dweight

    @property
    def backward_peak(self) -> int:
        """The backward's peak over the inputs, the returned gradients included."""
        if self.wgrad == "kept":
            return self.dhidden + self.dweight + self.returned_dhidden + self.returned_dweight
        if self.wgrad == "accumulate":  # the kept hidden gradient is the returned one; a
            return self.dhidden + self.chunk  # correction pass holds one chunk beside it
        return self.chunk + self.returned_dhidden

    @property
    def peak(self) -> int:
        """Peak over the inputs across forward and backward, returned gradients included."""
        return max(self.total, self.backward_peak)

    @property
    def transient(self) -> int:
        """The peak less the returned hidden gradient (module doc), when the upstream gradient
        is the one expected (``"accumulate"``: no correction pass)."""
        if self.wgrad == "accumulate":
            return self.chunk
        return self.peak - self.returned_dhidden


def fused_loss_bytes(
    tokens: int,
    hidden: int,
    vocab_local: int,
    *,
    chunk_tokens: int | None = None,
    act_bytes: int = 2,
    weight_grad: bool = True,
    wgrad: str = "kept",
    impl: str = "torch",
) -> FusedLossBytes:
    """Bytes of ``linear_cross_entropy`` on one rank (``total``: its forward's peak over its
    inputs, what the planner counts). ``wgrad``: where the weight gradient goes (module doc);
    ``impl``: the one that runs (``IMPLS``); ``chunk_tokens`` None: the op's default for these."""
    if wgrad not in WGRAD_MODES:
        raise ValueError(f"fused_loss_bytes: wgrad={wgrad!r}; use one of {WGRAD_MODES}")
    c = chunk_tokens or default_chunk_tokens(tokens, vocab_local, wgrad=wgrad, impl=impl,
                                             act_bytes=act_bytes)  # fmt: skip
    c = min(c, max(tokens, 1))
    dh = tokens * hidden * act_bytes
    kept = wgrad == "kept"
    return FusedLossBytes(
        chunk=c * vocab_local * logit_bytes(impl, act_bytes),
        dhidden=dh if wgrad != "recompute" else 0,
        dweight=vocab_local * hidden * 4 if weight_grad and kept else 0,
        wgrad=wgrad,
        returned_dhidden=dh,
        returned_dweight=vocab_local * hidden * act_bytes if weight_grad and kept else 0,
    )
