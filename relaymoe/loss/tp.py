"""The tensor-parallel contract of ``linear_cross_entropy``, checked in one all-reduce.

The ranks of ``tp_group`` must pass one T, H, Vl, chunk size, dtype, ignore_index, label
smoothing and the same labels; each writes a row of integers and every rank reads every row,
so ranks that break the contract all raise the same ``ValueError`` (see ``agree_tp``). A rank
whose own arguments fail their checks enters the same all-reduce with its message
(``refuse_on_every_rank``): every rank raises it, none waits.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist
from torch import Tensor

from relaymoe.loss.inputs import FLOATS, LossSetup

# The tensor-parallel contract, one row per rank (see ``agree_tp``); ``refused``: this rank's
# arguments failed their checks, the message's UTF-8 bytes in the last _MSG_COLS columns
_TP_FIELDS = ("T", "H", "Vl", "chunk", "dtype", "ignore_index", "smoothing", "labels", "bad",
              "first_bad", "live", "refused")  # fmt: skip
_MSG_COLS = 64  # 512 bytes of a refusal's message
_TP_WHAT = {
    "T": ("the token count T (hidden_TH.shape[0])", "every rank passes the same hidden_TH and "
          "labels_T"),
    "H": ("the hidden size H", "every rank passes the same hidden_TH"),
    "Vl": ("the vocabulary shard size Vl (weight_VH.shape[0])", "the vocabulary is split "
           "evenly, rank r holding rows [r*Vl, (r+1)*Vl): pad it to a multiple of the TP size "
           "(Megatron's make_vocab_size_divisible_by)"),
    "chunk": ("the chunk size (chunk_tokens)", "pass the same chunk_tokens (or None) on every "
              "rank"),
    "dtype": ("the dtype (code 1 float16, 2 bfloat16, 3 float32, 4 float64)", "use one dtype "
              "on every rank"),
    "ignore_index": ("ignore_index", "pass the same ignore_index on every rank"),
    "smoothing": ("label_smoothing", "pass the same label_smoothing on every rank"),
    "labels": ("labels_T (a checksum of them)", "every rank passes the same labels_T"),
}  # fmt: skip


def agree_tp(hidden: Tensor, labels: Tensor, setup: LossSetup) -> None:
    """Check, on every rank of ``tp_group`` at once, the contract the chunk loop's collectives
    rely on: one T, H, Vl, chunk size, dtype, ignore_index, smoothing and labels on every rank,
    and every label in range. Each rank writes one row of integers (its own values, a checksum
    of its labels, its first bad label, a validity marker) into a (TP, F) matrix; one all-reduce
    (sum) of that fixed-size matrix gives every rank every row, and the one host read of it
    replaces the label check's host sync. So ranks that broke the contract (different T, shards
    of different sizes) all raise the same ``ValueError`` before any size-dependent collective,
    instead of a hang, a transport error or a wrong loss. A row whose marker is missing (a peer
    that failed the collective) is never read as data."""
    dev, world = hidden.device, setup.world
    rank = dist.get_rank(setup.group)
    cols = len(_TP_FIELDS) + _MSG_COLS
    tokens, hid = hidden.shape
    vocab = setup.vocab_local * world
    bad = ((labels < 0) | (labels >= vocab)) & (labels != setup.ignore_index)
    weights = torch.arange(1, tokens + 1, dtype=torch.int64, device=dev)
    host = [tokens, hid, setup.vocab_local, setup.chunk, FLOATS.index(hidden.dtype) + 1,
            setup.ignore_index, _float_bits(setup.smoothing_arg), 0, 0, 0, 1]  # fmt: skip
    host += [0] * (cols - len(host))
    mat = torch.zeros(world, cols, dtype=torch.int64, device=dev)
    mat[rank] = torch.tensor(host, dtype=torch.int64).to(dev, non_blocking=True)  # no sync
    if tokens:
        first = torch.argmax(bad.to(torch.int8))  # the first bad label's position (device)
        mat[rank, _TP_FIELDS.index("labels")] = (labels * weights).sum()
        mat[rank, _TP_FIELDS.index("bad")] = bad.any().to(torch.int64)
        mat[rank, _TP_FIELDS.index("first_bad")] = labels[first]
    rows = _reduce_rows(mat, setup.group)
    for j, key in enumerate(_TP_FIELDS[:7]):  # the sizes and settings first
        _same_on_every_rank(key, [r[j] for r in rows])
    for r, row in enumerate(rows):
        if row[_TP_FIELDS.index("bad")]:
            raise ValueError(
                f"linear_cross_entropy: label {row[_TP_FIELDS.index('first_bad')]} (on rank {r} "
                f"of tp_group) is outside [0, {vocab}) (V = Vl {setup.vocab_local} x TP "
                f"{world}) and is not ignore_index={setup.ignore_index}; fix the labels or "
                "mark those tokens with ignore_index"
            )
    _same_on_every_rank("labels", [r[_TP_FIELDS.index("labels")] for r in rows])


def refuse_on_every_rank(err: Exception, hidden, group) -> None:
    """This rank's arguments failed their checks (``err``): at TP > 1, enter the contract's
    all-reduce that its peers enter (``agree_tp``) with the message in this rank's row, so
    that every rank raises the same ``ValueError`` instead of leaving the peers waiting. A
    group of one, or no initialised ``torch.distributed``, returns (the caller raises ``err``
    alone: nobody waits)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(group)
    if world < 2:
        return
    if isinstance(hidden, Tensor):
        dev = hidden.device
    elif "nccl" in str(dist.get_backend(group)).lower():
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    msg = str(err).encode()[: _MSG_COLS * 8].ljust(_MSG_COLS * 8, b" ")
    row = [0] * len(_TP_FIELDS) + list(struct.unpack(f"<{_MSG_COLS}q", msg))
    row[_TP_FIELDS.index("live")] = row[_TP_FIELDS.index("refused")] = 1
    mat = torch.zeros(world, len(row), dtype=torch.int64, device=dev)
    mat[dist.get_rank(group)] = torch.tensor(row, dtype=torch.int64)
    _reduce_rows(mat, group)  # raises the first refusing rank's message, as on every rank


def _reduce_rows(mat: Tensor, group) -> list[list[int]]:
    """Every rank's row of the contract (one all-reduce, one host read). Raises, the same on
    every rank, when a row lacks its validity marker (a peer that failed the collective) or a
    rank refused its arguments (the first such rank's message)."""
    dist.all_reduce(mat, op=dist.ReduceOp.SUM, group=group)
    rows = mat.tolist()  # host sync (the one the label check made)
    live = [r[_TP_FIELDS.index("live")] for r in rows]
    if live != [1] * len(rows):
        raise RuntimeError(
            f"linear_cross_entropy: the tensor-parallel check's all-reduce lacks the validity "
            f"marker of ranks {[r for r, v in enumerate(live) if v != 1]} (markers {live}); a "
            "peer failed, its result is not used"
        )
    for r, row in enumerate(rows):
        if row[_TP_FIELDS.index("refused")]:
            words = row[len(_TP_FIELDS) :]
            msg = struct.pack(f"<{len(words)}q", *words).decode(errors="replace").rstrip()
            raise ValueError(f"{msg} (rank {r} of tp_group; every rank of tp_group raises this)")
    return rows


def _same_on_every_rank(key: str, values: list[int]) -> None:
    if len(set(values)) != 1:
        what, fix = _TP_WHAT[key]
        shown = values if key not in ("smoothing", "labels") else _shown(key, values)
        raise ValueError(
            f"linear_cross_entropy: {what} differs across tp_group (by rank): {shown}; {fix}"
        )


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _shown(key: str, values: list[int]) -> list:
    if key == "smoothing":
        return [struct.unpack("<d", struct.pack("<q", v))[0] for v in values]
    return ["same" if v == values[0] else "different" for v in values]
