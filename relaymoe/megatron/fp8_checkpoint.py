"""Where a ring layer's delayed-scaling state is checkpointed: the ``_extra_state`` of a small
module on the ``MoELayer`` (``relaymoe_fp8``), the slot TransformerEngine's modules keep their
own fp8 scaling state in, so Megatron saves and loads it with the model's state dict.

Only the ``delayed`` recipe has state to keep (its amax histories; the other recipes scale each
tensor from itself), so only a delayed layer gets the module: the state dicts of every other
model are unchanged. Its histories are the same on every rank of the EP group
(:func:`agree_fp8_histories` all-reduces their maximum after each training step, the patched
``train_step``), so what any rank saved resumes at any EP. Not tested yet: Megatron's
distributed checkpoint of this object across EP sizes (its replica ids), on a GPU run.
"""

from __future__ import annotations

import torch

from relaymoe.fp8_state import Fp8State

__all__ = ["ATTR", "Fp8ExtraState", "agree_fp8_histories", "attach_fp8_extra_state"]

# the MoELayer's submodule: its state dict key is ``<layer>.relaymoe_fp8._extra_state``
ATTR = "relaymoe_fp8"


class Fp8ExtraState(torch.nn.Module):
    """A parameterless module whose ``_extra_state`` is its layer's ``Fp8State.state_dict()``."""

    def __init__(self, state: Fp8State):
        super().__init__()
        self.state = state

    def get_extra_state(self) -> dict:
        return self.state.state_dict()

    def set_extra_state(self, state) -> None:
        if state is None:  # a checkpoint without it (saved before, or by bf16 experts)
            return
        self.state.load_state_dict(state)


def attach_fp8_extra_state(layer, dispatcher) -> None:
    """Give ``layer`` (a ring ``MoELayer``) its ``relaymoe_fp8`` module when its dispatcher's
    experts run delayed scaling."""
    state = getattr(dispatcher, "fp8", None)
    if state is not None and state.roles():
        setattr(layer, ATTR, Fp8ExtraState(state))


def agree_fp8_histories(model) -> int:
    """Every ring layer's delayed-scaling histories merged (maximum) over its EP group, in
    layer order on every rank (the same collectives everywhere). Returns how many layers."""
    import torch.distributed as dist

    chunks = model if isinstance(model, (list, tuple)) else [model]
    count = 0
    for chunk in chunks:
        for m in chunk.modules():
            d = getattr(m, "token_dispatcher", None)
            state = getattr(d, "fp8", None)
            if state is None or not state.roles() or not dist.is_initialized():
                continue
            device = torch.device("cuda", torch.cuda.current_device()) if (
                torch.cuda.is_available()) else torch.device("cpu")  # fmt: skip
            state.agree_histories(d.ep_group, device)
            count += 1
    return count
