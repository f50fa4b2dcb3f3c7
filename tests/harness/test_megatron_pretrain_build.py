"""The e2e Megatron flags build a GPT model on CPU, through Megatron's own parser and builder.

``relaymoe.megatron.pretrain`` and ``launch`` only run on GPUs, where a config assertion deep in
Megatron's layer build (e.g. apex's persistent LayerNorm requested without apex) costs a device
call to find. This replays the part before training on CPU: parse + validate the flags that
``benchmarks.e2e.pretrain_args`` produces, turn them into Megatron's model config, and
build the GPT model with the ring dispatcher (alltoall's dispatcher allocates CUDA tensors when
built, so only ring builds here; tiny_qwen3 and its GELU-experts variant, whose dispatchers must
name the activation Megatron's flags built), run everything around the experts forward and
backward in bf16, and draw a sample from the mock dataset the way ``pretrain`` builds it.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.fixtures import MEGATRON_CPU_PRELUDE, needs, run_python

pytestmark = needs("megatron.core")

_SCRIPT = MEGATRON_CPU_PRELUDE + textwrap.dedent(
    """
    from benchmarks.e2e import pretrain_args
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import set_args
    from megatron.training.models.gpt import GPTModelBuilder
    from relaymoe.megatron.dispatcher import RingDispatcher
    config, activation = sys.argv[1], sys.argv[2]
    flags = pretrain_args(config, gpus=1, steps=2, dispatcher="ring", seed=1)
    sys.argv = ["pretrain", *flags, "--use-cpu-initialization"]
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    set_args(args)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
        ProcessGroupCollection.use_mpu_process_groups())
    moe = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert moe and all(isinstance(m.token_dispatcher, RingDispatcher) for m in moe), moe
    # the experts' activation as Megatron's flags built it (relaymoe/megatron/activation_map.py)
    assert {m.token_dispatcher.activation.name for m in moe} == {activation}, activation
    print("BUILT", len(moe), type(moe[0].experts).__name__)
    # One bf16 forward + backward of everything around the experts on CPU (the MoE layers, whose
    # router needs CUDA, pass their input through): catches the fused kernels that only exist as
    # CUDA extensions (masked softmax, persistent LayerNorm, ...) before a GPU run does.
    for m in moe:
        m.forward = lambda h, *a, **k: (h, None)
    import contextlib
    from megatron.core import tensor_parallel
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    model = model.to(torch.bfloat16)
    # what Megatron's DDP gives each parameter: the flags keep gradient-accumulation fusion on
    # (relaymoe's stand-in for apex where it is missing), which adds into main_grad
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    s, b = args.seq_length, args.micro_batch_size
    tokens = torch.randint(0, args.padded_vocab_size, (b, s))
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool)).logical_not().view(1, 1, s, s)
    loss = model(tokens, pos, mask, labels=tokens).float().mean()
    loss.backward()
    assert torch.isfinite(loss), loss
    fused = [n for n, p in model.named_parameters() if p.grad_added_to_main_grad]
    assert fused and all(p.main_grad.abs().sum() > 0 for n, p in model.named_parameters()
                         if p.grad_added_to_main_grad), fused
    print("FWD_BWD", float(loss))
    # the mock-data path of relaymoe.megatron.pretrain (dataset config, prebuilt index helpers)
    from relaymoe.megatron.pretrain import datasets_provider, use_prebuilt_dataset_helpers
    use_prebuilt_dataset_helpers()
    train, _, _ = datasets_provider([4, 0, 0])
    sample = train[0]
    assert sample["tokens"].numel() == s, {k: v.shape for k, v in sample.items()}
    print("DATA", len(train))
    """
)


@pytest.mark.parametrize(
    "config,activation", [("tiny_qwen3", "swiglu"), ("tiny_qwen3_gelu", "gelu")]
)
def test_pretrain_flags_build_a_ring_gpt_on_cpu(config, activation):
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}
    import os

    p = run_python(["-c", _SCRIPT, config, activation], timeout=240, env=dict(os.environ, **env))
    done = all(mark in p.stdout for mark in ("BUILT 4", "FWD_BWD", "DATA"))
    assert p.returncode == 0 and done, p.stdout[-2000:] + p.stderr[-4000:]
