"""The config schema: the model, parallel, training and relaymoe sections, each checked when built.

Field names of ``ModelConfig`` and ``TrainingConfig`` are Megatron's argument names;
``ParallelConfig`` uses the short names (``tp``, ``cp``, ``pp``, ``vpp``, ``ep``, ``etp``, ``dp``).
``Config`` holds the four sections and validates their layout (``layout.validate_layout``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from relaymoe.config.checks import check_keys, check_pos_int, coerce
from relaymoe.config.layout import validate_layout
from relaymoe.options import KernelOptions, RingConfig, check_field


@dataclass(frozen=True)
class ModelConfig:
    """Architecture; field names are Megatron's argument names (``args.<name>``)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_experts: int
    moe_router_topk: int
    moe_ffn_hidden_size: int
    vocab_size: int
    ffn_hidden_size: int | None = None  # dense MLP width (layers that moe_layer_freq makes dense)
    num_query_groups: int | None = None  # None: multi-head attention (groups == heads)
    kv_channels: int | None = None  # head dim; None: hidden_size // num_attention_heads
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    max_position_embeddings: int | None = None  # None: training.seq_length
    untie_embeddings_and_output_weights: bool = True
    make_vocab_size_divisible_by: int = 128
    qk_layernorm: bool = False
    add_qkv_bias: bool = False
    attention_output_gate: bool = False
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-6
    # the MLPs' activation (Megatron's flags): SwiGLU, squared ReLU, or neither (GELU, not gated)
    swiglu: bool = True
    squared_relu: bool = False
    disable_bias_linear: bool = True
    position_embedding_type: str = "rope"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    moe_layer_freq: int | tuple[int, ...] = 1  # int N: every N-th layer is MoE; list: 1 = MoE
    moe_grouped_gemm: bool = True
    attention_dropout: float = 0.0  # Megatron's default is 0.1; Qwen models train without dropout
    hidden_dropout: float = 0.0
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 1e-3
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    # Hybrid linear attention (Megatron's gated_delta_net variant, Qwen3-Next / Qwen3.5).
    experimental_attention_variant: str | None = None
    linear_attention_freq: int | tuple[int, ...] | None = (
        None  # int N: (N-1) LA per 1 full; list: 1=LA
    )
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    mtp_num_layers: int | None = None

    def __post_init__(self):
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_experts",
            "moe_router_topk",
            "moe_ffn_hidden_size",
            "vocab_size",
        ):
            check_pos_int(f"model.{name}", getattr(self, name))
        for name in (
            "ffn_hidden_size",
            "num_query_groups",
            "kv_channels",
            "moe_shared_expert_intermediate_size",
            "max_position_embeddings",
            "mtp_num_layers",
        ):
            v = getattr(self, name)
            if v is not None:
                check_pos_int(f"model.{name}", v)
        if self.moe_router_topk > self.num_experts:
            raise ValueError(
                f"model.moe_router_topk={self.moe_router_topk} exceeds model.num_experts="
                f"{self.num_experts}; top-k must be at most the number of experts"
            )
        if self.num_attention_heads % self.query_groups:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"model.num_query_groups={self.num_query_groups}; pick a divisor of the head count"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; set model.kv_channels (the head dim) explicitly"
            )
        if self.swiglu and self.squared_relu:
            raise ValueError(
                "model.swiglu and model.squared_relu are both true; Megatron builds one MLP "
                "activation: set swiglu: false for squared ReLU"
            )
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(
                f"model.normalization={self.normalization!r}; known: 'RMSNorm', 'LayerNorm'"
            )
        if self.experimental_attention_variant not in (None, "gated_delta_net"):
            raise ValueError(
                f"model.experimental_attention_variant={self.experimental_attention_variant!r}: "
                "relaymoe models only 'gated_delta_net' (or none)"
            )
        if (self.experimental_attention_variant is None) != (self.linear_attention_freq is None):
            raise ValueError(
                "model.experimental_attention_variant='gated_delta_net' and "
                "model.linear_attention_freq must be set together (got "
                f"{self.experimental_attention_variant!r} and {self.linear_attention_freq!r})"
            )
        for name in ("moe_layer_freq", "linear_attention_freq"):
            v = getattr(self, name)
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))
                v = getattr(self, name)
            if isinstance(v, tuple):
                if len(v) != self.num_layers or any(x not in (0, 1) for x in v):
                    raise ValueError(
                        f"model.{name} pattern must be {self.num_layers} entries of 0/1 "
                        f"(one per layer), got {list(v)}"
                    )
            elif v is not None:
                check_pos_int(f"model.{name}", v)
        if self.moe_layer_pattern.count(0) and self.ffn_hidden_size is None:
            raise ValueError(
                "model.moe_layer_freq makes some layers dense but model.ffn_hidden_size is unset; "
                "give the dense MLP width"
            )

    # -- derived quantities -------------------------------------------------------------------
    @property
    def num_moe_experts(self) -> int:  # TransformerConfig's name for the same thing
        return self.num_experts

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def moe_layer_pattern(self) -> tuple[int, ...]:
        """1 for an MoE layer, 0 for a dense-MLP layer (Megatron's moe_layer_freq semantics)."""
        f = self.moe_layer_freq
        if isinstance(f, tuple):
            return f
        return tuple(1 if i % f == 0 else 0 for i in range(self.num_layers))

    @property
    def attention_layer_pattern(self) -> tuple[int, ...]:
        """1 for a full (softmax) attention layer, 0 for a linear-attention (gated delta net)."""
        f = self.linear_attention_freq
        if f is None:
            return (1,) * self.num_layers
        if isinstance(f, tuple):
            return tuple(1 - x for x in f)
        # Megatron: N means (N-1) LA layers then 1 SDPA layer, repeated.
        return tuple(1 if (i + 1) % f == 0 else 0 for i in range(self.num_layers))

    def padded_vocab_size(self, tp: int) -> int:
        m = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // m) * m


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel sizes. World size = tp * cp * pp * dp; experts use ep * etp of the tp*cp*dp ranks
    of a pipeline stage (MoE parallel folding)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual stages per pipeline rank
    ep: int = 1
    etp: int = 1
    dp: int = 1
    sequence_parallel: bool = True
    use_distributed_optimizer: bool = True
    # GPUs per node of the cluster (None: the job's EP groups lie in one node). The planner
    # takes the ring's schedule from it (cost.choose_schedule).
    gpus_per_node: int | None = None

    def __post_init__(self):
        for name in ("tp", "cp", "pp", "ep", "etp", "dp"):
            check_pos_int(f"parallel.{name}", getattr(self, name))
        if self.gpus_per_node is not None:
            check_pos_int("parallel.gpus_per_node", self.gpus_per_node)
            G, span = self.gpus_per_node, self.ep * self.etp
            # Megatron lays an EP group over ep*etp consecutive ranks (members etp apart)
            if span > G and (span % G or (G % self.etp and self.etp % G)):
                raise ValueError(
                    f"parallel.gpus_per_node={G}: the EP group spans ep*etp={span} consecutive "
                    f"GPUs, more than one node of {G} but not whole nodes of equally many EP "
                    f"ranks; fix: make ep*etp a multiple of {G} (with etp dividing {G}), or at "
                    f"most {G} so that the group fits in one node"
                )
        if self.vpp is not None:
            check_pos_int("parallel.vpp", self.vpp)
            if self.pp == 1 and self.vpp > 1:
                raise ValueError(
                    f"parallel.vpp={self.vpp} needs parallel.pp > 1 (virtual stages interleave "
                    "pipeline stages); unset vpp or raise pp"
                )
        if (self.tp * self.cp * self.dp) % (self.ep * self.etp):
            raise ValueError(
                f"parallel: ep*etp={self.ep * self.etp} does not divide the tp*cp*dp="
                f"{self.tp * self.cp * self.dp} ranks of a pipeline stage (world "
                f"{self.world_size} = tp {self.tp} x cp {self.cp} x pp {self.pp} x dp {self.dp}); "
                "change dp or ep so that ep*etp divides tp*cp*dp"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        return self.tp * self.cp * self.dp // (self.ep * self.etp)


@dataclass(frozen=True)
class TrainingConfig:
    seq_length: int
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None: micro_batch_size * dp
    precision: str = "bf16"  # bf16 | fp16 | fp32
    recompute_granularity: str | None = None  # None | "full" | "selective"
    recompute_method: str | None = None  # None | "uniform" | "block" (full only)
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None  # selective only; Megatron default core_attn
    # How Megatron's build normalises (memory model only; not a Megatron flag): "fused" =
    # TransformerEngine, apex or another fused kernel (keeps the input and an fp32 rstd);
    # "torch" = megatron-core's fallback without TE and apex (``WrappedTorchNorm``) on a torch
    # whose RMSNorm is one fused kernel (``aten::_fused_rms_norm``: the same bytes as fused);
    # "torch_composite" = that fallback on a torch without the kernel, whose composite RMSNorm
    # keeps fp32 copies for backward (``relaymoe.planner.memory``).
    normalization_impl: str = "fused"
    # Megatron's gradient-accumulation fusion (its default; false: --no-gradient-accumulation-
    # fusion): layers add their weight gradients into DDP's main_grad themselves, the ring's
    # experts inside their weight-gradient kernel (relaymoe.planner.memory counts no buffer)
    gradient_accumulation_fusion: bool = True

    def __post_init__(self):
        check_pos_int("training.seq_length", self.seq_length)
        if not isinstance(self.gradient_accumulation_fusion, bool):
            raise ValueError(
                "training.gradient_accumulation_fusion="
                f"{self.gradient_accumulation_fusion!r} must be true or false"
            )
        if self.normalization_impl not in NORMALIZATION_IMPLS:
            raise ValueError(
                f"training.normalization_impl={self.normalization_impl!r}; known: "
                f"{', '.join(repr(x) for x in NORMALIZATION_IMPLS)} (fused: TransformerEngine "
                "or apex, torch: megatron-core's torch fallback, torch_composite: that fallback "
                "on a torch without the fused RMSNorm kernel)"
            )
        check_pos_int("training.micro_batch_size", self.micro_batch_size)
        if self.global_batch_size is not None:
            check_pos_int("training.global_batch_size", self.global_batch_size)
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise ValueError(
                f"training.precision={self.precision!r}; known: 'bf16', 'fp16', 'fp32'"
            )
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(
                f"training.recompute_granularity={self.recompute_granularity!r}; "
                "known: null, 'full', 'selective'"
            )
        if self.recompute_granularity == "full":
            if self.recompute_method not in ("uniform", "block"):
                raise ValueError(
                    f"training.recompute_method={self.recompute_method!r}: full recompute "
                    "needs 'uniform' or 'block'"
                )
            check_pos_int("training.recompute_num_layers", self.recompute_num_layers)
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            raise ValueError(
                "training.recompute_method / recompute_num_layers apply only to "
                f"recompute_granularity='full' (got {self.recompute_granularity!r})"
            )
        if isinstance(self.recompute_modules, list | str):
            mods = (
                (self.recompute_modules,)
                if isinstance(self.recompute_modules, str)
                else tuple(self.recompute_modules)
            )
            object.__setattr__(self, "recompute_modules", mods)
        if self.recompute_modules is not None:
            if self.recompute_granularity != "selective":
                raise ValueError(
                    "training.recompute_modules applies only to recompute_granularity="
                    f"'selective' (got {self.recompute_granularity!r})"
                )
            bad = set(self.recompute_modules) - RECOMPUTE_MODULES
            if bad:
                raise ValueError(
                    f"training.recompute_modules has unknown module(s) {sorted(bad)}; "
                    f"known: {sorted(RECOMPUTE_MODULES)}"
                )

    @property
    def bytes_per_param(self) -> int:
        return 4 if self.precision == "fp32" else 2


NORMALIZATION_IMPLS = ("fused", "torch", "torch_composite")

RECOMPUTE_MODULES = frozenset(
    {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"}
    | {"gdn_norm_out"}
)


DISPATCHERS = ("ring", "alltoall", "allgather", "flex")

# every RelayMoEConfig switch of its own with what it accepts: one of a tuple of choices, or a
# bool (flags); the ring's options among them are RingConfig's fields (_RING_OPTIONS)
_SWITCHES = {
    "dispatcher": DISPATCHERS,
    "recompute_planner": bool,
    "fused_loss": bool,
}
# the ring's options this section holds, each defined once in relaymoe.options: RingConfig's
# fields, and its kernels' (KernelOptions) that the memory plan depends on
_RING_FIELDS = {
    **{f.name: f for f in dataclasses.fields(RingConfig)},
    **{f.name: f for f in dataclasses.fields(KernelOptions)},
}
_RING_OPTIONS = ("mode", "transport", "hop_slice_mib")


def _ring_option(name: str):
    """The field of ``RingConfig`` (or of its ``KernelOptions``) of that name, as this
    section's (same default, choices and help): the option is defined once, in
    ``relaymoe.options``."""
    f = _RING_FIELDS[name]
    return dataclasses.field(default=f.default, metadata=f.metadata)


def _check_switch(name: str, value, known) -> None:
    if not (isinstance(value, bool) if known is bool else value in known):
        rule = " must be true or false" if known is bool else f"; known: {known}"
        raise ValueError(f"relaymoe.{name}={value!r}{rule}")


@dataclass(frozen=True)
class RelayMoEConfig:
    """relaymoe's switches: the dispatcher (``--moe-token-dispatcher-type``), the ring's mode
    (``mode``, ``--relaymoe-mode``) and transport (``--relaymoe-transport``), both
    ``relaymoe.options.RingConfig``'s fields, its hops' slice budget (``hop_slice_mib``,
    ``--relaymoe-hop-slice-mib``, ``KernelOptions``'), recompute planner
    (``--relaymoe-recompute-planner``), and the chunked output layer + cross-entropy
    (``--relaymoe-fused-loss``, ``relaymoe.linear_cross_entropy``; any dispatcher)."""

    dispatcher: str = "ring"  # ring | alltoall | allgather | flex
    mode: str = _ring_option("mode")
    transport: str = _ring_option("transport")
    hop_slice_mib: int = _ring_option("hop_slice_mib")
    recompute_planner: bool = False
    fused_loss: bool = False  # never holds the (tokens, vocab/TP) logits

    def __post_init__(self):
        for name, known in _SWITCHES.items():
            _check_switch(name, getattr(self, name), known)
        for name in _RING_OPTIONS:
            check_field("relaymoe", _RING_FIELDS[name], getattr(self, name))


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    relaymoe: RelayMoEConfig = field(default_factory=RelayMoEConfig)
    name: str = ""

    def __post_init__(self):
        validate_layout(self.model, self.parallel, self.training)

    def replace(self, *, name: str | None = None, **section_overrides) -> Config:
        """New config with some fields changed, e.g. ``cfg.replace(parallel={"tp": 4})``;
        re-validated."""
        kw = {}
        for sec, changes in section_overrides.items():
            if sec not in SECTIONS:
                raise ValueError(f"unknown config section {sec!r}; known: {sorted(SECTIONS)}")
            cls = SECTIONS[sec]
            check_keys(sec, changes, cls)
            kw[sec] = dataclasses.replace(getattr(self, sec), **coerce(sec, changes, cls))
        return dataclasses.replace(self, name=self.name if name is None else name, **kw)

    def to_dict(self) -> dict[str, Any]:
        out = {sec: dataclasses.asdict(getattr(self, sec)) for sec in SECTIONS}
        for sec in out.values():
            for k, v in sec.items():
                if isinstance(v, tuple):
                    sec[k] = list(v)
        return out


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "relaymoe": RelayMoEConfig,
}
