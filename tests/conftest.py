import os

import pytest
import torch

# Without a GPU, Triton kernels run in its CPU interpreter; must be set before triton.jit decorates.
# On a GPU machine (scripts/gpu_suite.sh) they compile for the device.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from relaymoe import options  # noqa: E402

# tests/__init__.py installed the options of the environment the session started with (the GPU
# suite's RELAYMOE_AUTOTUNE=0, say): each test starts from those.
SESSION_OPTIONS = options.defaults()


@pytest.fixture(autouse=True)
def _session_options_after_each_test():
    """A test that installs other options (``tests.helpers.use_env``) gets the session's back."""
    yield
    if options.defaults() is not SESSION_OPTIONS:
        options.install(SESSION_OPTIONS)
