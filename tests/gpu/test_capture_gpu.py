"""The ring captured whole in a CUDA graph (relaymoe/ring/hop_graphs.py) on one GPU.

* ``ring_moe`` forward + backward captured once in ``torch.cuda.graph`` after one eager call,
  then replayed over 20 steps of fresh inputs copied into the graph's static buffers: every
  replay gives the eager call's output and gradients bitwise, and the float64 oracle's within
  bf16 rounding; then every token routed to one expert (its first pick), replayed in the same
  graph: the eager result bitwise (the hops are sized for the worst case, nothing drops);
* Megatron's whole-iteration graph (``--cuda-graph-impl full_iteration``) with the ring: 20 steps
  of the tiny Qwen3-style GPT from one seed give the eager run's losses bitwise, and the same
  weights at the end (their sha256), with and without the fused loss;
* megatron-core's per-layer graphs over the whole MoE layer (``--cuda-graph-impl local
  --cuda-graph-modules attn moe``, and ``transformer_engine`` where TE imports), dropless, with
  the drop-and-pad assertion lifted for the ring (``relaymoe/megatron/patches.py``): the same.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile

import pytest
import torch

from tests.fixtures import oracle, rel_err, ring_problem

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

T, H, I, E, K = 1000, 256, 128, 16, 4  # T not a multiple of any tile


def _inputs(seed, route="uniform"):
    pb = ring_problem(seed, [T], E, K, H, I, route=route)
    dev, bf = "cuda", torch.bfloat16
    return pb, dict(
        x=pb["x"].to(dev, bf), w13=pb["w13"].to(dev, bf), w2=pb["w2"].to(dev, bf),
        idx=pb["idx"].to(dev), probs=pb["probs"].to(dev, bf), dy=pb["dy"].to(dev, bf),
    )  # fmt: skip


def _step(t, runtime):
    """Output and the gradients of x, probs, w13, w2 (fresh tensors: autograd.grad), on
    ``runtime`` (the captured call finds the agreement its eager warm-up made there)."""
    from relaymoe.ring import ring_moe

    leaves = [t[k].requires_grad_() for k in ("x", "probs", "w13", "w2")]
    out = ring_moe(t["x"], t["w13"], t["w2"], t["idx"], t["probs"], trusted=True,
                   capturable=True, runtime=runtime)  # fmt: skip
    grads = torch.autograd.grad(out, leaves, t["dy"])
    return (out.detach(), *grads)


def _static(t):
    return {k: v.detach().clone() for k, v in t.items()}


def test_ring_moe_captured_replays_equal_eager_and_the_oracle():
    from relaymoe.ring import RingRuntime

    rt = RingRuntime()  # every call's, eager and captured
    _, first = _inputs(0)
    static = _static(first)
    _step(_static(first), rt)  # the eager call that agrees (and compiles the kernels)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _step(static, rt)  # warm-up on the capture's stream, as torch recommends
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(static, rt)
    names = ("out", "dx", "dprobs", "dw13", "dw2")
    for step in range(20):
        route = "one" if step == 19 else "uniform"  # the last: every token's first pick is E-1
        pb, t = _inputs(100 + step, route)
        with torch.no_grad():  # the static inputs are leaves that require grad
            for k, v in t.items():
                static[k].copy_(v)
        graph.replay()
        eager = _step(_static(t), rt)
        torch.cuda.synchronize()
        for name, a, b in zip(names, captured, eager, strict=True):
            assert torch.equal(a, b), f"step {step} ({route}): captured {name} != eager"
        ref = oracle({k: v for k, v in pb.items()})
        want = (ref["out"], ref["dx"], ref["dprobs"], ref["dw13"], ref["dw2"])
        for name, a, b in zip(names, captured, want, strict=True):
            # the oracle runs on the CPU (float64)
            assert rel_err(a.cpu(), b) < 2e-2, f"step {step} ({route}): {name} vs the oracle"


def _pretrain(extra, steps, workdir, name, impl="local"):
    from benchmarks.e2e import pretrain_args, run_pretrain

    workdir = os.path.join(workdir, name)
    os.makedirs(workdir)
    flags = pretrain_args("tiny_qwen3", gpus=1, steps=steps, dispatcher="ring", seed=1234,
                          extra=[*extra, "--relaymoe-weights-digest"],
                          transformer_impl=impl)  # fmt: skip
    run = run_pretrain(flags, gpus=1, timeout_s=400, workdir=workdir)
    assert run.returncode == 0 and len(run.steps) == steps, (
        f"{name}: rc={run.returncode}\n{run.command}\n{run.log_tail}"
    )
    # run_pretrain's --relaymoe-report is workdir/steps.jsonl
    with open(os.path.join(workdir, "steps.jsonl.weights.rank0.json")) as f:
        digest = json.load(f)["sha256"]
    return run.losses, digest


GRAPHS = {
    "full_iteration": ["--cuda-graph-impl", "full_iteration"],
}
NO_NAN_CHECK = ["--no-check-for-nan-in-loss-and-grad"]  # full_iteration refuses the check


@functools.cache
def _eager(fused_loss: bool, impl: str):
    """The eager run every graphed run of the same loss and layers is compared with (once)."""
    extra = ["--relaymoe-fused-loss"] if fused_loss else []
    return _pretrain([*extra, *NO_NAN_CHECK], 20, tempfile.mkdtemp(), "eager", impl=impl)


def _graphed(fused_loss: bool, impl: str, graphs: list[str]):
    extra = ["--relaymoe-fused-loss"] if fused_loss else []
    flags = [*extra, *graphs, "--cuda-graph-warmup-steps", "2", *NO_NAN_CHECK]
    with tempfile.TemporaryDirectory() as tmp:
        return _pretrain(flags, 20, tmp, "graphed", impl=impl)


@pytest.mark.parametrize("graphs", sorted(GRAPHS))
@pytest.mark.parametrize("fused_loss", [False, True], ids=["megatron_loss", "fused_loss"])
def test_megatron_graphed_steps_equal_eager_bitwise(fused_loss, graphs):
    eager_losses, eager_w = _eager(fused_loss, "local")
    graph_losses, graph_w = _graphed(fused_loss, "local", GRAPHS[graphs])
    assert graph_losses == eager_losses, list(zip(eager_losses, graph_losses, strict=True))
    assert graph_w == eager_w, "the weights after 20 steps differ"


def test_megatron_te_layer_graphs_over_the_moe_equal_eager_bitwise():
    pytest.importorskip("transformer_engine", reason="needs TE")
    eager_losses, eager_w = _eager(False, "transformer_engine")
    graphs = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "moe"]
    graph_losses, graph_w = _graphed(False, "transformer_engine", graphs)
    assert graph_losses == eager_losses, list(zip(eager_losses, graph_losses, strict=True))
    assert graph_w == eager_w, "the weights after 20 steps differ"
