"""Triton's CPU interpreter with its bookkeeping cached, for the test suite (``install``).

Under ``TRITON_INTERPRET=1`` every kernel launch patches ``triton.language`` for the interpreter
(a few hundred attributes, found with ``inspect.getmembers``) and restores it afterwards; and
every call of a ``@triton.jit`` helper inside a kernel, in every program of the grid, patches the
modules it sees again (the same patches; never restored). That bookkeeping was a quarter to a
third of the suite's interpreter time. ``install`` keeps each package's list of builtins after
the first look, skips a helper's re-patch of modules already patched during its launch, and
memoizes the numpy dtype of a Triton dtype and which of ``triton.language``'s modules a kernel
module's globals hold. And every integer ``+``, ``-`` and ``*`` in a kernel recomputes itself in
int64 with range comparisons for the overflow sanitizer, whose only reader, ``device_assert``,
emits nothing unless the options ask for debug, which the interpreter's never do (a third of a
ring scenario's kernel time): ``install`` skips that recomputation when debug is off. The same
patched functions run on the same numpy arrays: what a kernel computes is unchanged
(``tests/harness/test_triton_interpreter.py`` checks it bitwise against the interpreter as shipped).

The hooks are Triton's private functions; ``install`` does nothing on a Triton other than the
versions it was written against (``VERSIONS``): the suite then runs at the interpreter's own pace.
The conftest installs it in pytest's processes, ``tests.worlds`` in the processes it starts.
"""

from __future__ import annotations

import inspect
import threading

VERSIONS = ("3.8",)  # Triton major.minor releases whose interpreter these hooks match
_installed: dict = {}  # the replaced originals, while installed


def supported() -> bool:
    try:
        import triton
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    from triton.language.semantic import TritonSemantic

    names = ("_patch_lang", "_patch_builtin", "_patch_attr", "_get_np_dtype", "GridExecutor")
    return (
        ".".join(triton.__version__.split(".")[:2]) in VERSIONS
        and all(hasattr(interp, n) for n in names)
        and hasattr(TritonSemantic, "binary_op_sanitize_overflow_impl")
    )


def install() -> bool:
    """Install the caches (once per process); False where the Triton is not one of ``VERSIONS``
    (nothing is changed then)."""
    if _installed:
        return True
    if not supported():
        return False
    import triton.language as tl
    import triton.runtime.interpreter as interp
    from triton.language.semantic import TritonSemantic

    originals = {
        "_patch_builtin": interp._patch_builtin,
        "_patch_lang": interp._patch_lang,
        "_get_np_dtype": interp._get_np_dtype,
        "GridExecutor.__call__": interp.GridExecutor.__call__,
        "TritonSemantic.binary_op_sanitize_overflow_impl": (
            TritonSemantic.binary_op_sanitize_overflow_impl
        ),
    }
    builtins: dict[int, list] = {}  # id(package) -> [(name, builtin)]

    def _patch_builtin(pkg, builder, scope):
        found = builtins.get(id(pkg))
        if found is None:
            found = builtins[id(pkg)] = [
                (name, member) for name, member in inspect.getmembers(pkg)
                if tl.core.is_builtin(member)
            ]  # fmt: skip
        for name, member in found:
            interp._patch_attr(pkg, name, member, builder, scope)

    dtypes: dict = {}

    def _get_np_dtype(tt_dtype):
        try:
            return dtypes[tt_dtype]
        except KeyError:
            dtypes[tt_dtype] = found = originals["_get_np_dtype"](tt_dtype)
            return found
        except TypeError:  # an unhashable one (a block type): as shipped
            return originals["_get_np_dtype"](tt_dtype)

    state = threading.local()  # per thread: autograd's backward launches in a thread of its own

    class _Launch:
        """A launch's patch: restored by the launch, which then no longer covers helpers."""

        def __init__(self, scope, stack):
            self.scope, self.stack = scope, stack

        def restore(self):
            self.stack.pop()
            self.scope.restore()

    class _Covered:
        def restore(self):
            pass

    # a kernel module's globals (by id; a module's live as long as it) -> (their count, the
    # modules found there): looked at again once names are added (the interpreter adds its own
    # to a module's globals when it first rewrites a function of it)
    found_in: dict[int, tuple[int, frozenset]] = {}

    def _modules(fn) -> frozenset:  # what the interpreter patches for fn: tl, tl.core
        names = fn.__globals__
        known = found_in.get(id(names))
        if known is not None and known[0] == len(names):
            return known[1]
        found = frozenset(id(v) for v in names.values()
                          if inspect.ismodule(v) and v in (tl, tl.core))  # fmt: skip
        found_in[id(names)] = (len(names), found)
        return found

    def _patch_lang(fn):
        stack = state.__dict__.setdefault("stack", [])
        modules = _modules(fn)
        if state.__dict__.pop("launch", False):  # the launch's own patch
            stack.append(set(modules))
            return _Launch(originals["_patch_lang"](fn), stack)
        if modules and stack and modules <= stack[-1]:  # a helper: patched in this launch
            return _Covered()
        scope = originals["_patch_lang"](fn)  # (a helper's patch is never restored)
        if modules and stack:
            stack[-1] |= modules
        return scope

    def _call(self, *args, **kwargs):
        state.launch = True
        try:
            return originals["GridExecutor.__call__"](self, *args, **kwargs)
        finally:
            state.__dict__.pop("launch", None)

    def _sanitize_overflow(self, lhs, rhs, binary_op):
        # its int64 recomputation and range checks feed device_assert alone, which returns
        # without emitting anything unless options.debug
        if self.builder.options.debug:
            return originals["TritonSemantic.binary_op_sanitize_overflow_impl"](
                self, lhs, rhs, binary_op
            )
        return None

    interp._patch_builtin = _patch_builtin
    interp._patch_lang = _patch_lang
    interp._get_np_dtype = _get_np_dtype
    interp.GridExecutor.__call__ = _call
    TritonSemantic.binary_op_sanitize_overflow_impl = _sanitize_overflow
    _installed.update(originals)
    return True


def uninstall() -> None:
    """The interpreter as shipped again (for the check of what ``install`` changes)."""
    if not _installed:
        return
    import triton.runtime.interpreter as interp
    from triton.language.semantic import TritonSemantic

    TritonSemantic.binary_op_sanitize_overflow_impl = _installed[
        "TritonSemantic.binary_op_sanitize_overflow_impl"
    ]
    interp._patch_builtin = _installed["_patch_builtin"]
    interp._patch_lang = _installed["_patch_lang"]
    interp._get_np_dtype = _installed["_get_np_dtype"]
    interp.GridExecutor.__call__ = _installed["GridExecutor.__call__"]
    _installed.clear()
