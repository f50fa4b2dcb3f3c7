import os

# Triton kernels run in the CPU interpreter in tests; must be set before triton.jit decorates.
os.environ.setdefault("TRITON_INTERPRET", "1")
