"""relaymoe.linear_cross_entropy on the GPU: bf16 against the float64 oracle and against
Megatron's output layer + ``vocab_parallel_cross_entropy``, at real vocabulary sizes.

Skipped without CUDA; run by ``scripts/gpu_suite.sh``. bf16 relative-error bound 1e-2
(CONTRIBUTING.md). The oracle is ``torch.nn.functional.cross_entropy`` on the whole float64
logits of the bf16 inputs (Megatron's smoothing ``a`` is PyTorch's ``a * V / (V - 1)``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from relaymoe.loss import linear_cross_entropy
from relaymoe.loss.chunk import _mixed_wgrad_mode
from relaymoe.lossmodel import ACCUMULATE_CHUNK_BUDGET_BYTES, default_chunk_tokens, fused_loss_bytes
from tests.fixtures import free_port, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BF16_BOUND = 1e-2
IGNORE = -100
MiB = 2**20

CASES = [
    # (T, H, V, label_smoothing)
    (4096, 2048, 151936, 0.0),  # qwen3 vocabulary and width
    (1531, 1000, 32003, 0.1),  # nothing a multiple of a tile, smoothing
    (777, 512, 50257, 0.0),  # gpt-2 vocabulary, odd
]


def _problem(T, H, V, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = {"generator": gen, "device": "cuda"}
    h = torch.randn(T, H, **kw).bfloat16()
    w = (torch.randn(V, H, **kw) * (2.0 / H**0.5)).bfloat16()
    y = torch.randint(0, V, (T,), **kw)
    y[torch.rand(T, **kw) < 0.05] = IGNORE
    return h, w, y


def _upstream(y, kind):
    if kind == "nonuniform":
        return torch.rand(y.shape[0], device="cuda") + 0.5
    return torch.where(y != IGNORE, 1.0 / y.numel(), float("nan"))  # junk where ignored


def _ours(h, w, y, up, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, y, **kw)
    loss.backward(up)
    return loss.detach(), h.grad, w.grad


def _oracle(h, w, y, up, smoothing):
    h, w = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    V = w.shape[0]
    loss = F.cross_entropy(h @ w.T, y, reduction="none", ignore_index=IGNORE,
                           label_smoothing=smoothing * V / (V - 1))  # fmt: skip
    loss.backward(torch.where(y != IGNORE, up.double(), 0.0))
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_bf16_matches_float64_oracle(case, impl):
    T, H, V, smoothing = case
    h, w, y = _problem(T, H, V, seed=T + V)
    for kind in ("uniform", "nonuniform"):
        up = _upstream(y, kind)
        got = _ours(h, w, y, up, impl=impl, label_smoothing=smoothing, chunk_tokens=1000)
        ref = _oracle(h, w, y, up, smoothing)
        for name, a, b in zip(("loss", "dhidden", "dweight"), got, ref, strict=True):
            assert rel_err(a, b) < BF16_BOUND, (kind, name, rel_err(a, b))
        assert got[0].dtype == torch.float32 and got[2].dtype == torch.bfloat16
        del got, ref
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def one_rank_group():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)  # fmt: skip
    yield dist.new_group([dist.get_rank()])
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_bf16_matches_megatron(one_rank_group, smoothing):
    """Megatron's path as its output layer runs it at TP=1: bf16 logits from one GEMM, then
    ``vocab_parallel_cross_entropy`` (no ignore_index: masked tokens get a zero gradient)."""
    cross = pytest.importorskip("megatron.core.tensor_parallel.cross_entropy")
    T, H, V = 2048, 2048, 151936
    h, w, y = _problem(T, H, V, seed=5)
    counted = y != IGNORE
    up = _upstream(y, "uniform")
    got = _ours(h, w, y, up, label_smoothing=smoothing)
    hm, wm = h.clone().requires_grad_(), w.clone().requires_grad_()
    mloss = cross.vocab_parallel_cross_entropy(hm @ wm.T, torch.where(counted, y, 0), smoothing,
                                               one_rank_group)  # fmt: skip
    mloss.backward(torch.where(counted, up, 0.0))
    ref = (torch.where(counted, mloss.detach(), 0.0), hm.grad, wm.grad)
    # the loss: both take fp32 statistics of the same bf16 logits (chunked vs whole GEMM)
    assert rel_err(got[0], ref[0]) < 1e-4, rel_err(got[0], ref[0])
    for name, a, b in zip(("dhidden", "dweight"), got[1:], ref[1:], strict=True):
        assert rel_err(a, b) < BF16_BOUND, (name, rel_err(a, b))


def test_bitwise_deterministic_and_impls_agree():
    h, w, y = _problem(3000, 1024, 65537, seed=9)
    up = _upstream(y, "nonuniform")
    a = _ours(h, w, y, up, impl="triton", chunk_tokens=700)
    b = _ours(h, w, y, up, impl="triton", chunk_tokens=700)
    for x, z in zip(a, b, strict=True):
        assert torch.equal(x, z)
    c = _ours(h, w, y, up, impl="torch", chunk_tokens=700)
    for name, x, z in zip(("loss", "dhidden", "dweight"), a, c, strict=True):
        assert rel_err(x, z) < BF16_BOUND, (name, rel_err(x, z))


def test_weight_gradient_accumulates_in_one_fp32_gemm():
    """The fast weight-gradient path exists on this torch (else every chunk upcasts its logits
    gradient to fp32: correct, but slower and above the loss model's working set)."""
    assert _mixed_wgrad_mode(torch.device("cuda")) in ("addmm", "mm")


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_peak_memory_within_the_loss_model(impl):
    T, H, V = 16384, 2048, 151936
    h, w, y = _problem(T, H, V, seed=3)
    up = _upstream(y, "uniform")
    h.requires_grad_()
    w.requires_grad_()
    linear_cross_entropy(h, w, y, impl=impl).backward(up)  # warm: kernels, cuBLAS workspace
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    linear_cross_entropy(h, w, y, impl=impl).backward(up)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    model = fused_loss_bytes(T, H, V, impl=impl)
    # forward: what it keeps + one chunk (the Triton path holds only the bf16 logits, 2 bytes
    # each); backward: what the forward kept + the two returned bf16 gradients
    bound = model.dhidden + model.dweight + max(model.chunk, 2 * (T * H + V * H)) + 64 * MiB
    assert peak <= bound, (impl, peak / MiB, bound / MiB)
    assert peak * 4 < 6 * T * V  # Megatron holds at least the bf16 logits and their fp32 copy


# ---------------------------------------------------------------------------------------------
# the accumulate mode (weight_grad_into, expected_grad): issue #53's weight-gradient transient
# ---------------------------------------------------------------------------------------------
def _accumulate(h, w, y, up, acc, expected, **kw):
    hr = h.clone().requires_grad_()
    loss = linear_cross_entropy(hr, w, y, weight_grad_into=acc, expected_grad=expected, **kw)
    loss.backward(up)
    return loss.detach(), hr.grad, acc


def _transient(run, h) -> int:
    """Peak bytes of ``run()`` over what existed before it, less the hidden gradient it returns
    (``bench_loss``'s measure, ``transient_MiB``)."""
    from benchmarks.bench_loss import peak_over_bytes

    return peak_over_bytes(run) - h.numel() * h.element_size()


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_accumulate_mode_transient_and_error_beat_the_default_mode(impl):
    """At a reduced shape (dW fp32 128 MiB, a chunk of 128 MiB of bf16 logits): with the
    expected upstream gradient the accumulate mode's transient is one chunk's working set (the
    model's, ``wgrad="accumulate"``), the default mode's holds its fp32 dW besides; and its
    weight gradient (fp32 accumulator) and hidden gradient are no further from the float64
    oracle (T not a power of two: the gradient 1/T is not exact in binary)."""
    T, H, V, chunk = 8000, 1024, 32768, 2048
    h, w, y = _problem(T, H, V, seed=21)
    up = _upstream(y, "uniform")
    exact = up[y != IGNORE][0].clone()  # a device scalar: the gradient of every counted token
    kw = dict(impl=impl, chunk_tokens=chunk)
    acc = torch.zeros(V, H, device="cuda")
    _accumulate(h, w, y, up, acc, exact, **kw)  # warm: kernels, cuBLAS workspace
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    linear_cross_entropy(hg, wg, y, **kw).backward(up)  # the default mode, warm
    acc.zero_()
    hr = h.clone().requires_grad_()

    def accumulate():
        loss = linear_cross_entropy(hr, w, y, weight_grad_into=acc, expected_grad=exact, **kw)
        loss.backward(up)

    ours = _transient(accumulate, h)
    hg.grad, wg.grad = None, torch.zeros_like(w)  # gradient accumulation: dW exists before
    today = _transient(lambda: linear_cross_entropy(hg, wg, y, **kw).backward(up), h)
    model = fused_loss_bytes(T, H, V, chunk_tokens=chunk, wgrad="accumulate", impl=impl)
    # margin: the per-token vectors (~0.2 MiB), and the hidden gradient should autograd copy it
    assert ours <= model.transient + 24 * MiB, (impl, ours / MiB, model.transient / MiB)
    # no fp32 (V, H) buffer: the saving is that buffer, within the per-call vectors' bytes
    assert ours + V * H * 4 <= today + MiB, (impl, ours / MiB, today / MiB)
    ref = _oracle(h, w, y, up, 0.0)
    pairs = zip(("dhidden", "dweight"), (hr.grad, acc), (hg.grad, wg.grad), ref[1:], strict=True)
    for name, a, b, r in pairs:
        assert rel_err(a, r) <= rel_err(b, r), (impl, name, rel_err(a, r), rel_err(b, r))
        assert rel_err(a, r) < BF16_BOUND


def test_accumulate_default_chunk_keeps_the_transient_within_512_mib():
    """Issue #53's shape (V 151,936, H 4,096, T 64k), bf16 on Triton, as Megatron's fused loss
    runs it (an fp32 accumulator that exists before the call, the exact expected gradient): the
    accumulate mode's default chunk (``lossmodel``: 1,664 tokens) keeps the transient, measured
    as ``bench_loss`` measures it, within 512 MiB and within the model's."""
    T, H, V = 65536, 4096, 151936
    assert default_chunk_tokens(T, V, wgrad="accumulate", impl="triton") == 1664
    h, w, y = _problem(T, H, V, seed=31)
    up = _upstream(y, "uniform")
    exact = up[y != IGNORE][0].clone()
    acc = torch.zeros(V, H, device="cuda")
    _accumulate(h, w, y, up, acc, exact, impl="triton")  # warm: kernels, cuBLAS workspace
    hr = h.clone().requires_grad_()

    def accumulate():
        loss = linear_cross_entropy(hr, w, y, impl="triton", weight_grad_into=acc,
                                    expected_grad=exact)  # fmt: skip
        loss.backward(up)

    got = _transient(accumulate, h)
    model = fused_loss_bytes(T, H, V, wgrad="accumulate", impl="triton")
    assert model.transient <= ACCUMULATE_CHUNK_BUDGET_BYTES
    # margin: the per-token vectors (about 20 bytes a token: 1.3 MiB here)
    assert got <= model.transient + 8 * MiB, (got / MiB, model.transient / MiB)
    assert got <= ACCUMULATE_CHUNK_BUDGET_BYTES, got / MiB


@pytest.mark.parametrize("kind", ["equal", "differs", "far", "nonuniform", "none"])
def test_accumulate_mode_paths_match_the_float64_oracle(kind):
    """Each backward path (nothing to correct, the difference added, the forward's part taken
    back, the weight gradient computed in the backward), two micro-batches into an accumulator
    that starts non-zero, bf16 against the float64 oracle."""
    T, H, V = 3001, 512, 50257
    h, w, y = _problem(T, H, V, seed=22)
    c = 1.0 / T
    up = torch.where(y != IGNORE, c, float("nan"))
    if kind == "nonuniform":
        up = _upstream(y, "nonuniform")
    expected = {"equal": torch.tensor(c, device="cuda"), "differs": 0.8 * c, "far": 5.0 * c,
                "nonuniform": 0.5, "none": None}[kind]  # fmt: skip
    ref = _oracle(h, w, y, up, 0.0)
    start = torch.randn(V, H, device="cuda") * ref[2].abs().mean().float()
    acc = start.clone()
    for _ in range(2):  # two micro-batches into one accumulator
        loss, dh, _ = _accumulate(h, w, y, up, acc, expected, chunk_tokens=1000)
    assert rel_err(loss, ref[0]) < BF16_BOUND and rel_err(dh, ref[1]) < BF16_BOUND, kind
    assert rel_err(acc - start, 2 * ref[2]) < BF16_BOUND, (kind, rel_err(acc - start, 2 * ref[2]))


def test_accumulate_mode_captured_in_a_cuda_graph_replays_the_eager_call():
    """Forward + backward with ``expected_grad`` (a device tensor the graph reads) captured once,
    replayed on fresh inputs (another count of counted tokens: another gradient) copied into its
    static buffers: the loss, the hidden gradient and the accumulator's gradient are the eager
    call's (the captured backward asserts the expectation on the device and takes the equal
    case, as the eager one does; within a rounding, should cuBLAS pick other kernels under
    capture) and the float64 oracle's."""
    T, H, V = 2000, 256, 32003
    static_h, w, static_y = _problem(T, H, V, seed=30)
    static_h.requires_grad_()
    static_up = _upstream(static_y, "uniform")
    static_c = static_up[static_y != IGNORE][0].clone()
    acc = torch.zeros(V, H, device="cuda")

    def step(h, y, up, c):  # validate=False: no host sync inside the capture
        loss = linear_cross_entropy(h, w, y, weight_grad_into=acc, expected_grad=c,
                                    chunk_tokens=700, validate=False)  # fmt: skip
        (dh,) = torch.autograd.grad(loss, h, up)
        return loss.detach(), dh

    step(static_h, static_y, static_up, static_c)  # compiles the kernels, probes cuBLAS
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static_h, static_y, static_up, static_c)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(static_h, static_y, static_up, static_c)
    for seed in (31, 32):
        h, _, y = _problem(T, H, V, seed=seed)
        y[: seed - 20] = IGNORE
        up = torch.where(y != IGNORE, 1.0 / (y != IGNORE).sum(), float("nan"))
        with torch.no_grad():
            static_h.copy_(h)
            static_y.copy_(y)
            static_up.copy_(up)
            static_c.copy_(up[y != IGNORE][0])
        acc.zero_()
        graph.replay()
        torch.cuda.synchronize()
        got = (captured[0].clone(), captured[1].clone(), acc.clone())
        acc.zero_()
        eager = (*step(h.requires_grad_(), y, up, up[y != IGNORE][0].clone()), acc)
        ref = _oracle(h, w, y, up, 0.0)
        for name, a, b, r in zip(("loss", "dh", "dW"), got, eager, ref, strict=True):
            assert rel_err(a, b) < 5e-3, (seed, name, rel_err(a, b))
            assert rel_err(a, r) < BF16_BOUND, (seed, name, rel_err(a, r))
