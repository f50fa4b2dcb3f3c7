"""The Megatron GPT model on the host: built as ``python -m relaymoe.megatron.pretrain`` builds it,
in a process without a GPU (gloo, local layers, the ring dispatcher).

``relaymoe convert-hf`` builds it to save Hugging Face weights through Megatron's own
``save_checkpoint``; ``relaymoe check-hf`` builds it to load a checkpoint through Megatron's own
``load_checkpoint`` and run a forward. Both go through megatron-core's parser
(``parse_and_validate_args``) and ``GPTModelBuilder``, so the model, its parameter names and its
checkpoint keys are a training run's.

megatron-core asks CUDA a few questions on the way, even for a host model; ``cpu_only_megatron``
and ``cpu_only_load`` answer them for a process that has no GPU (they change nothing where CUDA
is available).
"""

from __future__ import annotations

import os
import sys

# the layer spec the checkpoint's keys follow: Megatron's default first
TRANSFORMER_IMPLS = ("transformer_engine", "local")
PRECISION_FLAGS = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}


def init_distributed() -> None:
    """torch.distributed over gloo: torchrun's world when run under it, else a world of one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)


def cpu_only_megatron() -> None:
    """The CUDA queries megatron-core makes while parsing, building and saving, answered for a
    host-only process (nothing here runs on a GPU)."""
    import torch

    if torch.cuda.is_available():
        return
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # validate_args asks for it
    torch.cuda.current_device = lambda: "cpu"  # RoPE puts its frequencies there
    torch.cuda.get_rng_state = lambda *a, **k: torch.ByteTensor()  # save_checkpoint collects it
    torch.cuda.synchronize = lambda *a, **k: None  # the torch_dist writer waits for the device


def cpu_only_load() -> None:
    """What loading a checkpoint and a forward ask of CUDA, answered for a host-only process:
    ``load_checkpoint`` all-reduces the tracker file's iteration in a CUDA tensor (read here as
    the file says), the attention forks the CUDA RNG tracker (no dropout runs: a null context),
    and the router moves its weight to the current device (kept where it is)."""
    import contextlib

    import torch

    cpu_only_megatron()
    if torch.cuda.is_available():
        return
    import torch.nn.functional as F
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.training import checkpointing

    def read_metadata(path):
        text = open(path).read().strip()
        return (0, True) if text == "release" else (int(text), False)

    checkpointing.read_metadata = read_metadata
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    TopKRouter.gating = lambda self, x: F.linear(x, self.weight.to(x.dtype))


def host_argv(model_flags: list[str], *, world: int, pp: int = 1, ep: int = 1, seq: int = 4096,
              dtype: str = "fp32", dispatcher: str = "ring") -> list[str]:  # fmt: skip
    """Megatron's arguments for the model of ``model_flags`` on the host: local layers (no
    TransformerEngine here), the fusions that exist only as CUDA kernels off, one micro-batch per
    data-parallel rank, mock data, gloo. The caller adds ``--save`` or ``--load``."""
    return [
        *model_flags,
        "--seq-length", str(seq), "--micro-batch-size", "1",
        "--global-batch-size", str(world // pp),
        "--pipeline-model-parallel-size", str(pp), "--expert-model-parallel-size", str(ep),
        "--expert-tensor-parallel-size", "1",
        "--moe-token-dispatcher-type", dispatcher,
        "--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
        "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
        "--use-cpu-initialization", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--train-iters", "1", "--lr", "1e-4", "--ckpt-format", "torch_dist",
        "--distributed-backend", "gloo", *PRECISION_FLAGS[dtype],
    ]  # fmt: skip


def build_model(argv: list[str], *, prog: str, pp: int = 1, ep: int = 1):
    """(model, args): Megatron's arguments parsed from ``argv`` (as ``sys.argv[1:]``) and the GPT
    model they describe, built with megatron-core's ``GPTModelBuilder`` on this process's part
    of a ``pp`` x ``ep`` world. Needs ``init_distributed`` and ``cpu_only_megatron`` first."""
    from relaymoe.megatron import register
    from relaymoe.megatron.pretrain import use_prebuilt_dataset_helpers

    register()
    use_prebuilt_dataset_helpers()
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.models.gpt import GPTModelBuilder

    old_argv = sys.argv
    sys.argv = [prog, *argv]
    try:
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    finally:
        sys.argv = old_argv
    ps.initialize_model_parallel(1, pp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1)  # fmt: skip
    model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
        ProcessGroupCollection.use_mpu_process_groups()
    )
    return model, args


def release_model() -> None:
    """Undo ``build_model``'s global state (model-parallel groups, Megatron's global arguments),
    so that another model can be built in the same process."""
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training.global_vars import unset_global_variables

    ps.destroy_model_parallel()
    unset_global_variables()
    destroy_num_microbatches_calculator()


def use_keys_of(model, transformer_impl: str) -> None:
    """Make the local-layer ``model`` save and load the checkpoint keys of
    ``transformer_impl``'s layer spec.

    The local spec maps each layer's ``pre_mlp_layernorm.`` to ``mlp.linear_fc1.layer_norm_``
    (where a dense TE layer fuses that norm into its first linear); the TE spec keeps it as
    ``pre_mlp_layernorm.`` in MoE layers, whose grouped experts cannot fuse it. Dropping that
    one entry of an MoE layer's key map gives the TE spec's key
    (``relaymoe.megatron.checkpoint_compat``)."""
    import dataclasses

    from megatron.core.transformer.moe.moe_layer import MoELayer

    if transformer_impl == "local":
        return
    for layer in model.decoder.layers:
        if isinstance(layer.mlp, MoELayer):
            sub = layer.submodules_config
            keys = {k: v for k, v in sub.sharded_state_dict_keys_map.items()
                    if k != "pre_mlp_layernorm."}  # fmt: skip
            layer.submodules_config = dataclasses.replace(sub, sharded_state_dict_keys_map=keys)
