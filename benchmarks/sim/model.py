"""Inputs of the EP-scaling simulator: the MoE layer, the machine, and the compute model.

Pure Python (no torch): the simulator runs anywhere, including CI. Every default below is a
one-off probe on the 2x H200 machine (a P2P / overlap / copy micro-benchmark run before the
benchmark suite existed, not a committed row) or a stated assumption;
``benchmarks.sim.calibrate`` replaces them with the numbers of committed benchmark rows.

Shape legend: ``T`` tokens per GPU, ``E`` experts, ``K`` top-k, ``H`` hidden, ``I`` expert FFN
width, ``R`` ranks in the EP group (the ring length), ``El = E / R`` local experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from relaymoe.cost import INTER_NODE_BYTES_PER_S, NVLINK_BYTES_PER_S, Dims, grad_accum_bytes
from relaymoe.options import AUTO

GB = 1e9

# The links (relaymoe.cost, where they are stated with their sources): NVLink 394 GB/s one
# way as measured on 2x H200; between nodes one 400 Gb/s NIC per GPU at 90% (an assumption).
# ``calibrate`` replaces the NVLink rate by what the ring's copy-engine hops reached in the
# measured rows (their transfers run beside the hop's compute).
DEFAULT_INTRA_GBPS = NVLINK_BYTES_PER_S / GB
DEFAULT_INTER_GBPS = INTER_NODE_BYTES_PER_S / GB
# Share of a transfer hidden under concurrent compute (the overlap probe): copy engine
# 604 MB under a 2.33 ms GEMM: 2.44 ms total -> 1 - 0.11/1.62 = 93% hidden; NCCL: 3.16 ms total
# -> 1 - 0.83/1.70 = 51% hidden. Inter-node P2P goes through NCCL (its kernels use SMs).
DEFAULT_HIDE_COPY_ENGINE = 0.93
DEFAULT_HIDE_NCCL = 0.51


def _positive(name: str, value: float, fix: str) -> None:
    if not value > 0:
        raise ValueError(f"{name}={value!r} must be > 0; {fix}")


@dataclass(frozen=True)
class MoEShape:
    """One SwiGLU MoE layer as seen by one GPU: ``T`` local tokens, ``E`` global experts."""

    name: str
    T: int
    E: int
    K: int
    H: int
    I: int
    dtype_bytes: int = 2  # bf16 activations and weights (and the travelling gradients)
    prob_bytes: int = 4  # fp32 router probabilities

    def __post_init__(self):
        for key in ("T", "E", "K", "H", "I", "dtype_bytes", "prob_bytes"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < (0 if key == "T" else 1):
                raise ValueError(
                    f"MoEShape.{key}={v!r} must be an integer >= {0 if key == 'T' else 1}"
                )
        if self.K > self.E:
            raise ValueError(f"MoEShape.K={self.K} exceeds E={self.E}: top-k must be <= E")

    @property
    def pairs(self) -> int:
        """Token-expert pairs of one GPU's tokens (``P = T*K``)."""
        return self.T * self.K

    def dims(self, ep: int) -> Dims:
        """The cost model's sizes of one of ``ep`` ranks (``relaymoe.cost``)."""
        if self.E % ep:
            raise ValueError(f"E={self.E} experts do not split over ep={ep}; pick ep dividing E")
        return Dims(
            T=self.T, H=self.H, I=self.I, El=self.E // ep, K=self.K, R=ep, b=self.dtype_bytes,
            pb=self.prob_bytes, gb=grad_accum_bytes(AUTO, ep, self.dtype_bytes),
        )  # fmt: skip

    @property
    def expert_weight_bytes(self) -> int:
        """One expert: w13 (2I, H) + w2 (H, I)."""
        return 3 * self.H * self.I * self.dtype_bytes

    def flops_fwd(self, pairs: float) -> float:
        """Up-projection (2*2I*H) + down-projection (2*H*I) per pair."""
        return 6.0 * pairs * self.H * self.I

    def flops_bwd(self, pairs: float, *, recompute: bool) -> float:
        """dgrad + wgrad of both GEMMs (12*H*I per pair), plus the up-projection when recomputed."""
        return (12.0 + (4.0 if recompute else 0.0)) * pairs * self.H * self.I

    def with_tokens(self, T: int) -> MoEShape:
        return replace(self, T=T, name=f"{self.name.split('_T')[0]}_T{T}")


@dataclass(frozen=True)
class Cluster:
    """``ep`` GPUs in one ring, ``gpus_per_node`` per node, ranks numbered node-major.

    A link ``src -> dst`` runs over NVLink inside a node and over ``src``'s NIC between nodes
    (one NIC per GPU, so the GPUs of a node send across at once without sharing one). The flat
    ring visits ranks in order, so its hop ``r -> r+1`` crosses a node boundary exactly when
    ``(r+1) % gpus_per_node == 0`` (plus the wrap-around ``R-1 -> 0`` when ``ep > gpus_per_node``).
    ``hide_intra`` is the share of a copy-engine transfer hidden under compute, ``hide_inter``
    that of an NCCL transfer (inside a node too, when the ring cannot use the copy engine).
    """

    ep: int
    gpus_per_node: int
    intra_GBps: float = DEFAULT_INTRA_GBPS
    inter_GBps: float = DEFAULT_INTER_GBPS
    intra_latency_us: float = 15.0  # per P2P launch + signal within a node
    inter_latency_us: float = 30.0  # per RDMA message across nodes
    hide_intra: float = DEFAULT_HIDE_COPY_ENGINE
    hide_inter: float = DEFAULT_HIDE_NCCL

    def __post_init__(self):
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"Cluster.ep={self.ep!r} must be an integer >= 1")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"Cluster.gpus_per_node={self.gpus_per_node!r} must be >= 1")
        if self.ep > self.gpus_per_node and self.ep % self.gpus_per_node:
            raise ValueError(
                f"Cluster.ep={self.ep} spans nodes but is not a multiple of "
                f"gpus_per_node={self.gpus_per_node}; use whole nodes"
            )
        _positive("Cluster.intra_GBps", self.intra_GBps, "pass a measured bandwidth")
        _positive("Cluster.inter_GBps", self.inter_GBps, "pass a measured bandwidth")
        for key in ("hide_intra", "hide_inter"):
            v = getattr(self, key)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"Cluster.{key}={v!r} must be a fraction in [0, 1]")

    @property
    def nodes(self) -> int:
        return max(1, self.ep // self.gpus_per_node)

    @property
    def spans_nodes(self) -> bool:
        return self.ep > self.gpus_per_node

    def is_inter(self, src: int, dst: int) -> bool:
        """Whether the link ``src -> dst`` leaves the node."""
        return src // self.gpus_per_node != dst // self.gpus_per_node

    def hop_is_inter(self, src: int) -> bool:
        """Whether the flat ring's link ``src -> src+1 (mod ep)`` leaves the node."""
        return self.is_inter(src, (src + 1) % self.ep)

    def transfer_seconds(self, src: int, dst: int, nbytes: float) -> float:
        """Transfer time of ``nbytes`` over the link ``src -> dst``."""
        if nbytes <= 0:
            return 0.0
        if self.is_inter(src, dst):
            return self.inter_latency_us * 1e-6 + nbytes / (self.inter_GBps * GB)
        return self.intra_latency_us * 1e-6 + nbytes / (self.intra_GBps * GB)

    def link_seconds(self, src: int, nbytes: float) -> float:
        """Transfer time of ``nbytes`` over the flat ring's link leaving ``src``."""
        return self.transfer_seconds(src, (src + 1) % self.ep, nbytes)

    def link_hide(self, src: int, dst: int, *, copy_engine: bool = True) -> float:
        """Hidden share of a transfer ``src -> dst``: the copy engine's inside a node when the
        ring uses it there, NCCL's otherwise."""
        inter = self.is_inter(src, dst)
        return self.hide_intra if copy_engine and not inter else self.hide_inter

    def hide(self, src: int) -> float:
        return self.link_hide(src, (src + 1) % self.ep)


@dataclass(frozen=True)
class ComputeModel:
    """Grouped-GEMM time of a batch of token-expert pairs on one GPU.

    ``time = hypot(host, flops / (peak * m / (m + m_half)))`` with ``m`` the pairs per expert:
    small per-expert GEMMs waste tile rows, so throughput rises with ``m`` and saturates at
    ``peak``. ``host`` (``launch_us``) is the host time to issue one hop's work (launches, index
    slices, Python): the GPU runs behind the host, and neither hides the other fully where they
    are of one size, which the root-sum-square says (``relaymoe.cost.TimeModel`` found the
    same on the measured steps; with ``max`` the T8k ring rows came out 15-21% short).
    ``peak_*`` come from the measured relaymoe expert rows (``calibrate``); the default is what
    a fused-kernel grouped GEMM reaches on an H200 at qwen3 T32k (about 500 TFLOP/s) corrected
    for ``m = 2048`` pairs per expert. They hold at the expert width ``width_ref``; wider experts
    (longer GEMM rows, fewer tiles per byte moved) run faster by ``(I / width_ref) ** width_exp``
    (fitted where rows of several widths were measured; 0: no width dependence).
    """

    peak_tflops_fwd: float = 520.0
    peak_tflops_bwd: float = 520.0
    m_half: float = 64.0
    width_ref: float = 768.0
    width_exp: float = 0.0
    launch_us: float = 40.0  # per hop: host time to issue it (see the docstring)
    hbm_GBps: float = 4300.0  # device copy bandwidth (probed): permutes, in-place adds
    # Megatron's SequentialMLP runs experts one by one: per-expert overhead (fit, see calibrate).
    seq_mlp_ms_per_expert: float = 0.0
    seq_mlp_tflops: float = 0.0  # 0: mcore experts use the same throughput as relaymoe

    def __post_init__(self):
        _positive("ComputeModel.peak_tflops_fwd", self.peak_tflops_fwd, "measure it")
        _positive("ComputeModel.peak_tflops_bwd", self.peak_tflops_bwd, "measure it")
        if self.m_half < 0:
            raise ValueError(f"ComputeModel.m_half={self.m_half!r} must be >= 0")

    def efficiency(self, pairs_per_expert: float) -> float:
        if pairs_per_expert <= 0:
            return 1.0
        return pairs_per_expert / (pairs_per_expert + self.m_half)

    def seconds(
        self, flops: float, pairs: float, experts: float, *, bwd: bool, width: float | None = None
    ) -> float:
        if pairs <= 0:
            return 0.0
        peak = (self.peak_tflops_bwd if bwd else self.peak_tflops_fwd) * 1e12
        if width and self.width_exp:
            peak *= (width / self.width_ref) ** self.width_exp
        eff = self.efficiency(pairs / max(experts, 1.0))
        return math.hypot(self.launch_us * 1e-6, flops / (peak * eff))

    def copy_seconds(self, nbytes: float) -> float:
        """Read + write ``nbytes`` once in HBM (permute, in-place gradient add)."""
        return 2.0 * nbytes / (self.hbm_GBps * GB)


@dataclass
class SimResult:
    """Simulated times (ms) of one MoE layer forward+backward on the slowest rank."""

    scheme: str
    shape: str
    ep: int
    gpus_per_node: int
    ms_fwd: float
    ms_bwd: float
    bytes_per_rank: float  # bytes one rank sends over the whole fwd+bwd
    peak_MiB: float  # MoE-block memory over inputs (see benchmarks.sim.memory)
    compute_ms: float  # pure compute on the slowest rank (no communication)
    extra: dict = field(default_factory=dict)

    @property
    def ms_fwd_bwd(self) -> float:
        return self.ms_fwd + self.ms_bwd
