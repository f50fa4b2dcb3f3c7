"""``relaymoe convert-hf``: a Hugging Face Qwen3-MoE checkpoint to a Megatron ``torch_dist`` one.

Reads ``config.json`` and the safetensors shards (``model.safetensors.index.json`` or one
``model.safetensors``) of a ``qwen3_moe`` model, builds the Megatron GPT model exactly as
``python -m relaymoe.megatron.pretrain`` builds it (megatron-core's parser and
``GPTModelBuilder``, the local transformer layers, relaymoe's ring dispatcher; on CPU, gloo),
copies every Hugging Face tensor into its Megatron parameter, and saves through megatron-core's
own ``save_checkpoint`` as a ``release`` checkpoint (weights only: no optimizer, no RNG state).

megatron-core 0.19.2 ships no converter that fits (its ``models/huggingface/`` wraps Hugging
Face Qwen2 modules for multimodal models; Megatron-LM's ``tools/checkpoint/`` is not in the
wheel), and Megatron-Bridge 0.6.2 imports TransformerEngine at import time, whose PyTorch
extension builds only where the CUDA toolkit is (examples/qwen3/README.md says what fails).

Why through the model rather than writing keys by hand: ``save_checkpoint`` stores the model's
``sharded_state_dict``, whose tensors carry their global shape and offsets, and the content
metadata Megatron reads back on load. Megatron then reshards on load to any TP/PP/EP layout
(``torch_dist``), and the keys are the same for the local and the TransformerEngine layer
specs (the local spec maps its norms onto TE's fused names, ``sharded_state_dict_keys_map``;
``SequentialMLP`` and ``TEGroupedMLP`` write the same expert keys) and for every dispatcher
(``tests/lib/test_megatron_layer.py`` checks ring against alltoall).

Memory: the model is held once in ``--dtype`` on the host (Qwen3-30B-A3B in bf16: about 61 GB),
plus one Hugging Face tensor at a time. Under ``torchrun --nproc-per-node N`` with ``--ep N`` (or
``--pp N``) each process holds 1/N of the experts (or layers); the checkpoint is the same.

The modules: ``hf_config`` (the checkpoint's ``config.json``, the Megatron flags it gives, its
``architecture``), ``shards`` (its safetensors tensors by name), ``mapping`` (which Hugging Face
tensor is which Megatron tensor: the one table ``relaymoe export-hf`` reads backwards too),
``host`` (the Megatron model built on the host, which ``relaymoe check-hf`` loads through as
well), ``run`` (``convert``: build, copy, save), ``cli`` (the subcommand).

An entry point beside the CLI that exposes it, above ``relaymoe.megatron``: ``host`` and ``run``
import megatron-core and ``relaymoe.megatron`` inside their functions, so the subcommand's parser
and the checkpoint's reading need neither.
"""

from relaymoe.convert_hf.cli import add_parser, main
from relaymoe.convert_hf.errors import ConvertError
from relaymoe.convert_hf.hf_config import (
    SUPPORTED_MODEL_TYPES,
    architecture,
    check_against_config,
    megatron_model_flags,
    moe_layer_pattern,
    read_hf_config,
)
from relaymoe.convert_hf.mapping import fused_qkv, hf_names, hf_tensor, split_qkv
from relaymoe.convert_hf.run import DTYPES, FLAGS_FILE, convert
from relaymoe.convert_hf.shards import SafetensorsCheckpoint

__all__ = [
    "DTYPES",
    "FLAGS_FILE",
    "SUPPORTED_MODEL_TYPES",
    "ConvertError",
    "SafetensorsCheckpoint",
    "add_parser",
    "architecture",
    "check_against_config",
    "convert",
    "fused_qkv",
    "hf_names",
    "hf_tensor",
    "main",
    "megatron_model_flags",
    "moe_layer_pattern",
    "read_hf_config",
    "split_qkv",
]
