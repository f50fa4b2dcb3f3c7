"""The ring inside a whole-step CUDA graph (megatron-core's ``--cuda-graph-impl full_iteration``,
or any ``torch.cuda.graph`` around a training step).

A captured step is replayed without the host: whatever the host would read from the device, or
wait for, during the step cannot happen at replay. So a ``ring_moe`` call that is being captured
runs the one path of the ring that needs no host at all, and refuses, by name, what would need it:

* **The agreement comes from an eager call.** The ranks agree once per input signature
  (``agree.py``, ``trusted=True``): an eager step with the same shapes (Megatron's
  ``--cuda-graph-warmup-steps``, at least 1) must precede the capture. A captured call never
  enters the agreement's all-reduce; an untrusted call (its ids are validated on the host) or an
  uncached signature raises ``ValueError``.
* **Every hop's buffers are sized for the worst case, and that is a proof, not a guess.** A
  token's K expert ids are distinct (a router's top-k), so at most ``min(K, E_local)`` of them
  fall in any one rank's experts: a hop over ``T`` tokens never has more than
  ``T * min(K, E_local)`` pairs. The captured call sizes its pair buffers from that bound, never
  from counts read on the host, so no routing, however skewed (every token to one expert, one
  rank's experts never used), drops or overflows anything. The kernels find each expert's rows on
  the device (``kernels/grouped/tiles.py``). The pair-buffer budget (``pair_buffer_mib``) does not
  apply under capture: its exact-count path is a host read.
* **Only the ring modes.** ``mode="alltoall"`` sizes its messages on the host; a captured call
  whose agreed mode is the all-to-all raises. ``capturable=True`` (Megatron's dispatcher passes it
  whenever the model's step is captured) keeps ``mode="auto"`` among the ring modes, in the eager
  calls too, so that the eager warm-up and the captured step run the same code.
* **No host wait.** The bounded host waits that name a dead peer (``faults.py``) are skipped while
  capturing: a dead or stalled peer of a replayed step is left to NCCL's watchdog.
* **No hop graphs inside.** ``capture_hops`` (each hop recorded in a graph of its own) is off for a
  captured call: the step's graph already holds every hop.

Allocations made while capturing come from the graph's private memory pool and are the same
addresses at every replay (torch's capture semantics), so the ring needs no static buffers of its
own. A copy-engine transport's workspace must already be large enough: it is sized by the largest
pass of the eager steps, whose shapes a captured step repeats.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["capturing", "check_captured"]


def capturing(where: Tensor | torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph, for a call on ``where``
    (a tensor or a device; False off CUDA, and where no GPU is present)."""
    device = where.device if isinstance(where, Tensor) else where
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    )


def check_captured(*, trusted: bool, agree_mode: str) -> None:
    """Refuse, before anything runs, a captured call that would need the host."""
    if not trusted:
        raise ValueError(
            "ring_moe is being captured into a CUDA graph with trusted=False: an untrusted call "
            "validates its expert ids on the host, which a replayed graph cannot; fix: pass "
            "trusted=True (ids from a router, the same shapes on every rank) and run one eager "
            "call with the same shapes first"
        )
    if agree_mode == "every_call":
        raise ValueError(
            "ring_moe is being captured into a CUDA graph with RingConfig.agree='every_call' "
            "(RELAYMOE_RING_AGREE): every call would all-reduce and read the agreement on the "
            "host, which a replayed graph cannot; fix: agree='cached' (the default)"
        )
