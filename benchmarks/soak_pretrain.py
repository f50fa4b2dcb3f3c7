"""``relaymoe.megatron.pretrain`` with a drifting router, for the routing soak of issue #17.

    RELAYMOE_SOAK_DIR=DIR torchrun ... -m benchmarks.soak_pretrain <Megatron flags>

Every router's logits get a bias that moves with the training iteration from none (the router's
own, near-uniform routing) to ``strength`` on the experts of EP rank 0 and back, a triangle wave
of ``RELAYMOE_SOAK_PERIOD`` iterations (default 200) with peak ``RELAYMOE_SOAK_STRENGTH`` (default
12.0: at the peak the other EP ranks' experts receive almost no token). Every rank computes the
same bias from the same iteration, as a router shift in a real run would be seen by all.

After each iteration every rank appends one JSON line to ``DIR/rank<R>.jsonl``: ``step``, ``drift``
(the wave's value in [0, 1]), ``allocated_MiB`` (``memory_allocated`` after the step),
``peak_MiB`` (that step's ``max_memory_allocated``) and ``workspace_bytes`` (the copy-engine
workspace, ``RingRuntime.workspace_bytes`` of every ring layer). ``benchmarks/soak.py`` reads
them. Prints ``MARKER`` once the router is patched.
"""

from __future__ import annotations

import json
import os
import runpy
from pathlib import Path

MARKER = "[soak_pretrain] router drift installed"
PERIOD = 200
STRENGTH = 12.0


def drift(step: int, period: int) -> float:
    """The triangle wave in [0, 1]: 0 at step 0, 1 at half a period, 0 again at a period."""
    phase = (step % period) / period
    return 1.0 - abs(2.0 * phase - 1.0)


def drift_bias(step: int, num_experts: int, ep: int, period: int, strength: float) -> list[float]:
    """The bias added to every token's logits at ``step``: ``strength * drift`` on EP rank 0's
    experts ``[0, E/ep)``, 0 elsewhere."""
    w = strength * drift(step, period)
    owned = num_experts // ep
    return [w if e < owned else 0.0 for e in range(num_experts)]


def _install(ep: int, period: int, strength: float, outdir: Path) -> None:
    import torch
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.training import training

    state = {"step": 0}
    original_gating = TopKRouter.gating

    def gating(self, input):
        logits = original_gating(self, input)
        bias = drift_bias(state["step"], logits.shape[-1], ep, period, strength)
        return logits + torch.tensor(bias, dtype=logits.dtype, device=logits.device)

    TopKRouter.gating = gating
    original_step = training.train_step
    rank = torch.distributed.get_rank

    def train_step(*a, **kw):
        from relaymoe.megatron.dispatcher import RingDispatcher

        model = a[2] if len(a) > 2 else kw["model"]
        chunks = model if isinstance(model, (list, tuple)) else [model]

        torch.cuda.reset_peak_memory_stats()
        result = original_step(*a, **kw)
        torch.cuda.synchronize()
        line = {
            "step": state["step"],
            "drift": drift(state["step"], period),
            "allocated_MiB": torch.cuda.memory_allocated() / 2**20,
            "peak_MiB": torch.cuda.max_memory_allocated() / 2**20,
            "workspace_bytes": sum(  # every ring layer's runtime's copy-engine workspace
                m.token_dispatcher.runtime.workspace_bytes()
                for c in chunks
                for m in c.modules()
                if isinstance(getattr(m, "token_dispatcher", None), RingDispatcher)
            ),
        }
        with open(outdir / f"rank{rank()}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        state["step"] += 1
        return result

    training.train_step = train_step
    print(MARKER, flush=True)


def main() -> None:
    outdir = Path(os.environ["RELAYMOE_SOAK_DIR"])
    outdir.mkdir(parents=True, exist_ok=True)
    period = int(os.environ.get("RELAYMOE_SOAK_PERIOD", PERIOD))
    strength = float(os.environ.get("RELAYMOE_SOAK_STRENGTH", STRENGTH))
    ep = int(os.environ["RELAYMOE_SOAK_EP"])
    # relaymoe.megatron.pretrain registers relaymoe and parses the flags; the patches below only
    # touch megatron-core classes, which exist before that
    _install(ep, period, strength, outdir)
    runpy.run_module("relaymoe.megatron.pretrain", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
