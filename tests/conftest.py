import os

import torch

# Without a GPU, Triton kernels run in its CPU interpreter; must be set before triton.jit decorates.
# On a GPU machine (scripts/gpu_suite.sh) they compile for the device.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
