"""Self-contained GPT pretraining on ``megatron.training`` with relaymoe registered.

    torchrun --nproc-per-node 2 -m relaymoe.megatron.pretrain <megatron args> \
        --moe-token-dispatcher-type ring [--mock-data | --data-path PREFIX ...]

For users without a Megatron-LM checkout: the same command-line arguments as Megatron-LM's
``pretrain_gpt.py`` for plain GPT pretraining (mock data via ``--mock-data`` or indexed
``.bin/.idx`` datasets via ``--data-path``/``--split``; tokenizer via ``--tokenizer-type``,
``NullTokenizer`` with ``--vocab-size`` by default). Not supported here (use ``launch`` with
Megatron-LM's own script): SFT, FIM, packed sequences, multi-token prediction, ModelOpt.

Extra output (rank 0, ``--relaymoe-report PATH``): one JSON line per logged iteration with the
loss, Megatron's iteration number, the learning rate, tokens/s, that step's peak memory and the
bytes of expert weights the ring copied in it (``RingRuntime.copied_weight_bytes`` of the
model's ring runtimes), the bytes of expert weights the reporting rank sent its EP peers in
it (``ring_weight_bytes_sent``: ``RingRuntime.weight_bytes_sent``) and whether the experts ran
in fp8 (``fp8_experts``): what a comparison of two runs reads (the examples' and the end-to-end
benchmarks').
With ``--relaymoe-weights-digest`` every rank also writes ``PATH.weights.rank<R>.json`` after the
last iteration: a SHA-256 of its model parameters (names, dtypes, shapes and bytes), so two runs
can be compared for bitwise identical weights without saving checkpoints.
With ``--relaymoe-memory-phases`` each line also carries ``memory_phases``: where the step's
memory peak fell and its breakdown in the planner's terms (``relaymoe/megatron/memory_phases.py``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from functools import partial

import torch

_REPORT = {"path": None, "t0": None, "tokens": 0, "step": 0}


def extra_args(parser):
    group = parser.add_argument_group(title="relaymoe pretrain")
    group.add_argument(
        "--relaymoe-report",
        default=None,
        help="write one JSON line per training step (loss, tokens/s, peak memory) here",
    )
    group.add_argument(
        "--relaymoe-memory-phases",
        action="store_true",
        help="with --relaymoe-report PATH: each step's line also carries memory_phases, the "
        "allocator's counters at the step's phase boundaries and the breakdown of its peak "
        "in the planner's terms (relaymoe/megatron/memory_phases.py)",
    )
    group.add_argument(
        "--relaymoe-weights-digest",
        action="store_true",
        help="with --relaymoe-report PATH: after the last step every rank writes a SHA-256 of its "
        "parameters to PATH.weights.rank<R>.json",
    )
    return parser


def weights_digest(modules) -> tuple[str, int]:
    """(SHA-256 hex, parameter count) over ``modules``' named parameters in order: each name,
    dtype, shape and the raw bytes. Equal digests mean bitwise identical weights."""
    import hashlib

    h = hashlib.sha256()
    count = 0
    for i, module in enumerate(modules):
        for name, p in module.named_parameters():
            t = p.detach().contiguous().cpu()
            h.update(f"{i}.{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            count += 1
    return h.hexdigest(), count


def _dataset_config(args):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.utils.common_utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    wanted = {
        "random_seed": args.seed,
        "sequence_length": args.seq_length,
        "blend": blend,
        "blend_per_split": blend_per_split,
        "split": args.split,
        "num_dataset_builder_threads": getattr(args, "num_dataset_builder_threads", 1),
        "path_to_cache": getattr(args, "data_cache_path", None),
        "mmap_bin_files": getattr(args, "mmap_bin_files", True),
        "tokenizer": build_tokenizer(args),
        "reset_position_ids": args.reset_position_ids,
        "reset_attention_mask": args.reset_attention_mask,
        "eod_mask_loss": args.eod_mask_loss,
        "create_attention_mask": args.create_attention_mask_in_dataloader,
        "context_parallel_size": args.context_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "sequence_parallel_size": args.tensor_model_parallel_size * args.sequence_parallel,
    }
    names = {f.name for f in dataclasses.fields(GPTDatasetConfig)}
    return GPTDatasetConfig(**{k: v for k, v in wanted.items() if k in names})


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args
    from megatron.training.utils.common_utils import is_first_or_last_pipeline_stage

    args = get_args()
    kind = MockGPTDataset if args.mock_data else GPTDataset

    def built_here():
        return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(
            vp_stage
        )

    return BlendedMegatronDatasetBuilder(
        kind, train_val_test_num_samples, built_here, _dataset_config(args)
    ).build()


datasets_provider.is_distributed = True

_KEYS = ("attention_mask", "labels", "loss_mask", "position_ids", "tokens")


def _get_batch(data_iterator, vp_stage=None):
    from megatron.core import mpu
    from megatron.core.parallel_state import get_context_parallel_group
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils.common_utils import is_first_or_last_pipeline_stage

    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return {k: None for k in _KEYS}
    batch = {}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    if tp_rank == 0:
        raw = next(data_iterator)
        batch = {
            k: (raw[k].cuda(non_blocking=True) if raw.get(k) is not None else None) for k in _KEYS
        }
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    if args.context_parallel_size > 1:
        batch = get_batch_on_this_cp_rank(
            batch, is_hybrid_cp=False, cp_group=get_context_parallel_group()
        )
    return {k: batch.get(k) for k in _KEYS}


def _loss(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return (
        loss,
        num_tokens,
        {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])},
    )


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    from megatron.core.utils import get_attr_wrapped_model

    if return_schedule_plan:
        raise NotImplementedError(
            "relaymoe.megatron.pretrain builds no schedule plan for overlapping the expert-parallel"
            " all-to-all with the other micro-batch (--overlap-moe-expert-parallel-comm, which the "
            "ring dispatcher refuses anyway): remove that flag, or run Megatron-LM's own "
            "pretrain_gpt.py through `python -m relaymoe.megatron.launch`"
        )
    b = _get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    out = model(
        b["tokens"],
        b["position_ids"],
        b["attention_mask"],
        labels=b["labels"],
        loss_mask=b["loss_mask"],
    )
    _count_step_tokens(b["tokens"])
    return out, partial(_loss, b["loss_mask"])


def _count_step_tokens(tokens):
    if tokens is not None:
        _REPORT["tokens"] += tokens.numel()


def use_prebuilt_dataset_helpers() -> bool:
    """Skip Megatron's ``make`` of the dataset helpers when the wheel ships them prebuilt.

    megatron-core's wheel carries ``helpers_cpp`` compiled but not the Makefile, and
    ``megatron.training.initialize`` runs ``make`` on rank 0 anyway: without a Makefile it fails
    and exits. With a Megatron-LM checkout (Makefile present) nothing changes. Returns whether
    the compile step was replaced.
    """
    import importlib.util
    import os

    from megatron.core.datasets import utils as ds_utils

    folder = os.path.dirname(os.path.abspath(ds_utils.__file__))
    if os.path.exists(os.path.join(folder, "Makefile")):
        return False
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return False
    if not getattr(ds_utils.compile_helpers, "__relaymoe_patched__", False):

        def compile_helpers():
            print("> dataset index builder: using the prebuilt helpers_cpp of the wheel")

        compile_helpers.__relaymoe_patched__ = True
        ds_utils.compile_helpers = compile_helpers
    return True


def main(argv: list[str] | None = None) -> int:
    from relaymoe.megatron import register

    register()
    use_prebuilt_dataset_helpers()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(
        extra_args_provider=extra_args, args_defaults={"tokenizer_type": "NullTokenizer"}
    )
    for flag in ("weights_digest", "memory_phases"):
        if getattr(args, f"relaymoe_{flag}") and not args.relaymoe_report:
            raise SystemExit(
                f"--relaymoe-{flag.replace('_', '-')} writes with the step report: add "
                "--relaymoe-report PATH"
            )
    if args.relaymoe_report:
        _install_step_report(args)
    full = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(full, datasets_provider, ModelType.encoder_or_decoder, forward_step)
    return 0


def ring_dispatchers(model) -> list:
    """The ``RingDispatcher`` of every ring layer of ``model`` (a module or a list of model
    chunks)."""
    from relaymoe.megatron.dispatcher import RingDispatcher

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m.token_dispatcher for chunk in chunks for m in chunk.modules()
            if isinstance(getattr(m, "token_dispatcher", None), RingDispatcher)]  # fmt: skip


def _runtimes(model) -> list:
    """The distinct runtimes of ``model``'s ring layers (the layers of a model share one per EP
    group and ring config: ``dispatcher.model_runtime``), each counted once."""
    return list({id(d.runtime): d.runtime for d in ring_dispatchers(model)}.values())


def ring_copied_weight_bytes(model) -> int:
    """Bytes of expert weights the ring has copied so far in ``model`` (a module or a list of
    model chunks): the sum over its ring layers' runtimes."""
    return sum(rt.copied_weight_bytes for rt in _runtimes(model))


def ring_weight_bytes_sent(model) -> int:
    """Bytes of expert weights this rank's ring layers have sent to their EP peers so far
    (``RingRuntime.weight_bytes_sent``: bf16 weights, or their fp8 copies and scales)."""
    return sum(rt.weight_bytes_sent for rt in _runtimes(model))


def fp8_experts_ran(model) -> bool:
    """Whether ``model``'s ring layers compute their experts in fp8 (each holds an
    ``Fp8State``: ``fp8_experts.layer_fp8_state``)."""
    return any(d.fp8 is not None for d in ring_dispatchers(model))


def _install_step_report(args) -> None:
    """Wrap megatron's ``train_step`` to log loss, tokens/s and peak memory per iteration."""
    from megatron.core import parallel_state as ps
    from megatron.training import training

    from relaymoe.megatron.memory_phases import PhaseRecorder

    original = training.train_step
    path = args.relaymoe_report
    phases = PhaseRecorder() if args.relaymoe_memory_phases else None

    def train_step(*a, **kw):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _REPORT["tokens"] = 0
        # per-step peak: the first steps also hold one-off transients (Triton autotuning's
        # benchmark buffers, NCCL/symmetric-memory setup) that steady training never sees again
        torch.cuda.reset_peak_memory_stats()
        model = a[2] if len(a) > 2 else kw["model"]
        copied0, sent0 = ring_copied_weight_bytes(model), ring_weight_bytes_sent(model)
        if phases is not None:
            phases.attach(model, a[3] if len(a) > 3 else kw["optimizer"])
            phases.start()
        result = original(*a, **kw)
        memory = phases.finish() if phases is not None else None
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        iteration = getattr(args, "curr_iteration", _REPORT["step"]) + 1
        if args.relaymoe_weights_digest and iteration == args.train_iters:
            _write_digest(path, a[2] if len(a) > 2 else kw["model"], iteration)
        loss_dict = result[0] if isinstance(result, tuple) else {}
        loss = loss_dict.get("lm loss") if isinstance(loss_dict, dict) else None
        if isinstance(loss, torch.Tensor):
            loss = float(loss[0] / loss[1]) if loss.numel() == 2 else float(loss)
        _REPORT["step"] += 1
        # tokens this rank fed (first/last stage); global = x data-parallel x context-parallel
        world_tokens = args.global_batch_size * args.seq_length
        peak = torch.cuda.max_memory_allocated() / 2**20
        if torch.distributed.get_rank() == 0 or (
            ps.is_pipeline_last_stage()
            and ps.get_data_parallel_rank() == 0
            and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
        ):
            if loss is not None:
                with open(path, "a") as f:
                    f.write(
                        json.dumps(
                            {
                                "step": _REPORT["step"],
                                # Megatron's iteration (a resumed run continues the saved one)
                                "iteration": iteration,
                                "lr": _learning_rate(a[3] if len(a) > 3 else kw.get("optimizer")),
                                "loss": loss,
                                "step_s": dt,
                                "tokens_per_s": world_tokens / dt,
                                "peak_MiB": peak,
                                # expert-weight bytes the ring copied this step (ring runs)
                                "ring_weight_copy_bytes": ring_copied_weight_bytes(model) - copied0,
                                # expert-weight bytes this rank sent its EP peers this step
                                "ring_weight_bytes_sent": ring_weight_bytes_sent(model) - sent0,
                                "fp8_experts": fp8_experts_ran(model),
                                "dispatcher": args.moe_token_dispatcher_type,
                                **({"memory_phases": memory} if memory is not None else {}),
                            }
                        )
                        + "\n"
                    )
        return result

    training.train_step = train_step


def _learning_rate(optimizer) -> float | None:
    """The first parameter group's learning rate after the step (None when unreadable): a
    resumed run shows its schedule continuing."""
    try:
        return float(optimizer.param_groups[0]["lr"])
    except (AttributeError, IndexError, KeyError, TypeError):
        return None


def _write_digest(report: str, model, step: int) -> None:
    rank = torch.distributed.get_rank()
    digest, count = weights_digest(model if isinstance(model, (list, tuple)) else [model])
    with open(f"{report}.weights.rank{rank}.json", "w") as f:
        json.dump({"step": step, "rank": rank, "sha256": digest, "parameters": count}, f)


if __name__ == "__main__":
    sys.exit(main())
