"""``relaymoe convert-hf``: a Hugging Face Qwen3-MoE checkpoint to a Megatron ``torch_dist`` one.

Reads ``config.json`` and the safetensors shards (``model.safetensors.index.json`` or one
``model.safetensors``) of a ``qwen3_moe`` model, builds the Megatron GPT model exactly as
``python -m relaymoe.megatron.pretrain`` builds it (megatron-core's parser and
``GPTModelBuilder``, the local transformer layers, relaymoe's ring dispatcher; on CPU, gloo),
copies every Hugging Face tensor into its Megatron parameter, and saves through megatron-core's
own ``save_checkpoint`` as a ``release`` checkpoint (weights only: no optimizer, no RNG state).

megatron-core 0.19.2 ships no converter that fits (its ``models/huggingface/`` wraps Hugging
Face Qwen2 modules for multimodal models; Megatron-LM's ``tools/checkpoint/`` is not in the
wheel), and Megatron-Bridge's PyPI release pins an older megatron-core.

Why through the model rather than writing keys by hand: ``save_checkpoint`` stores the model's
``sharded_state_dict``, whose tensors carry their global shape and offsets, and the content
metadata Megatron reads back on load. Megatron then reshards on load to any TP/PP/EP layout
(``torch_dist``), and the keys are the same for the local and the TransformerEngine layer
specs (the local spec maps its norms onto TE's fused names, ``sharded_state_dict_keys_map``;
``SequentialMLP`` and ``TEGroupedMLP`` write the same expert keys) and for every dispatcher
(``tests/test_megatron_layer.py`` checks ring against alltoall).

The mapping, Hugging Face -> Megatron (names of the local spec, TP = 1):

* ``model.embed_tokens.weight`` -> ``embedding.word_embeddings.weight``;
* q/k/v_proj -> ``self_attention.linear_qkv.weight``, interleaved per query group: for each KV
  group its query heads, then its key head, then its value head (so that a TP split along
  dim 0 gives each rank whole groups);
* q_norm/k_norm -> ``self_attention.q_layernorm`` / ``k_layernorm``; o_proj -> ``linear_proj``;
* input_layernorm -> ``input_layernorm``, post_attention_layernorm -> ``pre_mlp_layernorm``;
* ``mlp.gate`` -> ``mlp.router``; expert ``j``'s [gate_proj; up_proj] -> ``linear_fc1`` (gate rows
  first, SwiGLU's order), down_proj -> ``linear_fc2`` (``local_experts.j.*`` of SequentialMLP or
  ``linear_fc1.weight{j}`` of a grouped MLP); dense layers (``mlp_only_layers``) likewise into
  ``mlp.linear_fc1``/``linear_fc2``;
* ``model.norm`` -> ``decoder.final_layernorm``; ``lm_head`` -> ``output_layer`` (untied).

Memory: the model is held once in ``--dtype`` on the host (Qwen3-30B-A3B in bf16: about 61 GB),
plus one Hugging Face tensor at a time. Under ``torchrun --nproc-per-node N`` with ``--ep N`` (or
``--pp N``) each process holds 1/N of the experts (or layers); the checkpoint is the same.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("qwen3_moe",)
FLAGS_FILE = "megatron_model_flags.txt"  # the model flags to train with, one per line
DTYPES = ("bf16", "fp32", "fp16")


class ConvertError(ValueError):
    """A checkpoint or setting ``relaymoe convert-hf`` cannot convert (the message names why)."""


# ------------------------------------------------------------------------------ config.json
def read_hf_config(hf_dir: str) -> dict:
    path = Path(hf_dir, "config.json")
    if not path.is_file():
        raise ConvertError(
            f"--hf {hf_dir}: no config.json; pass the folder of a downloaded Hugging Face "
            "checkpoint (config.json + *.safetensors), e.g. Qwen/Qwen3-30B-A3B"
        )
    cfg = json.loads(path.read_text())
    kind = cfg.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ConvertError(
            f"{path}: model_type {kind!r}; relaymoe convert-hf converts {SUPPORTED_MODEL_TYPES} "
            "(Qwen3-MoE: Qwen3-30B-A3B, Qwen3-235B-A22B)"
        )
    unsupported = {
        "attention_bias": (cfg.get("attention_bias", False), False),
        "use_sliding_window": (cfg.get("use_sliding_window", False), False),
        "rope_scaling": (_rope(cfg).get("rope_type", "default"), "default"),
        "hidden_act": (cfg.get("hidden_act", "silu"), "silu"),
    }
    # the Hub's Qwen3-MoE configs say num_experts, transformers >= 5 writes num_local_experts
    if "num_experts" not in cfg and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg["num_local_experts"]
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "vocab_size"):  # fmt: skip
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise ConvertError(f"{path}: {key}={cfg.get(key)!r}, expected a positive integer")
    for key, (value, wanted) in unsupported.items():
        if value != wanted:
            raise ConvertError(
                f"{path}: {key}={value!r}; the conversion supports {key}={wanted!r} only "
                "(what Qwen3-MoE checkpoints have)"
            )
    return cfg


def _rope(cfg: dict) -> dict:
    """rope parameters of either transformers generation (rope_parameters or rope_theta +
    rope_scaling)."""
    rp = dict(cfg.get("rope_parameters") or {})
    if "rope_theta" not in rp and "rope_theta" in cfg:
        rp["rope_theta"] = cfg["rope_theta"]
    if cfg.get("rope_scaling"):
        rp.setdefault("rope_type", cfg["rope_scaling"].get("rope_type", "scaled"))
    return rp


def moe_layer_pattern(cfg: dict) -> list[int]:
    """1 for a sparse (MoE) layer, 0 for a dense one, as transformers' Qwen3-MoE decides."""
    n = cfg["num_hidden_layers"]
    dense = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1) or 1
    return [0 if (i in dense or (i + 1) % step) else 1 for i in range(n)]


def megatron_model_flags(cfg: dict) -> list[str]:
    """The Megatron model flags of a Qwen3-MoE ``config.json`` (the same architecture flags
    relaymoe's configs render; ``--padded-vocab-size`` keeps the embedding at the checkpoint's
    rows whatever the tokenizer's length)."""
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    vocab = cfg["vocab_size"]
    pattern = moe_layer_pattern(cfg)
    flags = [
        "--num-layers", str(cfg["num_hidden_layers"]),
        "--hidden-size", str(cfg["hidden_size"]),
        "--ffn-hidden-size", str(cfg.get("intermediate_size") or cfg["moe_intermediate_size"]),
        "--num-attention-heads", str(heads),
        "--kv-channels", str(head_dim),
        "--num-experts", str(cfg["num_experts"]),
        "--moe-router-topk", str(cfg["num_experts_per_tok"]),
        "--moe-ffn-hidden-size", str(cfg["moe_intermediate_size"]),
        "--vocab-size", str(vocab),
        "--padded-vocab-size", str(vocab),
        "--max-position-embeddings", str(cfg.get("max_position_embeddings", 4096)),
        "--position-embedding-type", "rope",
        "--rotary-base", str(int(_rope(cfg).get("rope_theta", 10000))),
        "--normalization", "RMSNorm",
        "--norm-epsilon", repr(float(cfg.get("rms_norm_eps", 1e-6))),
        "--qk-layernorm",
        "--swiglu",
        "--disable-bias-linear",
        "--moe-grouped-gemm",
        "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", repr(float(cfg.get("router_aux_loss_coef", 1e-3))),
        "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0",
    ]  # fmt: skip
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", str(groups)]
    if not cfg.get("tie_word_embeddings", False):
        flags.append("--untie-embeddings-and-output-weights")
    if not cfg.get("norm_topk_prob", True):
        # softmax over all experts, top-k of those probabilities, not renormalised
        flags.append("--moe-router-pre-softmax")
    if 0 in pattern:
        flags += ["--moe-layer-freq", "[" + ",".join(map(str, pattern)) + "]"]
    return flags


# relaymoe config model keys -> what a Qwen3-MoE config.json says about them
def _hf_model_fields(cfg: dict) -> dict:
    heads = cfg["num_attention_heads"]
    return {
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "num_attention_heads": heads,
        "query_groups": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "num_experts": cfg["num_experts"],
        "moe_router_topk": cfg["num_experts_per_tok"],
        "moe_ffn_hidden_size": cfg["moe_intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", False),
        "qk_layernorm": True,
        "rotary_base": int(_rope(cfg).get("rope_theta", 10000)),
        "norm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "moe_layer_pattern": tuple(moe_layer_pattern(cfg)),
    }


def check_against_config(cfg: dict, config_name: str) -> None:
    """ConvertError unless the relaymoe config's model is the checkpoint's architecture."""
    from relaymoe.config import load_config

    model = load_config(config_name).model
    bad = []
    for key, want in _hf_model_fields(cfg).items():
        have = getattr(model, key)
        if isinstance(want, float) and abs(have - want) <= 1e-12 * max(1.0, abs(want)):
            continue
        if have != want:
            bad.append(f"{key}: config {have!r}, checkpoint {want!r}")
    if bad:
        raise ConvertError(
            f"config {config_name} is not this checkpoint's architecture ({'; '.join(bad)}); "
            "fix: pass the matching config, or train with the flags convert-hf prints"
        )


# ------------------------------------------------------------------------------ safetensors
class SafetensorsCheckpoint:
    """Lazy access to the tensors of a Hugging Face checkpoint folder, by name."""

    def __init__(self, hf_dir: str):
        try:
            from safetensors import safe_open
        except ImportError:
            raise ConvertError(
                "relaymoe convert-hf reads safetensors shards: pip install 'relaymoe[data]' "
                "(or safetensors)"
            ) from None
        self._open = safe_open
        folder = Path(hf_dir)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self.where = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").is_file():
            with safe_open(str(folder / "model.safetensors"), "pt") as f:
                self.where = {k: "model.safetensors" for k in f.keys()}
        else:
            raise ConvertError(
                f"--hf {hf_dir}: no model.safetensors.index.json or model.safetensors (only "
                "safetensors checkpoints are read; re-save a .bin one with save_pretrained)"
            )
        missing = sorted({f for f in self.where.values() if not (folder / f).is_file()})
        if missing:
            raise ConvertError(
                f"--hf {hf_dir}: shard(s) {missing[:3]} named in the index are absent"
            )
        self.folder = folder
        self._files: dict = {}
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str):
        if name not in self.where:
            raise ConvertError(f"the checkpoint has no tensor {name!r} (a Qwen3-MoE one has)")
        shard = self.where[name]
        if shard not in self._files:
            self._files[shard] = self._open(str(self.folder / shard), "pt").__enter__()
        self.used.add(name)
        return self._files[shard].get_tensor(name)

    def close(self) -> None:
        for f in self._files.values():
            f.__exit__(None, None, None)
        self._files.clear()


# ------------------------------------------------------------------------------ the mapping
def fused_qkv(q, k, v, heads: int, groups: int, head_dim: int):
    """Megatron's ``linear_qkv`` weight from Hugging Face's q/k/v projections: per KV group,
    its ``heads // groups`` query heads, its key head, its value head (rows), in group order."""
    import torch

    hidden = q.shape[-1]
    per = heads // groups
    q = q.reshape(groups, per * head_dim, hidden)
    k = k.reshape(groups, head_dim, hidden)
    v = v.reshape(groups, head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(groups * (per + 2) * head_dim, hidden)


def split_qkv(w, heads: int, groups: int, head_dim: int):
    """The inverse of ``fused_qkv``: (q, k, v)."""
    per = heads // groups
    w = w.reshape(groups, (per + 2) * head_dim, -1)
    q, k, v = w.split([per * head_dim, head_dim, head_dim], dim=1)
    hidden = w.shape[-1]
    return (
        q.reshape(heads * head_dim, hidden),
        k.reshape(groups * head_dim, hidden),
        v.reshape(groups * head_dim, hidden),
    )


def _expert_weights(hf: SafetensorsCheckpoint, layer: int, expert: int):
    """(fc1 = [gate; up], fc2 = down) of one expert, from the per-expert (Hub) layout or the
    fused one transformers >= 5 keeps in memory (``experts.gate_up_proj``, ``down_proj``)."""
    import torch

    base = f"model.layers.{layer}.mlp.experts"
    if f"{base}.{expert}.gate_proj.weight" in hf:
        gate = hf.get(f"{base}.{expert}.gate_proj.weight")
        up = hf.get(f"{base}.{expert}.up_proj.weight")
        return torch.cat([gate, up], dim=0), hf.get(f"{base}.{expert}.down_proj.weight")
    if f"{base}.gate_up_proj" in hf:
        return hf.get(f"{base}.gate_up_proj")[expert], hf.get(f"{base}.down_proj")[expert]
    raise ConvertError(f"the checkpoint has no weights of expert {expert} in layer {layer}")


def hf_tensor(hf: SafetensorsCheckpoint, name: str, cfg: dict, layer_of: dict, experts_of: dict):
    """The Hugging Face tensor for the Megatron parameter ``name`` (local or TE spec names;
    ``layer_of``: the model's ``decoder.layers.N`` -> global layer; ``experts_of``: global
    layer -> its local expert ids in order)."""
    import torch

    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if name == "embedding.word_embeddings.weight":
        return hf.get("model.embed_tokens.weight")
    if name == "decoder.final_layernorm.weight":
        return hf.get("model.norm.weight")
    if name == "output_layer.weight":
        if "lm_head.weight" in hf:
            return hf.get("lm_head.weight")
        return hf.get("model.embed_tokens.weight")
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        raise ConvertError(f"no Hugging Face tensor maps to Megatron parameter {name!r}")
    local = int(parts[2])
    i = layer_of[local]
    rest = ".".join(parts[3:])
    p = f"model.layers.{i}."
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE spec
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",  # TE, dense
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.router.weight": "mlp.gate.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    if rest in simple:
        return hf.get(p + simple[rest])
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = (hf.get(f"{p}self_attn.{x}_proj.weight") for x in "qkv")
        return fused_qkv(q, k, v, heads, groups, head_dim)
    if rest == "mlp.linear_fc1.weight":  # a dense layer
        return torch.cat([hf.get(p + "mlp.gate_proj.weight"), hf.get(p + "mlp.up_proj.weight")])
    for prefix in ("mlp.experts.local_experts.", "mlp.experts.linear_fc"):
        if not rest.startswith(prefix):
            continue
        if prefix.endswith("local_experts."):  # SequentialMLP: local_experts.J.linear_fcN.weight
            j, what = int(parts[6]), parts[7]
        else:  # grouped MLP: linear_fcN.weightJ
            what, j = parts[5], int(parts[6].removeprefix("weight"))
        fc1, fc2 = _expert_weights(hf, i, experts_of[i][j])
        return fc1 if what == "linear_fc1" else fc2
    raise ConvertError(f"no Hugging Face tensor maps to Megatron parameter {name!r}")


# ------------------------------------------------------------------------------ the run
def _init_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)


def _cpu_only_megatron() -> None:
    """The CUDA queries megatron-core makes while parsing, building and saving, answered for a
    host-only process (nothing here runs on a GPU)."""
    import torch

    if torch.cuda.is_available():
        return
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # validate_args asks for it
    torch.cuda.current_device = lambda: "cpu"  # RoPE puts its frequencies there
    torch.cuda.get_rng_state = lambda *a, **k: torch.ByteTensor()  # save_checkpoint collects it
    torch.cuda.synchronize = lambda *a, **k: None  # the torch_dist writer waits for the device


def convert(
    hf_dir: str,
    out_dir: str,
    *,
    dtype: str = "bf16",
    pp: int = 1,
    ep: int = 1,
    config: str | None = None,
    extra: list[str] = (),
) -> list[str]:
    """Convert; returns the model flags to train with. Run in a fresh process (it initialises
    torch.distributed and megatron's global state)."""
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}; known: {DTYPES}")
    cfg = read_hf_config(hf_dir)
    if config is not None:
        check_against_config(cfg, config)
    model_flags = megatron_model_flags(cfg)
    hf = SafetensorsCheckpoint(hf_dir)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ConvertError(
            f"--out {out_dir} exists and is not empty; pass a new folder (a conversion never "
            "overwrites a checkpoint)"
        )
    import torch

    _cpu_only_megatron()
    _init_distributed()
    world = torch.distributed.get_world_size()
    if pp * ep != world:
        raise ConvertError(
            f"--pp {pp} x --ep {ep} = {pp * ep} processes, but {world} run; fix: torchrun "
            f"--nproc-per-node {pp * ep} (or --pp 1 --ep 1 alone)"
        )
    from relaymoe.megatron import register
    from relaymoe.megatron.pretrain import use_prebuilt_dataset_helpers

    register()
    use_prebuilt_dataset_helpers()
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.models.gpt import GPTModelBuilder

    seq = min(4096, int(cfg.get("max_position_embeddings", 4096)))
    precision = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[dtype]
    argv = [
        *model_flags,
        "--seq-length", str(seq), "--micro-batch-size", "1",
        "--global-batch-size", str(world // pp),  # one micro-batch per data-parallel rank
        "--pipeline-model-parallel-size", str(pp), "--expert-model-parallel-size", str(ep),
        "--moe-token-dispatcher-type", "ring",
        "--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
        "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
        "--use-cpu-initialization", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--train-iters", "1", "--lr", "1e-4",
        "--save", str(out), "--save-interval", "1", "--ckpt-format", "torch_dist",
        "--no-save-optim", "--no-save-rng",
        "--distributed-backend", "gloo", *precision, *extra,
    ]  # fmt: skip
    old_argv = sys.argv
    sys.argv = ["relaymoe convert-hf", *argv]
    try:
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    finally:
        sys.argv = old_argv
    ps.initialize_model_parallel(1, pp, expert_model_parallel_size=ep)
    model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
        ProcessGroupCollection.use_mpu_process_groups()
    )
    _load_hf_weights(model, hf, cfg)
    hf.close()
    try:
        save_checkpoint(0, [model], None, None, 0, release=True)
        if torch.distributed.get_rank() == 0:  # beside the checkpoint, which Megatron ignores
            (out / FLAGS_FILE).write_text("\n".join(model_flags) + "\n")
        torch.distributed.barrier()
    except BaseException:
        if torch.distributed.get_rank() == 0:  # no half-written checkpoint left to load
            import shutil

            shutil.rmtree(out, ignore_errors=True)
        raise
    return model_flags


def _load_hf_weights(model, hf: SafetensorsCheckpoint, cfg: dict) -> None:
    import torch
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers = model.decoder.layers
    layer_of = {j: layer.layer_number - 1 for j, layer in enumerate(layers)}
    experts_of = {}
    for j, layer in enumerate(layers):
        if isinstance(layer.mlp, MoELayer):
            experts_of[layer_of[j]] = list(layer.mlp.local_expert_indices)
    with torch.no_grad():
        for name, param in model.named_parameters():
            src = hf_tensor(hf, name, cfg, layer_of, experts_of)
            if tuple(src.shape) != tuple(param.shape):
                raise ConvertError(
                    f"{name}: the checkpoint's tensor is {tuple(src.shape)}, the model's "
                    f"{tuple(param.shape)} (config.json does not describe these shards?)"
                )
            param.copy_(src.to(param.dtype))
    if torch.distributed.get_world_size() == 1:  # one process reads every tensor it should
        unused = [n for n in sorted(set(hf.where) - hf.used) if not n.endswith("inv_freq")]
        if unused:
            raise ConvertError(
                f"{len(unused)} tensor(s) of the checkpoint map to no Megatron parameter, e.g. "
                f"{unused[:3]}: not a plain Qwen3-MoE checkpoint"
            )


# ------------------------------------------------------------------------------ CLI
def add_parser(sub) -> None:
    c = sub.add_parser(
        "convert-hf",
        help="a Hugging Face Qwen3-MoE checkpoint (config.json + safetensors) to a Megatron "
        "torch_dist checkpoint (--load / --pretrained-checkpoint, any TP/PP/EP)",
        description="Builds the Megatron GPT model as relaymoe.megatron.pretrain does (on the "
        "host, gloo), copies the Hugging Face weights into it and saves a torch_dist release "
        "checkpoint, weights only. Megatron reshards it on load to any TP/PP/EP and either "
        "dispatcher. Prints the model flags to train with.",
    )
    c.add_argument("--hf", required=True, help="the Hugging Face checkpoint folder")
    c.add_argument("--out", required=True, help="a new folder for the Megatron checkpoint")
    c.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bf16",
        help="dtype of the saved weights (default bf16: what --bf16 training holds)",
    )
    c.add_argument(
        "--config",
        default=None,
        help="a relaymoe config to check the checkpoint's architecture against (e.g. "
        "qwen3_30b_a3b)",
    )
    c.add_argument("--pp", type=int, default=1, help="pipeline stages (one process each)")
    c.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel processes (each holds 1/EP of the experts): run under torchrun "
        "--nproc-per-node PP*EP to spread the host memory",
    )


def main(ns) -> int:
    try:
        flags = convert(ns.hf, ns.out, dtype=ns.dtype, pp=ns.pp, ep=ns.ep, config=ns.config)
    except ConvertError as e:
        print(f"relaymoe convert-hf: error: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    if dist.get_rank() == 0:
        out = os.path.abspath(ns.out)
        print(f"[relaymoe convert-hf] wrote {out} (torch_dist, release, weights only)",
              file=sys.stderr)  # fmt: skip
        print(f"[relaymoe convert-hf] train from it with --pretrained-checkpoint {out} (or "
              f"--load {out}) --ckpt-format torch_dist and its model flags, one per line in "
              f"{out}/{FLAGS_FILE}: {' '.join(flags)}", file=sys.stderr)  # fmt: skip
    dist.destroy_process_group()
    return 0
