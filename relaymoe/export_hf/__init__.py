"""``relaymoe export-hf``: a Megatron ``torch_dist`` checkpoint to a Hugging Face Qwen3-MoE folder.

The way back after ``relaymoe convert-hf`` and training with ``--moe-token-dispatcher-type
ring``: evaluation harnesses, inference servers and the Hub read Hugging Face folders.

Any checkpoint Megatron's ``save_checkpoint`` wrote in ``torch_dist`` (its default) exports:
saved at any TP/PP/EP, by either dispatcher (ring and alltoall save the same keys), with
either ``--transformer-impl`` (the two specs key one norm per MoE layer differently; the table
in ``relaymoe.convert_hf.mapping`` knows both names). ``torch_dist`` keeps every tensor as its
global tensor cut into the saving processes' chunks, so the export reads the global tensors
directly, one decoder layer at a time, without building a model: every expert of every EP rank
is read from that rank's file, and a file or a chunk that is missing is named, never skipped
(Megatron-Bridge's export at EP > 1 and Megatron-LM's legacy converter have lost expert
weights this way).

The modules: ``checkpoint`` (the iteration folder, its files, saved arguments and boxes of
its global tensors), ``architecture`` (the ``config.json`` of the saved arguments, and what
Qwen3-MoE cannot express), ``tensors`` (where each layer's tensors are, and their Hugging Face
names), ``writer`` (safetensors shards and index), ``run`` (``export``), ``cli`` (the
subcommand).

An entry point beside the CLI, above ``relaymoe.megatron``: only ``checkpoint`` imports
megatron-core (its reader of the saved arguments), inside a function.
"""

from relaymoe.export_hf.architecture import hf_config, refusal
from relaymoe.export_hf.checkpoint import TorchDistCheckpoint, iteration_folder
from relaymoe.export_hf.cli import add_parser, main
from relaymoe.export_hf.errors import ExportError
from relaymoe.export_hf.run import DTYPES, export
from relaymoe.export_hf.writer import parse_size

__all__ = [
    "DTYPES",
    "ExportError",
    "TorchDistCheckpoint",
    "add_parser",
    "export",
    "hf_config",
    "iteration_folder",
    "main",
    "parse_size",
    "refusal",
]
