"""Chunked linear + cross-entropy: the language-model loss without a ``(T, V)`` logits tensor.

Shape legend: T tokens, H hidden, Vl vocabulary rows on this rank (``V / TP``), V the whole
vocabulary, C tokens of one chunk.

``linear_cross_entropy(hidden_TH, weight_VH, labels_T)`` returns the per-token loss of
``softmax(hidden @ weight_full.T)``, the value Megatron's output layer followed by
``tensor_parallel.vocab_parallel_cross_entropy`` returns: the logits are rounded to the
activations' dtype (the output layer's GEMM output), the statistics are taken in fp32, and the
vocabulary is split over ``tp_group`` as Megatron splits it (rank ``r`` holds global rows
``[r*Vl, (r+1)*Vl)``).

How (per chunk of ``C`` tokens, ``C`` from ``relaymoe.lossmodel.default_chunk_tokens``):
1. ``logits_CV = h_C @ W.T`` into one reused ``(C, Vl)`` buffer (activations' dtype).
2. Per-row max, sum-exp, target logit (and the row sum for label smoothing); across ``tp_group``
   an all-reduce MAX of the max, then one all-reduce SUM of the rescaled sum-exp and the target
   logit together.
3. When a gradient is wanted, the chunk's logits gradient ``softmax - onehot`` (label smoothing
   included, ignored tokens zero) overwrites the logits buffer, and is applied at once:
   ``dh_unit[C] = dlogits @ W`` and ``dW_unit += dlogits.T @ h_C`` (fp32 accumulation).
So the forward does the three GEMMs of the layer and the backward none: ``dh = g * dh_unit``
holds for any upstream gradient ``g``, and ``dW = c * dW_unit`` when ``g == c`` on every
non-ignored token (the loss-mask-times-constant form of a training loss once masked tokens carry
``ignore_index``). Backward checks that condition with one host sync; when it does not hold it
recomputes each chunk's logits and weight gradient weighted by ``g`` (exact, one GEMM pair more
per chunk).

Peak extra memory: one chunk's working set plus ``dh_unit`` (T, H, activations' dtype) and
``dW_unit`` (Vl, H, fp32), see ``relaymoe.lossmodel``. Deterministic: fixed chunk order, no
atomics.

The accumulate mode (``weight_grad_into=``, ``relaymoe.loss.accumulate``) keeps no ``dW_unit``:
the weight gradient goes into the caller's accumulator (Megatron's ``main_grad``), during the
forward when the caller gives the upstream gradient it expects (``expected_grad``; the backward
corrects it exactly where the real one differs), else in the backward. Its transient is one
chunk's working set. ``check_settled`` and ``reset_ledger`` (``relaymoe.loss.ledger``) guard a
forward whose backward never ran.

Tensor parallelism. Every rank of ``tp_group`` passes the same ``hidden`` and ``labels`` (same
T) and its own shard of the weight. The hidden gradient returned is this rank's part
``dlogits_local @ W_local``; the caller sums it over the group, as Megatron's column-parallel
output layer does (``copy_to_tensor_model_parallel_region``, or the sequence-parallel gather,
whose backward all-reduces / reduce-scatters). The weight gradient is this rank's shard's, whole.

Label smoothing follows Megatron's formula (``smoothing = a * Vl / (Vl - 1)``, loss
``(1 - smoothing) * nll - smoothing * mean(log p)``) including its tensor-parallel behaviour:
``Vl`` and the mean are those of this rank's shard, so at TP > 1 with smoothing the ranks return
different losses, exactly as Megatron's do. At TP = 1 it equals ``torch.nn.functional
.cross_entropy(label_smoothing=a * V / (V - 1))``.

The modules: ``autograd`` (``linear_cross_entropy`` and the default mode's autograd function),
``accumulate`` (the accumulate mode), ``ledger`` (its speculative contributions), ``passes``
(the loops over the chunks), ``inputs`` (the checks of the arguments, the call's setup), ``tp``
(the tensor-parallel contract, agreed in one all-reduce), ``chunk`` (what one chunk computes).
"""

from relaymoe.loss.autograd import linear_cross_entropy
from relaymoe.loss.ledger import check_settled, reset_ledger

__all__ = ["check_settled", "linear_cross_entropy", "reset_ledger"]
