"""``convert``: the Megatron model built on the host, the Hugging Face weights copied in, saved.

The model is built as ``python -m relaymoe.megatron.pretrain`` builds it and saved through
megatron-core's ``save_checkpoint`` as a ``torch_dist`` release checkpoint, weights only; the
writer process megatron-core starts for it is stopped after it
(``relaymoe.megatron.checkpoint_writer``).
"""

from __future__ import annotations

from pathlib import Path

from relaymoe.convert_hf.errors import ConvertError
from relaymoe.convert_hf.hf_config import (
    check_against_config,
    megatron_model_flags,
    read_hf_config,
)
from relaymoe.convert_hf.host import (
    PRECISION_FLAGS,
    TRANSFORMER_IMPLS,
    build_model,
    cpu_only_megatron,
    host_argv,
    init_distributed,
    use_keys_of,
)
from relaymoe.convert_hf.mapping import hf_tensor
from relaymoe.convert_hf.shards import SafetensorsCheckpoint

FLAGS_FILE = "megatron_model_flags.txt"  # the model flags to train with, one per line
DTYPES = tuple(PRECISION_FLAGS)


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

    cpu_only_megatron()
    init_distributed()
    world = torch.distributed.get_world_size()
    if pp * ep != world:
        raise ConvertError(
            f"--pp {pp} x --ep {ep} = {pp * ep} processes, but {world} run; fix: torchrun "
            f"--nproc-per-node {pp * ep} (or --pp 1 --ep 1 alone)"
        )
    from megatron.training.checkpointing import save_checkpoint

    from relaymoe.megatron.checkpoint_writer import stop_checkpoint_writer

    seq = min(4096, int(cfg.get("max_position_embeddings", 4096)))
    argv = [*host_argv(model_flags, world=world, pp=pp, ep=ep, seq=seq, dtype=dtype),
            "--save", str(out), "--save-interval", "1", "--no-save-optim", "--no-save-rng",
            *extra]  # fmt: skip
    model, args = build_model(argv, prog="relaymoe convert-hf", pp=pp, ep=ep)
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
    finally:  # one save: megatron-core's writer process outlives it otherwise (checkpoint_writer)
        stop_checkpoint_writer()
    return model_flags


def _write_as(model, args, transformer_impl: str) -> None:
    """Make the local-layer model save the keys of ``transformer_impl``'s spec
    (``host.use_keys_of``). The saved arguments name the implementation, so that a resume with
    the other one is refused by name (``checkpoint_compat.impl_mismatch``), and mark the
    conversion: the local layers write no TE ``_extra_state``, which a TE model's load then
    leaves at its fresh values (``checkpoint_compat.drop_absent_extra_state``)."""
    from relaymoe.megatron.checkpoint_compat import CONVERTED_MARK

    args.transformer_impl = transformer_impl
    setattr(args, CONVERTED_MARK, True)  # no TE _extra_state here: a TE load leaves it fresh
    use_keys_of(model, transformer_impl)


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
