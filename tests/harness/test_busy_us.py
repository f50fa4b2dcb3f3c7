"""The GPU-busy measure of the profiling benchmarks (``benchmarks.common.busy_us``: the union
of kernel intervals), on CPU."""

from benchmarks.common import busy_us


def test_busy_is_the_union_of_kernel_intervals():
    kernels = [
        ("gemm", 0.0, 10.0),
        ("combine", 5.0, 20.0),  # overlaps the first (another stream)
        ("add", 6.0, 7.0),  # nested
        ("ncclDevKernel_AllReduce", 0.0, 100.0),  # spins while a peer is late: not busy
        ("copy", 30.0, 40.0),  # after a gap
    ]
    assert busy_us(kernels, exclude=("nccl",)) == 30.0
    assert busy_us(kernels) == 100.0
    assert busy_us([]) == 0.0
