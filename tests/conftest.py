import os

import pytest
import torch

# Without a GPU, Triton kernels run in its CPU interpreter; must be set before triton.jit decorates.
# On a GPU machine (scripts/gpu_suite.sh) they compile for the device.
# And torch.compile'd functions (megatron-core's jit_fuser fusions: its SwiGLU, GeLU, quick-GeGLU)
# run eagerly: inductor's CPU backend would compile C++ for each in every process that calls it
# (seconds apiece, more on a cold cache, as on a fresh CI machine), which no CPU test checks; the
# GPU suites compile them. torch.compile still returns its wrapper (the activation map reads
# through it); dynamo only skips its frames. Set here, in the environment, so that the processes
# the tests start run them eagerly too (before tests.worlds keeps the session's environment).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # read when torch._dynamo is imported
if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's bookkeeping cached
    from tests import triton_interpreter

    triton_interpreter.install()

from tests.fixtures import Worlds  # noqa: E402


@pytest.fixture(scope="session")
def gloo_worlds():
    """The spawned worlds the ring scenarios run in, kept for the session (``tests.worlds``):
    ``gloo_worlds.run(fn, size, timeout=...)`` runs ``fn(rank, size, group)`` on every rank of
    the world of ``size`` ranks its module uses, spawned on first use; fails the test with each
    failing rank's traceback, or the ranks that hung (that world is killed, a fresh one serves
    the next scenario). Every world is shut down at the end of the session."""
    # three worlds kept: a file's sizes 1, 2 and 4 (tests/lib/test_megatron_layer.py) interleave
    # in a serial run
    worlds = Worlds(live=3)
    yield worlds
    worlds.close()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """For pytest-xdist (``-n 2 --dist loadgroup``, as scripts/test.sh runs the suite): the tests
    of a file that share a module-scoped fixture of that file run on one worker (the fixture is
    built once, as in a serial run); and the slow tests come first, each file's in their order,
    so that no long test starts last while the other worker idles. Serial runs keep the order
    too: only the position of whole slow files changes."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info else ()
        module = item.nodeid.split("::")[0]
        shared = any(
            d.scope == "module" and d.baseid == module for fixturedefs in defs for d in fixturedefs
        )
        if shared and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(module))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


class _GroupSuffix:
    """pytest-xdist's ``--dist loadgroup`` sends the tests whose node ids end in ``@group`` to one
    worker; xdist (3.8) writes that suffix into ``item._nodeid``, which pytest 9 no longer reads
    (the id lives in ``item._id``), so no test was grouped. After xdist's hook, this one writes
    the suffix where pytest 9 keeps the id, for items that still lack it."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if not getattr(config.option, "loadgroup", False):
            return
        from _pytest.nodeid import coerce_node_id

        for item in items:
            names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                            for m in item.iter_markers("xdist_group")})  # fmt: skip
            if names and "@" not in item.nodeid.rsplit("]", 1)[-1] and hasattr(item, "_id"):
                item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


def pytest_configure(config):
    config.pluginmanager.register(_GroupSuffix(), "relaymoe-xdist-group-suffix")


# ------------------------------------------------------------- Hugging Face checkpoints, tiny
# Built once per session (the test files that use them share an xdist_group, so one worker
# builds them): tests/lib/test_convert_hf.py and tests/lib/test_export_hf.py.
@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """(folder, model): a tiny random Hugging Face Qwen3-MoE (``tests.fixtures.tiny_qwen3_moe``,
    untied, every layer MoE) in several safetensors shards."""
    from tests.fixtures import tiny_qwen3_moe

    folder = tmp_path_factory.mktemp("hf") / "hf"
    return folder, tiny_qwen3_moe(folder)


@pytest.fixture(scope="session")
def converted_local(tiny_hf):
    """(checkpoint, model flags): ``tiny_hf`` converted by two processes at PP 2 (each writes its
    layer's tensors to its own file) in the local spec's keys, fp32."""
    from tests.fixtures import convert_hf

    ckpt = tiny_hf[0].parent / "ckpt_local_pp2"
    flags = convert_hf(tiny_hf[0], ckpt, "--transformer-impl", "local", "--pp", "2", world=2)
    assert flags[-2:] == ["--transformer-impl", "local"], flags
    return ckpt, flags


@pytest.fixture(scope="session")
def converted_te_ep2(tiny_hf):
    """(checkpoint, model flags): ``tiny_hf`` converted by two processes at EP 2 (each writes its
    half of the experts to its own file) in the TE spec's keys (convert-hf's default), fp32."""
    from tests.fixtures import convert_hf

    ckpt = tiny_hf[0].parent / "ckpt_te_ep2"
    flags = convert_hf(tiny_hf[0], ckpt, "--ep", "2", world=2)
    assert flags[-2:] == ["--transformer-impl", "transformer_engine"], flags
    return ckpt, flags
