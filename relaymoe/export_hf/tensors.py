"""The Hugging Face tensors of a Megatron checkpoint, one decoder layer at a time.

megatron-core saves a decoder's layers one of two ways: stacked, one key per kind of tensor
(``decoder.layers.self_attention.linear_qkv.weight``) with the global layer number as its first
axis, when every layer is alike; or one key per layer (``decoder.layers.3.mlp.router.weight``)
when they differ (dense and MoE layers mixed). A MoE layer's experts carry the global expert id
on the next axis, whichever dispatcher, expert layout (SequentialMLP, grouped) and EP saved
them. ``Layout`` finds each layer's tensors in either form and checks that every layer's and
every expert's chunks were saved; ``layer_tensors`` reads one layer and names its tensors as
Hugging Face does, through the one table both directions share
(``relaymoe.convert_hf.mapping``).
"""

from __future__ import annotations

from relaymoe.convert_hf.mapping import (
    DENSE_FC1,
    EXPERTS_FC1,
    EXPERTS_FC2,
    GLOBAL_TENSORS,
    LAYER_TENSORS,
    QKV,
    attention_shape,
    hf_dense_mlp_names,
    hf_expert_names,
    hf_layer,
    hf_qkv_names,
    split_gate_up,
    split_qkv,
)
from relaymoe.export_hf.checkpoint import TorchDistCheckpoint
from relaymoe.export_hf.errors import ExportError

LAYERS = "decoder.layers."
# keys of the training state saved beside the model (Adam's moments, fp32 main weights), which a
# Hugging Face folder has no place for and needs none of: ``optimizer.`` or ``chained_N.``
TRAINING_STATE = ("optimizer.", "chained_")
EXPERT_KEYS = (EXPERTS_FC1, EXPERTS_FC2)
# what an unknown tensor key most likely is, by a piece of its name
_HINTS = (
    ("shared_expert", "shared experts"),
    ("expert_bias", "a router expert bias"),
    ("bias", "a bias"),
    ("mtp", "multi-token prediction"),
)


def _unknown(key: str) -> ExportError:
    hint = next((what for piece, what in _HINTS if piece in key), "no Qwen3-MoE tensor")
    return ExportError(
        f"the checkpoint has tensor {key!r} ({hint}), for which a Qwen3-MoE model has no place; "
        "export-hf writes Qwen3-MoE folders only"
    )


class Layout:
    """Where each tensor of the checkpoint is: ``globals`` (Megatron name -> key) and
    ``layers[i]`` (name inside layer ``i`` -> (key, global offsets, sizes, stacked)); the
    optimizer's state is left out. Refuses a key that maps to no Qwen3-MoE tensor, and a tensor
    some of whose layers or experts no saved chunk holds (naming them)."""

    def __init__(self, ckpt: TorchDistCheckpoint, num_layers: int, num_experts: int):
        self.globals: dict[str, str] = {}
        self.layers: list[dict[str, tuple]] = [{} for _ in range(num_layers)]
        for key, md in ckpt.tensors.items():
            if key.startswith(TRAINING_STATE):
                continue
            size = tuple(md.size)
            if key in GLOBAL_TENSORS:
                self.globals[key] = key
                _check_saved(ckpt, key, ())
                continue
            if not key.startswith(LAYERS):
                raise _unknown(key)
            head, _, rest = key.removeprefix(LAYERS).partition(".")
            per_layer = head.isdigit()
            if not per_layer:
                rest = key.removeprefix(LAYERS)
            if rest not in LAYER_TENSORS and rest not in (QKV, DENSE_FC1, *EXPERT_KEYS):
                raise _unknown(key)
            experts = rest in EXPERT_KEYS
            axes = ("layer",) * (not per_layer) + ("expert",) * experts
            if experts and size[len(axes) - 1] != num_experts:
                raise ExportError(
                    f"{key} holds {size[len(axes) - 1]} experts but the run had "
                    f"--num-experts {num_experts}"
                )
            _check_saved(ckpt, key, axes)
            if per_layer:
                i = int(head)
                if i >= num_layers:
                    raise ExportError(f"{key}: layer {i} of a {num_layers}-layer model")
                self.layers[i][rest] = (key, (0,) * len(size), size, False)
                continue
            if size[0] != num_layers:
                raise ExportError(
                    f"{key} stacks {size[0]} layers but the run had --num-layers {num_layers}"
                )
            for i in range(num_layers):
                self.layers[i][rest] = (key, (i,) + (0,) * (len(size) - 1), (1, *size[1:]), True)


def _check_saved(ckpt: TorchDistCheckpoint, key: str, axes: tuple[str, ...]) -> None:
    """ExportError naming the layers/experts of ``key`` (indexed by ``axes``) that no saved
    chunk holds: a save that lost a process's part, e.g. one EP rank's experts."""
    gaps = ckpt.unsaved(key, len(axes))
    if not gaps:
        return
    named = ", ".join(
        " ".join(f"{a} {i}" for a, i in zip(axes, gap, strict=True)) or "all of it"
        for gap in gaps[:6]
    )
    more = f" and {len(gaps) - 6} more" if len(gaps) > 6 else ""
    raise ExportError(
        f"the checkpoint does not hold all of {key}: no saved chunk has {named}{more}; the save "
        "was incomplete (a process's chunks lost): export a complete checkpoint"
    )


def global_tensors(ckpt: TorchDistCheckpoint, layout: Layout) -> dict:
    """Megatron name -> tensor of the tensors outside the decoder layers."""
    boxes = {}
    for key in layout.globals.values():
        size = tuple(ckpt.tensors[key].size)
        boxes[key] = ((0,) * len(size), size)
    return ckpt.read(boxes)


def layer_tensors(ckpt: TorchDistCheckpoint, layout: Layout, i: int, cfg: dict) -> dict:
    """Hugging Face name -> tensor of decoder layer ``i`` (views of what was read; clone before
    keeping them beside each other)."""
    entries = layout.layers[i]
    got = ckpt.read({key: (off, size) for key, off, size, _ in entries.values()})
    heads, groups, head_dim = attention_shape(cfg)
    out: dict = {}

    def put(name: str, tensor) -> None:
        if name in out:
            raise ExportError(
                f"layer {i}: two checkpoint tensors map to {name} (one of each "
                f"layer spec's names? {sorted(entries)})"
            )
        out[name] = tensor

    for rest, (key, _, _, stacked) in entries.items():
        t = got[key][0] if stacked else got[key]
        if rest in LAYER_TENSORS:
            put(hf_layer(i) + LAYER_TENSORS[rest], t)
        elif rest == QKV:
            for name, part in zip(
                hf_qkv_names(i), split_qkv(t, heads, groups, head_dim), strict=True
            ):
                put(name, part)
        elif rest == DENSE_FC1:
            gate, up, _ = hf_dense_mlp_names(i)
            put(gate, split_gate_up(t)[0])
            put(up, split_gate_up(t)[1])
        else:
            for j in range(t.shape[0]):
                gate, up, down = hf_expert_names(i, j)
                if rest == EXPERTS_FC1:
                    put(gate, split_gate_up(t[j])[0])
                    put(up, split_gate_up(t[j])[1])
                else:
                    put(down, t[j])
    return out
