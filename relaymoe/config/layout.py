"""The parallel layout's arithmetic: the sizes that must divide the model, the sequence and batch.

``validate_layout`` applies Megatron's own rules (every one a ``ValueError`` naming the value,
the limit and the fix); ``Config`` calls it on every construction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relaymoe.config.schema import ModelConfig, ParallelConfig, TrainingConfig


def _check_divides(size: str, n: int, what: str, value: int, fix: str = "") -> None:
    """Refuse a parallel size ``size=n`` that does not divide the model's ``what=value``."""
    if value % n:
        raise ValueError(f"{size}={n} does not divide {what}={value}" + (f"; {fix}" if fix else ""))


def validate_layout(model: ModelConfig, par: ParallelConfig, tr: TrainingConfig) -> None:
    """Checks that the parallel sizes divide the model and the sequence (Megatron's own rules)."""
    _check_divides(
        "parallel.ep", par.ep, "model.num_experts", model.num_experts,
        "choose ep among the divisors of the expert count",
    )  # fmt: skip
    _check_divides(
        "parallel.tp", par.tp, "model.num_attention_heads", model.num_attention_heads,
        "choose a tp that divides the head count",
    )  # fmt: skip
    _check_divides(
        "parallel.tp", par.tp, "model.num_query_groups", model.query_groups,
        "choose tp <= the number of KV groups and dividing it",
    )  # fmt: skip
    _check_divides("parallel.etp", par.etp, "model.moe_ffn_hidden_size", model.moe_ffn_hidden_size)
    stages = par.pp * (par.vpp or 1)
    if model.num_layers % stages:
        raise ValueError(
            f"model.num_layers={model.num_layers} is not divisible by pp*vpp={stages}; "
            "choose pp (and vpp) so that every virtual stage gets the same number of layers"
        )
    if par.tp > 1 and not par.sequence_parallel:
        raise ValueError(
            f"parallel.tp={par.tp} with sequence_parallel=false: Megatron MoE needs sequence "
            "parallelism whenever tp > 1; set parallel.sequence_parallel: true"
        )
    shard = par.cp * 2 if par.cp > 1 else 1  # Megatron splits each CP chunk in two (load balance)
    shard *= par.tp if par.sequence_parallel else 1
    if tr.seq_length % shard:
        raise ValueError(
            f"training.seq_length={tr.seq_length} is not divisible by "
            f"{'2*cp*tp' if par.cp > 1 else 'tp'}={shard}; round it to a multiple of {shard}"
        )
    if tr.global_batch_size is not None and tr.global_batch_size % (tr.micro_batch_size * par.dp):
        raise ValueError(
            f"training.global_batch_size={tr.global_batch_size} is not a multiple of "
            f"micro_batch_size*dp={tr.micro_batch_size * par.dp}"
        )
    positions = model.max_position_embeddings
    if (
        model.position_embedding_type == "learned_absolute"
        and positions is not None
        and tr.seq_length > positions
    ):
        raise ValueError(
            f"training.seq_length={tr.seq_length} exceeds model.max_position_embeddings="
            f"{positions}, the rows of the learned position table; lower seq_length, or raise "
            "max_position_embeddings (a larger table: new, untrained positions)"
        )
    if tr.normalization_impl.startswith("torch") and par.tp > 1:
        raise ValueError(
            f"training.normalization_impl={tr.normalization_impl!r} with parallel.tp={par.tp}: "
            "megatron-core's "
            "torch norm fallback refuses sequence parallelism, which MoE needs at tp > 1; "
            "install TransformerEngine or apex (normalization_impl: fused) or use tp=1"
        )
    if tr.recompute_granularity == "full" and tr.recompute_num_layers:
        per_stage = model.num_layers // stages
        if tr.recompute_num_layers > per_stage:
            raise ValueError(
                f"training.recompute_num_layers={tr.recompute_num_layers} exceeds the "
                f"{per_stage} layers of a (virtual) pipeline stage"
            )
