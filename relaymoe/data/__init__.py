"""``relaymoe data``: JSON lines or plain text to Megatron's indexed dataset (``.bin``/``.idx``).

What Megatron-LM's ``tools/preprocess_data.py --append-eod`` makes, without a Megatron-LM
checkout: every document is tokenised by the tokenizer that training will build from
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH`` (megatron-core's own
``build_tokenizer``, so the ids, the vocabulary size and the EOD id are training's), the EOD id
is appended, and the documents are written through megatron-core's ``IndexedDatasetBuilder``
into ``PREFIX_{key}_document.bin``/``.idx`` (one dataset per JSON key, preprocess_data's names).

The inputs are cut into chunks (``--chunk-mib`` of JSON lines or text lines, a line belonging to
the chunk it starts in; a paragraph- or file-document input is one chunk). Each chunk is
tokenised by one worker process into a part dataset of its own, written under a temporary name
and renamed when complete, with a sidecar naming what it was made from (the input's path, size
and modification time, the chunk's byte range, the tokenizer files' hash, the settings). A
rerun keeps every part whose sidecar matches and makes only the missing ones, so an
interrupted run continues where it stopped; the parts are then merged in input order, which
makes the output independent of the worker count. A completed output has a manifest
(``PREFIX_{key}_document.json``, which also records the Megatron flags to train with); when it
matches, nothing is redone.

The modules: ``tokenizer`` (training's tokenizer and its fingerprint), ``inputs`` (the chunks of
the inputs and their documents), ``parts`` (one chunk's part dataset, made by a worker),
``build`` (``prepare``: the parts, then the merge), ``lock`` (one run per output prefix),
``progress``, ``cli`` (the subcommand), ``check`` (what training needs of a dataset: train.sh's
preflight runs it).

Megatron-core (its tokenizer and ``IndexedDatasetBuilder``) is imported by the functions, never
at import time, so the ``relaymoe`` CLI stays cheap; of the rest of relaymoe only
``host_warnings`` is imported (by the subcommand), and ``relaymoe.megatron``'s preflight checks
use the tokenizer and ``dataset_problems`` from here.
"""

from relaymoe.data.build import Result, prepare
from relaymoe.data.check import dataset_problems
from relaymoe.data.cli import add_parser, main
from relaymoe.data.errors import DataError
from relaymoe.data.inputs import (
    INPUT_FORMATS,
    TEXT_MODES,
    Chunk,
    documents,
    input_format,
    plan_chunks,
)
from relaymoe.data.parts import FORMAT_VERSION, Settings, make_part, part_done
from relaymoe.data.tokenizer import (
    build_megatron_tokenizer,
    resolve_tokenizer,
    tokenizer_fingerprint,
)

__all__ = [
    "FORMAT_VERSION",
    "INPUT_FORMATS",
    "TEXT_MODES",
    "Chunk",
    "DataError",
    "Result",
    "Settings",
    "add_parser",
    "build_megatron_tokenizer",
    "dataset_problems",
    "documents",
    "input_format",
    "main",
    "make_part",
    "part_done",
    "plan_chunks",
    "prepare",
    "resolve_tokenizer",
    "tokenizer_fingerprint",
]
