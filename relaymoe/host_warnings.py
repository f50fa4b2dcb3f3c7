"""The warnings megatron-core and torch print when imported on a host, which ask nothing of the
user; the command-line entry points silence them (``quiet_host_warnings``).

On a machine without a GPU every ``relaymoe`` subcommand that imports megatron-core (``data``
for its tokenizer and dataset builder, ``convert-hf``, train.sh's preflight) printed three of
them: torch's "No CUDA runtime is found" (``torch.utils.cpp_extension`` looks for a CUDA
toolkit when imported), megatron-core's "Could not determine rank" (no ``torch.distributed`` in
a single process) and "Apex is not installed" (megatron-core's layer specs fall back to torch's
norms); and, once ``register()`` imports ``megatron.training``, its own "Transformer Engine and
Apex are not installed", "absl.logging is not installed" and TE's version "0.0.0" (TE absent).
None of them changes what these commands compute, and a user reading them can do nothing about
them. Only these messages are filtered, by their text; every other warning, among them the
ones a training run prints, still shows.

Library code never calls this: the filters are process state, set by an entry point (the
``relaymoe`` command line, the preflight module, the worker processes ``relaymoe data`` starts
for the command line) for its own process.
"""

from __future__ import annotations

import logging
import warnings

# (module-regex, message-regex) of the Python warnings filtered
_WARNINGS = (
    (r"megatron\.core\._rank_utils", r"Could not determine rank"),
    (r"megatron\.core\.", r"Apex is not installed"),
    (r"megatron\.core\.", r"Transformer Engine and Apex are not installed"),
    # megatron.training's modules, imported by register()'s train_step patch: the same notes
    (r"megatron\.training\.", r"Transformer Engine and Apex are not installed"),
    (r"megatron\.core\.hyper_comm_grid", r"absl\.logging is not installed"),
    (
        r"megatron\.core\.extensions\.",
        r"Only transformer-engine>=1\.7\.0 supports MoE experts, but "
        r"your version is 0\.0\.0",
    ),
)
# loggers whose warnings at import ask nothing of the user
_LOGGERS = ("torch.utils.cpp_extension",)


def quiet_host_warnings() -> None:
    """Silence, in this process, the import-time warnings of torch and megatron-core listed
    above (call before importing megatron-core); every other warning still shows."""
    for module, message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
