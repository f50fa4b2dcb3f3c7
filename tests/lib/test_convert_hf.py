"""``relaymoe convert-hf``: a Hugging Face Qwen3-MoE checkpoint -> Megatron ``torch_dist`` -> the
same logits.

A tiny random Qwen3-MoE (``tests.fixtures.tiny_qwen3_moe``: 2 layers, hidden 64, 4 query heads
in 2 KV groups, 4 experts top-2, vocab 256, untied; the ``tiny_hf`` fixture of
``tests/conftest.py``) is converted by ``python -m relaymoe convert-hf`` (fp32; the
``converted_local`` fixture: two processes at PP 2, local keys; ``converted_te_ep2``: two
processes at EP 2, TE keys). Then separate processes build the
Megatron GPT model the way ``relaymoe.megatron.pretrain`` builds it, load the checkpoint through
Megatron's ``load_checkpoint`` and run fixed prompts forward, through the library's
``relaymoe.check_hf.megatron_logits`` (what ``relaymoe check-hf`` runs):

* one process, TP = EP = 1: ring, then megatron-core's own allgather dispatcher (alltoall
  creates a CUDA stream when built, so it cannot be built on the host; dispatchers own no
  parameters, and ``tests/lib/test_megatron_layer.py`` checks that ring's and alltoall's
  checkpoint keys are the same; ``tests/gpu/test_e2e_gpu.py`` loads a converted checkpoint with
  alltoall and ring on a GPU);
* two processes, ring at EP = 2 (each rank loads its half of the experts: torch_dist reshards
  the PP = 2 checkpoint). TP > 1 cannot be built on the host: MoE needs sequence parallelism
  there, which megatron-core's torch norms refuse without TransformerEngine or Apex; the GPU
  test (``tests/gpu/test_e2e_gpu.py``) loads at TP = 2 where TransformerEngine is installed.

Each must give transformers' logits on the same tokens within fp32 noise (relative 1e-5; a
wrong head order, a swapped gate/up or a transposed router gives errors of order 1).
The way back (``relaymoe export-hf``) and the user's check (``relaymoe check-hf``):
``tests/lib/test_export_hf.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.fixtures import TINY_QWEN3_MOE, end_left_running, needs, run_world, world_mark

# one worker (xdist_group) for the session-scoped conversions of tests/conftest.py, which
# tests/lib/test_export_hf.py shares: built once although pytest-xdist runs other files' tests
# between these
pytestmark = [pytest.mark.slow, needs("transformers", "safetensors", "megatron.training"),
              pytest.mark.xdist_group("hf_checkpoints")]  # fmt: skip
SEQ = 16

# Megatron's logits of fixed prompts, per dispatcher, through relaymoe check-hf's own function;
# the dispatcher each model built is recorded from the model itself
_LOAD = """
import json, sys
from pathlib import Path
import torch
from relaymoe.check_hf.megatron_logits import megatron_logits
from relaymoe.convert_hf import host
built = []
build_model = host.build_model
def recording(*a, **k):
    model, args = build_model(*a, **k)
    built.append(type(model.decoder.layers[0].mlp.token_dispatcher).__name__)
    return model, args
host.build_model = recording
folder, flags, prompts, out, dispatchers, ep = sys.argv[1:7]
results = {}
for dispatcher in dispatchers.split(","):
    logits = megatron_logits(Path(folder), json.loads(flags), json.loads(prompts),
                             transformer_impl="local", ep=int(ep), dispatcher=dispatcher)
    results[dispatcher] = (built[-1], logits)
if torch.distributed.get_rank() == 0:
    torch.save(results, out)
print("LOADED")
"""


def prompts(n: int = 2, seq: int = SEQ) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, TINY_QWEN3_MOE["vocab_size"], (n, seq), generator=g).tolist()


def megatron_logits(ckpt: Path, flags, dispatchers: str, ep: int) -> dict:
    """dispatcher -> (its class, the logits of each of ``prompts()``), from ``ep`` processes."""
    root = ckpt.parent
    (root / "load.py").write_text(_LOAD)
    out = root / f"logits_ep{ep}.pt"
    args = [str(root / "load.py"), str(ckpt / "release"), json.dumps(flags),
            json.dumps(prompts()), str(out), dispatchers, str(ep)]  # fmt: skip
    for rc, o, e in run_world(args, ep, cwd=root):
        assert rc == 0 and "LOADED" in o, o[-2000:] + e[-5000:]
    return torch.load(out)


def hf_logits(model, ids: list[list[int]]) -> list:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([p])).logits[0] for p in ids]


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dispatchers,ep", [("ring,allgather", 1), ("ring", 2)],
                         ids=["one-process", "ep2"])  # fmt: skip
def test_megatron_logits_match_transformers(tiny_hf, converted_local, dispatchers, ep):
    _, hf = tiny_hf
    ckpt, flags = converted_local
    got = megatron_logits(ckpt, flags, dispatchers, ep)
    ref = hf_logits(hf, prompts())
    for dispatcher in dispatchers.split(","):
        kind, logits = got[dispatcher]
        assert kind == ("RingDispatcher" if dispatcher == "ring" else "MoEAllGatherTokenDispatcher")
        for k, (a, b) in enumerate(zip(logits, ref, strict=True)):
            assert a.shape == b.shape, (a.shape, b.shape)
            err = rel(a, b)
            assert err < 1e-5, f"{dispatcher} EP={ep} prompt {k}: relative logits error {err:.3g}"


def test_conversions_leave_no_process_running(converted_local, converted_te_ep2):
    """Every process a conversion starts has ended once it has: megatron-core's torch_dist
    writer spawns a Manager process on a rank's first save and keeps it for the next one, and
    only multiprocessing's exit handler stops it, which a process leaving through ``os._exit``
    (as the suite's processes do, ``tests/worlds.py``) or a signal never runs. ``convert-hf``
    stops it after its save (``relaymoe.megatron.checkpoint_writer``). Checked on the session's
    two conversions (two processes each, PP 2 and EP 2) through the mark their processes were
    started with (``tests.worlds.end_left_running``), whatever else runs on the machine."""
    left = {ckpt.name: end_left_running(world_mark(ckpt))
            for ckpt, _ in (converted_local, converted_te_ep2)}  # fmt: skip
    assert not any(left.values()), f"left running by the conversions (now killed): {left}"


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
    cfg = dict(TINY_QWEN3_MOE, model_type="qwen3_moe", attention_bias=True)
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


def test_default_writes_the_transformer_engine_keys(converted_local, converted_te_ep2):
    """By default (Megatron's --transformer-impl transformer_engine) each MoE layer's pre-MLP
    norm is saved under the TE spec's ``pre_mlp_layernorm.weight``, not the local spec's
    ``mlp.linear_fc1.layer_norm_weight``; every other key and every value is the local
    conversion's (that one at PP 2, this one at EP 2: each process wrote its own layer, or its
    own experts, to its own file), and the saved arguments name the implementation (what a
    resume checks)."""
    local_ckpt, local_flags = converted_local
    te_ckpt, flags = converted_te_ep2
    assert flags == [*local_flags[:-1], "transformer_engine"], flags
    assert len(list((te_ckpt / "release").glob("*.distcp"))) == 2  # one file per process
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


def test_preflight_refuses_what_the_run_could_not_load(converted_local, converted_te_ep2, capsys):
    """Issue #52, items 1-2, on real conversions: train.sh's preflight passes the local
    checkpoint for a run of its own flags, and refuses in one line, before anything is
    launched, the TE-keyed one for a local run (convert again with --transformer-impl local)
    and the local one for qwen3_30b_a3b's flags (another model)."""
    from relaymoe.config import load_config, to_megatron_args
    from relaymoe.megatron import preflight

    local_ckpt, flags = converted_local
    te_ckpt, _ = converted_te_ep2
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
