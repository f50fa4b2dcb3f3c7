"""``convert``: the Megatron model built on the host, the Hugging Face weights copied in, saved.

The model is built as ``python -m relaymoe.megatron.pretrain`` builds it and saved through
megatron-core's ``save_checkpoint`` as a ``torch_dist`` release checkpoint, weights only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from relaymoe.convert_hf.errors import ConvertError
from relaymoe.convert_hf.hf_config import (
    check_against_config,
    megatron_model_flags,
    read_hf_config,
)
from relaymoe.convert_hf.mapping import hf_tensor
from relaymoe.convert_hf.shards import SafetensorsCheckpoint

FLAGS_FILE = "megatron_model_flags.txt"  # the model flags to train with, one per line
DTYPES = ("bf16", "fp32", "fp16")
# the layer spec the checkpoint's keys follow: Megatron's default first
TRANSFORMER_IMPLS = ("transformer_engine", "local")


def _init_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)


def _cpu_only_megatron() -> None:
    """The CUDA queries megatron-core makes while parsing, building and saving, answered for a
    host-only process (nothing here runs on a GPU)."""
    import torch

    if torch.cuda.is_available():
        return
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # validate_args asks for it
    torch.cuda.current_device = lambda: "cpu"  # RoPE puts its frequencies there
    torch.cuda.get_rng_state = lambda *a, **k: torch.ByteTensor()  # save_checkpoint collects it
    torch.cuda.synchronize = lambda *a, **k: None  # the torch_dist writer waits for the device


def convert(
    hf_dir: str,
    out_dir: str,
    *,
    dtype: str = "bf16",
    pp: int = 1,
    ep: int = 1,
    config: str | None = None,
    extra: list[str] = (),
    transformer_impl: str = TRANSFORMER_IMPLS[0],
) -> list[str]:
    """Convert; returns the model flags to train with, ``--transformer-impl`` included. Run in a
    fresh process (it initialises torch.distributed and megatron's global state).

    The model is always built with the local layers (the host has no TransformerEngine), and
    ``transformer_impl`` picks the key layout the checkpoint is written in: the specs differ in
    one key per MoE layer (``checkpoint_compat``), which ``_write_as`` renames."""
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}; known: {DTYPES}")
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ConvertError(
            f"--transformer-impl {transformer_impl!r}; known: {TRANSFORMER_IMPLS} (the one the "
            "training run will use: Megatron's default is transformer_engine)"
        )
    cfg = read_hf_config(hf_dir)
    if config is not None:
        check_against_config(cfg, config)
    model_flags = [*megatron_model_flags(cfg), "--transformer-impl", transformer_impl]
    hf = SafetensorsCheckpoint(hf_dir)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ConvertError(
            f"--out {out_dir} exists and is not empty; pass a new folder (a conversion never "
            "overwrites a checkpoint)"
        )
    import torch

    _cpu_only_megatron()
    _init_distributed()
    world = torch.distributed.get_world_size()
    if pp * ep != world:
        raise ConvertError(
            f"--pp {pp} x --ep {ep} = {pp * ep} processes, but {world} run; fix: torchrun "
            f"--nproc-per-node {pp * ep} (or --pp 1 --ep 1 alone)"
        )
    from relaymoe.megatron import register
    from relaymoe.megatron.pretrain import use_prebuilt_dataset_helpers

    register()
    use_prebuilt_dataset_helpers()
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.models.gpt import GPTModelBuilder

    seq = min(4096, int(cfg.get("max_position_embeddings", 4096)))
    precision = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[dtype]
    argv = [
        *model_flags,
        "--seq-length", str(seq), "--micro-batch-size", "1",
        "--global-batch-size", str(world // pp),  # one micro-batch per data-parallel rank
        "--pipeline-model-parallel-size", str(pp), "--expert-model-parallel-size", str(ep),
        "--moe-token-dispatcher-type", "ring",
        "--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
        "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
        "--use-cpu-initialization", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--train-iters", "1", "--lr", "1e-4",
        "--save", str(out), "--save-interval", "1", "--ckpt-format", "torch_dist",
        "--no-save-optim", "--no-save-rng",
        "--distributed-backend", "gloo", *precision, *extra,
    ]  # fmt: skip
    old_argv = sys.argv
    sys.argv = ["relaymoe convert-hf", *argv]
    try:
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    finally:
        sys.argv = old_argv
    ps.initialize_model_parallel(1, pp, expert_model_parallel_size=ep)
    model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
        ProcessGroupCollection.use_mpu_process_groups()
    )
    _load_hf_weights(model, hf, cfg)
    hf.close()
    _write_as(model, args, transformer_impl)
    try:
        save_checkpoint(0, [model], None, None, 0, release=True)
        if torch.distributed.get_rank() == 0:  # beside the checkpoint, which Megatron ignores
            (out / FLAGS_FILE).write_text("\n".join(model_flags) + "\n")
        torch.distributed.barrier()
    except BaseException:
        if torch.distributed.get_rank() == 0:  # no half-written checkpoint left to load
            import shutil

            shutil.rmtree(out, ignore_errors=True)
        raise
    return model_flags


def _write_as(model, args, transformer_impl: str) -> None:
    """Make the local-layer model save the keys of ``transformer_impl``'s spec.

    The local spec maps each layer's ``pre_mlp_layernorm.`` to ``mlp.linear_fc1.layer_norm_``
    (where a dense TE layer fuses that norm into its first linear); the TE spec keeps it as
    ``pre_mlp_layernorm.`` in MoE layers, whose grouped experts cannot fuse it. Dropping that
    one entry of an MoE layer's key map writes the TE spec's key. The saved arguments name the
    implementation, so that a resume with the other one is refused by name
    (``checkpoint_compat.impl_mismatch``), and mark the conversion: the local layers write no TE
    ``_extra_state``, which a TE model's load then leaves at its fresh values
    (``checkpoint_compat.drop_absent_extra_state``)."""
    import dataclasses

    from megatron.core.transformer.moe.moe_layer import MoELayer

    from relaymoe.megatron.checkpoint_compat import CONVERTED_MARK

    args.transformer_impl = transformer_impl
    setattr(args, CONVERTED_MARK, True)  # no TE _extra_state here: a TE load leaves it fresh
    if transformer_impl == "local":
        return
    for layer in model.decoder.layers:
        if isinstance(layer.mlp, MoELayer):
            sub = layer.submodules_config
            keys = {k: v for k, v in sub.sharded_state_dict_keys_map.items()
                    if k != "pre_mlp_layernorm."}  # fmt: skip
            layer.submodules_config = dataclasses.replace(sub, sharded_state_dict_keys_map=keys)


def _load_hf_weights(model, hf: SafetensorsCheckpoint, cfg: dict) -> None:
    import torch
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers = model.decoder.layers
    layer_of = {j: layer.layer_number - 1 for j, layer in enumerate(layers)}
    experts_of = {}
    for j, layer in enumerate(layers):
        if isinstance(layer.mlp, MoELayer):
            experts_of[layer_of[j]] = list(layer.mlp.local_expert_indices)
    with torch.no_grad():
        for name, param in model.named_parameters():
            src = hf_tensor(hf, name, cfg, layer_of, experts_of)
            if tuple(src.shape) != tuple(param.shape):
                raise ConvertError(
                    f"{name}: the checkpoint's tensor is {tuple(src.shape)}, the model's "
                    f"{tuple(param.shape)} (config.json does not describe these shards?)"
                )
            param.copy_(src.to(param.dtype))
    if torch.distributed.get_world_size() == 1:  # one process reads every tensor it should
        unused = [n for n in sorted(set(hf.where) - hf.used) if not n.endswith("inv_freq")]
        if unused:
            raise ConvertError(
                f"{len(unused)} tensor(s) of the checkpoint map to no Megatron parameter, e.g. "
                f"{unused[:3]}: not a plain Qwen3-MoE checkpoint"
            )
