"""The seven small, idempotent patches ``register()`` applies to megatron-core 0.19.

1. ``megatron.training.arguments.add_megatron_arguments``: adds ``ring`` to the choices of
   ``--moe-token-dispatcher-type`` (built from ``TransformerConfig``'s ``Literal``) and adds the
   ``relaymoe`` argument group; escapes the stray ``%`` of megatron-core's help strings so
   that ``--help`` works (``escape_help_percents``).
2. ``megatron.training.arguments.validate_args``: runs the ring refusals and, with
   ``--relaymoe-fused-loss``, the fused-loss refusals on the parsed arguments and, with
   ``--relaymoe-recompute-planner``, the recompute planner (before Megatron's own validation,
   which derives the config from the recompute flags); and builds the ring's ``RingConfig``
   once, from the flags over the ``RELAYMOE_*`` environment, onto ``args.relaymoe_ring``
   (``settings.py``), where every ``RingDispatcher`` reads it.
3. ``TransformerConfig.__post_init__``: the refusals at config time (before Megatron's own
   checks, so the user reads our message and its fix rather than an unrelated assertion).
   ``TransformerConfig`` only types the field as a ``Literal``; it checks no value itself.
   With per-layer CUDA graphs over the MoE layer, megatron-core's drop-and-pad assertion is
   lifted for the ring only (``shown_as_drop_and_pad`` says why).
4. ``MoELayer.__init__`` / ``MoELayer.routed_experts_compute``: with ``ring`` the layer is
   built as ``allgather`` (which communicates nothing at build time), its dispatcher replaced
   by a ``RingDispatcher`` and its experts' parameters re-homed contiguously; the experts call
   goes through ``RingDispatcher.compute_experts``. Every other dispatcher type is untouched.
5. ``GPTModel.__init__`` / ``GPTModel._postprocess``: with ``--relaymoe-fused-loss`` (or a
   ``FusedLoss(enabled=True)`` attached by ``configure``) the model is checked at build time
   and remembers its fused output processor; ``_postprocess`` passes it as Megatron's
   ``output_processor`` when labels
   are given outside inference and the caller passed none, so the output layer + loss run
   through ``relaymoe.linear_cross_entropy`` (``relaymoe/megatron/fused_loss.py``). Without
   the flag both are Megatron's own.
6. ``megatron.training.checkpointing._load_base_checkpoint``: a checkpoint saved with the other
   ``--transformer-impl`` of an MoE model is refused by name before any tensor is read
   (``checkpoint_compat.py``: megatron-core keys the pre-MoE norm differently per layer spec).
7. ``megatron.training.training.train_step``: the ring layers' fp8 weight copies are dropped
   before and after every step (``fp8_experts.invalidate_fp8_weights``: Megatron's optimizer
   writes the weights where no version counter sees it), and delayed scaling's histories are
   merged over each EP group after it (``fp8_checkpoint.py``). Without fp8 experts it does
   nothing.

Each patched callable carries ``__relaymoe_patched__`` so a second ``register()`` is a no-op.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re

logger = logging.getLogger("relaymoe.megatron")

MARK = "__relaymoe_patched__"


def _mark(fn, original):
    setattr(fn, MARK, True)
    fn.__relaymoe_original__ = original
    return fn


# --------------------------------------------------------------------------- argparse
def add_relaymoe_args(parser):
    """The ``relaymoe`` argument group (also usable as an ``extra_args_provider``): a
    ``--relaymoe-<name>`` flag for each flagged field of ``relaymoe.options.RingConfig`` (the
    one schema of the ring's options; the field's default, or None for a field the
    environment may set: the environment's value then, else the default), then the fused loss
    and recompute planner, which are Megatron's only."""
    from relaymoe import options

    if any(a.dest == "relaymoe_mode" for a in parser._actions):
        return parser
    group = parser.add_argument_group(title="relaymoe")
    for flag, f in options.megatron_flags():
        if f.type == "bool":  # a switch: given, True; absent, None (the process's value)
            group.add_argument(flag, action="store_true", default=None, help=f.metadata["help"])
            continue
        choices = f.metadata.get("choices")
        ints = _non_negative_int if f.metadata.get("least") == 0 else _positive_int
        kind = {"type": ints} if choices is None else {"choices": choices}
        default = None if f.metadata.get("env") else f.default
        group.add_argument(flag, default=default, help=f.metadata["help"], **kind)
    group.add_argument(
        "--relaymoe-fused-loss",
        action="store_true",
        help="compute GPTModel's output layer + cross-entropy in token chunks "
        "(relaymoe.linear_cross_entropy) without materialising the logits; any dispatcher",
    )
    group.add_argument(
        "--relaymoe-loss-chunk-tokens",
        type=_positive_int,
        default=None,
        help="tokens per chunk of --relaymoe-fused-loss (default: relaymoe's choice)",
    )
    group.add_argument(
        "--relaymoe-recompute-planner",
        action="store_true",
        help="let relaymoe's planner choose the activation-recompute flags from the model, "
        "parallelism and GPU memory at start (printed once)",
    )
    return parser


def _positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return value


def _extend_dispatcher_choices(parser) -> None:
    for action in parser._actions:
        if action.dest == "moe_token_dispatcher_type":
            choices = list(action.choices or [])
            if "ring" not in choices:
                action.choices = [*choices, "ring"]
            if action.help and "ring" not in action.help:
                action.help += " 'ring': relaymoe's ring (tokens stay, experts travel over P2P)."
            return
    raise RuntimeError(
        "megatron's parser has no --moe-token-dispatcher-type; this relaymoe supports "
        "megatron-core 0.19"
    )


# argparse's own help placeholders (``%%``, ``%(default)s``) or a bare ``%``
_HELP_FORMAT = re.compile(r"%%|%\(\w+\)[sdrfgeixc]|%")


def escape_help_percents(parser) -> list[str]:
    """Escape the ``%`` signs of help strings that argparse would take as format characters.

    ``--help`` expands every help string with ``%`` formatting; megatron-core 0.19.2 writes
    ``10%`` into the help of ``--moe-paged-stash-buffer-size-factor-cuda``, which makes
    ``--help`` raise ``ValueError: unsupported format character``. A ``%`` that does not start
    ``%%`` or ``%(name)s`` is doubled. Returns the ``dest`` of each action changed."""
    changed = []
    for action in parser._actions:
        text = action.help
        if isinstance(text, str) and "%" in text:
            fixed = _HELP_FORMAT.sub(lambda m: "%%" if m.group() == "%" else m.group(), text)
            if fixed != text:
                action.help = fixed
                changed.append(action.dest)
    return changed


def patch_arguments() -> None:
    from megatron.training import arguments

    original = arguments.add_megatron_arguments
    if not getattr(original, MARK, False):

        @functools.wraps(original)
        def add_megatron_arguments(parser):
            parser = original(parser)
            _extend_dispatcher_choices(parser)
            parser = add_relaymoe_args(parser)
            escape_help_percents(parser)
            return parser

        arguments.add_megatron_arguments = _mark(add_megatron_arguments, original)

    original_validate = arguments.validate_args
    if not getattr(original_validate, MARK, False):

        @functools.wraps(original_validate)
        def validate_args(args, defaults=None):
            from relaymoe.megatron.validate import check_fused_loss_args, check_ring_args

            # Ours first: the user reads the ring's refusal and its fix, not a later assertion.
            check_ring_args(args)
            check_fused_loss_args(args)
            announce_fp8_experts(args)
            build_ring_config(args)
            if getattr(args, "relaymoe_recompute_planner", False):
                apply_recompute_plan(args)
            return original_validate(args, {} if defaults is None else defaults)

        arguments.validate_args = _mark(validate_args, original_validate)


def build_ring_config(args):
    """The ring's ``RingConfig`` of this run, built once at argument parsing (the entry point:
    the ``RELAYMOE_*`` environment is read here, ``relaymoe.options.from_env``) with each given
    ``--relaymoe-<name>`` flag over it, and kept on ``args.relaymoe_ring`` for the dispatchers
    (``settings.ring_config_of``). Returns it."""
    from relaymoe import options
    from relaymoe.megatron.settings import ARGS_ATTR, ring_config_from_args

    config = ring_config_from_args(args, base=options.from_env())
    setattr(args, ARGS_ATTR, config)
    return config


def announce_fp8_experts(args) -> str | None:
    """Print, on rank 0, the line saying which layers an fp8 ring run computes in fp8; returns
    it (None when there is nothing to say)."""
    from relaymoe.megatron.validate import fp8_expert_notice

    notice = fp8_expert_notice(args)
    if notice and getattr(args, "rank", 0) == 0:
        print(notice, flush=True)
    return notice


# ------------------------------------------------------------------ recompute planner
_PLAN_PRINTED = "relaymoe_recompute_plan_printed"  # the mark on Megatron's args
_RECOMPUTE_ARGS = (
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "recompute_modules",
)


def apply_recompute_plan(args) -> dict:
    """Ask ``relaymoe.planner.plan_from_megatron_args(args)`` for recompute flags, apply them.

    The planner returns either a mapping of Megatron argument names to values or an object
    with such a mapping in ``megatron_args``; only the recompute arguments are taken. Printed
    once per ``args`` on rank 0 (marked on ``args``). Returns the applied overrides."""
    try:
        from relaymoe.planner import plan_from_megatron_args
    except ImportError as e:
        raise ImportError(
            "--relaymoe-recompute-planner needs relaymoe.planner.plan_from_megatron_args, "
            "which this installation lacks"
        ) from e
    from relaymoe.megatron.settings import ARGS_ATTR
    from relaymoe.options import planner_gpu_bytes

    ring = getattr(args, ARGS_ATTR, None) or build_ring_config(args)  # the run's own options
    plan = plan_from_megatron_args(args, gpu_bytes=planner_gpu_bytes(), kernels=ring.kernels)
    overrides = plan if isinstance(plan, dict) else getattr(plan, "megatron_args", None)
    if not isinstance(overrides, dict):
        raise TypeError(
            f"plan_from_megatron_args returned {type(plan).__name__}; expected a dict of "
            f"Megatron arguments or an object with a .megatron_args dict"
        )
    applied = {
        k: v
        for k, v in overrides.items()
        if k in _RECOMPUTE_ARGS and not (k == "recompute_modules" and v is None)
    }
    for k, v in applied.items():
        setattr(args, k, v)
    if getattr(args, "rank", 0) == 0 and not getattr(args, _PLAN_PRINTED, False):
        setattr(args, _PLAN_PRINTED, True)  # once per run's arguments
        summary = plan.summary() if hasattr(plan, "summary") else applied
        print(f"[relaymoe] recompute planner: {summary}; applying {applied}", flush=True)
    return applied


# ------------------------------------------------------------------ checkpoint loading
def patch_checkpoint_loading() -> None:
    """``_load_base_checkpoint``: when the common state Megatron reads first (``rank0=True``,
    every rank) carries the saving run's arguments, refuse a layer-spec mismatch by name
    (``relaymoe/megatron/checkpoint_compat.py``) before any tensor is loaded; and when those
    arguments mark a ``relaymoe convert-hf`` checkpoint, leave the TE ``_extra_state`` objects
    it lacks out of the load that follows from the same folder (every rank decides alike, from
    the checkpoint's own metadata)."""
    import os

    from megatron.training import checkpointing

    original = checkpointing._load_base_checkpoint
    if getattr(original, MARK, False):
        return
    converted: set[str] = set()  # folders whose saved arguments mark a convert-hf checkpoint

    @functools.wraps(original)
    def _load_base_checkpoint(load_dir, args, *a, **kw):
        from relaymoe.megatron import checkpoint_compat as cc

        rank0 = kw.get("rank0", a[0] if a else False)
        where = os.path.realpath(load_dir) if load_dir is not None else None
        sharded = kw.get("sharded_state_dict")
        release = os.path.join(load_dir, "release") if where in converted else None
        if not rank0 and release and os.path.isdir(release) and isinstance(sharded, dict):
            from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

            saved = load_sharded_metadata(release)  # convert-hf writes a release checkpoint
            dropped = cc.drop_absent_extra_state(sharded, saved)
            if dropped and getattr(args, "rank", 0) == 0:
                print(f"[relaymoe] {load_dir} was written by relaymoe convert-hf, which writes "
                      f"no TransformerEngine fp8 state: {len(dropped)} _extra_state object(s) "
                      "keep their fresh values", flush=True)  # fmt: skip
        result = original(load_dir, args, *a, **kw)
        state = result[0] if isinstance(result, tuple) and result else None
        if rank0 and isinstance(state, dict) and state.get("args") is not None:
            why = cc.impl_mismatch(state["args"], args)
            if why is not None:
                raise ValueError(f"cannot load the checkpoint in {load_dir}: {why}")
            if cc.converted_by_relaymoe(state["args"]) and where is not None:
                converted.add(where)
        return result

    checkpointing._load_base_checkpoint = _mark(_load_base_checkpoint, original)


def patch_train_step() -> None:
    """``train_step``: the fp8 experts' weight copies dropped around each optimizer step."""
    from megatron.training import training

    original = training.train_step
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def train_step(*a, **kw):
        from relaymoe.megatron.fp8_checkpoint import agree_fp8_histories
        from relaymoe.megatron.fp8_experts import invalidate_fp8_weights

        model = a[2] if len(a) > 2 else kw.get("model")
        if model is not None:
            invalidate_fp8_weights(model)
        result = original(*a, **kw)
        if model is not None:
            invalidate_fp8_weights(model)  # the optimizer wrote the weights
            agree_fp8_histories(model)  # delayed scaling: the same histories on every EP rank
        return result

    training.train_step = _mark(train_step, original)


# ------------------------------------------------------------------ TransformerConfig
def patch_transformer_config() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    original = TransformerConfig.__post_init__
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def __post_init__(self):
        if getattr(self, "moe_token_dispatcher_type", None) != "ring":
            return original(self)
        from relaymoe.megatron.validate import check_ring_config, ring_graph_capture

        if getattr(self, "num_moe_experts", None) is None:
            return original(self)
        check_ring_config(self)
        if ring_graph_capture(self) != "per_layer":
            return original(self)
        with shown_as_drop_and_pad(self):
            return original(self)

    TransformerConfig.__post_init__ = _mark(__post_init__, original)


@contextlib.contextmanager
def shown_as_drop_and_pad(config):
    """Let megatron-core 0.19 build a ring config whose per-layer CUDA graphs hold the MoE layer.

    ``TransformerConfig.__post_init__`` asserts "moe cuda graph is only supported with
    drop-padding MoE": its own dispatchers size each expert's buffer from token counts copied to
    the host, and only capacity-and-pad fixes those sizes. The ring needs neither: under capture
    it sizes every hop from ``T * min(K, E_local)`` pairs, a bound no routing can exceed (a
    token's K experts are distinct), so it captures dropless (``relaymoe/ring/hop_graphs.py``).
    For the ring only, and only while the original ``__post_init__`` runs, the config shows
    capacity 1.0 with padding; both fields are put back afterwards, so the model built is the
    dropless ring. ``check_ring_config`` has already run on the real values."""
    saved = config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity
    config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity = 1.0, True
    try:
        yield config
    finally:
        config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity = saved


# --------------------------------------------------------------------------- MoELayer
def patch_moe_layer() -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    original_init = MoELayer.__init__
    if not getattr(original_init, MARK, False):

        @functools.wraps(original_init)
        def __init__(self, config, *args, **kwargs):
            if getattr(config, "moe_token_dispatcher_type", None) != "ring":
                return original_init(self, config, *args, **kwargs)
            from relaymoe.megatron.dispatcher import RingDispatcher
            from relaymoe.megatron.expert_weights import make_expert_weights_contiguous
            from relaymoe.megatron.fp8_checkpoint import attach_fp8_extra_state

            # Build as allgather (no communication at construction), then swap the dispatcher.
            # The config object is shared by all layers: restore it even if the build fails.
            config.moe_token_dispatcher_type = "allgather"
            try:
                original_init(self, config, *args, **kwargs)
            finally:
                config.moe_token_dispatcher_type = "ring"
            dispatcher = RingDispatcher(
                self.num_local_experts,
                self.local_expert_indices,
                config=config,
                pg_collection=_pg_collection_of(self),
            )
            self.token_dispatcher = dispatcher
            make_expert_weights_contiguous(self.experts)
            attach_fp8_extra_state(self, dispatcher)  # delayed scaling's checkpointed state

        MoELayer.__init__ = _mark(__init__, original_init)

    original_rec = MoELayer.routed_experts_compute
    if not getattr(original_rec, MARK, False):

        @functools.wraps(original_rec)
        def routed_experts_compute(self, hidden_states, probs):
            from relaymoe.megatron.dispatcher import RingDispatcher

            if not isinstance(self.token_dispatcher, RingDispatcher):
                return original_rec(self, hidden_states, probs)
            out = self.token_dispatcher.compute_experts(self.experts, hidden_states, probs)
            return self.token_dispatcher.combine_preprocess(out), None

        MoELayer.routed_experts_compute = _mark(routed_experts_compute, original_rec)


# --------------------------------------------------------------------------- GPTModel
def patch_gpt_model() -> None:
    from megatron.core.models.gpt.gpt_model import GPTModel

    original_init = GPTModel.__init__
    if not getattr(original_init, MARK, False):

        @functools.wraps(original_init)
        def __init__(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            from relaymoe.megatron.settings import fused_loss_of

            fused = fused_loss_of(self.config)
            if fused.enabled:
                from relaymoe.megatron.fused_loss import install

                install(self, chunk_tokens=fused.chunk_tokens)

        GPTModel.__init__ = _mark(__init__, original_init)

    original_post = GPTModel._postprocess
    if not getattr(original_post, MARK, False):
        signature = inspect.signature(original_post)

        @functools.wraps(original_post)
        def _postprocess(self, *args, **kwargs):
            from relaymoe.megatron.fused_loss import ATTR, takes_fused_path

            processor = getattr(self, ATTR, None)
            if processor is not None:
                bound = signature.bind(self, *args, **kwargs)
                if takes_fused_path(self, bound.arguments):
                    bound.arguments["output_processor"] = processor
                    return original_post(*bound.args, **bound.kwargs)
            return original_post(self, *args, **kwargs)

        GPTModel._postprocess = _mark(_postprocess, original_post)


class _PGs:
    """The groups a ``MoETokenDispatcher`` reads (``ep``, ``expt_tp``, ``tp_ep``)."""

    def __init__(self, ep, expt_tp, tp_ep):
        self.ep, self.expt_tp, self.tp_ep = ep, expt_tp, tp_ep


def _pg_collection_of(layer):
    """Rebuild the dispatcher's view of the layer's process groups from the allgather one."""
    d = layer.token_dispatcher
    return _PGs(d.ep_group, d.tp_group, d.tp_ep_group)


def patched_everything() -> bool:
    """True when all seven patches are in place."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training import arguments, checkpointing, training

    return all(
        getattr(f, MARK, False)
        for f in (
            arguments.add_megatron_arguments,
            arguments.validate_args,
            TransformerConfig.__post_init__,
            MoELayer.__init__,
            MoELayer.routed_experts_compute,
            GPTModel.__init__,
            GPTModel._postprocess,
            checkpointing._load_base_checkpoint,
            training.train_step,
        )
    )
