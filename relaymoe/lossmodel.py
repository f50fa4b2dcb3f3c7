"""Memory of the language-model loss: relaymoe's chunked linear + cross-entropy against Megatron's.

Pure Python (no torch): ``relaymoe.linear_cross_entropy`` takes its default chunk from here and
the planner sizes the last pipeline stage from here, so the two cannot disagree.

Legend: ``T`` tokens on this rank, ``H`` hidden, ``Vl`` vocabulary rows on this rank (the
vocab-parallel shard, ``V/TP``), ``C`` tokens per chunk, ``b`` bytes of an activation element.

The fused loss never holds a ``(T, Vl)`` tensor. One chunk's working set is ``C*Vl`` elements at
``CHUNK_BYTES_PER_LOGIT`` bytes each: the logits in the activations' dtype (their gradient is
written over them), plus, on the torch path, one fp32 working copy that every elementwise step
updates in place. The Triton path (the default on CUDA) needs only the first ``b`` bytes; the
constant is the larger of the two, for 2-byte activations (``impl="triton"`` counts the logits
alone). What it keeps across chunks depends on where the weight gradient goes (``wgrad``):

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
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "WGRAD_MODES",
    "CHUNK_BYTES_PER_LOGIT",
    "CHUNK_QUANTUM",
    "LOSS_CHUNK_BUDGET_BYTES",
    "FusedLossBytes",
    "default_chunk_tokens",
    "fused_loss_bytes",
]

LOSS_CHUNK_BUDGET_BYTES = 2 * 2**30  # one chunk's working set, by default
CHUNK_BYTES_PER_LOGIT = 6  # b=2 logits, then their gradient in place + 4 fp32 copy (torch path)
CHUNK_QUANTUM = 128  # chunks are multiples of this many tokens (GEMM tiles), but never above T
WGRAD_MODES = ("kept", "accumulate", "recompute")  # where the weight gradient goes (module doc)


def default_chunk_tokens(tokens: int, vocab_local: int) -> int:
    """Tokens per chunk so that one chunk's working set stays within ``LOSS_CHUNK_BUDGET_BYTES``
    (at least ``CHUNK_QUANTUM``, at most ``tokens``; 1 when ``tokens`` is 0)."""
    if tokens < 0 or vocab_local < 1:
        raise ValueError(
            f"default_chunk_tokens: tokens={tokens} must be >= 0 and vocab_local={vocab_local} >= 1"
        )
    fit = LOSS_CHUNK_BUDGET_BYTES // (vocab_local * CHUNK_BYTES_PER_LOGIT)
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
    impl: str | None = None,
) -> FusedLossBytes:
    """Bytes of ``linear_cross_entropy`` on one rank (``total``: its forward's peak over its
    inputs, what the planner counts). ``wgrad``: where the weight gradient goes (module doc);
    ``impl``: ``"triton"`` counts the chunk's logits alone, else ``CHUNK_BYTES_PER_LOGIT``."""
    if wgrad not in WGRAD_MODES:
        raise ValueError(f"fused_loss_bytes: wgrad={wgrad!r}; use one of {WGRAD_MODES}")
    c = chunk_tokens or default_chunk_tokens(tokens, vocab_local)
    c = min(c, max(tokens, 1))
    per_logit = act_bytes if impl == "triton" else CHUNK_BYTES_PER_LOGIT
    dh = tokens * hidden * act_bytes
    kept = wgrad == "kept"
    return FusedLossBytes(
        chunk=c * vocab_local * per_logit,
        dhidden=dh if wgrad != "recompute" else 0,
        dweight=vocab_local * hidden * 4 if weight_grad and kept else 0,
        wgrad=wgrad,
        returned_dhidden=dh,
        returned_dweight=vocab_local * hidden * act_bytes if weight_grad and kept else 0,
    )
