"""``relaymoe.megatron.pretrain`` with this rank's GPU allocator capped, to emulate a smaller GPU.

    RELAYMOE_MEMORY_CAP_BYTES=N torchrun ... -m benchmarks.capped_pretrain <Megatron flags>

``benchmarks/max_seq.py --memory-cap GPU`` runs its trials through this module: the caching
allocator of the rank's device (``LOCAL_RANK``) may hold at most N bytes
(``torch.cuda.set_per_process_memory_fraction``), so an allocation beyond N raises the same
``torch.OutOfMemoryError`` that a GPU of that size would. Prints ``MARKER`` once the cap is set;
the harness treats a trial log without it as an error.
"""

from __future__ import annotations

import os
import runpy

MARKER = "[capped_pretrain] allocator capped at"


def main() -> None:
    import torch

    cap = int(os.environ["RELAYMOE_MEMORY_CAP_BYTES"])
    dev = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    if not 0 < cap <= total:
        raise ValueError(
            f"RELAYMOE_MEMORY_CAP_BYTES={cap} is outside (0, {total}] (device {dev}'s memory)"
        )
    torch.cuda.set_per_process_memory_fraction(cap / total, dev)
    print(f"{MARKER} {cap} of {total} bytes on cuda:{dev}", flush=True)
    runpy.run_module("relaymoe.megatron.pretrain", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
