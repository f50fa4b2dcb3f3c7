"""A guard that fails on any host read of a tensor made by relaymoe's own code.

Inside ``no_host_reads()`` (backward passes included), a torch call that would read device
data on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool``/``int``/
``float`` of a tensor, ``nonzero``, ``unique``, ``masked_select``, ``torch.equal``, ...; on a
GPU each is a device-to-host sync, and inside a CUDA graph capture an error) raises
``HostRead`` when the Python frame that made it lives in the ``relaymoe`` package. Calls made
by other packages (the Triton interpreter reads its tensors on the host to run a kernel on the
CPU; torch's own helpers) are let through, so the guard runs the CPU suite's kernels as they
are and still sees every read the library itself would make on a GPU.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

import relaymoe

_LIBRARY = os.path.dirname(os.path.abspath(relaymoe.__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

T = torch.Tensor
READS = {
    T.item: "item()",
    T.tolist: "tolist()",
    T.cpu: "cpu()",
    T.numpy: "numpy()",
    T.__bool__: "bool(tensor)",
    T.__int__: "int(tensor)",
    T.__float__: "float(tensor)",
    T.__index__: "index(tensor)",
    T.nonzero: "nonzero()",
    torch.nonzero: "torch.nonzero",
    torch.argwhere: "torch.argwhere",
    torch.unique: "torch.unique",
    T.unique: "unique()",
    torch.masked_select: "torch.masked_select",
    T.masked_select: "masked_select()",
    torch.equal: "torch.equal",
    torch.allclose: "torch.allclose",
    torch.bincount: "torch.bincount",
    T.bincount: "bincount()",
}


class HostRead(AssertionError):
    """A host read of device data from relaymoe's code inside ``no_host_reads``."""


def _library_caller() -> str | None:
    """``file:line`` of the innermost frame outside torch when it is relaymoe's, else None."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_TORCH) or path == os.path.abspath(__file__):
            frame = frame.f_back
            continue
        return f"{path[len(_LIBRARY) :]}:{frame.f_lineno}" if path.startswith(_LIBRARY) else None
    return None


class _Guard(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = READS.get(func)
        if what is None and func in (T.to, T.repeat_interleave, torch.repeat_interleave):
            if func is T.to and any(_is_cpu(a) for a in (*args[1:], *kwargs.values())):
                what = "to('cpu')"
            elif func is not T.to and kwargs.get("output_size") is None:
                what = "repeat_interleave without output_size"
        if what is not None:
            where = _library_caller()
            if where is not None:
                self.seen.append(f"{what} at relaymoe/{where}")
                raise HostRead(f"host read of device data: {what} at relaymoe/{where}")
        return func(*args, **kwargs)


def _is_cpu(a) -> bool:
    return (isinstance(a, str) and a == "cpu") or (isinstance(a, torch.device) and a.type == "cpu")


@contextlib.contextmanager
def no_host_reads():
    """Raise ``HostRead`` at the first host read relaymoe's code makes inside the block, the
    backward of its autograd functions included: autograd runs a custom function's backward
    with no torch-function mode active, so the guard is entered again around each."""
    from unittest import mock

    from torch.autograd.function import BackwardCFunction

    guard = _Guard()
    backward = BackwardCFunction.apply

    def guarded(node, *args):
        with guard:
            return backward(node, *args)

    with guard, mock.patch.object(BackwardCFunction, "apply", guarded):
        yield guard
