import os

import pytest
import torch

# Without a GPU, Triton kernels run in its CPU interpreter; must be set before triton.jit decorates.
# On a GPU machine (scripts/gpu_suite.sh) they compile for the device.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.fixtures import Worlds  # noqa: E402


@pytest.fixture(scope="session")
def gloo_worlds():
    """The spawned worlds the ring scenarios run in, kept for the session (``tests.worlds``):
    ``gloo_worlds.run(fn, size, timeout=...)`` runs ``fn(rank, size, group)`` on every rank of
    the world of ``size`` ranks its module uses, spawned on first use; fails the test with each
    failing rank's traceback, or the ranks that hung (that world is killed, a fresh one serves
    the next scenario). Every world is shut down at the end of the session."""
    worlds = Worlds()
    yield worlds
    worlds.close()
