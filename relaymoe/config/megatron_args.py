"""A config as Megatron-LM's command-line flags, and notes on what they render differently.

Keys of ``model:`` and ``training:`` are Megatron argument names in snake_case (``num_layers``
is ``--num-layers``), so the rendering is mechanical but for the few fields handled by name.
"""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

from relaymoe.config.schema import DISPATCHERS, Config, ModelConfig
from relaymoe.options import HOP_SLICE_MIB

# ModelConfig fields not rendered 1:1 (handled explicitly below).
_MODEL_SPECIAL = {"num_query_groups", "max_position_embeddings", "moe_shared_expert_gate"}
# Linear-attention knobs only make sense with the gated_delta_net variant.
_LINEAR_KEYS = {
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _render_value(v) -> str:
    if isinstance(v, tuple):
        return "[" + ",".join(str(x) for x in v) + "]"  # Megatron evaluates "[..]" patterns
    return str(v)


def to_megatron_args(cfg: Config, *, dispatcher: str | None = None) -> list[str]:
    """Megatron-LM command-line flags for the model, parallelism, training and relaymoe sections.

    ``dispatcher`` overrides ``cfg.relaymoe.dispatcher``; ``ring`` renders
    ``--moe-token-dispatcher-type ring --relaymoe-mode <mode>`` (flags that exist once
    ``relaymoe.megatron`` is registered). Data, tokenizer, optimizer and schedule flags are the
    launcher's business.
    """
    dispatcher = dispatcher or cfg.relaymoe.dispatcher
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher={dispatcher!r}; known: {DISPATCHERS}")
    m, p, t = cfg.model, cfg.parallel, cfg.training
    defaults = {f.name: f.default for f in fields(ModelConfig)}
    args: list[str] = []
    for f in fields(ModelConfig):
        name, v = f.name, getattr(m, f.name)
        if name in _MODEL_SPECIAL:
            continue
        if name in _LINEAR_KEYS and m.experimental_attention_variant is None:
            continue
        if isinstance(v, bool):
            if v:
                args.append(_flag(name))
            continue
        if v is None:
            continue
        # Megatron has its own defaults for these; render them only when ours differ or matter.
        if name in ("moe_layer_freq",) and v == 1:
            continue
        if name == "make_vocab_size_divisible_by" and v == defaults[name]:
            continue
        args += [_flag(name), _render_value(v)]
    if m.query_groups != m.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", str(m.query_groups)]
    if m.moe_shared_expert_gate:
        args.append("--moe-shared-expert-gate")
    args += ["--max-position-embeddings", str(max_positions(cfg))]
    # parallel
    args += [
        "--tensor-model-parallel-size", str(p.tp),
        "--context-parallel-size", str(p.cp),
        "--pipeline-model-parallel-size", str(p.pp),
        "--expert-model-parallel-size", str(p.ep),
        "--expert-tensor-parallel-size", str(p.etp),
    ]  # fmt: skip
    if p.vpp is not None and p.vpp > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(p.vpp)]
    if p.sequence_parallel and p.tp > 1:
        args.append("--sequence-parallel")
    if p.use_distributed_optimizer:
        args.append("--use-distributed-optimizer")
    # training
    gbs = t.global_batch_size or t.micro_batch_size * p.dp
    args += [
        "--seq-length", str(t.seq_length),
        "--micro-batch-size", str(t.micro_batch_size),
        "--global-batch-size", str(gbs),
        "--moe-token-dispatcher-type", dispatcher,
    ]  # fmt: skip
    if dispatcher == "ring":
        args += ["--relaymoe-mode", cfg.relaymoe.mode]
        if cfg.relaymoe.transport != "auto":
            args += ["--relaymoe-transport", cfg.relaymoe.transport]
        if cfg.relaymoe.hop_slice_mib != HOP_SLICE_MIB:
            args += ["--relaymoe-hop-slice-mib", str(cfg.relaymoe.hop_slice_mib)]
        if p.gpus_per_node is not None:
            args += ["--relaymoe-gpus-per-node", str(p.gpus_per_node)]
    if cfg.relaymoe.recompute_planner:
        args.append("--relaymoe-recompute-planner")
    if cfg.relaymoe.fused_loss:
        args.append("--relaymoe-fused-loss")
    if t.precision in ("bf16", "fp16"):
        args.append(f"--{t.precision}")
    if not t.gradient_accumulation_fusion:
        args.append("--no-gradient-accumulation-fusion")
    args += recompute_args(
        t.recompute_granularity, t.recompute_method, t.recompute_num_layers, t.recompute_modules
    )
    return args


# Flags whose presence sets another argument to False (Megatron's store_false flags)
_STORE_FALSE = {
    "disable_bias_linear": "add_bias_linear",
    "no_gradient_accumulation_fusion": "gradient_accumulation_fusion",
}


def megatron_namespace(flags: list[str]) -> SimpleNamespace:
    """Megatron's parsed arguments for the flags ``to_megatron_args`` renders, as far as the
    flags give them (an args-like object for ``relaymoe.megatron.validate``'s checks, without
    Megatron): ``--name value`` is ``name=value`` (an int or a float where the text is one),
    several values a list, a bare flag True (``--disable-bias-linear``: ``add_bias_linear``
    False; ``--no-gradient-accumulation-fusion``: ``gradient_accumulation_fusion`` False).
    Arguments no flag sets are absent (the checks read Megatron's defaults for them)."""
    out: dict = {}
    for flag, *words in flag_groups(flags):
        name = flag[2:].replace("-", "_")
        values = [_parsed(v) for v in words]
        if not values:
            name, value = _STORE_FALSE.get(name, name), name not in _STORE_FALSE
        else:
            value = values[0] if len(values) == 1 else values
        out[name] = value
    return SimpleNamespace(**out)


def flag_groups(flags: list[str]) -> list[list[str]]:
    """``flags`` cut into one list per flag: the flag, then its values (the words up to the
    next ``--`` word), as ``relaymoe flags`` prints them, one flag per line."""
    groups: list[list[str]] = []
    for word in flags:
        if word.startswith("--") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    return groups


def _parsed(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def max_positions(cfg: Config) -> int:
    """``--max-position-embeddings``: the model's, or the sequence length when that is longer.

    Megatron asserts ``max_position_embeddings >= seq_length``. Only a learned absolute
    position table is sized by it (``validate_layout`` refuses a sequence longer than that
    table); RoPE and the other encodings take any length, so training longer than the model's
    native context (a planner question, ``relaymoe plan --seq``) raises the flag to the sequence
    length, and :func:`megatron_notes` says so: refusing would make the user edit the model to
    ask about memory, and keeping the smaller value would give flags Megatron rejects."""
    pos = cfg.model.max_position_embeddings or cfg.training.seq_length
    return max(pos, cfg.training.seq_length)


def megatron_notes(cfg: Config) -> list[str]:
    """One line for each value ``to_megatron_args`` renders differently from the config."""
    m, t = cfg.model, cfg.training
    notes = []
    if m.max_position_embeddings is not None and t.seq_length > m.max_position_embeddings:
        notes.append(
            f"training.seq_length={t.seq_length} exceeds model.max_position_embeddings="
            f"{m.max_position_embeddings}: the flags pass --max-position-embeddings "
            f"{t.seq_length} (Megatron requires max_position_embeddings >= seq_length; "
            f"{m.position_embedding_type} positions size no weight by it); a model trained at "
            f"{m.max_position_embeddings} positions may want RoPE scaling at this length"
        )
    return notes


def recompute_args(
    granularity: str | None,
    method: str | None = None,
    num_layers: int | None = None,
    modules: tuple[str, ...] | list[str] | None = None,
) -> list[str]:
    """Megatron's recompute flags (shared by configs and the planner's output)."""
    if granularity is None:
        return []
    out = ["--recompute-granularity", granularity]
    if granularity == "full":
        out += ["--recompute-method", str(method), "--recompute-num-layers", str(num_layers)]
    elif modules:
        out += ["--recompute-modules", *modules]
    return out
