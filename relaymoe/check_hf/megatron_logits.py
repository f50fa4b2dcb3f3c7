"""Logits of a Megatron checkpoint on the host, in fp32, through the model a training run builds.

The GPT model is built as ``python -m relaymoe.megatron.pretrain`` builds it (megatron-core's
parser and ``GPTModelBuilder``, local layers, the ring dispatcher unless told otherwise; gloo)
by ``relaymoe.convert_hf.host``, in the checkpoint's key layout (``use_keys_of``), and loaded by
Megatron's own ``load_checkpoint``: what a resumed training run would hold. Under torchrun with
``ep`` processes each holds 1/EP of the experts (Megatron reshards the checkpoint on load) and
all run every prompt; rank 0 returns the logits.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

from relaymoe.check_hf.errors import CheckError


def megatron_logits(
    folder: Path,
    model_flags: list[str],
    prompts: list[list[int]],
    *,
    transformer_impl: str,
    ep: int = 1,
    dispatcher: str = "ring",
) -> list | None:
    """fp32 logits (tokens, vocabulary) of each prompt on rank 0 (None on the other ranks):
    ``folder`` is the iteration folder (``release`` or ``iter_NNNNNNN``) of a Megatron
    checkpoint whose model ``model_flags`` describe, saved in ``transformer_impl``'s keys."""
    import torch

    log = io.StringIO()  # Megatron prints every argument: shown only if something fails
    try:
        with contextlib.redirect_stdout(log):
            out = _forward(folder, model_flags, prompts, transformer_impl, ep, dispatcher)
    except BaseException:
        sys.stderr.write(log.getvalue())
        raise
    return out if torch.distributed.get_rank() == 0 else None


def _forward(folder, model_flags, prompts, transformer_impl, ep, dispatcher) -> list:
    import torch

    from relaymoe.convert_hf.host import (
        build_model,
        cpu_only_load,
        host_argv,
        init_distributed,
        release_model,
        use_keys_of,
    )

    cpu_only_load()
    init_distributed()
    from megatron.training.checkpointing import load_checkpoint

    world = torch.distributed.get_world_size()
    if world != ep:
        raise CheckError(
            f"--ep {ep} but {world} process(es) run; fix: torchrun --nproc-per-node {ep} -m "
            f"relaymoe check-hf ... --ep {ep} (or --ep 1 in one process)"
        )
    seq = max(len(p) for p in prompts)
    argv = [
        *host_argv(model_flags, world=world, ep=ep, seq=seq, dispatcher=dispatcher),
        "--load",
        str(folder.parent),
        "--no-load-optim",
        "--no-load-rng",
    ]
    model, args = build_model(argv, prog="relaymoe check-hf", ep=ep)
    use_keys_of(model, transformer_impl)
    args.transformer_impl = transformer_impl  # what the load's layer-spec check compares
    if folder.name != "release":
        args.ckpt_step = int(folder.name.removeprefix("iter_"))
    load_checkpoint([model], None, None, strict=True)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            tokens = torch.tensor([ids])
            s = tokens.shape[1]
            pos = torch.arange(s).unsqueeze(0)
            mask = torch.tril(torch.ones(s, s, dtype=torch.bool)).logical_not().view(1, 1, s, s)
            out.append(model(tokens, pos, mask)[0].float())
    del model
    release_model()
    return out
