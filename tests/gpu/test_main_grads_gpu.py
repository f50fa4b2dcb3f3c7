"""The experts' weight gradients added into Megatron-style ``main_grad`` on one GPU
(``ring_moe(main_grads=)``, ``relaymoe/ring/main_grads.py``), bf16 weights, fp32 accumulators.

* the weight-gradient kernel adds into an fp32 span in expert order and in reverse expert order
  (a negative expert stride), qwen3 widths, bf16 operands: prefill + the float64 oracle's sums,
  nothing written beside the span, an empty expert untouched;
* ``ring_moe`` in a world of one, expert and token mode, two micro-batches into prefilled
  ``main_grad``: per-expert parameters and accumulators as DDP lays them out (both in reverse
  order: in place; parameters in expert order and accumulators reversed: through the negative
  stride; SequentialMLP's interleaved accumulators: the fallback), within bf16 rounding of the
  oracle and of the unfused run's gradients, and no gradient reaches ``.grad`` but the
  dummies;
* the whole step (forward, backward, DDP's hooks) captured in a CUDA graph as megatron-core's
  ``full_iteration`` does: a replay from the same ``main_grad`` leaves it bitwise as the eager
  step does, and the hooks add nothing (the marks set at capture).
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures import (
    attach_main_grads,
    ddp_main_grad_hooks,
    oracle,
    rehome,
    rel_err,
    ring_problem,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

BF16_BOUND = 1e-2
T, H, I, E, K = 1000, 1024, 512, 16, 4


def _routing(n_tokens, n_experts, k, seed):
    """Distinct top-k ids per token among all experts but the last (which gets no pair)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n_tokens, n_experts - 1, generator=g).argsort(1)[:, :k]


@pytest.mark.parametrize("reverse", [False, True])
def test_wgrad_kernel_adds_into_an_fp32_span(reverse):
    from relaymoe.kernels import grouped
    from relaymoe.routing import build_routing_index

    Tk, Hk, J, Ek, Kk = 2048, 2048, 1536, 8, 4  # qwen3's fc1 rows and hidden
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    idx = _routing(Tk, Ek, Kk, seed=1).to(dev)
    index = build_routing_index(idx, Ek)
    n = index.num_pairs
    x = torch.randn(Tk, Hk, generator=g, device=dev).to(bf)
    dh = torch.randn(n, J, generator=g, device=dev).to(bf)
    buf = torch.randn(Ek + 2, J, Hk, generator=g, device=dev)
    before = buf.clone()
    span = buf[1 : Ek + 1]
    offs = index.offsets_for(0, Ek)
    grouped.wgrad(dh, x, index.expert_token_indices, offs, span, a_gather=False, b_gather=True,
                  accumulate=True, reverse=reverse)  # fmt: skip
    torch.cuda.synchronize()
    ends = index.expert_token_offsets.tolist()
    tok = index.expert_token_indices.long()
    for e in range(Ek):
        row = Ek - 1 - e if reverse else e
        lo, hi = ends[e], ends[e + 1]
        want = before[1 + row].double() + dh[lo:hi].double().T @ x[tok[lo:hi]].double()
        if hi == lo:
            assert torch.equal(span[row], before[1 + row]), f"expert {e}: empty, yet written"
            continue
        err = rel_err(span[row] - before[1 + row], want - before[1 + row].double())
        assert err < 1e-4, f"expert {e} (row {row}): {err}"
    assert torch.equal(buf[0], before[0]) and torch.equal(buf[-1], before[-1])


def _params(w13, w2, layout):
    """Per-expert bf16 parameters: ``"reversed"`` views of one buffer in reverse order (fc1s then
    fc2s, DDP's param buffer with the distributed optimizer), else in expert order (what the
    ring's MoELayer builds: ``make_expert_weights_contiguous``)."""
    fc1 = [torch.nn.Parameter(w.clone()) for w in w13]
    fc2 = [torch.nn.Parameter(w.clone()) for w in w2]
    rehome((fc1 + fc2)[::-1] if layout == "reversed" else fc1 + fc2)
    return fc1, fc2


def _main_grads(fc1, fc2, layout, seed):
    """fp32 ``main_grad`` of each parameter, prefilled, in DDP's reverse registration order:
    fc1s then fc2s (TEGroupedMLP) or fc1/fc2 per expert (SequentialMLP, ``"interleaved"``); the
    mark False. Returns the prefills (stacked)."""
    pairs = [p for a, b in zip(fc1, fc2, strict=True) for p in (a, b)]
    registered = pairs if layout == "interleaved" else fc1 + fc2
    attach_main_grads(registered[::-1], torch.Generator(device="cuda").manual_seed(seed), "cuda")
    return _stack(fc1, fc2)


def _stack(fc1, fc2):
    return (torch.stack([p.main_grad for p in fc1]).clone(),
            torch.stack([p.main_grad for p in fc2]).clone())  # fmt: skip


def _finish(weights):
    """Megatron's protocol without Megatron: marked, one shared dummy per shape, aliases."""
    made = {}
    out = []
    for w in weights:
        w.grad_added_to_main_grad = True
        buf = made.setdefault(tuple(w.shape), torch.empty_like(w))
        out.append(buf.detach())
    return out


def _problem(seed):
    pb = ring_problem(seed, [T], E, K, H, I)
    return pb, {k: (v.cuda().bfloat16() if v.is_floating_point() else v.cuda())
                for k, v in pb.items()}  # fmt: skip


def _oracle_bf16(pb):
    """The float64 oracle of the bf16-rounded inputs."""
    return oracle({k: v.bfloat16().double() if k in ("x", "w13", "w2", "dy") else v
                   for k, v in pb.items()})  # fmt: skip


@pytest.mark.parametrize("mode", ["expert", "token"])
@pytest.mark.parametrize(
    ("params", "grads"),
    [("reversed", "reversed"), ("forward", "reversed"), ("forward", "interleaved")],
    ids=["in_place", "negative_stride", "fallback"],
)
def test_ring_world_of_one_adds_into_main_grad(mode, params, grads):
    from relaymoe.options import RingConfig
    from relaymoe.ring import MainGrads, ring_moe

    pbs = [_problem(3), _problem(4)]
    w13, w2 = pbs[0][1]["w13"], pbs[0][1]["w2"]
    result = {}
    for fused in (False, True):
        fc1, fc2 = _params(w13, w2, params)
        start = _main_grads(fc1, fc2, grads, seed=5)
        keep = []
        ddp_main_grad_hooks(fc1 + fc2, keep)
        for _, t in pbs:
            main = None
            if fused:
                main = MainGrads([p.main_grad for p in fc1], [p.main_grad for p in fc2], _finish)
            out = ring_moe(t["x"], fc1, fc2, t["idx"], t["probs"],
                           config=RingConfig(mode=mode), main_grads=main)  # fmt: skip
            out.backward(t["dy"])
            assert all(p.grad is None for p in fc1 + fc2)
            assert all(p.grad_added_to_main_grad is fused for p in fc1 + fc2)
            for p in fc1 + fc2:
                p.grad_added_to_main_grad = False
        end = _stack(fc1, fc2)
        result[fused] = (end[0] - start[0], end[1] - start[1])
    refs = [_oracle_bf16({**pb, "w13": pbs[0][0]["w13"], "w2": pbs[0][0]["w2"]})
            for pb, _ in pbs]  # fmt: skip
    for j, name in enumerate(("dw13", "dw2")):
        want = (refs[0][name] + refs[1][name]).cuda()
        assert rel_err(result[True][j], want) < BF16_BOUND, (name, "fused vs the oracle")
        assert rel_err(result[True][j], result[False][j]) < BF16_BOUND, (name, "fused vs unfused")


def test_captured_step_adds_into_main_grad_as_the_eager_step():
    """megatron-core's full_iteration, in small: forward, backward and DDP's hooks captured in
    one graph after eager steps; the replay from the same main_grad leaves it bitwise as the
    eager step does.

    The streams as Megatron sets them: its training runs on a stream of its own (not the legacy
    default one, which a capture may not wait on), and FullCudaGraphWrapper lets autograd nodes
    made before the capture (DDP's gradient accumulators, kept alive by its hooks) run on the
    capturing stream (``set_override_stale_capture_stream``, where torch has it)."""
    side = torch.cuda.Stream()
    override = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    side.wait_stream(torch.cuda.current_stream())
    try:
        if override is not None:
            override(True)
        with torch.cuda.stream(side):
            _captured_step_vs_eager(side)
    finally:
        if override is not None:
            override(False)
    torch.cuda.current_stream().wait_stream(side)


def _captured_step_vs_eager(stream):
    from relaymoe.ring import MainGrads, RingRuntime, ring_moe

    _, t = _problem(7)
    fc1, fc2 = _params(t["w13"], t["w2"], "forward")
    start = _main_grads(fc1, fc2, "reversed", seed=8)
    keep = []
    ddp_main_grad_hooks(fc1 + fc2, keep)
    rt = RingRuntime()
    main = MainGrads([p.main_grad for p in fc1], [p.main_grad for p in fc2], _finish)
    static = {k: t[k].clone() for k in ("x", "idx", "probs", "dy")}

    def step():
        x = static["x"].detach().requires_grad_()
        out = ring_moe(x, fc1, fc2, static["idx"], static["probs"], trusted=True,
                       capturable=True, runtime=rt, main_grads=main)  # fmt: skip
        out.backward(static["dy"])
        for p in fc1 + fc2:  # zero_grad_buffer resets the marks between steps
            p.grad_added_to_main_grad = False

    def reset():
        for j, p in enumerate(fc1):
            p.main_grad.copy_(start[0][j])
        for j, p in enumerate(fc2):
            p.main_grad.copy_(start[1][j])

    step()  # eager: agrees, compiles and tunes
    reset()
    step()
    eager = _stack(fc1, fc2)
    # as megatron-core's FullCudaGraphWrapper captures: after the eager steps, errors of this
    # thread only
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        step()
    torch.cuda.synchronize()
    reset()
    graph.replay()
    torch.cuda.synchronize()
    replayed = _stack(fc1, fc2)
    for name, a, b in zip(("w13", "w2"), replayed, eager, strict=True):
        assert torch.equal(a, b), f"{name}: the replayed step's main_grad != the eager step's"
    assert not torch.equal(replayed[0], start[0])  # the step did add
