"""Per-GPU memory model of a Megatron GPT-MoE training step (closed forms, no torch).

Units are bytes. ``e`` is the activation/param element size (2 for bf16/fp16, 4 for fp32).
Token counts per GPU (the shape legend of docs/ARCHITECTURE.md):

* ``T_a = b*s/cp``   tokens a CP rank attends for (heads split over TP: ``/tp`` per tensor)
* ``T = T_a/tp``     tokens of the sequence-parallel residual stream (``T_a`` without SP); this
                     is also the MoE input per GPU (ETP=1, MoE parallel folding; paper §2.2)
* ``P = T*K``        token-expert pairs per GPU

Terms (each a function so that tests can check it against hand-computed values):

* model states: bf16 params + fp32 main grads + (distributed) Adam fp32 master/m/v
  (``6 + 12/shard`` bytes per param; dense params shard over dp*cp, experts over expert-dp)
* retained activations per layer and microbatch, for a recomputed layer (its input only) and a
  kept one (attention block: norms, projections, flash-attention q/k/v/out/lse; MoE block:
  router, and for alltoall the dispatched tokens and the expert intermediates (fc1 output and
  the probability-weighted activation; megatron-core applies the probabilities inside the
  expert, so its output is not kept); for the ring only the routing index: it recomputes per
  hop). Norms: ``training.normalization_impl`` "fused" (TE/apex: the bf16 input + an fp32
  rstd per row, counted in the terms above), "torch" (megatron-core without TE and apex,
  ``torch.nn.RMSNorm`` as torch's fused kernel: the same bytes) or "torch_composite" (that
  fallback on a torch without the kernel: the composite keeps an fp32 copy of its input and
  the fp32 normalised tensor, ``TORCH_RMSNORM_EXTRA_BYTES`` more per element; see
  ``norm_extra_bytes``).
* the MoE-block working set (peak over its inputs while one layer runs fwd+bwd), from
  ``relaymoe.cost``: Megatron's alltoall dispatcher (``mcore_alltoall_memory_bytes``:
  coexisting top-k-expanded (P, H) buffers fit to megatron-core, (P, I) intermediates, the
  local weight gradient) or the relaymoe mode the runtime runs (``memory_bytes``: the engine's
  memory bound, accumulators in the activations' dtype), plus the router and, for relaymoe,
  the resident output and dx accumulators. The copy-engine transport's symmetric workspace is
  persistent and shared by all layers: one term per GPU (``symmetric_workspace_bytes``).
* the last pipeline stage's final norm and its loss: Megatron's logits and fp32 cross-entropy
  buffers, or with ``relaymoe.fused_loss`` (``--relaymoe-fused-loss``) the chunked output
  layer + cross-entropy, whose bytes come from ``relaymoe.lossmodel`` (the op's own model).
"""

from __future__ import annotations

from dataclasses import dataclass

from relaymoe import cost, lossmodel, options
from relaymoe.activation import fc1_rows
from relaymoe.config import Config

ROUTER_BYTES_PER_TOKEN_EXPERT = 10  # bf16 logits + fp32 softmax scores + fp32 aux-loss scores
# Megatron's routers hand fp32 probabilities to the dispatcher (softmax/sigmoid in fp32).
PROB_BYTES = 4
# Megatron's vocab-parallel cross entropy works in place on one fp32 copy of the logits (max
# subtraction, exp, normalisation, then the gradient), so per logit element: forward, the bf16
# logits + that fp32 copy; backward, the fp32 copy (now the gradient) + its bf16 cast.
# Measured peaks of training steps agree: 6 bytes, not 10.
LOGIT_BYTES_PER_ELEMENT = 2 + 4
# torch.nn.RMSNorm (megatron-core's WrappedTorchNorm without TE/apex) where torch has no fused
# kernel for it (CPU tensors, older builds) runs as a composite in fp32: autograd saves the fp32
# upcast of the input (pow, mul) and the fp32 normalised tensor (the weight multiply), 8 bytes
# per element beyond the bf16 input (saved-tensor hooks on CPU). On CUDA, torch runs it as
# ``aten::_fused_rms_norm``, which saves the bf16 input, the weight and an fp32 rstd per row
# (FusedRmsNormBackward0, saved-tensor hooks): nothing extra. torch.nn.LayerNorm is one native
# kernel (input, mean, rstd): no extra.
TORCH_RMSNORM_EXTRA_BYTES = 8
# The fused loss's impl in a Megatron run: linear_cross_entropy(impl="auto") on a CUDA device
# runs the Triton row kernels (relaymoe.loss.inputs.resolve_impl)
FUSED_LOSS_IMPL = "triton"


@dataclass(frozen=True)
class Shapes:
    """Per-GPU sizes derived from a config and (seq, micro-batch)."""

    b: int
    s: int
    h: int
    tp: int
    cp: int
    T_a: int  # tokens per CP rank (attention; heads are split over TP)
    T: int  # tokens of the SP residual stream = MoE input tokens per GPU
    K: int
    E: int
    El: int  # local experts
    I: int
    R: int  # ranks in the EP group (ring length)
    e: int  # element bytes
    gated: bool = True  # the expert MLP is gated (model.swiglu): fc1 has 2I rows, else I
    bias: bool = False  # the experts' fc1/fc2 carry biases (not model.disable_bias_linear)
    # Megatron's gradient-accumulation fusion (training.gradient_accumulation_fusion): the
    # ring's experts add their weight gradients into DDP's main_grad (moe_peak_ring)
    wgrad_fusion: bool = False
    # the ring hops' slice budget, MiB (relaymoe.hop_slice_mib: KernelOptions.hop_slice_mib)
    slice_mib: int = options.HOP_SLICE_MIB

    @property
    def P(self) -> int:
        return self.T * self.K

    @property
    def J(self) -> int:
        """Rows of one local expert's fc1 weight: 2I gated, I not."""
        return fc1_rows(self.I, gated=self.gated)

    def dims(self) -> cost.Dims:
        """The cost model's sizes of one GPU (every rank of the EP group holds ``T`` tokens;
        the weight-gradient accumulators as ``--relaymoe-grad-accum auto`` makes them)."""
        gb = cost.grad_accum_bytes(options.AUTO, self.R, self.e)
        return cost.Dims(
            T=self.T, H=self.h, I=self.I, El=self.El, K=self.K, R=self.R, b=self.e, pb=PROB_BYTES,
            gb=gb, gated=self.gated, b13=self.bias, b2=self.bias, slice_mib=self.slice_mib,
        )  # fmt: skip


def shapes(cfg: Config, seq: int | None = None, mbs: int | None = None) -> Shapes:
    m, p, t = cfg.model, cfg.parallel, cfg.training
    s = seq or t.seq_length
    b = mbs or t.micro_batch_size
    T_a = b * s // p.cp
    T = T_a // p.tp if (p.sequence_parallel and p.tp > 1) else T_a
    return Shapes(
        b=b,
        s=s,
        h=m.hidden_size,
        tp=p.tp,
        cp=p.cp,
        T_a=T_a,
        T=T,
        K=m.moe_router_topk,
        E=m.num_experts,
        El=m.num_experts // p.ep,
        I=m.moe_ffn_hidden_size // p.etp,
        R=p.ep,
        e=t.bytes_per_param,
        gated=m.swiglu,
        bias=not m.disable_bias_linear,
        wgrad_fusion=t.gradient_accumulation_fusion,
        slice_mib=cfg.relaymoe.hop_slice_mib,
    )


# -- parameters and model states ---------------------------------------------------------------


@dataclass(frozen=True)
class StageParams:
    dense: int  # non-expert params held by one GPU of this stage (TP-sharded)
    expert: int  # expert params held by one GPU (EP/ETP-sharded)


def attention_params(cfg: Config, layer: int) -> int:
    """Parameters of one attention block (full rank, before TP), norms included."""
    m = cfg.model
    h, d = m.hidden_size, m.head_dim
    if m.attention_layer_pattern[layer]:
        q = m.num_attention_heads * d * (2 if m.attention_output_gate else 1)
        kv = 2 * m.query_groups * d
        n = h * (q + kv) + m.num_attention_heads * d * h
        if m.add_qkv_bias:
            n += q + kv
        if m.qk_layernorm:
            n += 2 * d
    else:  # gated delta net: q,k (nk*dk), v and gate z (nv*dv), beta and alpha (nv), conv, out
        qk = 2 * m.linear_num_key_heads * m.linear_key_head_dim
        v = m.linear_num_value_heads * m.linear_value_head_dim
        n = h * (qk + 2 * v + 2 * m.linear_num_value_heads)
        n += (qk + v) * m.linear_conv_kernel_dim + 2 * m.linear_num_value_heads
        n += m.linear_value_head_dim + v * h
    return n + h  # input layernorm


def moe_params(cfg: Config, layer: int) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters of one MLP block (full size, before sharding).
    A routed expert: fc1 (J, h) with J = 2*ffn gated (``model.swiglu``) or ffn, fc2 (h, ffn),
    and their biases (J + h) unless ``model.disable_bias_linear``. The dense MLP and the shared
    experts are counted as SwiGLU without biases."""
    m = cfg.model
    h = m.hidden_size
    if not m.moe_layer_pattern[layer]:
        return h + h * m.ffn_hidden_size * 3, 0
    dense = h + m.num_experts * h  # pre-MLP norm, router
    if m.moe_shared_expert_intermediate_size:
        dense += 3 * h * m.moe_shared_expert_intermediate_size
        dense += h if m.moe_shared_expert_gate else 0
    ffn = m.moe_ffn_hidden_size
    rows = 2 * ffn if m.swiglu else ffn  # fc1 of a gated (SwiGLU) expert: 2*ffn rows
    biases = 0 if m.disable_bias_linear else rows + h
    return dense, m.num_experts * ((rows + ffn) * h + biases)


def total_params(cfg: Config) -> int:
    m = cfg.model
    n = m.vocab_size * m.hidden_size * (2 if m.untie_embeddings_and_output_weights else 1)
    n += m.hidden_size  # final norm
    for i in range(m.num_layers):
        d, x = moe_params(cfg, i)
        n += attention_params(cfg, i) + d + x
    return n


def stage_layers(cfg: Config, stage: int) -> list[int]:
    """Layer indices held by pipeline rank ``stage`` (interleaved virtual stages with vpp)."""
    p, L = cfg.parallel, cfg.model.num_layers
    v = p.vpp or 1
    per = L // (p.pp * v)
    out = []
    for chunk in range(v):
        start = (chunk * p.pp + stage) * per
        out += list(range(start, start + per))
    return out


def stage_params(cfg: Config, stage: int) -> StageParams:
    m, p = cfg.model, cfg.parallel
    dense = expert = 0
    for i in stage_layers(cfg, stage):
        d, x = moe_params(cfg, i)
        dense += attention_params(cfg, i) + d
        expert += x
    vocab = m.padded_vocab_size(p.tp) * m.hidden_size
    if stage == 0:
        dense += vocab
    if stage == p.pp - 1:
        dense += m.hidden_size
        if m.untie_embeddings_and_output_weights or p.pp > 1:
            dense += vocab
    return StageParams(dense=dense // p.tp, expert=expert // (p.ep * p.etp))


def model_state_bytes(cfg: Config, stage: int) -> dict[str, int]:
    """Params (bf16), fp32 main grads, and Adam fp32 master + m + v, per GPU."""
    p, t = cfg.parallel, cfg.training
    sp = stage_params(cfg, stage)
    n = sp.dense + sp.expert
    e = t.bytes_per_param
    grads = 4 * n  # Megatron DDP keeps fp32 main grads (grad buffer)
    if p.use_distributed_optimizer:
        opt = 12 * sp.dense // (p.dp * p.cp) + 12 * sp.expert // p.expert_dp
    else:
        opt = 12 * n
    if e == 4:  # fp32 training: the params are the master copy
        opt -= 4 * n // (p.dp * p.cp if p.use_distributed_optimizer else 1)
    return {"params": e * n, "grads": grads, "optimizer": max(opt, 0)}


# -- activations ------------------------------------------------------------------------------


def layer_input_bytes(sh: Shapes) -> int:
    """What a fully recomputed layer keeps: its (SP-sharded) input."""
    return sh.e * sh.T * sh.h


def norm_extra_per_element(cfg: Config) -> int:
    """Bytes per normalised element kept beyond the fused norm's (0 unless torch RMSNorm)."""
    t, m = cfg.training, cfg.model
    if t.normalization_impl == "torch_composite" and m.normalization == "RMSNorm":
        return TORCH_RMSNORM_EXTRA_BYTES
    return 0


def norm_extra_bytes(cfg: Config, sh: Shapes, part: str, layer: int = 0) -> int:
    """Extra bytes the norms of ``part`` keep with ``normalization_impl: torch_composite`` (0
    otherwise): "attention" (input norm, T*h, and the q/k norms, T_a*(heads+groups)*d/tp,
    full-attention layers with qk_layernorm), "mlp" (pre-MLP norm, T*h) or "final" (the last
    stage's final norm, T*h). The gated delta net's internal gated norm is not counted."""
    x = norm_extra_per_element(cfg)
    if not x:
        return 0
    m = cfg.model
    if part == "attention":
        n = sh.T * sh.h
        if m.attention_layer_pattern[layer] and m.qk_layernorm:
            n += sh.T_a * (m.num_attention_heads + m.query_groups) // sh.tp * m.head_dim
        return x * n
    if part in ("mlp", "final"):
        return x * sh.T * sh.h
    raise ValueError(f"norm part {part!r}; known: 'attention', 'mlp', 'final'")


def attention_keep_bytes(cfg: Config, sh: Shapes, layer: int) -> int:
    """Activations one attention block keeps for backward (flash attention, no dropout)."""
    m = cfg.model
    e, Ta, tp = sh.e, sh.T_a, sh.tp
    norm_and_proj_in = 2 * e * sh.T * sh.h  # input-norm input, QKV-projection input (SP-sharded)
    norm_and_proj_in += norm_extra_bytes(cfg, sh, "attention", layer)
    if m.attention_layer_pattern[layer]:
        d, nh, ng = m.head_dim, m.num_attention_heads // tp, m.query_groups // tp
        qkv = e * Ta * (nh + 2 * ng) * d
        out = e * Ta * nh * d  # flash output = out-projection input
        lse = 4 * Ta * nh
        qknorm = e * Ta * (nh + ng) * d if m.qk_layernorm else 0
        gate = 2 * e * Ta * nh * d if m.attention_output_gate else 0
        return norm_and_proj_in + qkv + out + lse + qknorm + gate
    # Gated delta net (approximate: projections, conv outputs, core output, gated norm)
    qk = 2 * (m.linear_num_key_heads // tp) * m.linear_key_head_dim
    v = (m.linear_num_value_heads // tp) * m.linear_value_head_dim
    proj = e * Ta * (qk + 2 * v + 2 * (m.linear_num_value_heads // tp))
    conv = e * Ta * (qk + v)
    core = 3 * e * Ta * v  # core output, norm input, gated output (out-projection input)
    return norm_and_proj_in + proj + conv + core


def moe_keep_bytes(
    cfg: Config, sh: Shapes, layer: int, dispatcher: str, ring_mode: str = "expert"
) -> int:
    """Activations one MLP block keeps for backward when its layer is not recomputed."""
    inner = mlp_inner_keep_bytes(cfg, sh, layer, dispatcher, ring_mode)
    return mlp_norm_keep_bytes(cfg, sh) + inner


def mlp_norm_keep_bytes(cfg: Config, sh: Shapes) -> int:
    """The pre-MLP norm's input and output (the router/dispatcher input), torch extra incl."""
    return 2 * sh.e * sh.T * sh.h + norm_extra_bytes(cfg, sh, "mlp")


def mlp_inner_keep_bytes(
    cfg: Config, sh: Shapes, layer: int, dispatcher: str, ring_mode: str = "expert"
) -> int:
    """What the MLP block keeps after its norm: the part ``moe_peak_*`` also counts (the peak
    is over the block's inputs, i.e. over the norm's output). ``ring_mode``: the relaymoe mode
    (what it saves for backward differs: the own tokens' routing index for the ring modes,
    the received rows' index for alltoall)."""
    m = cfg.model
    if not m.moe_layer_pattern[layer]:
        f = m.ffn_hidden_size // sh.tp
        return sh.e * sh.T_a * 3 * f
    router = ROUTER_BYTES_PER_TOKEN_EXPERT * sh.T * sh.E
    shared = 0
    if m.moe_shared_expert_intermediate_size:
        shared = sh.e * sh.T_a * 3 * m.moe_shared_expert_intermediate_size // sh.tp
    if dispatcher == "ring":
        # the mode's saved routing index + the probabilities; h is recomputed
        moe = cost.memory_bytes(ring_mode, sh.dims()).saved + PROB_BYTES * sh.P
    else:
        # dispatched tokens (fc1 input), fc1 output (P, J), fc2 input (P, I). megatron-core
        # 0.19 applies the routing probabilities to the activation inside the expert MLP (fused
        # weighted SwiGLU, --bias-swiglu-fusion, the default), so the expert output is not kept
        # and the combine keeps only indices.
        moe = sh.e * sh.P * (sh.h + sh.J + sh.I)
    return router + shared + moe


def attention_backward_transient_bytes(cfg: Config, sh: Shapes, layer: int) -> int:
    """What a kept attention block allocates in its backward beyond its saved tensors: the
    q/k/v gradients and flash attention's fp32 dq accumulator (full attention); the gated
    delta net: the gradients of its projections (same size as the projections)."""
    m, e, Ta, tp = cfg.model, sh.e, sh.T_a, sh.tp
    if m.attention_layer_pattern[layer]:
        d, nh, ng = m.head_dim, m.num_attention_heads // tp, m.query_groups // tp
        return e * Ta * (nh + 2 * ng) * d + 4 * Ta * nh * d
    qk = 2 * (m.linear_num_key_heads // tp) * m.linear_key_head_dim
    v = (m.linear_num_value_heads // tp) * m.linear_value_head_dim
    return e * Ta * (qk + 2 * v + 2 * (m.linear_num_value_heads // tp))


def attention_flops(cfg: Config, sh: Shapes, layer: int) -> float:
    """Forward FLOPs of one attention block per GPU (what keeping it saves in backward)."""
    m = cfg.model
    Ta, tp, h = sh.T_a, sh.tp, sh.h
    if m.attention_layer_pattern[layer]:
        d, nh, ng = m.head_dim, m.num_attention_heads, m.query_groups
        q = nh * d * (2 if m.attention_output_gate else 1)
        proj = 2 * Ta * h * (q + 2 * ng * d) / tp + 2 * Ta * nh * d * h / tp
        core = 2 * 2 * Ta * sh.s * nh * d / tp * 0.5  # QK^T and PV, causal half
        return proj + core
    qk = 2 * m.linear_num_key_heads * m.linear_key_head_dim
    v = m.linear_num_value_heads * m.linear_value_head_dim
    proj = 2 * Ta * h * (qk + 2 * v) / tp + 2 * Ta * v * h / tp
    chunk = 64  # chunked delta rule: intra-chunk attention + state updates
    core = 2 * Ta * (m.linear_num_value_heads / tp) * m.linear_key_head_dim * (2 * chunk + 4 * 128)
    return proj + core


# -- MoE block working set ----------------------------------------------------------------------


def moe_peak_alltoall(sh: Shapes) -> int:
    """Peak over the MoE block's inputs, one layer fwd+bwd, Megatron alltoall dispatcher."""
    router = ROUTER_BYTES_PER_TOKEN_EXPERT * sh.T * sh.E
    return cost.mcore_alltoall_memory_bytes(sh.dims()) + router


def moe_peak_ring(sh: Shapes, mode: str, transport: str = "copy_engine") -> int:
    """Peak over the MoE block's inputs, one layer fwd+bwd, relaymoe in ``mode``: the router,
    the resident output and dx accumulators (activations' dtype) and the mode's saved and
    transient bytes (the copy-engine workspace is ``symmetric_workspace_bytes``).

    With gradient-accumulation fusion (``sh.wgrad_fusion``) Megatron's dispatcher hands the
    ring its experts' ``main_grad`` (``relaymoe/megatron/main_grad.py``), which DDP's buffer
    holds back to back per projection: the weight-gradient kernel adds into it (a world of one,
    token and alltoall modes) and no ``(El, J, H) + (El, H, I)`` gradient buffer exists; expert
    mode over a ring still brings its gradient home first (``cost.memory_bytes(main_grads=)``).
    Autograd then gets one expert's dummy gradient per projection, TransformerEngine's shared
    buffer (``1/El`` of that buffer, once per GPU and shared with TE's own layers): not
    counted."""
    router = ROUTER_BYTES_PER_TOKEN_EXPERT * sh.T * sh.E
    resident = 2 * sh.T * sh.h * sh.e
    mem = cost.memory_bytes(mode, sh.dims(), transport=transport, main_grads=sh.wgrad_fusion)
    return router + resident + mem.peak


def symmetric_workspace_bytes(sh: Shapes, mode: str, transport: str) -> int:
    """The copy-engine workspace of ``mode`` on one GPU (0 with another transport)."""
    if transport != "copy_engine":
        return 0
    return cost.memory_bytes(mode, sh.dims(), transport=transport).workspace


def captured_hop_bytes(sh: Shapes, mode: str) -> int:
    """The static buffers of the recorded hop bodies (``--relaymoe-capture-hops``) on one GPU:
    shared by all layers, once per GPU (``cost.captured_hop_bytes``: the tokens, probabilities
    and routing arrays a hop copies; not the weights or their gradients, bound by address, nor
    the graphs' pool)."""
    return cost.captured_hop_bytes(mode, sh.dims())


def vocab_local(cfg: Config, sh: Shapes) -> int:
    """Output-layer rows on one GPU: the padded vocabulary split over TP (vocab parallel)."""
    return cfg.model.padded_vocab_size(sh.tp) // sh.tp


def logits_bytes(cfg: Config, sh: Shapes) -> int:
    """Last stage: logits and the vocab-parallel cross-entropy's fp32 buffers. The output
    layer all-gathers the sequence-parallel stream first, so it sees ``T_a`` tokens."""
    return LOGIT_BYTES_PER_ELEMENT * sh.T_a * vocab_local(cfg, sh)


def fused_loss_bytes(cfg: Config, sh: Shapes) -> int:
    """Last stage with the fused loss: ``relaymoe.linear_cross_entropy``'s peak over its input
    (one chunk's working set + the hidden gradient it keeps), at the ``T_a`` tokens the output
    layer sees after the sequence-parallel gather. Under Megatron's DDP the loss adds its
    weight gradient straight into the fp32 ``main_grad`` (its accumulate mode,
    ``relaymoe/megatron/fused_loss.py``), so no ``(V/TP, h)`` buffer of its own is counted; its
    chunk is the op's default for that mode and ``FUSED_LOSS_IMPL``."""
    fl = lossmodel.fused_loss_bytes(sh.T_a, sh.h, vocab_local(cfg, sh), act_bytes=sh.e,
                                    wgrad="accumulate", impl=FUSED_LOSS_IMPL)  # fmt: skip
    return fl.peak


def output_gather_bytes(sh: Shapes) -> int:
    """The output layer's input all-gathered over sequence parallelism, ``(T_a, h)`` (0 without
    SP at tp > 1). The fused loss reads it in every chunk, so it lives through the loss's whole
    forward; Megatron's output layer frees it after the logits GEMM, before the fp32 copy, so
    there it never adds to the loss's peak (``e*h`` is far below ``4*V/tp`` per token)."""
    return sh.e * sh.T_a * sh.h if sh.T != sh.T_a else 0


def loss_bytes(cfg: Config, sh: Shapes, fused: bool) -> int:
    """Last stage: the loss's peak beyond the final norm (Megatron's, or the fused one with its
    gathered input)."""
    if fused:
        return fused_loss_bytes(cfg, sh) + output_gather_bytes(sh)
    return logits_bytes(cfg, sh)


def final_norm_bytes(cfg: Config, sh: Shapes) -> int:
    """Last stage: the final norm's input and output (the output layer's input), kept from the
    forward until the output layer's backward (torch norm extra included)."""
    return 2 * sh.e * sh.T * sh.h + norm_extra_bytes(cfg, sh, "final")


def inflight_microbatches(cfg: Config, stage: int) -> float:
    """Microbatches whose activations a pipeline stage holds at its peak (1F1B; interleaved
    schedules add (pp-1)/(pp*vpp) on the first stage, as Megatron's own estimate)."""
    p, t = cfg.parallel, cfg.training
    gbs = t.global_batch_size or t.micro_batch_size * p.dp
    n_mb = max(1, gbs // (t.micro_batch_size * p.dp))
    if p.pp == 1:
        return 1
    inflight = min(p.pp - stage, n_mb)
    if p.vpp and p.vpp > 1 and stage == 0:
        inflight = min(n_mb, p.pp) * (1 + (p.pp - 1) / (p.pp * p.vpp))
    return inflight


# -- megatron-core's selective recompute ----------------------------------------------------------

TE_IMPL = "transformer_engine"  # Megatron's --transformer-impl default
LOCAL_IMPL = "local"
TRANSFORMER_IMPLS = (TE_IMPL, LOCAL_IMPL)


def selective_layer_bytes(
    cfg: Config,
    sh: Shapes,
    layer: int,
    dispatcher: str,
    ring_mode: str,
    moe_peak: int,
    modules: frozenset[str],
    transformer_impl: str = TE_IMPL,
) -> tuple[int, int]:
    """``(r, x)`` of one layer under megatron-core's selective recompute of ``modules``
    (``--recompute-granularity selective --recompute-modules ...``): what the layer retains
    through the forward, and what its backward adds on top (``recompute.stage_peak``'s terms).

    From megatron-core 0.19's layer: ``core_attn`` checkpoints the core attention, whose inputs
    (q, k, v) stay saved and whose output stays saved by the output projection: only the
    softmax statistics (``lse``) go, and come back in the backward with the output.
    ``layernorm`` discards the outputs of ``input_layernorm`` and ``pre_mlp_layernorm`` and
    recomputes them; under TransformerEngine the input norm is fused into the QKV projection
    (``input_layernorm`` is an identity there), so only the pre-MLP norm's output goes.
    ``moe`` checkpoints the whole MoE layer: it keeps only its input (the pre-MLP norm's
    output, itself discarded with ``layernorm``), and its backward rematerialises the block's
    whole working set (``moe_peak``), as a fully recomputed layer's. ``moe_act`` discards the
    expert activation's output (fc2's input, ``(P, I)``), which ``moe`` makes moot."""
    bad = sorted(set(modules) - {"core_attn", "layernorm", "moe", "moe_act"})
    if bad:
        raise ValueError(
            f"recompute modules {bad}: the planner models core_attn, layernorm, moe and moe_act "
            "(megatron-core's memory set for this model); drop the others"
        )
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl={transformer_impl!r}; known: {TRANSFORMER_IMPLS}")
    m, e = cfg.model, sh.e
    full_attn = m.attention_layer_pattern[layer]
    lse = 4 * sh.T_a * (m.num_attention_heads // sh.tp) if full_attn else 0
    row = e * sh.T * sh.h  # one (T, h) activation
    attn = attention_keep_bytes(cfg, sh, layer)
    attn_x = attention_backward_transient_bytes(cfg, sh, layer)
    if "core_attn" in modules and full_attn:
        attn -= lse
        attn_x += lse + e * sh.T_a * (m.num_attention_heads // sh.tp) * m.head_dim
    if "layernorm" in modules and transformer_impl == LOCAL_IMPL:
        attn -= row + norm_extra_per_element(cfg) * sh.T * sh.h
        attn_x += row
    inner = mlp_inner_keep_bytes(cfg, sh, layer, dispatcher, ring_mode)
    moe_layer = m.moe_layer_pattern[layer]
    norm_out = 0 if "layernorm" in modules else row + norm_extra_bytes(cfg, sh, "mlp")
    if "moe" in modules and moe_layer:
        mlp = row + norm_out  # the norm's input, and its output as the checkpoint's input
        mlp_x = max(moe_peak, inner) + (row if "layernorm" in modules else 0)
    else:
        kept_inner = inner
        if "moe_act" in modules and moe_layer and dispatcher != "ring":
            kept_inner -= e * sh.P * sh.I  # recomputed in the backward, within the MoE peak
        mlp = row + norm_out + kept_inner
        peak = max(moe_peak, inner) if moe_layer else inner
        mlp_x = peak - kept_inner + (row if "layernorm" in modules else 0)
    return attn + mlp, max(attn_x, mlp_x)
