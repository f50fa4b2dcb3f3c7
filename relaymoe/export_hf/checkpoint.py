"""A Megatron ``torch_dist`` checkpoint, read without building a model.

``torch_dist`` (PyTorch Distributed Checkpoint under megatron-core) stores every tensor as its
*global* tensor, cut into the chunks the saving processes held: a box of global offsets and
sizes each, listed in the folder's ``.metadata`` with the file (``__R_N.distcp``) and byte range
that hold it. The layout the run was saved at (TP, PP, EP, the dispatcher, the layer spec) only
decides how the global tensors were cut, so reading boxes of the global tensors reads any of
them alike: that is how megatron-core reshards on load, and what ``read`` does here, for any box
(one layer, one expert) so that an export holds one layer at a time.

``TorchDistCheckpoint`` finds the iteration folder (``latest_checkpointed_iteration.txt``, or
``--iteration``, or the folder itself), refuses what is not a ``torch_dist`` checkpoint, checks
that every file the metadata names is there and long enough, reads the saving run's arguments
(megatron-core's ``load_common_state_dict``, as ``relaymoe.megatron.checkpoint_info`` reads the
newest checkpoint's for train.sh's preflight) and says which parts of a tensor no chunk holds
(``unsaved``).
"""

from __future__ import annotations

import itertools
import json
import math
import warnings
from pathlib import Path

from relaymoe.export_hf.errors import ExportError
from relaymoe.megatron.checkpoint_info import TRACKER  # "release" or the newest iteration


def iteration_folder(load: str, iteration: int | None = None) -> Path:
    """The folder of one saved iteration of the checkpoint ``load``: ``load`` itself when it is
    one, else ``iter_NNNNNNN`` of ``iteration``, else the one Megatron's tracker file names."""
    root = Path(load)
    if not root.is_dir():
        raise ExportError(
            f"--load {load}: no such folder; pass the --save folder of the run "
            "(or one iter_NNNNNNN / release folder in it)"
        )
    if iteration is not None:
        folder = root / f"iter_{iteration:07d}"
        if not folder.is_dir():
            saved = sorted(p.name for p in root.glob("iter_*")) + (
                ["release"] if (root / "release").is_dir() else []
            )
            raise ExportError(
                f"--iteration {iteration}: {folder} does not exist; saved here: {saved or 'none'}"
            )
        return folder
    if any((root / f).is_file() for f in (".metadata", "metadata.json")) or any(
        root.glob("mp_rank_*")
    ):  # an iteration folder itself (torch_dist, or a legacy one to refuse by name)
        return root
    tracker = root / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        return root / ("release" if text == "release" else f"iter_{int(text):07d}")
    saved = sorted(p.name for p in root.glob("iter_*"))
    fix = f"pass --iteration N (saved here: {saved})" if saved else "pass a Megatron --save folder"
    raise ExportError(f"--load {load}: no {TRACKER} and no checkpoint in it; {fix}")


class TorchDistCheckpoint:
    """One iteration of a Megatron ``torch_dist`` checkpoint: ``args`` (the saving run's
    arguments), ``tensors`` (key -> torch's ``TensorStorageMetadata``: global size, dtype,
    saved chunks), ``read`` (boxes of the global tensors)."""

    def __init__(self, load: str, iteration: int | None = None):
        self.folder = iteration_folder(load, iteration)
        self._check_format()
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.metadata = FileSystemReader(str(self.folder)).read_metadata()
        self._check_files()
        self.tensors = {
            k: v
            for k, v in self.metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }
        self.args = self._saved_args()

    def _check_format(self) -> None:
        where = self.folder
        if any(where.glob("mp_rank_*")):
            raise ExportError(
                f"{where} is a legacy 'torch' checkpoint (one file per rank, saved at a fixed "
                "TP/PP/EP); export-hf reads torch_dist; fix: load it once in Megatron with "
                "--ckpt-convert-format torch_dist --ckpt-convert-save DIR and export DIR"
            )
        meta = where / "metadata.json"
        backend = json.loads(meta.read_text()).get("sharded_backend") if meta.is_file() else None
        if backend != "torch_dist" or not (where / ".metadata").is_file():
            raise ExportError(
                f"{where} is not a torch_dist checkpoint (metadata.json names backend "
                f"{backend!r}; .metadata present: {(where / '.metadata').is_file()}); save it "
                "with --ckpt-format torch_dist (Megatron's default)"
            )

    def _check_files(self) -> None:
        """Every file the metadata names is there and holds its byte ranges: a torch_dist
        checkpoint has one file per saving process, and one left behind in a copy loses that
        process's chunks (at EP > 1, its experts)."""
        ends: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            ends[info.relative_path] = max(
                ends.get(info.relative_path, 0), info.offset + info.length
            )
        missing = sorted(f for f in ends if not (self.folder / f).is_file())
        if missing:
            raise ExportError(
                f"{self.folder}: {len(missing)} of its {len(ends)} files are missing "
                f"({', '.join(missing[:4])}): every saving process wrote one, and their "
                "chunks (at EP > 1 their experts) are in no other; fix: copy the whole folder"
            )
        short = sorted(f for f, end in ends.items() if (self.folder / f).stat().st_size < end)
        if short:
            raise ExportError(
                f"{self.folder}: file(s) {short[:4]} are shorter than the metadata "
                "says (an interrupted save or copy); fix: copy them again"
            )

    def _saved_args(self):
        with warnings.catch_warnings():
            # megatron-core's import warns of every optional package it lacks, and dcp that it
            # "assumes the intent is to load in a single process": both as intended here
            warnings.simplefilter("ignore")
            from megatron.core.dist_checkpointing import load_common_state_dict

            common = load_common_state_dict(str(self.folder))
        args = common.get("args") if isinstance(common, dict) else None
        if args is None:
            raise ExportError(
                f"{self.folder}: the checkpoint holds no saved arguments, which say its "
                "architecture; export a checkpoint written by Megatron's save_checkpoint (a "
                "training run's --save, or relaymoe convert-hf)"
            )
        return args

    def unsaved(self, key: str, lead: int) -> list[tuple[int, ...]]:
        """The indices along the first ``lead`` axes of tensor ``key`` (e.g. (layer, expert))
        whose slices no saved chunk, or only part of one, holds: empty for a complete tensor."""
        md = self.tensors[key]
        size = tuple(md.size)
        slab = math.prod(size[lead:])
        held: dict[tuple[int, ...], int] = {}
        for c in md.chunks:
            volume = math.prod(c.sizes[lead:])
            ranges = (
                range(o, o + s) for o, s in zip(c.offsets[:lead], c.sizes[:lead], strict=True)
            )
            for idx in itertools.product(*ranges):
                held[idx] = held.get(idx, 0) + volume
        return [
            idx
            for idx in itertools.product(*(range(n) for n in size[:lead]))
            if held.get(idx, 0) < slab
        ]

    def read(self, boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> dict:
        """The tensors of ``boxes`` (key -> (global offsets, sizes)), read in one pass over the
        files, in the checkpoint's dtypes."""
        import torch
        from torch.distributed.checkpoint import FileSystemReader, load

        out = {
            key: torch.empty(sizes, dtype=self.tensors[key].properties.dtype)
            for key, (_, sizes) in boxes.items()
        }
        planner = _box_planner({key: offsets for key, (offsets, _) in boxes.items()})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
            load(
                out,
                storage_reader=FileSystemReader(str(self.folder)),
                planner=planner,
                no_dist=True,
            )
        return out


def _box_planner(offsets: dict):
    """torch's default load planner, asked for one box of each global tensor (at ``offsets``, of
    its destination's size) instead of the whole: torch.distributed.checkpoint reshards, reading
    every saved chunk that overlaps the box. (A class made on use: torch is imported lazily.)"""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class BoxPlanner(DefaultLoadPlanner):
        def __init__(self, offsets: dict):
            super().__init__()
            self.offsets = offsets

        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, dest in self.state_dict.items():
                box = ChunkStorageMetadata(offsets=torch.Size(self.offsets[key]), sizes=dest.size())
                md = self.metadata.state_dict_metadata[key]
                items += create_read_items_for_chunk_list(key, md, [box])
            return LoadPlan(items)

        def lookup_tensor(self, index):  # the destination is the box itself
            return self.state_dict[index.fqn]

    return BoxPlanner(offsets)
