"""relaymoe's options: their names, choices and defaults, in one place; torch-free.

One frozen object holds every knob, validated once when it is built, and is handed down:

* :class:`RingConfig`: how ``ring_moe`` runs (mode, transport, schedule, gradient accumulators,
  overlap, hop capture, host waits, timeout, how often the ranks agree), with its ``kernels``;
* :class:`KernelOptions`: its nested part for the expert kernels, how they compute (never what):
  the GEMM backends, the row gathers, tensor descriptors, the Gluon kernels, autotuning, the
  pair-buffer budget.

Each field's name is the option's one name: the key of a config's ``relaymoe:`` section and,
for the fields with ``flag`` metadata, Megatron's ``--relaymoe-<name>`` flag. ``ring_moe`` takes
the options in this one object (``config=``), no keyword of its own for any of them. Two levels
only: the value the caller passes (a
``RingConfig`` built by the caller, by Megatron's dispatcher from its flags, or by an entry
point from the environment), else the field's documented default. Nothing here is process
state. The ``RELAYMOE_*`` environment is read only by :func:`from_env`, which entry points call
(Megatron's argument parsing, the CLI, the benchmarks, the test suite) and which returns a
``RingConfig``: nothing deeper reads the environment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "AGREE_CHOICES",
    "AUTO",
    "AUTOTUNE_CHOICES",
    "DENSE_GEMM_CHOICES",
    "FP8_EXPERTS_CHOICES",
    "FP8_WGRAD_LAYOUT_CHOICES",
    "FP32_GRAD_ACCUM_MIN_EP",
    "GATHER_WS_CHOICES",
    "GRAD_ACCUMS",
    "GRAD_ACCUM_CHOICES",
    "HOP_SLICE_MIB",
    "HOST_WAIT_CHOICES",
    "INT64_MAX",
    "KernelOptions",
    "LINK_TRANSPORTS",
    "MAX_TIMEOUT_S",
    "MODES",
    "MODE_CHOICES",
    "NODE_BATCHED",
    "RING_MODES",
    "ROWS_GATHER_CHOICES",
    "RingConfig",
    "check_field",
    "SCHEDULES",
    "SCHEDULE_CHOICES",
    "TMA_CHOICES",
    "TRANSPORTS",
    "TRANSPORT_CHOICES",
    "WGRAD_CHOICES",
    "env_var",
    "from_env",
    "megatron_flags",
    "planner_gpu_bytes",
    "with_flags",
]

AUTO = "auto"  # a request resolved by the runtime: choose_mode / the copy engine when it works
MODES = ("expert", "token", "alltoall")  # the order breaks ties in choose_mode
RING_MODES = ("expert", "token")
LINK_TRANSPORTS = ("nccl", "copy_engine")  # what a world of more than one rank may run over
TRANSPORTS = ("local", *LINK_TRANSPORTS)  # as resolved by the runtime (local: a world of 1)
MODE_CHOICES = (AUTO, *MODES)  # what a caller may ask for (ring_moe, flags, configs)
TRANSPORT_CHOICES = (AUTO, *LINK_TRANSPORTS)
# How the ring's ranks are ordered into hops (relaymoe/ring/plan.py): one ring over the
# group ("flat"), or rings inside each node joined by one hop to the next node that every GPU
# of the node makes at once ("two_level"); "auto": two_level when the group spans nodes.
SCHEDULES = ("flat", "two_level")
# Expert mode only, asked for by name (not yet measured, so "auto" never picks it): rounds of a
# whole node's experts, all-gathered inside the node, the column of each local rank a ring
# across nodes (relaymoe/ring/expert_mode.py): one hop per node instead of per rank.
NODE_BATCHED = "node_batched"
SCHEDULE_CHOICES = (AUTO, *SCHEDULES, NODE_BATCHED)
# The dtype of the ring's weight-gradient accumulators (expert mode: the gradients that travel
# with their weights; token mode: the local ones every hop adds to): "param" (the weights' own,
# bf16), "fp32", or "auto": fp32 from FP32_GRAD_ACCUM_MIN_EP ranks. Each hop adds one rounding
# in a 16-bit accumulator, so the ring's weight-gradient error grows with EP while an all-to-all's
# single GEMM does not.
GRAD_ACCUMS = ("param", "fp32")
GRAD_ACCUM_CHOICES = (AUTO, *GRAD_ACCUMS)
FP32_GRAD_ACCUM_MIN_EP = 16
# How the host waits for a ring pass's transfers on CUDA (ring/faults.py): at the end of each
# pass for the one before it and at a backward's end for its last ("lag", the default), never
# ("off"), or at the end of each pass for the pass itself ("pass").
HOST_WAIT_CHOICES = ("lag", "off", "pass")
# How often a trusted ring call agrees with its peers: once per call signature ("cached"), or
# at every call ("every_call"). It decides whether a collective runs, so the ranks agree on it.
AGREE_CHOICES = ("cached", "every_call")
# The expert kernels' choices (relaymoe/kernels/select.py applies them): the first is the
# default.
DENSE_GEMM_CHOICES = ("auto", "torch", "triton")  # contiguous-operand GEMMs
WGRAD_CHOICES = ("auto", "triton", "gmm")  # weight gradients
ROWS_GATHER_CHOICES = ("index", "copy")  # gathered-row GEMMs: through the index, or a copy
TMA_CHOICES = ("auto", "on", "off")  # tensor descriptors for contiguous operands
GATHER_WS_CHOICES = ("auto", "off")  # the persistent Gluon kernels on sm90
AUTOTUNE_CHOICES = ("shipped", "search", "first")  # shipped configs, a full search, the first
# The routed experts' GEMMs under Megatron's fp8 recipe (--fp8-format): in fp8 where measured
# faster than bf16 ("auto": relaymoe.megatron.fp8_experts), always in fp8 ("on"; which GEMMs:
# relaymoe.fp8_recipe), or in bf16 ("off")
FP8_EXPERTS_CHOICES = ("auto", "on", "off")
# The operand layout of the tensor-scaled fp8 weight gradients (relaymoe/kernels/fp8/wgrad.py):
# transposed, pairs contiguous, each expert's columns padded to 16 ("columnwise": K-major loads,
# pipelined on sm90), or the pair rows the rest of the backward stores ("rows": no copies, the
# tiles transposed through registers, not pipelined)
FP8_WGRAD_LAYOUT_CHOICES = ("columnwise", "rows")


# The default budget of a hop's pair intermediates (KernelOptions.hop_slice_mib), MiB: above the
# kernels' benchmark shapes (qwen3 T32k: 2.9 GiB; Mixtral 8x7B-like T16k: 4.6 GiB), so only long
# sequences slice. Each slice costs time (every kernel of a slice launches over all the range's
# experts), so the budget is the largest that still bounds what grows as T*K. The cost model and
# the planner take it from here.
HOP_SLICE_MIB = 8192


# Bounds of the numeric options: an int option is at most INT64_MAX (the agreement's rows and
# the kernels' sizes are int64), a timeout at most MAX_TIMEOUT_S (a week: far beyond any useful
# wait, and within what datetime.timedelta and c10d's millisecond timeouts hold).
INT64_MAX = 2**63 - 1
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _opt(default, choices=None, *, env: str | None = None, env_values=None, flag=None, why="",
         least: int = 1, most: float = INT64_MAX, help: str = ""):  # fmt: skip
    """A field with its metadata: ``choices`` (None: any value the type check allows, an int
    in ``[least, most]``, a number of seconds in ``(0, most]``), the ``env`` variable
    :func:`from_env` reads (``env_values``: spellings of the environment that mean a choice,
    e.g. ``{"1": "search"}``), the Megatron ``flag``, what the option is (``why``, in errors)
    and the flag's ``help``."""
    meta = {"choices": choices, "env": env, "env_values": env_values or {}, "flag": flag,
            "why": why, "least": least, "most": most, "help": help or why}  # fmt: skip
    return field(default=default, metadata=meta)


def check_field(owner: str, f: dataclasses.Field, value) -> None:
    """Raise ``ValueError`` naming ``owner.f.name``, ``value``, the field's choices or bounds
    and its default when ``value`` is not one ``f`` (a field of :class:`RingConfig` or
    :class:`KernelOptions`, or one made from it) accepts."""
    choices = f.metadata.get("choices")
    if choices is not None:
        if value not in choices:
            raise ValueError(
                f"{owner}.{f.name}={value!r} is not one of {tuple(choices)}"
                + (f" ({f.metadata['why']})" if f.metadata.get("why") else "")
                + f"; the default is {f.default!r}"
            )
        return
    most = f.metadata.get("most", INT64_MAX)
    if f.type in ("int", "int | None"):
        least = f.metadata.get("least", 1)
        ok = (value is None and f.type == "int | None") or (
            isinstance(value, int) and not isinstance(value, bool) and least <= value <= most
        )
        if not ok:
            raise ValueError(
                f"{owner}.{f.name}={value!r} must be an int in [{least}, {most}]"
                + (" or None" if f.type == "int | None" else "")
                + (f" ({f.metadata['why']})" if f.metadata.get("why") else "")
                + f"; the default is {f.default!r}"
            )
    elif f.type == "float | None":
        ok = value is None or (
            isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= most
        )  # NaN and inf fail the comparisons
        if not ok:
            raise ValueError(
                f"{owner}.{f.name}={value!r} must be a number of seconds in (0, {most:g}] "
                f"(at most {_days(most)}) or None ({f.metadata['why']}); the default is "
                f"{f.default!r}"
            )
    elif f.type == "bool" and not isinstance(value, bool):
        raise ValueError(f"{owner}.{f.name}={value!r} must be True or False")


def _days(seconds: float) -> str:
    days = seconds / 86400
    return f"{days:g} day{'s' if days != 1 else ''}"


def _check_all(obj) -> None:
    for f in dataclasses.fields(obj):
        if f.name != "kernels":
            check_field(type(obj).__name__, f, getattr(obj, f.name))


@dataclass(frozen=True)
class KernelOptions:
    """How the expert kernels compute; every choice gives the same result up to rounding.

    ``dense_gemm``: contiguous-operand GEMMs (``a @ w2[e]^T``, ``dh @ w13[e]``) on
    ``torch._grouped_mm`` for bf16 on sm90 (``auto``/``torch``) or always Triton (``triton``).
    ``wgrad``: weight gradients by ``torch._grouped_mm`` over gathered column chunks on CUDA for
    long expert groups (``auto``), always the gathered-operand Triton kernel (``triton``), or
    torch's grouped GEMM wherever it runs, CPU included (``gmm``). ``rows_gather``: the
    up-projection and the down backward read token rows through the routing index (``index``)
    or gather one (P, H) copy for ``torch._grouped_mm`` (``copy``). ``tma``: tensor descriptors
    for contiguous operands (``auto``: on sm90). ``gather_ws``: the warp-specialised Gluon
    kernels on sm90 (``auto``) or never (``off``). ``autotune``: the shipped configurations
    (``shipped``), a full search (``search``) or each kernel's first configuration (``first``).
    ``fp8_wgrad_layout``: the operands of the tensor-scaled fp8 weight gradients transposed,
    pairs contiguous and padded per expert (``columnwise``: K-major tiles, pipelined loads; x,
    dy, dh and p*a each also stored once transposed in fp8), or read across the pair rows the
    backward already stores (``rows``: no copies, not pipelined on sm90).
    ``pair_buffer_mib``: the budget of any transient (P, chunk) pair buffer, MiB.
    ``hop_slice_mib``: the budget of one hop's pair intermediates, MiB (the backward's largest
    set: the pre-activation and its gradient, the activation, the down-projection rows;
    ``relaymoe.cost.hop_pair_bytes``). A hop over more pairs computes them in slices of
    consecutive pairs (whole experts but for the two at a slice's ends), one after another, so
    that its transient memory stays within the budget whatever the sequence length; 0 never
    slices. Without it a hop's intermediates grow as T*K: at EP 1 they are the MoE layer's
    largest activation-sized term (``relaymoe plan``'s ``moe_block_peak``). The Triton hops
    slice; the fp8 experts and the torch backend compute a hop in one pass.
    """

    dense_gemm: str = _opt("auto", DENSE_GEMM_CHOICES, env="RELAYMOE_DENSE_GEMM",
                           why="contiguous-operand GEMMs: torch._grouped_mm for bf16 on sm90, "
                           "or always Triton")  # fmt: skip
    wgrad: str = _opt("auto", WGRAD_CHOICES, env="RELAYMOE_WGRAD",
                      why="weight gradients: torch._grouped_mm for long expert groups on CUDA, "
                      "always Triton, or always torch._grouped_mm")  # fmt: skip
    rows_gather: str = _opt("index", ROWS_GATHER_CHOICES, env="RELAYMOE_ROWS_GATHER",
                            why="gathered-row GEMMs read rows through the routing index, or "
                            "from one gathered copy")  # fmt: skip
    tma: str = _opt("auto", TMA_CHOICES, env="RELAYMOE_TMA", env_values={"1": "on", "0": "off"},
                    why="tensor descriptors for contiguous operands; auto: on sm90")  # fmt: skip
    gather_ws: str = _opt("auto", GATHER_WS_CHOICES, env="RELAYMOE_GATHER_WS",
                          env_values={"0": "off"},
                          why="the warp-specialised Gluon kernels on sm90, or never")  # fmt: skip
    autotune: str = _opt("shipped", AUTOTUNE_CHOICES, env="RELAYMOE_AUTOTUNE",
                         env_values={"1": "search", "0": "first"},
                         why="the shipped tile configurations, a full search, or each "
                         "kernel's first")  # fmt: skip
    fp8_wgrad_layout: str = _opt("columnwise", FP8_WGRAD_LAYOUT_CHOICES,
                                 env="RELAYMOE_FP8_WGRAD_LAYOUT",
                                 why="operands of the tensor-scaled fp8 weight gradients: "
                                 "transposed with pairs contiguous (K-major, pipelined), or the "
                                 "pair rows as stored")  # fmt: skip
    pair_buffer_mib: int = _opt(512, env="RELAYMOE_PAIR_BUFFER_MIB", least=0,
                                most=INT64_MAX >> 20,  # its bytes an int64
                                why="MiB budget of any transient (P, chunk) pair buffer; the "
                                "ring sizes its hop buffers from it")  # fmt: skip
    hop_slice_mib: int = _opt(
        HOP_SLICE_MIB, env="RELAYMOE_HOP_SLICE_MIB", flag="--relaymoe-hop-slice-mib", least=0,
        most=INT64_MAX >> 20,  # its bytes an int64
        why="MiB budget of one hop's pair intermediates: a hop over more pairs runs in slices "
        "of pairs; 0: never sliced",
        help="MiB budget of one ring hop's expert intermediates (pre-activation, activation, "
        "down-projection rows and the backward's pre-activation gradient): a hop over more "
        "token-expert pairs computes them slice by slice, so the MoE layer's transient memory "
        "stops growing with the sequence at this size (relaymoe plan models it; each slice "
        "costs some time); 0 never "
        "slices; default: RELAYMOE_HOP_SLICE_MIB, else 8192",
    )  # fmt: skip

    def __post_init__(self):
        _check_all(self)


@dataclass(frozen=True)
class RingConfig:
    """How a ``ring_moe`` call runs: every ring and kernel option, validated once here.

    ``mode``, ``transport``, ``schedule``, ``gpus_per_node``, ``grad_accum`` and ``agree`` are
    agreed by every rank of the group before any transfer (a
    mismatch raises on every rank); ``kernels.pair_buffer_mib`` too, since it sizes the hops'
    pair buffers. ``overlap``, ``capture_hops``, ``host_wait`` and ``timeout_s`` are this
    rank's. ``fp8_experts`` is read by Megatron's dispatcher, which hands ``ring_moe`` its
    ``Fp8State`` (``fp8=``) when the model has an fp8 recipe and it is ``on``, or ``auto`` and
    the recipe's fp8 experts are measured faster than bf16 (``relaymoe.megatron.fp8_experts``)."""

    mode: str = _opt(
        AUTO, MODE_CHOICES, flag="--relaymoe-mode",
        why="experts travel, tokens travel, one all-to-all, or the cost model's pick",
        help="execution mode with --moe-token-dispatcher-type ring: experts circulate (expert), "
        "tokens circulate (token), tokens go once to their experts' ranks (alltoall), or the "
        "fastest by relaymoe.cost (auto)",
    )  # fmt: skip
    transport: str = _opt(
        AUTO, TRANSPORT_CHOICES, flag="--relaymoe-transport",
        why="the ring's P2P transport; copy_engine inside one node",
        help="P2P transport of the ring hops (auto: copy engine within a node when available)",
    )  # fmt: skip
    schedule: str = _opt(
        AUTO, SCHEDULE_CHOICES, flag="--relaymoe-schedule",
        why="one ring, or rings inside nodes joined by all-GPU node crossings",
        help="hop order of the ring: one ring over the EP group (flat), rings inside each node "
        "joined by hops every GPU of a node makes at once to the next node (two_level), "
        "two_level when the EP group spans nodes (auto), or, expert mode only and asked for by "
        "name, one hop per node over a node's experts all-gathered inside it (node_batched; "
        "experimental: simulated, not yet measured across nodes)",
    )  # fmt: skip
    gpus_per_node: int | None = _opt(
        None, flag="--relaymoe-gpus-per-node",
        why="GPUs per node of the cluster; None: read from the ranks' hosts",
        help="GPUs per node of the cluster, for the two-level ring: the EP ranks' nodes are "
        "global rank // N (default: read from the EP ranks' hosts)",
    )  # fmt: skip
    grad_accum: str = _opt(
        AUTO, GRAD_ACCUM_CHOICES, flag="--relaymoe-grad-accum",
        why="dtype of the weight-gradient accumulators",
        help="dtype of the ring's expert weight-gradient accumulators (the gradients that travel "
        "with their weights, or token mode's local sums): the weights' own (param), fp32, or "
        f"fp32 from {FP32_GRAD_ACCUM_MIN_EP} EP ranks (auto), where bf16 sums rounded once a hop "
        "would take the error past twice an all-to-all's",
    )  # fmt: skip
    # False runs each hop's transfer after its compute: the sequential ring that an ablation
    # compares the overlapped one with, not a training setting; so no Megatron flag: a caller
    # passes RingConfig(overlap=False)
    overlap: bool = _opt(True, why="each hop's transfer overlaps its compute (False: after it)")
    capture_hops: bool = _opt(
        False, flag="--relaymoe-capture-hops",
        why="experimental: record each ring hop's compute once per shape in a CUDA graph and "
        "replay it (this rank's: it changes how a hop is issued, not which collectives run)",
        help="experimental, measured on one GPU only: record each ring hop's expert compute "
        "once per hop shape in a CUDA graph and replay it with the step's tokens and routing "
        "copied into static buffers and the weights and their gradients read in place at "
        "their addresses (less host time per hop at small token counts; "
        "needs trusted ring calls with pair buffers sized from the bound and the Triton "
        "backend, else the hops run eagerly, logged once)",
    )  # fmt: skip
    host_wait: str = _opt(
        "lag", HOST_WAIT_CHOICES, env="RELAYMOE_RING_HOST_WAIT", flag="--relaymoe-host-wait",
        why="how the host waits, bounded, so that a dead peer is named",
        help="how the host waits, bounded by the process group's timeout, for the ring's "
        "transfers so that a dead or stalled EP peer raises RingPeerError naming it: lag (the "
        "default: at each pass's end for the pass before, at a backward's end for its last; "
        "measured free), pass (at each pass's end for the pass itself: about 10%% of "
        "throughput) or off (no host sync: a hang is left to NCCL's watchdog); default: "
        "RELAYMOE_RING_HOST_WAIT, else lag",
    )  # fmt: skip
    timeout_s: float | None = _opt(
        None,
        env="RELAYMOE_RING_TIMEOUT_S",
        most=MAX_TIMEOUT_S,
        why="seconds to wait for a peer; None: the group's timeout",
    )
    agree: str = _opt(
        "cached",
        AGREE_CHOICES,
        env="RELAYMOE_RING_AGREE",
        why="agree once per call signature, or at every call",
    )
    fp8_experts: str = _opt(
        "auto", FP8_EXPERTS_CHOICES, flag="--relaymoe-fp8-experts",
        why="the routed experts' GEMMs under an fp8 recipe: in fp8 where measured faster than "
        "bf16 (auto: not yet, so bf16), in fp8 (on), or in bf16 (off)",
        help="with --fp8-format and --moe-token-dispatcher-type ring: on runs the ring's routed "
        "experts' GEMMs in fp8 with the same recipe (fprop and dgrad in fp8, wgrad as "
        "--fp8-wgrad and the recipe say; their fp8 copies travel the ring, half the bf16 "
        "bytes); off keeps them in bf16 while TransformerEngine runs the other layers in fp8; "
        "auto (the default) is on only for a recipe whose fp8 experts are measured faster than "
        "the bf16 ones, which none is yet (the start-up notice names the measurement); no "
        "effect without --fp8-format",
    )  # fmt: skip
    kernels: KernelOptions = field(default_factory=KernelOptions)

    def __post_init__(self):
        _check_all(self)
        if not isinstance(self.kernels, KernelOptions):
            raise ValueError(f"RingConfig.kernels={self.kernels!r} must be a KernelOptions")

    def replace(self, **changes) -> RingConfig:
        """A copy with ``changes`` (``kernels=`` a ``KernelOptions`` or a dict of its fields)."""
        k = changes.get("kernels")
        if isinstance(k, Mapping):
            changes["kernels"] = dataclasses.replace(self.kernels, **k)
        return dataclasses.replace(self, **changes)


def _env_value(owner: str, f: dataclasses.Field, raw: str):
    """A field's value from its environment spelling, checked as the field checks it; a bad
    one raises ``ValueError`` naming the variable, its raw value, the limit and the fix."""
    name = f.metadata["env"]
    value = f.metadata["env_values"].get(raw, raw)
    try:
        if f.type in ("int", "int | None"):
            value = int(value)
        elif f.type == "float | None":
            value = float(value)
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} must be a number; unset it for the default ({f.default!r})"
        ) from None
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        spell = {v: k for k, v in f.metadata["env_values"].items()}
        shown = tuple(spell.get(c, c) for c in choices)
        raise ValueError(
            f"{name}={raw!r}: use one of {shown} (the first is the default); unset it for the "
            f"default"
        )
    try:
        check_field(owner, f, value)
    except ValueError as err:
        raise ValueError(
            f"{name}={raw!r} (environment) is refused: {err}; set {name} within that range, "
            "or unset it for the default"
        ) from None
    return value


def from_env(environ: Mapping[str, str] | None = None, *, base: RingConfig | None = None):
    """``base`` (default ``RingConfig()``) with every ``RELAYMOE_*`` variable of ``environ``
    (default ``os.environ``) that names one of its fields applied. A bad value raises
    ``ValueError`` naming the variable, its value and the choices."""
    if environ is None:
        import os

        environ = os.environ
    base = base or RingConfig()

    def changes(obj) -> dict:
        out = {}
        for f in dataclasses.fields(obj):
            env = f.metadata.get("env")
            if env and environ.get(env, "") != "":
                out[f.name] = _env_value(type(obj).__name__, f, environ[env])
        return out

    kernels = dataclasses.replace(base.kernels, **changes(base.kernels))
    return dataclasses.replace(base, kernels=kernels, **changes(base))


def planner_gpu_bytes(environ: Mapping[str, str] | None = None) -> str | None:
    """``RELAYMOE_GPU_BYTES`` of ``environ`` (default ``os.environ``): the GPU memory that
    ``--relaymoe-recompute-planner`` plans for (bytes, or a preset name the planner knows), or
    None for the device's own. Read here, with the other ``RELAYMOE_*`` variables, by the
    Megatron entry point."""
    if environ is None:
        import os

        environ = os.environ
    return environ.get("RELAYMOE_GPU_BYTES") or None


def megatron_flags() -> list[tuple[str, dataclasses.Field]]:
    """``(flag, field)`` of every field that Megatron's parser takes: ``RingConfig``'s, then its
    ``KernelOptions``' (no name is both's: :func:`with_flags` routes each by its name)."""
    fields = [*dataclasses.fields(RingConfig), *dataclasses.fields(KernelOptions)]
    return [(f.metadata["flag"], f) for f in fields if f.metadata.get("flag")]


def with_flags(base: RingConfig, given: Mapping[str, object]) -> RingConfig:
    """``base`` with the flagged fields in ``given`` (field name -> value) applied, each to the
    object it belongs to (``RingConfig`` or its ``kernels``), validated as the fields are."""
    kernel_names = {f.name for f in dataclasses.fields(KernelOptions)}
    kernels = {k: v for k, v in given.items() if k in kernel_names}
    ring = {k: v for k, v in given.items() if k not in kernel_names}
    return base.replace(**ring, **({"kernels": kernels} if kernels else {}))


def env_var(name: str) -> str:
    """The ``RELAYMOE_*`` variable :func:`from_env` reads for the field ``name`` of
    ``RingConfig`` or ``KernelOptions`` (for harnesses that set it for a child process)."""
    for cls in (RingConfig, KernelOptions):
        for f in dataclasses.fields(cls):
            if f.name == name and f.metadata.get("env"):
                return f.metadata["env"]
    raise ValueError(f"no RELAYMOE_* variable sets the option {name!r}")
