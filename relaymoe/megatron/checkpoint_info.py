"""What a Megatron checkpoint folder says about itself, read without building a model:
``read_checkpoint``.

A folder (``--load``, ``--pretrained-checkpoint``) names its newest checkpoint in
``latest_checkpointed_iteration.txt`` (an iteration, or ``release`` for weights-only ones such
as ``relaymoe convert-hf`` writes), kept in ``iter_NNNNNNN/`` or ``release/``. A ``torch_dist``
checkpoint holds, besides its tensors, a common state with the saving run's parsed arguments
(the model it built, its layout, its ``--transformer-impl``) and the content metadata (how the
distributed optimizer's state is laid out); megatron-core reads that state first, on every
rank, before any tensor. Reading it here takes the same call, on the host, and no tensor.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint folder's newest checkpoint.

    ``iteration``: the tracker's iteration (0 for ``release``); ``release``: weights only;
    ``path``: its iteration folder; ``torch_dist``: whether it is a distributed checkpoint
    (the only kind whose common state is read); ``args``: the saving run's arguments (None
    where the checkpoint has none or is not ``torch_dist``); ``content``: its content metadata
    (None likewise)."""

    folder: str
    iteration: int
    release: bool
    path: str
    torch_dist: bool
    args: object | None
    content: dict | None


def has_checkpoint(folder: str | None) -> bool:
    """Whether ``folder`` names a checkpoint (its tracker file exists), as Megatron decides
    between ``--load`` and ``--pretrained-checkpoint``."""
    return folder is not None and Path(folder, TRACKER).is_file()


def read_checkpoint(folder: str) -> CheckpointInfo | str:
    """The newest checkpoint of ``folder``, or why it cannot be loaded: one line with the fix,
    to follow the folder's name and a colon."""
    tracker = Path(folder, TRACKER)
    if not tracker.is_file():
        return (
            f"not a Megatron checkpoint (no {TRACKER}); fix: the --out folder of "
            "'relaymoe convert-hf', or a SAVE_DIR of an earlier run"
        )
    text = tracker.read_text().strip()
    release = text == "release"
    if not release and not text.isdigit():
        return (
            f"its {TRACKER} holds {text[:40]!r}, neither an iteration nor 'release'; fix: the "
            "checkpoint folder as Megatron or relaymoe convert-hf wrote it"
        )
    iteration = 0 if release else int(text)
    path = Path(folder, "release" if release else f"iter_{iteration:07d}")
    if not path.is_dir():
        return (
            f"its {TRACKER} names {path.name}, which it does not hold (an incomplete copy?); "
            f"fix: copy the whole checkpoint, or point {TRACKER} at a saved iteration"
        )
    from megatron.core import dist_checkpointing

    if not dist_checkpointing.check_is_distributed_checkpoint(str(path)):
        return CheckpointInfo(folder, iteration, release, str(path), False, None, None)
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    try:
        with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
            warnings.simplefilter("ignore")
            state = load_common_state_dict(str(path))
    except Exception as e:  # a truncated or foreign file: the run's load would fail as well
        return (
            f"the common state of {path.name}/ does not load ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}); fix: copy the checkpoint again "
            "(an incomplete copy?)"
        )
    state = state if isinstance(state, dict) else {}
    content = state.get("content_metadata")
    return CheckpointInfo(
        folder, iteration, release, str(path), True, state.get("args"),
        content if isinstance(content, dict) else None,
    )  # fmt: skip
