"""Model / parallel / training configuration: schema, YAML loader and Megatron CLI rendering.

A config file (``configs/*.yaml``) has the sections ``model:``, ``parallel:``, ``training:`` and an
optional ``relaymoe:``. Keys in ``model:`` and ``training:`` are Megatron argument names in
snake_case (``num_layers`` is ``--num-layers``), so ``to_megatron_args`` is a mechanical rendering.
``parallel:`` uses short names (``tp``, ``cp``, ``pp``, ``vpp``, ``ep``, ``etp``, ``dp``).

Everything is validated when loaded: unknown keys, wrong types, and parallel sizes that do not
divide the world or the model raise ``ValueError`` naming the value, the limit and the fix.
Nothing here imports torch or Megatron.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from relaymoe.options import MODE_CHOICES, TRANSPORT_CHOICES

# shipped with the package (the checkout's configs/ links here), so bare names resolve in a wheel
CONFIG_DIR = Path(__file__).resolve().parent / "configs"

# YAML keys accepted as spellings of a field (TransformerConfig names for the same Megatron arg).
_MODEL_ALIASES = {"num_moe_experts": "num_experts"}


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
    swiglu: bool = True
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
            _check_pos_int(f"model.{name}", getattr(self, name))
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
                _check_pos_int(f"model.{name}", v)
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
                _check_pos_int(f"model.{name}", v)
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
            _check_pos_int(f"parallel.{name}", getattr(self, name))
        if self.gpus_per_node is not None:
            _check_pos_int("parallel.gpus_per_node", self.gpus_per_node)
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
            _check_pos_int("parallel.vpp", self.vpp)
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

    def __post_init__(self):
        _check_pos_int("training.seq_length", self.seq_length)
        if self.normalization_impl not in NORMALIZATION_IMPLS:
            raise ValueError(
                f"training.normalization_impl={self.normalization_impl!r}; known: "
                f"{', '.join(repr(x) for x in NORMALIZATION_IMPLS)} (fused: TransformerEngine "
                "or apex, torch: megatron-core's torch fallback, torch_composite: that fallback "
                "on a torch without the fused RMSNorm kernel)"
            )
        _check_pos_int("training.micro_batch_size", self.micro_batch_size)
        if self.global_batch_size is not None:
            _check_pos_int("training.global_batch_size", self.global_batch_size)
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
            _check_pos_int("training.recompute_num_layers", self.recompute_num_layers)
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

# every RelayMoEConfig switch with what it accepts: one of a tuple of choices, or a bool (flags)
_SWITCHES = {
    "dispatcher": DISPATCHERS,
    "mode": MODE_CHOICES,
    "transport": TRANSPORT_CHOICES,
    "recompute_planner": bool,
    "fused_loss": bool,
}


def _check_switch(name: str, value, known) -> None:
    if not (isinstance(value, bool) if known is bool else value in known):
        rule = " must be true or false" if known is bool else f"; known: {known}"
        raise ValueError(f"relaymoe.{name}={value!r}{rule}")


@dataclass(frozen=True)
class RelayMoEConfig:
    """relaymoe's switches: the dispatcher (``--moe-token-dispatcher-type``), the ring's mode
    (``mode``, ``--relaymoe-mode``) and transport (``--relaymoe-transport``), recompute planner
    (``--relaymoe-recompute-planner``), and the chunked output layer + cross-entropy
    (``--relaymoe-fused-loss``, ``relaymoe.linear_cross_entropy``; any dispatcher)."""

    dispatcher: str = "ring"  # ring | alltoall | allgather | flex
    mode: str = "auto"  # relaymoe.options.MODE_CHOICES
    transport: str = "auto"  # relaymoe.options.TRANSPORT_CHOICES
    recompute_planner: bool = False
    fused_loss: bool = False  # never holds the (tokens, vocab/TP) logits

    def __post_init__(self):
        for name, known in _SWITCHES.items():
            _check_switch(name, getattr(self, name), known)


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
            if sec not in _SECTIONS:
                raise ValueError(f"unknown config section {sec!r}; known: {sorted(_SECTIONS)}")
            cls = _SECTIONS[sec]
            _check_keys(sec, changes, cls)
            kw[sec] = dataclasses.replace(getattr(self, sec), **_coerce(sec, changes, cls))
        return dataclasses.replace(self, name=self.name if name is None else name, **kw)

    def to_dict(self) -> dict[str, Any]:
        out = {sec: dataclasses.asdict(getattr(self, sec)) for sec in _SECTIONS}
        for sec in out.values():
            for k, v in sec.items():
                if isinstance(v, tuple):
                    sec[k] = list(v)
        return out


_SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "relaymoe": RelayMoEConfig,
}


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


# -- loading ------------------------------------------------------------------------------------


def resolve_config_path(path_or_name: str | os.PathLike) -> Path:
    """A path to a YAML file, or a bare name (``qwen3_30b_a3b``, ``table3/e64``) in configs/."""
    p = Path(path_or_name)
    if p.is_file():
        return p
    for cand in (CONFIG_DIR / p, CONFIG_DIR / f"{p}.yaml", CONFIG_DIR / f"{p}.yml"):
        if cand.is_file():
            return cand
    known = sorted(str(q.relative_to(CONFIG_DIR))[:-5] for q in CONFIG_DIR.rglob("*.yaml"))
    raise ValueError(f"config {str(path_or_name)!r} not found (no such file); known names: {known}")


def load_config(path_or_name: str | os.PathLike) -> Config:
    path = resolve_config_path(path_or_name)
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    rp = path.resolve()
    name = (
        str(rp.relative_to(CONFIG_DIR).with_suffix(""))
        if rp.is_relative_to(CONFIG_DIR)
        else path.stem
    )
    try:
        return config_from_dict(data, name=name)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def config_from_dict(data: Any, name: str = "") -> Config:
    if not isinstance(data, dict):
        raise ValueError(f"a config is a mapping with sections {sorted(_SECTIONS)}, got {data!r}")
    unknown = set(data) - set(_SECTIONS)
    if unknown:
        raise ValueError(f"unknown config section(s) {sorted(unknown)}; known: {sorted(_SECTIONS)}")
    for req in ("model", "parallel", "training"):
        if req not in data:
            raise ValueError(f"config has no {req!r} section (needs {sorted(_SECTIONS)[:3]})")
    kw = {}
    for sec, cls in _SECTIONS.items():
        raw = data.get(sec) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"section {sec!r} must be a mapping, got {raw!r}")
        if sec == "model":
            raw = {_MODEL_ALIASES.get(k, k): v for k, v in raw.items()}
        _check_keys(sec, raw, cls)
        missing = [
            f.name
            for f in fields(cls)
            if f.name not in raw
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ValueError(f"section {sec!r} misses required key(s) {missing}")
        kw[sec] = cls(**_coerce(sec, raw, cls))
    return Config(name=name, **kw)


def _check_keys(sec: str, raw: dict, cls) -> None:
    known = [f.name for f in fields(cls)]
    for k in raw:
        if k not in known:
            raise ValueError(f"unknown key {sec}.{k!r}; known keys of {sec}: {', '.join(known)}")


def _coerce(sec: str, raw: dict, cls) -> dict:
    """Type checks (YAML gives int/float/bool/str/list); lists become tuples."""
    types = {f.name: f.type for f in fields(cls)}
    out = {}
    for k, v in raw.items():
        t = str(types[k])
        if isinstance(v, list):
            v = tuple(v)
        if "tuple" in t and v is not None:
            _check_sequence(f"{sec}.{k}", v, t)
            out[k] = v
            continue
        if v is None:
            if "None" not in t:
                raise ValueError(f"{sec}.{k} may not be null")
        elif t.startswith("bool"):
            if not isinstance(v, bool):
                raise ValueError(f"{sec}.{k}={v!r} must be true or false")
        elif t.startswith("int") and "tuple" not in t:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{sec}.{k}={v!r} must be an integer")
        elif t.startswith("float"):
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ValueError(f"{sec}.{k}={v!r} must be a number")
            v = float(v)
        elif t.startswith("str") and not isinstance(v, str):
            raise ValueError(f"{sec}.{k}={v!r} must be a string")
        out[k] = v
    return out


def _check_sequence(name: str, v: Any, t: str) -> None:
    """A field typed with a tuple (``moe_layer_freq: int | tuple[int, ...]``,
    ``recompute_modules: tuple[str, ...] | None``): a YAML list of the element type, or the
    scalar form the field also takes (an int; one module name)."""
    elem = "int" if "tuple[int" in t else "str"
    if isinstance(v, tuple):
        wrong = [x for x in v if isinstance(x, bool) or type(x).__name__ != elem]
        if wrong:
            raise ValueError(
                f"{name}={list(v)!r} must be a list of {'integers' if elem == 'int' else 'names'}"
                f", but holds {wrong[0]!r}"
            )
        return
    scalar_ok = (elem == "str" and isinstance(v, str)) or (
        "int |" in t and isinstance(v, int) and not isinstance(v, bool)
    )
    if not scalar_ok:
        form = "an integer or a list of 0/1 per layer" if elem == "int" else "a list of names"
        raise ValueError(f"{name}={v!r} must be {form}")


def _check_pos_int(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive integer")


# -- Megatron CLI -------------------------------------------------------------------------------

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
        if p.gpus_per_node is not None:
            args += ["--relaymoe-gpus-per-node", str(p.gpus_per_node)]
    if cfg.relaymoe.recompute_planner:
        args.append("--relaymoe-recompute-planner")
    if cfg.relaymoe.fused_loss:
        args.append("--relaymoe-fused-loss")
    if t.precision in ("bf16", "fp16"):
        args.append(f"--{t.precision}")
    args += recompute_args(
        t.recompute_granularity, t.recompute_method, t.recompute_num_layers, t.recompute_modules
    )
    return args


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


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "CONFIG_DIR",
    "Config",
    "ModelConfig",
    "ParallelConfig",
    "RelayMoEConfig",
    "TrainingConfig",
    "ceil_div",
    "config_from_dict",
    "load_config",
    "max_positions",
    "megatron_notes",
    "recompute_args",
    "resolve_config_path",
    "to_megatron_args",
    "validate_layout",
]
