"""Memory of the language-model loss: relaymoe's chunked linear + cross-entropy against Megatron's.

Pure Python (no torch): ``relaymoe.linear_cross_entropy`` takes its default chunk from here and
the planner sizes the last pipeline stage from here, so the two cannot disagree.

Legend: ``T`` tokens on this rank, ``H`` hidden, ``Vl`` vocabulary rows on this rank (the
vocab-parallel shard, ``V/TP``), ``C`` tokens per chunk, ``b`` bytes of an activation element.

The fused loss never holds a ``(T, Vl)`` tensor. One chunk's working set is ``C*Vl`` elements at
``CHUNK_BYTES_PER_LOGIT`` bytes each: the logits in the activations' dtype (their gradient is
written over them), plus, on the torch path, one fp32 working copy that every elementwise step
updates in place. The Triton path (the default on CUDA) needs only the first ``b`` bytes; the
constant is the larger of the two, for 2-byte activations. Across chunks it keeps the hidden
gradient ``(T, H)`` in the activations' dtype and the weight gradient ``(Vl, H)`` in fp32, both
computed during the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
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
    dhidden: int  # the hidden gradient, kept from the forward to the backward
    dweight: int  # the fp32 weight gradient, kept from the forward to the backward

    @property
    def total(self) -> int:
        return self.chunk + self.dhidden + self.dweight


def fused_loss_bytes(
    tokens: int,
    hidden: int,
    vocab_local: int,
    *,
    chunk_tokens: int | None = None,
    act_bytes: int = 2,
    weight_grad: bool = True,
) -> FusedLossBytes:
    """Peak extra bytes of ``linear_cross_entropy`` on one rank during its forward (the backward
    only scales what the forward kept)."""
    c = chunk_tokens or default_chunk_tokens(tokens, vocab_local)
    c = min(c, max(tokens, 1))
    return FusedLossBytes(
        chunk=c * vocab_local * CHUNK_BYTES_PER_LOGIT,
        dhidden=tokens * hidden * act_bytes,
        dweight=vocab_local * hidden * 4 if weight_grad else 0,
    )
