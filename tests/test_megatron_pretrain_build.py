"""The e2e Megatron flags build a GPT model on CPU, through Megatron's own parser and builder.

``relaymoe.megatron.pretrain`` and ``launch`` only run on GPUs, where a config assertion deep in
Megatron's layer build (e.g. apex's persistent LayerNorm requested without apex) costs a device
call to find. This replays the part before training on CPU: parse + validate the flags that
``relaymoe.megatron.e2e.pretrain_args`` produces, turn them into Megatron's model config, and
build the GPT model with the ring dispatcher (alltoall's dispatcher allocates CUDA tensors when
built, so only ring builds here).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")

_SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    torch.cuda.get_device_capability = lambda *a: (9, 0)  # validate_args asks for it
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    from relaymoe.megatron import register
    from relaymoe.megatron.e2e import pretrain_args
    register()
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import set_args
    from megatron.training.models.gpt import GPTModelBuilder
    from relaymoe.megatron.dispatcher import RingDispatcher
    flags = pretrain_args("tiny_qwen3", gpus=1, steps=2, dispatcher="ring", seed=1)
    sys.argv = ["pretrain", *flags, "--use-cpu-initialization"]
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    set_args(args)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
        ProcessGroupCollection.use_mpu_process_groups())
    moe = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert moe and all(isinstance(m.token_dispatcher, RingDispatcher) for m in moe), moe
    print("BUILT", len(moe), type(moe[0].experts).__name__)
    """
)


def test_pretrain_flags_build_a_ring_gpt_on_cpu():
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}
    import os

    p = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, **env),
    )
    assert p.returncode == 0 and "BUILT 4" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
