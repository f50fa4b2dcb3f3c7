"""``--relaymoe-fused-loss``: a Megatron ``GPTModel`` with and without the flag.

Two spawned gloo worlds build tiny GPT models twice from the same weights, once plain (the
output layer + ``vocab_parallel_cross_entropy``: Megatron's own path) and once with the flag
(``relaymoe.linear_cross_entropy`` through ``GPTModel._postprocess``'s output processor), and
require the same masked loss and the same gradient for every parameter:

* world 1 (TP = 1): untied and tied embeddings, loss masks with zeros, Megatron's loss-function
  gradient and an arbitrary one, a chunk of 3 tokens, ``main_grad`` with gradient accumulation
  fusion (untied: no DDP mark; tied: DDP's mark and zeroed dummy), MoE layers with the
  allgather and the ring dispatcher; which calls take the fused path (labels ``None``, the
  caller's ``output_processor``, inference mode do not); the build-time refusals;
* world 2 (TP = 2, vocabulary 38: 19 rows per rank): with and without sequence parallelism,
  tied and untied, masks, ``main_grad``; gathered logits at TP > 1 stay on Megatron's path.

Label smoothing (which megatron-core 0.19's ``GPTModel`` never applies) is checked at the
output-layer level against ``vocab_parallel_cross_entropy(label_smoothing=...)`` in both worlds.
The same workers run on GPUs in bf16 from ``tests/gpu/test_e2e_gpu.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.fixtures import assert_close as close
from tests.fixtures import free_port, needs, run_spawned, tiny_transformer_config

pytestmark = [pytest.mark.slow, needs("megatron.core")]

B, S, H, HEADS = 2, 6, 20, 2


# ------------------------------------------------------------------------------ world setup
def _init(rank: int, world: int, port: int, tp: int, device: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    from megatron.core import tensor_parallel

    if device == "cpu":
        # Megatron allocates its communication buffers on "the current CUDA device"
        torch.cuda.current_device = lambda: "cpu"
        from megatron.core.transformer.moe.router import TopKRouter

        def gating(self, input):  # Megatron's moves the router weight to CUDA
            dtype = torch.float32 if self.config.moe_router_dtype == "fp32" else input.dtype
            return F.linear(input.to(dtype), self.weight.to(dtype))

        TopKRouter.gating = gating
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tp, 1, create_gloo_process_groups=False)
    import relaymoe.loss
    import relaymoe.megatron as rm

    rm.register()
    real = relaymoe.loss.linear_cross_entropy

    def counted(*args, **kwargs):  # the real function; the count tells which path ran
        CALLS[0] += 1
        return real(*args, **kwargs)

    # patched where the output processor looks it up (at each call), for this process's life
    relaymoe.loss.linear_cross_entropy = counted


CALLS = [0]


class _Norm(torch.nn.LayerNorm):
    """A per-token LayerNorm Megatron's builders accept at any TP (its torch wrapper refuses
    sequence parallelism only because of the norm weights' gradient reduction, which these tests
    compare per rank, before any reduction)."""

    def __init__(self, config, hidden_size, eps=1e-5, **_):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)


def make_config(tp: int, sp: bool, dtype, moe: str | None = None, **kw):
    base = dict(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=HEADS,
        ffn_hidden_size=12,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
    )
    if moe is not None:
        base.update(
            num_moe_experts=4,
            moe_token_dispatcher_type=moe,
            expert_tensor_parallel_size=1,
        )
    return tiny_transformer_config(moe=moe is not None, **{**base, **kw})


def build(cfg, *, fused: bool, tied: bool, vocab: int, chunk: int | None = None, cls=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from relaymoe.megatron import settings

    layer = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts)
    layer = dataclasses.replace(
        layer,
        submodules=dataclasses.replace(
            layer.submodules, input_layernorm=_Norm, pre_mlp_layernorm=_Norm
        ),
    )
    spec = TransformerBlockSubmodules(layer_specs=[layer] * cfg.num_layers, layer_norm=_Norm)
    if fused:  # this model's config only: the caller's cfg builds Megatron's own models still
        cfg = settings.configure(copy.copy(cfg), fused_loss=settings.FusedLoss(True, chunk))
    torch.manual_seed(0)
    return (cls or GPTModel)(
        cfg,
        spec,
        vocab_size=vocab,
        max_sequence_length=S * 2,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
    )


def pair(cfg, *, tied: bool, vocab: int, device: str, chunk: int | None = None):
    """(Megatron's model, the flag's model) with identical weights."""
    ref = build(cfg, fused=False, tied=tied, vocab=vocab).to(device)
    fus = build(cfg, fused=True, tied=tied, vocab=vocab, chunk=chunk).to(device)
    fus.load_state_dict(ref.state_dict())
    with torch.no_grad():  # the router weights, the norms: all away from their initial values
        for (_, a), (_, b) in zip(ref.named_parameters(), fus.named_parameters(), strict=True):
            noise = torch.randn(a.shape, generator=torch.Generator().manual_seed(a.numel()))
            a.add_(0.1 * noise.to(a.device, a.dtype))
            b.copy_(a)
    from megatron.core.models.gpt.gpt_model import GPTModel

    assert getattr(GPTModel._postprocess, "__relaymoe_patched__", False)
    assert getattr(fus, "_relaymoe_fused_loss", None) is not None
    assert getattr(ref, "_relaymoe_fused_loss", None) is None
    return ref, fus


def batch(vocab: int, device: str, seed: int, *, masked: bool):
    """tokens, position ids, causal mask, labels (B, S); loss mask (B, S) with zeros or None."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    mask = None
    if masked:
        mask = (torch.rand(B, S, generator=g) > 0.35).float()
        mask[0, 0], mask[-1, -1] = 0.0, 1.0
        mask = mask.to(device)
    pos = torch.arange(S).expand(B, S).to(device)
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool)).logical_not().view(1, 1, S, S)
    return tokens.to(device), pos, causal.to(device), labels.to(device), mask


def loss_and_grads(model, b, objective: str, *, seed: int):
    """Forward with labels, backward of Megatron's loss function (``"megatron"``: masked sum
    over the token count, a constant per counted token) or of random per-token weights."""
    tokens, pos, causal, labels, mask = b
    model.zero_grad(set_to_none=True)
    loss_BS = model(tokens, pos, causal, labels=labels, loss_mask=mask)
    m = torch.ones_like(loss_BS) if mask is None else mask.to(loss_BS.dtype)
    if objective == "megatron":
        total = (loss_BS * m).sum() / m.sum()
    else:
        w = torch.rand(loss_BS.shape, generator=torch.Generator().manual_seed(seed))
        total = (loss_BS * m * w.to(loss_BS.device)).sum()
    total.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss_BS, m, grads


def compare(tag, ref, fus, b, *, tol, objective="megatron", seed=0, expect_fused=True):
    CALLS[0] = 0
    loss_r, m, grads_r = loss_and_grads(ref, b, objective, seed=seed)
    assert CALLS[0] == 0, f"{tag}: Megatron's model called the fused loss"
    loss_f, _, grads_f = loss_and_grads(fus, b, objective, seed=seed)
    assert CALLS[0] == (1 if expect_fused else 0), f"{tag}: fused calls {CALLS[0]}"
    assert loss_f.dtype == loss_r.dtype == torch.float32, (loss_f.dtype, loss_r.dtype)
    if b[4] is not None and expect_fused:
        assert (loss_f[b[4] == 0] == 0).all(), f"{tag}: masked tokens have a non-zero loss"
    close(f"{tag} loss", loss_f * m, loss_r * m, tol)
    for name, gr in grads_r.items():
        gf = grads_f[name]
        assert (gf is None) == (gr is None), f"{tag}: grad of {name} is {gf} vs {gr}"
        if gr is not None:
            close(f"{tag} d {name}", gf, gr, tol)
    return grads_r


def output_weight(model):
    if model.share_embeddings_and_output_weights:
        return model.embedding.word_embeddings.weight
    return model.output_layer.weight


def check_main_grad(tag, cfg, vocab, device, tol, *, tied: bool, ddp_mark: bool,
                    fusion: bool = True):  # fmt: skip
    """Gradient accumulation fusion (or, without it, Megatron's DDP marking the parameter)
    over three micro-batches: the output weight's gradient lands in ``main_grad`` (fp32: the
    loss's accumulate mode). The first micro-batch has no
    guess of its upstream gradient (the backward computes the weight gradient: one backward
    pass); the second's guess, the first's gradient rescaled by the token counts, is right (no
    backward pass); the third's loss is weighted, so the guess is wrong and corrected. Then a
    forward whose backward never runs is refused at Megatron's finalize point and at the next
    call."""
    import relaymoe.loss
    import relaymoe.loss.accumulate as acc_mod

    ref, fus = pair(cfg, tied=tied, vocab=vocab, device=device)
    name = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    micro = [(batch(vocab, device, seed=5 + k, masked=True), obj)
             for k, obj in enumerate(("megatron", "megatron", "weighted"))]  # fmt: skip
    want = sum(loss_and_grads(ref, b, obj, seed=k)[2][name].float()
               for k, (b, obj) in enumerate(micro))  # fmt: skip
    fus.output_layer.gradient_accumulation_fusion = fusion  # (Megatron's own needs Apex)
    w = output_weight(fus)
    start = torch.randn(w.shape, generator=torch.Generator().manual_seed(9)).to(device)
    w.main_grad = start.clone()  # fp32, as Megatron's DDP buffers are
    if ddp_mark:
        w.grad_added_to_main_grad = False
        w.zero_out_wgrad = True
    finalized = []
    fus.config.finalize_model_grads_func = lambda *a, **k: finalized.append(a)
    real, passes = acc_mod.backward_chunks, []
    acc_mod.backward_chunks = lambda *a, **k: passes.append(1) or real(*a, **k)
    try:
        via_grad, runs = torch.zeros_like(start), []
        for k, (b, obj) in enumerate(micro):
            CALLS[0], before = 0, len(passes)
            loss_and_grads(fus, b, obj, seed=k)
            assert CALLS[0] == 1
            runs.append(len(passes) - before)
            if ddp_mark:
                assert w.grad_added_to_main_grad is True, f"{tag}: parameter not marked"
                via_grad += w.grad.float()  # the embedding's own gradient plus the zeroed dummy
            else:
                assert w.grad is None, f"{tag}: a gradient reached .grad besides main_grad"
    finally:
        acc_mod.backward_chunks = real
    assert runs[:2] == [1, 0] and runs[2] >= 1, f"{tag}: backward passes {runs}"
    fus.config.finalize_model_grads_func("chunks")  # the guard passes, then Megatron's runs
    assert finalized == [("chunks",)], finalized
    close(f"{tag} main_grad", w.main_grad - start + via_grad, want, tol)
    tokens, pos, causal, labels, mask = micro[0][0]
    fus(tokens, pos, causal, labels=labels, loss_mask=mask)  # dropped: its backward never runs
    with pytest.raises(RuntimeError, match="their backward never ran"):
        fus.config.finalize_model_grads_func("chunks")
    with pytest.raises(RuntimeError, match=r"reset_ledger\(accumulator\)"):
        fus(tokens, pos, causal, labels=labels, loss_mask=mask)
    relaymoe.loss.reset_ledger(w.main_grad)
    with torch.no_grad():  # evaluation: nothing speculative
        fus(tokens, pos, causal, labels=labels, loss_mask=mask)
    fus.config.finalize_model_grads_func("chunks")


def check_label_smoothing(tag, cfg, vocab, device, tol, smoothing=0.1):
    """The output layer + ``vocab_parallel_cross_entropy(label_smoothing)`` vs the fused one."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from relaymoe.megatron.fused_loss import output_layer_loss

    ref, _ = pair(cfg, tied=False, vocab=vocab, device=device)
    layer = ref.output_layer
    tp = cfg.tensor_model_parallel_size
    s_local = S // tp if layer.sequence_parallel else S
    g = torch.Generator().manual_seed(11 + dist.get_rank())
    hidden = torch.randn(s_local, B, H, generator=g).to(device, cfg.params_dtype)
    labels = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(12))
    labels = labels.to(device)
    upstream = torch.rand(B, S, generator=torch.Generator().manual_seed(13)).to(device)
    out = []
    for fused in (False, True):
        h = hidden.clone().requires_grad_(True)
        layer.weight.grad = None
        if fused:
            loss = output_layer_loss(layer, h, labels, label_smoothing=smoothing)
        else:
            logits, _ = layer(h)
            loss = vocab_parallel_cross_entropy(
                logits, labels.t().contiguous(), smoothing, layer.tp_group
            ).t()
        (loss * upstream).sum().backward()
        out.append((loss.detach(), h.grad, layer.weight.grad.clone()))
    for what, got, want in zip(("loss", "d hidden", "d weight"), out[1], out[0], strict=True):
        close(f"{tag} smoothing {what}", got, want, tol)


# ------------------------------------------------------------------------------ world 1
def check_paths(cfg, vocab, device, tol):
    """Which calls take the fused path, and what the others return (Megatron's)."""
    from megatron.core.inference.utils import InferenceMode

    ref, fus = pair(cfg, tied=False, vocab=vocab, device=device)
    tokens, pos, causal, labels, mask = batch(vocab, device, seed=3, masked=True)
    CALLS[0] = 0
    with torch.no_grad():
        logits_r = ref(tokens, pos, causal)
        logits_f = fus(tokens, pos, causal)
        assert CALLS[0] == 0 and logits_f.shape == (B, S, vocab)
        close("labels=None: logits", logits_f, logits_r, tol)
        sentinel = torch.zeros(1)
        got = fus(tokens, pos, causal, labels=labels, output_processor=lambda **kw: sentinel)
        assert got is sentinel and CALLS[0] == 0, "the caller's output_processor was replaced"
        with InferenceMode.active():
            out = fus(tokens, pos, causal, labels=labels, runtime_gather_output=True)
        assert CALLS[0] == 0, "the fused loss ran in inference mode"
        close("inference-mode loss", out, ref(tokens, pos, causal, labels=labels), tol)
        # gathered logits at TP = 1 are the same logits: fused; eval mode too
        fus.eval()
        loss = fus(tokens, pos, causal, labels=labels, loss_mask=mask, runtime_gather_output=True)
        assert CALLS[0] == 1 and loss.shape == (B, S)


def check_args_wiring(cfg, vocab, device):
    """``--relaymoe-fused-loss --relaymoe-loss-chunk-tokens 5`` parsed by Megatron's parser
    reach a model built afterwards (``settings`` reads ``megatron.training.get_args()``)."""
    from megatron.training import arguments
    from megatron.training.global_vars import set_args

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    set_args(parser.parse_args(["--relaymoe-fused-loss", "--relaymoe-loss-chunk-tokens", "5"]))
    try:
        model = build(cfg, fused=False, tied=False, vocab=vocab).to(device)
    finally:
        set_args(None)
    processor = getattr(model, "_relaymoe_fused_loss", None)
    assert processor is not None and processor.chunk_tokens == 5, processor
    tokens, pos, causal, labels, mask = batch(vocab, device, seed=4, masked=True)
    CALLS[0] = 0
    model(tokens, pos, causal, labels=labels, loss_mask=mask).sum().backward()
    assert CALLS[0] == 1
    assert (
        getattr(build(cfg, fused=False, tied=False, vocab=vocab), "_relaymoe_fused_loss", None)
        is None
    )


def check_refusals(device):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from relaymoe.megatron import fused_loss

    cases = [
        (dict(mtp_num_layers=1), "remove --mtp-num-layers"),
        (dict(use_mup=True), "remove --use-mup"),
        # (Megatron allows this one with pipeline parallelism only: set after the checks)
        (dict(defer_embedding_wgrad_compute=True), "remove --defer-embedding-wgrad-compute"),
    ]
    for kw, message in cases:
        cfg = make_config(
            1,
            False,
            torch.float32,
            **{k: v for k, v in kw.items() if k != "defer_embedding_wgrad_compute"},
        )
        for k, v in kw.items():
            setattr(cfg, k, v)
        build(cfg, fused=False, tied=False, vocab=37)  # Megatron's path builds
        with pytest.raises(ValueError) as info:
            build(cfg, fused=True, tied=False, vocab=37)
        assert "--relaymoe-fused-loss cannot run" in str(info.value), info.value
        assert message in str(info.value), info.value

    class CustomLoss(GPTModel):
        def compute_language_model_loss(self, labels, logits):
            return super().compute_language_model_loss(labels, logits) * 2

    cfg = make_config(1, False, torch.float32)
    with pytest.raises(ValueError, match="CustomLoss overrides compute_language_model_loss"):
        build(cfg, fused=True, tied=False, vocab=37, cls=CustomLoss)
    model = build(cfg, fused=False, tied=False, vocab=37)
    model.output_layer.bias = torch.nn.Parameter(torch.zeros(37))
    with pytest.raises(ValueError, match="the output layer has a bias"):
        fused_loss.install(model)
    model.output_layer.skip_bias_add = True  # Megatron returns the bias apart: not in the loss
    fused_loss.install(model)


def worker(rank: int, world: int, port: int, device: str = "cpu") -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tol = 2e-5 if device == "cpu" else 2e-2
    _init(rank, world, port, world, device)
    tp = world
    vocab = 37 if tp == 1 else 38  # odd rows per rank either way
    sps = (False,) if tp == 1 else (False, True)
    for sp in sps:
        cfg = make_config(tp, sp, dtype)
        for k, (tied, masked, objective, chunk) in enumerate(
            [
                (False, False, "megatron", None),
                (True, True, "megatron", None),
                (False, True, "weighted", 3),
                (True, True, "weighted", 1),
            ]
        ):
            tag = f"[TP={tp} SP={sp} tied={tied} mask={masked} {objective} chunk={chunk}]"
            ref, fus = pair(cfg, tied=tied, vocab=vocab, device=device, chunk=chunk)
            b = batch(vocab, device, seed=k, masked=masked)
            compare(tag, ref, fus, b, tol=tol, objective=objective, seed=k)
        for tied in (False, True):
            tag = f"[TP={tp} SP={sp} tied={tied} main_grad]"
            check_main_grad(tag, cfg, vocab, device, tol, tied=tied, ddp_mark=tied)
        tag = f"[TP={tp} SP={sp} main_grad, DDP's mark, no fusion]"
        check_main_grad(tag, cfg, vocab, device, tol, tied=False, ddp_mark=True, fusion=False)
        check_label_smoothing(f"[TP={tp} SP={sp}]", cfg, vocab, device, tol)
    if tp == 1:
        dispatchers = ["allgather", "ring"] + (["alltoall"] if device != "cpu" else [])
        for moe in dispatchers:
            cfg = make_config(1, False, dtype, moe=moe)
            ref, fus = pair(cfg, tied=False, vocab=vocab, device=device)
            b = batch(vocab, device, seed=7, masked=True)
            compare(f"[MoE {moe}]", ref, fus, b, tol=tol)
        check_paths(make_config(1, False, dtype), vocab, device, 1e-6 if device == "cpu" else tol)
        check_args_wiring(make_config(1, False, dtype), vocab, device)
        if device == "cpu":
            check_refusals(device)
    else:
        # gathered logits at TP > 1: Megatron's path (its loss is not vocab-parallel then)
        cfg = make_config(tp, False, dtype)
        ref, fus = pair(cfg, tied=False, vocab=vocab, device=device)
        tokens, pos, causal, labels, mask = batch(vocab, device, seed=8, masked=True)
        CALLS[0] = 0
        with torch.no_grad():
            fus(tokens, pos, causal, labels=labels, runtime_gather_output=True)
        assert CALLS[0] == 0, "the fused loss ran on gathered logits at TP > 1"
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_gpt_model_with_and_without_the_flag(world):
    port = free_port()
    hung, codes = run_spawned(worker, lambda r: (r, world, port), world, timeout=240)
    assert not hung and all(c == 0 for c in codes), f"hung ranks {hung}, exit codes {codes}"


# ------------------------------------------------------------------------------ in process
@pytest.fixture(scope="module")
def rm():
    import relaymoe.megatron as rm

    rm.register()
    return rm


def test_register_patches_gpt_model_once(rm):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from relaymoe.megatron.patches import patched_everything

    before = (GPTModel.__init__, GPTModel._postprocess)
    rm.register()
    from relaymoe.megatron import patches

    patches.patch_gpt_model()  # even called directly: no second wrapper
    assert (GPTModel.__init__, GPTModel._postprocess) == before
    assert patched_everything()
    assert not getattr(GPTModel._postprocess.__relaymoe_original__, "__relaymoe_patched__", False)


def test_flags_parse_and_settings_precedence(rm, monkeypatch):
    from megatron.training import arguments

    from relaymoe.megatron import settings

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ns = parser.parse_args(["--relaymoe-fused-loss", "--relaymoe-loss-chunk-tokens", "96"])
    assert (ns.relaymoe_fused_loss, ns.relaymoe_loss_chunk_tokens) == (True, 96)
    assert parser.parse_args([]).relaymoe_fused_loss is False
    for bad in ("0", "-3", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--relaymoe-loss-chunk-tokens", bad])

    assert settings.fused_loss_from_args(ns) == settings.FusedLoss(True, 96)

    class Config:  # a TransformerConfig stand-in: what configure() attaches to
        pass

    cfg = Config()
    assert settings.fused_loss_of(cfg) == settings.FusedLoss()  # no arguments parsed: default
    # whole objects: the caller's attached one beats the parsed arguments, which beat the default
    monkeypatch.setattr(settings, "_megatron_args", lambda: ns)
    assert settings.fused_loss_of(cfg) == settings.FusedLoss(True, 96)
    assert settings.ring_config_of(cfg).mode == "auto"
    rm.configure(cfg, fused_loss=settings.FusedLoss(True, 64))
    assert settings.fused_loss_of(cfg) == settings.FusedLoss(True, 64)
    assert settings.fused_loss_of(Config()) == settings.FusedLoss(True, 96)  # another config's
    with pytest.raises(ValueError, match="loss_chunk_tokens=0 must be a positive int"):
        settings.FusedLoss(chunk_tokens=0)
    with pytest.raises(ValueError, match=r"configure\(fused_loss=True\): pass"):
        rm.configure(cfg, fused_loss=True)


def test_refused_on_megatron_args(rm):
    from megatron.training import arguments

    from relaymoe.megatron.validate import check_fused_loss_args, fused_loss_problems

    ns = types.SimpleNamespace(relaymoe_fused_loss=True, mtp_num_layers=None, use_mup=False)
    check_fused_loss_args(ns)
    ns.mtp_num_layers, ns.use_mup, ns.fp8_output_proj = 2, True, True
    with pytest.raises(ValueError) as info:
        check_fused_loss_args(ns)
    text = str(info.value)
    assert text.startswith("--relaymoe-fused-loss cannot run these arguments")
    for message in ("mtp_num_layers=2", "remove --use-mup", "remove --fp8-output-proj"):
        assert message in text, text
    assert len(fused_loss_problems(ns)) == 3
    ns.relaymoe_fused_loss = False
    check_fused_loss_args(ns)  # the flag is off: nothing to refuse
    # the patched validate_args refuses before Megatron's own checks run
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["--relaymoe-fused-loss", "--mtp-num-layers", "1"])
    with pytest.raises(ValueError, match="remove --mtp-num-layers"):
        arguments.validate_args(args)


def test_grad_guess_is_exact_while_the_token_count_holds():
    """The fused loss's guess of Megatron's upstream gradient: the last g itself while the
    counted tokens do not change (exact, so the eager forward's speculative dW equals a captured
    step's recomputed one bitwise), rescaled by n_last / n when they do, g for a per-token loss;
    a non-finite or zero observation keeps the last guess."""
    from relaymoe.megatron.fused_loss import GradGuess

    guess = GradGuess()
    n = torch.tensor(3)
    g = torch.tensor(0.1234567)  # (g * 3) / 3 != g in fp32: a rescaled guess would miss
    assert not torch.equal(g * 3 / 3, g)
    valid = torch.ones(3, dtype=torch.bool)
    assert guess.expected(n, False) is None
    guess.observe(valid, n, False)(torch.full((3,), g.item()))
    assert torch.equal(guess.expected(n, False), g)
    assert torch.equal(guess.expected(n, True), g)
    m = torch.tensor(3000)
    assert torch.allclose(guess.expected(m, False), g * 3 / 3000, rtol=1e-6)
    guess.observe(valid, n, False)(torch.full((3,), float("nan")))
    assert torch.equal(guess.expected(n, False), g)
