"""``relaymoe convert-hf``: a Hugging Face Qwen3-MoE checkpoint -> Megatron ``torch_dist`` -> the
same logits.

A tiny Qwen3-MoE (2 layers, hidden 64, 4 query heads in 2 KV groups, 4 experts top-2, vocab 256,
untied) is initialised at random (every norm weight too, so that a swapped q/k norm or
input/post-attention norm shows) with transformers' ``Qwen3MoeForCausalLM`` and saved with
``save_pretrained`` in several safetensors shards. ``python -m relaymoe convert-hf`` turns it into
a Megatron checkpoint (fp32). Then separate processes build the Megatron GPT model the way
``relaymoe.megatron.pretrain`` builds it (Megatron's parser and ``GPTModelBuilder``, local
layers, gloo on CPU), ``--load`` the checkpoint through Megatron's ``load_checkpoint`` and run one
batch forward:

* one process, TP = EP = 1: ring, then megatron-core's own allgather dispatcher (alltoall
  creates a CUDA stream when built, so it cannot be built on the host; dispatchers own no
  parameters, and ``tests/lib/test_megatron_layer.py`` checks that ring's and alltoall's
  checkpoint keys are the same; ``tests/gpu/test_e2e_gpu.py`` loads a converted checkpoint with
  alltoall and ring on a GPU);
* two processes, ring at EP = 2 (each rank loads its half of the experts: torch_dist reshards
  the EP = 1 checkpoint). TP > 1 cannot be built on the host: MoE needs sequence parallelism
  there, which megatron-core's torch norms refuse without TransformerEngine or Apex; the GPU
  test (``tests/gpu/test_e2e_gpu.py``) loads at TP = 2 where TransformerEngine is installed.

Each must give transformers' logits on the same tokens within fp32 noise (relative 1e-5; a
wrong head order, a swapped gate/up or a transposed router gives errors of order 1). The
router's ``gating`` is replaced by the same linear on the host (megatron moves the router
weight to CUDA there), as in ``tests/lib/test_megatron_layer.py``, and so is ``load_checkpoint``'s
reading of the tracker file (it all-reduces the iteration in a CUDA tensor).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.fixtures import free_port, needs, start_python

# one worker (xdist_group) and a session-scoped conversion: built once although pytest-xdist
# runs other files' tests between these (a module-scoped one is torn down and built again then)
pytestmark = [pytest.mark.slow, needs("transformers", "safetensors", "megatron.training"),
              pytest.mark.xdist_group("convert_hf")]  # fmt: skip
ROOT = Path(__file__).resolve().parents[2]
SEQ, BATCH = 16, 2

HF_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    rope_theta=1e6,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)

_LOAD = textwrap.dedent(
    """
    import contextlib, json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo")
    ckpt, flags, out, dispatchers, tp, ep = sys.argv[1:7]
    tp, ep, world = int(tp), int(ep), dist.get_world_size()
    from relaymoe.megatron import register
    from relaymoe.megatron.pretrain import use_prebuilt_dataset_helpers
    register(); use_prebuilt_dataset_helpers()
    from megatron.core.transformer.moe.router import TopKRouter
    TopKRouter.gating = lambda self, x: F.linear(x, self.weight)  # megatron moves it to CUDA
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import checkpointing
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.global_vars import unset_global_variables
    from megatron.training.models.gpt import GPTModelBuilder
    def read_metadata(path):  # Megatron's all-reduces the iteration on a CUDA tensor
        text = open(path).read().strip()
        return (0, True) if text == "release" else (int(text), False)
    checkpointing.read_metadata = read_metadata
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (%(batch)d, %(seq)d), generator=g)
    pos = torch.arange(%(seq)d).unsqueeze(0).expand_as(tokens)
    mask = torch.tril(torch.ones(%(seq)d, %(seq)d, dtype=torch.bool)).logical_not().view(
        1, 1, %(seq)d, %(seq)d)
    results = {"tokens": tokens}
    for dispatcher in dispatchers.split(","):
        sys.argv = ["load", *json.loads(flags),
            "--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep),
            "--expert-tensor-parallel-size", "1", "--moe-token-dispatcher-type", dispatcher,
            "--seq-length", "%(seq)d", "--micro-batch-size", "1",
            "--global-batch-size", str(world // tp), "--transformer-impl", "local",
            "--no-rope-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion",
            "--no-gradient-accumulation-fusion", "--use-cpu-initialization", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--train-iters", "1", "--lr", "1e-4",
            "--load", ckpt, "--ckpt-format", "torch_dist", "--distributed-backend", "gloo",
            *(["--sequence-parallel"] if tp > 1 else [])]
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
        ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=1)
        model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
            ProcessGroupCollection.use_mpu_process_groups())
        load_checkpoint([model], None, None, strict=True)
        model.eval()
        with torch.no_grad():
            logits = model(tokens, pos, mask)
        if tp > 1:  # vocab-parallel output: gather the columns
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(),
                            group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, dim=-1)
        name = type(model.decoder.layers[0].mlp.token_dispatcher).__name__
        results[dispatcher] = (name, logits)
        ps.destroy_model_parallel(); unset_global_variables()
        destroy_num_microbatches_calculator()
    if dist.get_rank() == 0:
        torch.save(results, out)
    print("LOADED")
    dist.destroy_process_group()
    """
) % {"seq": SEQ, "batch": BATCH}


def _env() -> dict:
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT) + (os.pathsep + path if path else ""))  # fmt: skip


def _hf_model(folder: Path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(7)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**HF_CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms: around 1, each entry different
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2 if "gate.weight" in name else 0.08)
    model.save_pretrained(str(folder), max_shard_size="60KB")
    assert len(list(folder.glob("*.safetensors"))) > 2  # several shards
    return model


def _convert(root: Path, ckpt: Path, *extra: str) -> list[str]:
    p = subprocess.run(
        [sys.executable, "-m", "relaymoe", "convert-hf", "--hf", str(root / "hf"), "--out",
         str(ckpt), "--dtype", "fp32", *extra],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=root,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    flags = (ckpt / "megatron_model_flags.txt").read_text().split("\n")
    return [f for f in flags if f]


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """The checkpoint in the local spec's keys: the host builds the model with local layers."""
    root = tmp_path_factory.mktemp("hf")
    hf = _hf_model(root / "hf")
    ckpt = root / "ckpt"
    flags = _convert(root, ckpt, "--transformer-impl", "local")
    assert flags[-2:] == ["--transformer-impl", "local"], flags
    return root, hf, ckpt, flags


@pytest.fixture(scope="session")
def converted_te(converted):
    """The same model converted with the default, TransformerEngine's keys."""
    root = converted[0]
    ckpt = root / "ckpt_te"
    return ckpt, _convert(root, ckpt)


def _load(root: Path, ckpt: Path, flags, dispatchers: str, tp: int, ep: int) -> dict:
    world = max(tp, ep)
    script = root / "load.py"
    script.write_text(_LOAD)
    out = root / f"logits_tp{tp}_ep{ep}.pt"
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(_env(), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
        procs.append(start_python(
            [str(script), str(ckpt), json.dumps(flags), str(out), dispatchers, str(tp), str(ep)],
            env=env, cwd=root,
        ))  # fmt: skip
    logs = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        logs.append((p.returncode, o, e))
    for rc, o, e in logs:
        assert rc == 0 and "LOADED" in o, o[-2000:] + e[-5000:]
    return torch.load(out)


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(input_ids=tokens).logits


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(
    "dispatchers,tp,ep",
    [("ring,allgather", 1, 1), ("ring", 1, 2)],
    ids=["one-process", "ep2"],
)
def test_megatron_logits_match_transformers(converted, dispatchers, tp, ep):
    root, hf, ckpt, flags = converted
    got = _load(root, ckpt, flags, dispatchers, tp, ep)
    ref = _hf_logits(hf, got["tokens"])
    for dispatcher in dispatchers.split(","):
        kind, logits = got[dispatcher]
        assert kind == ("RingDispatcher" if dispatcher == "ring" else "MoEAllGatherTokenDispatcher")
        assert logits.shape == ref.shape, (logits.shape, ref.shape)
        err = _rel(logits, ref)
        assert err < 1e-5, f"{dispatcher} TP={tp} EP={ep}: relative logits error {err:.3g}"


def test_qkv_interleave_round_trips_and_is_per_group():
    from relaymoe.convert_hf import fused_qkv, split_qkv

    heads, groups, d, h = 8, 2, 3, 5
    q = torch.arange(heads * d * h, dtype=torch.float).view(heads * d, h)
    k = -torch.arange(groups * d * h, dtype=torch.float).view(groups * d, h) - 1
    v = 1000 + torch.arange(groups * d * h, dtype=torch.float).view(groups * d, h)
    w = fused_qkv(q, k, v, heads, groups, d)
    per = heads // groups
    # group 1 starts after group 0's 4 query heads, its key head and its value head
    start = (per + 2) * d
    assert torch.equal(w[start : start + d], q[per * d : (per + 1) * d])
    assert torch.equal(w[start + per * d : start + (per + 1) * d], k[d : 2 * d])
    for a, b in zip(split_qkv(w, heads, groups, d), (q, k, v), strict=True):
        assert torch.equal(a, b)


def test_refusals_name_the_problem(tmp_path):
    from relaymoe import convert_hf as c

    with pytest.raises(c.ConvertError, match="no config.json"):
        c.read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(c.ConvertError, match="model_type 'llama'"):
        c.read_hf_config(str(tmp_path))
    cfg = dict(HF_CONFIG, model_type="qwen3_moe", attention_bias=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(c.ConvertError, match="attention_bias=True"):
        c.read_hf_config(str(tmp_path))
    cfg["attention_bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(c.ConvertError, match="no model.safetensors"):
        c.SafetensorsCheckpoint(str(tmp_path))
    with pytest.raises(c.ConvertError, match=r"not this checkpoint's architecture.*num_layers"):
        c.check_against_config(c.read_hf_config(str(tmp_path)), "tiny_qwen3")


def _tensors(ckpt: Path) -> dict:
    """Every tensor of a torch_dist release checkpoint, by key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt / "release"), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items()
            if isinstance(v, torch.Tensor)}  # fmt: skip


def test_default_writes_the_transformer_engine_keys(converted, converted_te):
    """By default (Megatron's --transformer-impl transformer_engine) each MoE layer's pre-MLP
    norm is saved under the TE spec's ``pre_mlp_layernorm.weight``, not the local spec's
    ``mlp.linear_fc1.layer_norm_weight``; every other key and every value is the local
    conversion's, and the saved arguments name the implementation (what a resume checks)."""
    root, _, local_ckpt, local_flags = converted
    te_ckpt, flags = converted_te
    assert flags == [*local_flags[:-1], "transformer_engine"], flags
    local, te = _tensors(local_ckpt), _tensors(te_ckpt)
    # torch_dist stacks the layers: one key for every layer's tensor
    renamed = {"decoder.layers.mlp.linear_fc1.layer_norm_weight":
               "decoder.layers.pre_mlp_layernorm.weight"}  # fmt: skip
    assert set(renamed) <= set(local), sorted(local)
    assert set(te) == {renamed.get(k, k) for k in local}, sorted(set(te) ^ set(local))
    for k, v in local.items():
        assert torch.equal(te[renamed.get(k, k)], v), k
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    from relaymoe.megatron.checkpoint_compat import converted_by_relaymoe

    for ckpt, impl in ((te_ckpt, "transformer_engine"), (local_ckpt, "local")):
        saved = load_common_state_dict(ckpt / "release")["args"]
        assert saved.transformer_impl == impl
        assert converted_by_relaymoe(saved)  # what lets a TE load leave its _extra_state fresh


def test_qwen3_30b_config_matches_the_shipped_config():
    """The flags for the real checkpoint's config.json (values from its model card's
    config) agree with relaymoe's qwen3_30b_a3b.yaml."""
    from relaymoe import convert_hf as c

    hub = {
        "model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048,
        "intermediate_size": 6144, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "vocab_size": 151936, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "norm_topk_prob": True,
        "max_position_embeddings": 40960, "mlp_only_layers": [], "decoder_sparse_step": 1,
    }  # fmt: skip
    c.check_against_config(hub, "qwen3_30b_a3b")
    flags = c.megatron_model_flags(hub)
    assert "--moe-router-pre-softmax" not in flags and "--moe-layer-freq" not in flags
    assert flags[flags.index("--padded-vocab-size") + 1] == "151936"


def test_preflight_refuses_what_the_run_could_not_load(converted, converted_te, capsys):
    """Issue #52, items 1-2, on real conversions: train.sh's preflight passes the local
    checkpoint for a run of its own flags, and refuses in one line, before anything is
    launched, the TE-keyed one for a local run (convert again with --transformer-impl local)
    and the local one for qwen3_30b_a3b's flags (another model)."""
    from relaymoe.config import load_config, to_megatron_args
    from relaymoe.megatron import preflight

    _, _, local_ckpt, flags = converted
    te_ckpt, _ = converted_te
    train = ["--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "1",
             "--moe-token-dispatcher-type", "ring", "--mock-data", "--tokenizer-type",
             "NullTokenizer", "--train-iters", "1", "--lr", "1e-4"]  # fmt: skip

    def check(ckpt, argv):
        rc = preflight.main(["--dry-run", "--pretrained", str(ckpt), "--", *argv, "--load",
                             str(ckpt), "--ckpt-format", "torch_dist"])  # fmt: skip
        return rc, capsys.readouterr().err.splitlines()

    assert check(local_ckpt, [*flags, *train]) == (0, [])
    rc, err = check(te_ckpt, [*flags, *train])  # the local run, as train.sh without TE
    assert rc == 2 and len(err) == 1, err
    assert "saved with --transformer-impl transformer_engine and this run builds " in err[0]
    assert "convert it again for this run" in err[0] and "--transformer-impl local'" in err[0]
    qwen3 = [*to_megatron_args(load_config("qwen3_30b_a3b")), "--transformer-impl", "local",
             "--padded-vocab-size", "151936", *train[6:]]  # fmt: skip
    rc, err = check(local_ckpt, qwen3)
    assert rc == 2 and len(err) == 1, err
    assert f"PRETRAINED={local_ckpt} holds another model than this run builds" in err[0]
    assert "num_layers: checkpoint 2, this run 48" in err[0]
