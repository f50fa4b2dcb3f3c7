"""The longest sequence that trains, measured: a bisection over separate Megatron runs.

    python benchmarks/max_seq.py [--providers mcore_alltoall,relaymoe_ring,relaymoe_ring_fused_loss]
        [--config qwen3_slice_v152k] [--gpus 2] [--budget-s 14400] [--max-trial-s 1200]
        [--out benchmarks/results/max_seq.jsonl] [--dry-run]

Model: ``configs/qwen3_slice_v152k.yaml`` (4 layers of Qwen3-30B-A3B with its 151,936-token
vocabulary) at EP = data-parallel size = ``--gpus``, full recompute (uniform, 1 layer),
micro-batch 1, bf16, mock data. Providers: ``mcore_alltoall`` (megatron-core's alltoall
dispatcher), ``relaymoe_ring`` (``--moe-token-dispatcher-type ring``, ring mode auto),
``relaymoe_ring_fused_loss`` (the ring + ``--relaymoe-fused-loss``); ``mcore_alltoall_fused_loss``
on request.

Attention: without TransformerEngine megatron-core's local attention keeps (heads, s, s) scores
and would bind long before the MoE block or the loss. Each trial therefore passes
``--spec benchmarks.sdpa_attention sdpa_decoder_spec --no-create-attention-mask-in-dataloader``
(Megatron's own spec hook; ``benchmarks/sdpa_attention.py``): causal GQA flash attention through
SDPA, O(s) memory like TE's. A trial whose log lacks the spec's marker is an error, not data.
With TransformerEngine installed its attention is used as it is.

Allocator: every trial runs with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
(``--alloc-conf``; '' for the default), for all providers alike: the planner models no
fragmentation. ``--memory-cap GPU`` emulates a smaller GPU (e.g. ``h100-80gb``): each trial's
allocator is capped at the planner's usable bytes of that GPU (``benchmarks/capped_pretrain.py``,
whose marker the log must carry) and the planner plans for it; rows say ``memory_cap_gpu`` /
``memory_cap_bytes``. That is how a provider whose longest sequence on the whole GPU would take
longer than a trial can run (attention is O(s^2)) is still bisected.

Search, per provider: every trial is one ``torchrun -m relaymoe.megatron.pretrain`` job of
``--steps`` (2) training steps in its own process group and folder (logs kept there). A trial is
``ok`` (all steps, finite losses), ``oom`` (CUDA out-of-memory text in the log, whichever rank),
``timeout`` (no result within ``--max-trial-s``: an upper bound for the search, but not an OOM),
``budget`` (cut by ``--budget-s``) or ``error`` (anything else: the search stops and shows it).
The first trial is the planner's prediction rounded down to ``--step`` (4096); then the bracket
grows (after a success) or shrinks (after a failure) geometrically, by 1/8, 1/4, 1/2, 1, ...,
and is bisected to one step. ``--budget-s`` bounds the whole invocation; each provider gets the
time left divided by the providers left, and a trial is started only if its estimated time
fits. Trial time is estimated from FLOPs (attention is O(s^2)) and calibrated on each completed
trial's last step; each estimate is printed. Leftover worker processes are killed by pid after
every trial, and a trial does not start while another process holds GPU memory.

Rows ``bench: max_seq`` (one per provider, appended to ``--out`` as each provider finishes):
``provider``, ``shape``, ``config``, ``ep``, ``gpus``, ``max_seq`` (largest sequence that trained;
0 if none), ``first_oom_seq`` (smallest that ran out of memory), ``upper_seq`` /
``upper_reason`` (smallest failed trial, OOM or timeout), ``bracket_open`` (true: ``max_seq`` is
only a lower bound: budget, timeout bound, error or sequence limit), ``stop_reason``, ``trials``
(each ``seq``, ``ok``, ``reason``, ``wall_s``, ``peak_MiB`` (max_memory_allocated of rank 0, the
largest step), ``megatron_max_allocated_MB`` / ``megatron_max_reserved_MB`` (Megatron's memory
report after step 1), ``est_s``, ``timeout_s``, ``detail``, ``log_dir``), ``predicted_max_seq``
(the planner's, for the same model and parallelism at the GPU's total memory from
``torch.cuda.mem_get_info``), ``predicted_over_measured``, ``planner_peak_at_max_seq_MiB``,
``planner_gpu_bytes``, ``gpu_total_bytes``, ``gpu_free_bytes``, the run settings, and ``gpu``,
``commit``, ``torch``, ``triton``, ``command``, ``date``. ``--dry-run`` prints the predictions and
the trial plan (commands included) without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, JsonlWriter, environment  # noqa: E402
from benchmarks.e2e import RunResult, _have_te, _stop_group, pretrain_args  # noqa: E402

DEFAULT_CONFIG = "qwen3_slice_v152k"
SEQ_STEP = 4096
SEQ_LIMIT = 1 << 21  # 2M tokens: far beyond what one H200 trains here (and hours of attention)
STEPS = 2
GROWTH0 = 0.125  # first bracket move: 1/8 of the sequence, doubling each further move
MIN_TRIAL_S = 90.0  # no trial starts with less budget left (start-up alone is ~40-60 s)
DEFAULT_GPU = "h200-141gb"  # --dry-run without --gpu-bytes
SPEC_FLAGS = ("--spec", "benchmarks.sdpa_attention", "sdpa_decoder_spec")
SDPA_MARKER = "[sdpa_attention] core attention replaced by SdpaCoreAttention"  # its MARKER
GPU_BUSY_MIB = 2048  # another process holding more than this on a trial's GPU: do not start
# The trials' PYTORCH_CUDA_ALLOC_CONF (--alloc-conf): without expandable segments a 46-67 GiB
# fp32 logits block of Megatron's cross-entropy found 36-58 GiB reserved but unusable in the
# second step (megatron-core out of memory at 81,920 tokens with a 65,536-token peak of 87 GiB,
# commit e3bbf85); the planner models no fragmentation. PyTorch's own out-of-memory message
# advises this setting.
ALLOC_CONF = "expandable_segments:True"
CAPPED_MODULE = "benchmarks.capped_pretrain"


@dataclass(frozen=True)
class Provider:
    name: str
    dispatcher: str  # --moe-token-dispatcher-type
    fused_loss: bool  # --relaymoe-fused-loss
    variant: str  # the planner's name (relaymoe.planner.plan.VARIANTS)


PROVIDERS = {
    p.name: p
    for p in (
        Provider("mcore_alltoall", "alltoall", False, "alltoall"),
        Provider("relaymoe_ring", "ring", False, "ring"),
        Provider("relaymoe_ring_fused_loss", "ring", True, "ring_fused_loss"),
        Provider("mcore_alltoall_fused_loss", "alltoall", True, "alltoall_fused_loss"),
    )
}
DEFAULT_PROVIDERS = ("mcore_alltoall", "relaymoe_ring", "relaymoe_ring_fused_loss")


# -- flags and the planner -----------------------------------------------------------------


def attention_flags() -> list[str]:
    """The SDPA substitution (without TransformerEngine), and never a (b, 1, s, s) mask."""
    flags = [] if _have_te() else list(SPEC_FLAGS)
    return flags + ["--no-create-attention-mask-in-dataloader"]


def trial_flags(
    config: str, provider: str, seq: int, *, gpus: int, steps: int = STEPS, seed: int = 1234
) -> list[str]:
    """Megatron flags of one trial: ``config`` at sequence ``seq``, micro-batch 1, EP = ``gpus``
    (the config's recompute), the provider's dispatcher and loss, and the SDPA attention."""
    p = PROVIDERS[provider]
    extra = attention_flags() + (["--relaymoe-fused-loss"] if p.fused_loss else [])
    # regime "launcher": its warm-up fits 2 steps; the learning rate does not change memory
    return pretrain_args(
        config,
        gpus=gpus,
        steps=steps,
        dispatcher=p.dispatcher,
        seed=seed,
        extra=extra,
        seq_length=seq,
        micro_batch_size=1,
        regime="launcher",
    )


def normalization_impl() -> str:
    """How these runs normalise (``relaymoe.planner.plan.normalization_impl_of`` for
    ``pretrain_args``' flags): TE's fused norms, else ``--transformer-impl local`` with apex's
    (fused) or megatron-core's torch fallback ("torch" where torch has its fused RMSNorm
    kernel, else "torch_composite")."""
    import importlib.util

    if _have_te() or importlib.util.find_spec("apex") is not None:
        return "fused"
    from benchmarks.common import torch_norm_impl

    return torch_norm_impl()


def planner_config(config: str, gpus: int):
    """The planner's view of the trials: the config at EP = DP = ``gpus``, micro-batch 1, this
    machine's normalisation."""
    from relaymoe.config import load_config

    cfg = load_config(config)
    return cfg.replace(
        parallel={"ep": gpus, "dp": gpus},
        training={
            "micro_batch_size": 1,
            "global_batch_size": None,
            "normalization_impl": normalization_impl(),
        },
    )


@dataclass(frozen=True)
class Prediction:
    gpu_bytes: int
    usable_bytes: int
    max_seq: dict  # provider -> planner's longest sequence (None: the planner has no variant)
    breakdown: dict  # provider -> {"stage", "terms"} at that length, or None


def predict(cfg, gpu_bytes: int, providers) -> Prediction:
    from relaymoe.planner.plan import plan

    p = plan(cfg, gpu_bytes)
    at_max = getattr(p, "max_seq_breakdown", None) or {}
    return Prediction(
        gpu_bytes=p.gpu_bytes,
        usable_bytes=p.usable_bytes,
        max_seq={n: p.max_seq_length.get(PROVIDERS[n].variant) for n in providers},
        breakdown={n: at_max.get(PROVIDERS[n].variant) for n in providers},
    )


def planner_peak_bytes(cfg, provider: str, seq: int) -> int:
    """The planner's full-recompute peak of ``provider`` at ``seq`` (to set beside the measured
    peak of the longest trial that trained)."""
    from relaymoe.planner.recompute import worst_stage_peak

    p = PROVIDERS[provider]
    if p.fused_loss:
        cfg = cfg.replace(relaymoe={"fused_loss": True})
    return worst_stage_peak(cfg, p.dispatcher, seq=seq).total


# -- trial time --------------------------------------------------------------------------------

STARTUP_S = 60.0  # torchrun + Megatron init + model build, before the first step
ATTN_FLOPS_PER_S = 250e12  # SDPA flash on an H200, bf16 causal, forward + backward averaged
OTHER_FLOPS_PER_S = 100e12  # projections, experts, loss: smaller GEMMs, dispatch included
STEP_FIXED_S = 2.0  # optimizer step, gradient reductions


@dataclass
class TimeModel:
    """Seconds of a trial: start-up + steps x (attention FLOPs / rate + other FLOPs / rate),
    scaled by the last completed trial (its last step's time over the model's)."""

    cfg: object  # relaymoe.config.Config
    steps: int = STEPS
    startup_s: float = STARTUP_S
    scale: float = 1.0
    calibrated_at: int | None = None  # the sequence of the trial it was calibrated on

    def step_flops(self, seq: int) -> tuple[float, float]:
        """(attention core, everything else) FLOPs of one step on one GPU, full recompute: the
        layers run forward twice and backward (2x, flash attention's 2.5x); the output layer
        forward and backward."""
        m = self.cfg.model
        h, d, nh, ng = m.hidden_size, m.head_dim, m.num_attention_heads, m.query_groups
        t = seq  # micro-batch 1, no CP/TP
        core_fwd = 2.0 * t * seq * nh * d  # QK^T and PV over the causal half
        proj = 2.0 * t * h * (nh + 2 * ng) * d + 2.0 * t * nh * d * h
        moe = (
            2.0 * t * m.moe_router_topk * h * 3 * m.moe_ffn_hidden_size
            + 2.0 * t * h * m.num_experts
        )
        layers = m.num_layers
        attn = layers * 4.5 * core_fwd
        other = layers * 4.0 * (proj + moe) + 3.0 * 2.0 * t * h * m.vocab_size
        return attn, other

    def raw_step_s(self, seq: int) -> float:
        attn, other = self.step_flops(seq)
        return attn / ATTN_FLOPS_PER_S + other / OTHER_FLOPS_PER_S + STEP_FIXED_S

    def step_s(self, seq: int) -> float:
        return self.scale * self.raw_step_s(seq)

    def trial_s(self, seq: int) -> float:
        return self.startup_s + self.steps * self.step_s(seq)

    def calibrate(self, seq: int, last_step_s: float, wall_s: float) -> None:
        self.scale = last_step_s / self.raw_step_s(seq)
        # step 1's one-off warm-up lands in the start-up, where every trial pays it
        self.startup_s = max(10.0, wall_s - self.steps * last_step_s)
        self.calibrated_at = seq


# -- one trial ---------------------------------------------------------------------------------

REASONS = ("ok", "oom", "timeout", "budget", "error")
OOM_PATTERNS = (
    r"torch\.(?:cuda\.)?OutOfMemoryError",
    r"CUDA out of memory",
    r"CUDA (?:driver )?error: out of memory",
    r"\[CUDA\]: out of memory",  # Triton's launcher
    r"CUBLAS_STATUS_ALLOC_FAILED",
    r"Cuda failure[^\n]*out of memory",
    r"cudaErrorMemoryAllocation",
)
_OOM_RE = re.compile("|".join(OOM_PATTERNS))
_MEGATRON_MEM_RE = re.compile(
    r"memory \(MB\) \| allocated: ([\d.]+) \| max allocated: ([\d.]+) \| "
    r"reserved: ([\d.]+) \| max reserved: ([\d.]+)"
)
_SIZE = r"([\d.]+) (GiB|MiB|KiB|bytes)"
_UNITS = {"GiB": 1024.0, "MiB": 1.0, "KiB": 1 / 1024, "bytes": 1 / 2**20}


@dataclass(frozen=True)
class Trial:
    seq: int
    reason: str  # ok | oom | timeout | budget | error
    wall_s: float
    peak_MiB: float | None = None  # rank 0's max_memory_allocated, largest step
    detail: str = ""  # the OOM line, the timeout, or the error's log tail
    step_s: tuple[float, ...] = ()
    megatron_max_allocated_MB: float | None = None
    megatron_max_reserved_MB: float | None = None
    oom_request_MiB: float | None = None  # "Tried to allocate ..."
    oom_allocated_MiB: float | None = None  # "... is allocated by PyTorch"
    est_s: float | None = None
    timeout_s: float | None = None
    log_dir: str = ""

    def __post_init__(self):
        if self.reason not in REASONS:
            raise ValueError(f"trial reason {self.reason!r}; known: {REASONS}")

    @property
    def ok(self) -> bool:
        return self.reason == "ok"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["step_s"] = list(self.step_s)
        return {"seq": self.seq, "ok": self.ok, **{k: v for k, v in d.items() if k != "seq"}}


def oom_line(log: str) -> str | None:
    """The first line of ``log`` that reports a CUDA out-of-memory (any rank), or None."""
    m = _OOM_RE.search(log)
    if m is None:
        return None
    start = log.rfind("\n", 0, m.start()) + 1
    end = log.find("\n", m.end())
    return log[start : end if end >= 0 else len(log)].strip()[:600]


def _mib(m: re.Match | None) -> float | None:
    return None if m is None else float(m.group(1)) * _UNITS[m.group(2)]


def classify(
    *,
    returncode: int,
    timed_out: bool,
    timeout_s: float,
    steps: list[dict],
    log: str,
    expected_steps: int,
    marker: str | tuple[str, ...] | None,
) -> tuple[str, str]:
    """(reason, detail) of a finished job.

    ``ok``: every step reported a finite loss (rank 0 reports a step only after both ranks'
    gradients met in it), and the log has ``marker`` when one is given; an exit status or a
    hang after the last step is noted in the detail. Else ``oom`` when the log has CUDA
    out-of-memory text (also if the job then hung until its timeout), else ``timeout``, else
    ``error`` with the log's tail (a non-finite loss is an error too).
    """
    losses = [s.get("loss") for s in steps]
    finite = all(isinstance(x, int | float) and math.isfinite(x) for x in losses)
    if len(steps) >= expected_steps and finite:
        markers = (marker,) if isinstance(marker, str) else tuple(marker or ())
        missing = [m for m in markers if m not in log]
        if missing:
            return "error", (
                f"the run trained but its log lacks {missing[0]!r}: the --spec import or the "
                "allocator cap did not take effect (see the log)"
            )
        if timed_out:
            return "ok", "all steps trained, then the job hung until its timeout"
        return "ok", "" if returncode == 0 else f"all steps trained, then exit status {returncode}"
    tail = "\n".join(log.rstrip().splitlines()[-40:])
    if not finite:
        return "error", f"non-finite loss {losses}; log tail:\n{tail}"
    oom = oom_line(log)
    if oom is not None:
        return "oom", oom + (" (then hung until the timeout)" if timed_out else "")
    if timed_out:
        return "timeout", f"no result within {timeout_s:.0f} s ({len(steps)} steps reported)"
    run = RunResult("?", returncode, steps=list(steps))
    why = run.failure(expected_steps) or f"exit status {returncode}"
    return "error", f"{why}; log tail:\n{tail}"


def trial_from_log(
    seq: int,
    *,
    returncode: int,
    timed_out: bool,
    timeout_s: float,
    wall_s: float,
    steps: list[dict],
    log: str,
    expected_steps: int,
    marker: str | tuple[str, ...] | None,
    log_dir: str = "",
) -> Trial:
    reason, detail = classify(
        returncode=returncode, timed_out=timed_out, timeout_s=timeout_s, steps=steps, log=log,
        expected_steps=expected_steps, marker=marker,
    )  # fmt: skip
    mem = _MEGATRON_MEM_RE.findall(log)
    peaks = [s["peak_MiB"] for s in steps if s.get("peak_MiB") is not None]
    oom = reason == "oom"
    return Trial(
        seq=seq,
        reason=reason,
        wall_s=wall_s,
        peak_MiB=max(peaks) if peaks else None,
        detail=detail,
        step_s=tuple(float(s["step_s"]) for s in steps if "step_s" in s),
        megatron_max_allocated_MB=max(float(x[1]) for x in mem) if mem else None,
        megatron_max_reserved_MB=max(float(x[3]) for x in mem) if mem else None,
        oom_request_MiB=_mib(re.search("Tried to allocate " + _SIZE, log) if oom else None),
        oom_allocated_MiB=_mib(re.search(_SIZE + " is allocated by PyTorch", log) if oom else None),
        log_dir=log_dir,
    )


def _proc_start(pid: int) -> int | None:
    """Start time (clock ticks since boot) of ``pid``, None if it is gone (Linux /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _descendants(pid: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of ``pid`` (Linux /proc; {} elsewhere)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(d.name))
    out, todo = {}, [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            start = _proc_start(c)
            if start is not None and c not in out:
                out[c] = start
                todo.append(c)
    return out


def _kill_leftovers(seen: dict[int, int]) -> list[int]:
    """SIGKILL the job's processes still alive (same pid and start time: never a reused pid).
    torchrun starts each worker in its own session, so stopping torchrun's group can miss them."""
    killed = []
    for pid, start in seen.items():
        if _proc_start(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def gpu_memory_used_mib() -> list[float] | None:
    """Memory used on each GPU by any process (nvidia-smi; None when it is not there)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (subprocess.SubprocessError, OSError):
        return None
    return [float(x) for x in out.split() if x.strip()]


def wait_gpus_free(gpus: int, *, wait_s: float = 60.0, probe=gpu_memory_used_mib) -> str | None:
    """None once the first ``gpus`` GPUs hold at most ``GPU_BUSY_MIB`` each (or nothing can
    tell); else, after ``wait_s``, why not (a leftover process would turn every later trial
    into a false OOM)."""
    deadline = time.monotonic() + wait_s
    while True:
        used = probe()
        if used is None:
            return None
        busy = {i: u for i, u in enumerate(used[:gpus]) if u > GPU_BUSY_MIB}
        if not busy:
            return None
        if time.monotonic() >= deadline:
            return (
                f"GPU memory held by another process before the trial: "
                f"{', '.join(f'GPU {i}: {u:.0f} MiB' for i, u in busy.items())} "
                f"(limit {GPU_BUSY_MIB} MiB); free the GPUs and rerun"
            )
        time.sleep(5)


def trial_command(flags: list[str], *, gpus: int, report: str, capped: bool = False) -> list[str]:
    """The torchrun command line of one trial (its step report written to ``report``);
    ``capped``: through ``benchmarks.capped_pretrain`` (the allocator cap from the env)."""
    module = CAPPED_MODULE if capped else "relaymoe.megatron.pretrain"
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", str(gpus),
        "-m", module, *flags,
        "--relaymoe-report", report,
    ]  # fmt: skip


def launch(
    flags: list[str],
    *,
    gpus: int,
    timeout_s: float,
    workdir: Path,
    alloc_conf: str = ALLOC_CONF,
    cap_bytes: int | None = None,
) -> dict:
    """One ``torchrun -m relaymoe.megatron.pretrain FLAGS`` job, output to ``workdir/log.txt``.

    Like ``benchmarks.e2e.run_pretrain`` (own process group, stopped on timeout), plus:
    the whole log is kept (an OOM on either rank is found wherever it is), ``ROOT`` is on
    ``PYTHONPATH`` (the ``--spec`` module lives in ``benchmarks/``), and every process the job
    started is killed by pid afterwards. ``alloc_conf`` is the job's
    ``PYTORCH_CUDA_ALLOC_CONF`` ("" for the allocator's default); ``cap_bytes`` caps each rank's
    allocator (``benchmarks.capped_pretrain``).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / "steps.jsonl"
    report.unlink(missing_ok=True)
    log_path = workdir / "log.txt"
    cmd = trial_command(flags, gpus=gpus, report=str(report), capped=cap_bytes is not None)
    path = os.environ.get("PYTHONPATH")
    env = dict(
        os.environ,
        CUDA_DEVICE_MAX_CONNECTIONS="1",
        OMP_NUM_THREADS="4",
        PYTHONPATH=str(ROOT) + (os.pathsep + path if path else ""),
    )
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    if cap_bytes is not None:
        env["RELAYMOE_MEMORY_CAP_BYTES"] = str(cap_bytes)
    command = " ".join(shlex.quote(c) for c in cmd)
    envs = " ".join(
        f"{k}={shlex.quote(env[k])}"
        for k in ("PYTORCH_CUDA_ALLOC_CONF", "RELAYMOE_MEMORY_CAP_BYTES")
        if k in env
    )
    command = f"{envs} {command}" if envs else command
    (workdir / "command.sh").write_text(command + "\n")
    t0 = time.perf_counter()
    timed_out = False
    seen: dict[int, int] = {}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir,
            start_new_session=True,
        )  # fmt: skip
        try:
            while True:
                seen.update(_descendants(proc.pid))
                left = timeout_s - (time.perf_counter() - t0)
                if left <= 0:
                    timed_out = True
                    _stop_group(proc)  # torchrun's group; its workers are in their own sessions
                    break
                try:
                    proc.wait(timeout=min(1.0, left))
                    break
                except subprocess.TimeoutExpired:
                    pass
        except BaseException:  # e.g. Ctrl-C: do not leave workers on the GPUs
            _stop_group(proc)
            _kill_leftovers(seen)
            raise
    wall = time.perf_counter() - t0
    killed = _kill_leftovers(seen)
    text = log_path.read_text(errors="replace")
    if killed:
        text += f"\n[max_seq] killed leftover processes {killed} after the job\n"
    steps = []
    if report.exists():
        steps = [json.loads(x) for x in report.read_text().splitlines() if x.strip()]
    return {
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "wall_s": wall,
        "steps": steps,
        "log": text,
        "command": command,
        "log_dir": str(workdir),
    }


# -- the search --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchResult:
    max_seq: int  # largest sequence that trained (0: none did)
    first_oom_seq: int | None  # smallest that ran out of memory
    upper_seq: int | None  # smallest failed trial (OOM or timeout)
    upper_reason: str | None
    bracket_open: bool  # max_seq is only a lower bound
    stop_reason: str  # converged | none_fits | timeout_bound | budget | error | limit
    trials: tuple[Trial, ...]
    error: str | None = None


def search_max_seq(
    run_trial: Callable[[int, float], Trial],
    *,
    start: int,
    max_trial_s: float,
    estimate_s: Callable[[int], float],
    step: int = SEQ_STEP,
    limit: int = SEQ_LIMIT,
    budget_s: float | None = None,
    growth: float = GROWTH0,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = print,
) -> SearchResult:
    """Longest multiple of ``step`` (at most ``limit``) for which ``run_trial(seq, timeout_s)``
    is ok, assuming that fitting is monotone in ``seq``.

    Tries ``start`` (rounded down to ``step``) first; grows after a success by ``growth`` of
    the largest success, shrinks after a failure by ``1 + growth`` of the smallest failure, the
    fraction doubling at every move, until a success and a failure bracket the answer; then
    bisects to one ``step``. A timeout bounds the search from above like an OOM but leaves the
    bracket open; ``budget`` and ``error`` stop it. A trial starts only with
    ``max(estimate_s(seq), MIN_TRIAL_S)`` of ``budget_s`` left; its timeout is ``max_trial_s``
    or the budget left, whichever is smaller (cut by the budget, it is a ``budget`` trial).
    """
    if step < 1 or limit < step:
        raise ValueError(f"step={step}, limit={limit}: need 1 <= step <= limit")
    kmax = limit // step
    k = min(max(start // step, 1), kmax)
    lo, hi, hi_reason = 0, None, None  # lo: largest ok (0: none yet); hi: smallest failure
    g = growth
    trials: list[Trial] = []
    t0 = clock()
    stop, error = None, None
    while stop is None:
        seq = k * step
        est = estimate_s(seq)
        left = None if budget_s is None else budget_s - (clock() - t0)
        if left is not None and left < max(est, MIN_TRIAL_S):
            log(f"  seq {seq}: not started, estimated {est:.0f} s with {max(left, 0):.0f} s "
                "of the budget left")  # fmt: skip
            stop = "budget"
            break
        timeout = max_trial_s if left is None else min(max_trial_s, left)
        warn = " (above --max-trial-s: it will likely time out)" if est > max_trial_s else ""
        log(f"  seq {seq}: starting, estimated {est:.0f} s, timeout {timeout:.0f} s{warn}")
        t = dataclasses.replace(run_trial(seq, timeout), est_s=est, timeout_s=timeout)
        if t.reason == "timeout" and timeout < max_trial_s:
            t = dataclasses.replace(t, reason="budget", detail=t.detail + " (cut by --budget-s)")
        trials.append(t)
        log("  " + trial_line(t))
        if t.reason == "error":
            stop, error = "error", t.detail
        elif t.reason == "budget":
            stop = "budget"
        elif t.ok:
            lo = k
        else:  # oom or timeout
            hi, hi_reason = k, t.reason
        if stop is not None:
            break
        if hi is None:  # only successes so far: grow
            if lo >= kmax:
                stop = "limit"
                break
            k = min(kmax, max(lo + 1, math.ceil(lo * (1 + g))))
            g *= 2
        elif lo == 0:  # only failures so far: shrink
            if hi == 1:
                stop = "none_fits" if hi_reason == "oom" else "timeout_bound"
                break
            k = max(1, min(hi - 1, math.floor(hi / (1 + g))))
            g *= 2
        elif hi - lo <= 1:
            stop = "converged" if hi_reason == "oom" else "timeout_bound"
        else:
            k = (lo + hi) // 2
    ooms = [t.seq for t in trials if t.reason == "oom"]
    return SearchResult(
        max_seq=lo * step,
        first_oom_seq=min(ooms) if ooms else None,
        upper_seq=None if hi is None else hi * step,
        upper_reason=hi_reason,
        bracket_open=stop not in ("converged", "none_fits"),
        stop_reason=stop,
        trials=tuple(trials),
        error=error,
    )


def trial_line(t: Trial) -> str:
    """One printed line per trial: outcome, wall time, peak memory, and why it failed."""
    mem = []
    if t.peak_MiB is not None:
        mem.append(f"peak {t.peak_MiB:.0f} MiB")
    if t.megatron_max_allocated_MB is not None:
        mem.append(
            f"Megatron max allocated {t.megatron_max_allocated_MB:.0f} MB, max reserved "
            f"{t.megatron_max_reserved_MB:.0f} MB"
        )
    if t.oom_allocated_MiB is not None:
        mem.append(f"{t.oom_allocated_MiB:.0f} MiB allocated at the OOM")
    if t.oom_request_MiB is not None:
        mem.append(f"asked {t.oom_request_MiB:.0f} MiB more")
    head = f"seq {t.seq}: {t.reason.upper()} after {t.wall_s:.0f} s"
    head += f" ({'; '.join(mem)})" if mem else ""
    if t.ok:
        return head
    detail = t.detail if t.reason != "error" else t.detail.split("\n", 1)[0]
    where = f" [log: {t.log_dir}/log.txt]" if t.log_dir else ""
    return f"{head}: {detail}{where}"


# -- rows and the command line -----------------------------------------------------------------


def device_facts(gpus: int) -> dict:
    """GPU names and (free, total) memory from ``torch.cuda.mem_get_info`` in a subprocess, so
    that this process never holds a CUDA context on a GPU that the trials need."""
    code = (
        "import json, torch\n"
        "n = torch.cuda.device_count()\n"
        "print(json.dumps({'count': n, 'devices': [dict(name=torch.cuda.get_device_name(i), "
        f"mem=torch.cuda.mem_get_info(i)) for i in range(min(n, {gpus}))]}}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"querying the GPUs failed:\n{out.stderr[-2000:]}")
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    devs = facts["devices"]
    if devs:
        facts["gpu"] = devs[0]["name"]
        facts["free_bytes"] = min(d["mem"][0] for d in devs)
        facts["total_bytes"] = min(d["mem"][1] for d in devs)
    return facts


def provider_row(
    provider: str,
    res: SearchResult,
    *,
    config: str,
    gpus: int,
    steps: int,
    pred: Prediction,
    planner_peak_MiB: float | None,
    facts: dict,
    wall_s: float,
    budget_s: float | None,
    max_trial_s: float,
    alloc_conf: str = ALLOC_CONF,
    memory_cap: str | None = None,
    cap_bytes: int | None = None,
) -> dict:
    p = PROVIDERS[provider]
    predicted = pred.max_seq.get(provider)
    at_max = next((t for t in res.trials if t.ok and t.seq == res.max_seq), None)
    return {
        "bench": "max_seq",
        "provider": provider,
        "shape": f"{config}_ep{gpus}",
        "config": config,
        "ep": gpus,
        "gpus": gpus,
        "dispatcher": p.dispatcher,
        "fused_loss": p.fused_loss,
        "ring_mode": "auto" if p.dispatcher == "ring" else None,
        "micro_batch_size": 1,
        "recompute": "full/uniform/1",
        "steps_per_trial": steps,
        "seq_step": SEQ_STEP,
        "attention": "transformer_engine" if _have_te() else "sdpa_flash",
        "normalization_impl": normalization_impl(),
        "alloc_conf": alloc_conf or None,
        "memory_cap_gpu": memory_cap,
        "memory_cap_bytes": cap_bytes,
        "max_seq": res.max_seq,
        "first_oom_seq": res.first_oom_seq,
        "upper_seq": res.upper_seq,
        "upper_reason": res.upper_reason,
        "bracket_open": res.bracket_open,
        "stop_reason": res.stop_reason,
        "error": res.error,
        "n_trials": len(res.trials),
        "trials": [t.to_dict() for t in res.trials],
        "peak_MiB_at_max_seq": at_max.peak_MiB if at_max else None,
        "predicted_max_seq": predicted,
        "predicted_over_measured": (predicted / res.max_seq) if predicted and res.max_seq else None,
        "planner_peak_at_max_seq_MiB": planner_peak_MiB,
        "planner_breakdown_at_predicted": pred.breakdown.get(provider),
        "planner_gpu_bytes": pred.gpu_bytes,
        "planner_usable_bytes": pred.usable_bytes,
        "gpu_total_bytes": facts.get("total_bytes"),
        "gpu_free_bytes": facts.get("free_bytes"),
        "wall_s": wall_s,
        "budget_s": budget_s,
        "max_trial_s": max_trial_s,
    }


def first_trial(predicted: int | None, fallback: int, step: int = SEQ_STEP) -> int:
    """The planner's prediction rounded down to ``step`` (``fallback`` without one)."""
    seq = predicted if predicted else fallback
    return max(step, seq // step * step)


def ladder(start: int, step: int, n: int = 3, growth: float = GROWTH0) -> tuple[list, list]:
    """The first ``n`` sequences the search tries above (all ok) and below (all failing)."""
    up, down = [], []
    k, g = start // step, growth
    for _ in range(n):
        k = max(k + 1, math.ceil(k * (1 + g)))
        up.append(k * step)
        g *= 2
    k, g = start // step, growth
    for _ in range(n):
        if k <= 1:
            break
        k = max(1, min(k - 1, math.floor(k / (1 + g))))
        down.append(k * step)
        g *= 2
    return up, down


def print_plan(providers, pred: Prediction, tm: TimeModel, a, gpus: int) -> None:
    print(
        f"planner: GPU {pred.gpu_bytes / 1e9:.1f} GB -> usable {pred.usable_bytes / 2**30:.1f} "
        f"GiB per GPU; config {a.config}, EP={gpus}, micro-batch 1, full recompute, "
        f"normalization {normalization_impl()}; attention "
        f"{'TransformerEngine' if _have_te() else 'SDPA flash (benchmarks/sdpa_attention.py)'}"
    )
    for name in providers:
        predicted = pred.max_seq.get(name)
        start = first_trial(a.start_seq or predicted, 32768)
        up, down = ladder(start, SEQ_STEP, growth=a.growth)
        fmt = ", ".join
        print(f"== {name}: planner predicts {predicted if predicted is not None else '-'} "
              f"({PROVIDERS[name].variant})")  # fmt: skip
        print(f"   first trial {start} (est {tm.trial_s(start):.0f} s); if it trains: "
              f"{fmt(f'{s} ({tm.trial_s(s):.0f} s)' for s in up)}, ...; if not: "
              f"{fmt(f'{s} ({tm.trial_s(s):.0f} s)' for s in down)}, ...; then bisection to "
              f"{SEQ_STEP}")  # fmt: skip
        flags = trial_flags(a.config, name, start, gpus=gpus, steps=a.steps, seed=a.seed)
        cmd = trial_command(
            flags, gpus=gpus, report="<trial>/steps.jsonl", capped=bool(a.memory_cap)
        )
        print("   " + shlex.join(cmd))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--providers", default=",".join(DEFAULT_PROVIDERS),
                   help=f"comma-separated, in order; known: {', '.join(PROVIDERS)}")  # fmt: skip
    p.add_argument("--gpus", type=int, default=2, help="GPUs per trial = EP = data-parallel size")
    p.add_argument("--steps", type=int, default=STEPS, help="training steps per trial")
    p.add_argument("--budget-s", type=float, default=None, help="wall-time bound of everything")
    p.add_argument("--max-trial-s", type=float, default=1200.0, help="timeout of one trial")
    p.add_argument("--start-seq", type=int, default=None,
                   help="first trial (default: the planner's prediction, 32768 without one); "
                        "to resume a search next to trials already made")  # fmt: skip
    p.add_argument("--limit-seq", type=int, default=SEQ_LIMIT, help="never try above this")
    p.add_argument("--gpu-bytes", default=None,
                   help="GPU memory for the planner (bytes, 141GB, a preset); default: the "
                        f"GPUs' total from torch.cuda.mem_get_info ({DEFAULT_GPU} in --dry-run "
                        "without GPUs)")  # fmt: skip
    p.add_argument("--alloc-conf", default=ALLOC_CONF,
                   help=f"the trials' PYTORCH_CUDA_ALLOC_CONF (default {ALLOC_CONF}; '' for "
                        "the allocator's default)")  # fmt: skip
    p.add_argument("--memory-cap", default=None, metavar="GPU",
                   help="emulate a smaller GPU (a planner preset such as h100-80gb, or bytes): "
                        "each trial's allocator is capped at the planner's usable bytes of that "
                        "GPU, and the planner plans for it")  # fmt: skip
    p.add_argument("--growth", type=float, default=GROWTH0,
                   help=f"first bracket move as a fraction of the sequence (default {GROWTH0});"
                        " smaller where the planner is trusted to a few percent")  # fmt: skip
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workdir", default=None, help="trial folders and logs (default: a temp dir)")
    p.add_argument("--dry-run", action="store_true", help="print predictions and the trial plan")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "max_seq.jsonl"))
    a = p.parse_args(argv)
    providers = [s.strip() for s in a.providers.split(",") if s.strip()]
    unknown = [n for n in providers if n not in PROVIDERS]
    if unknown or not providers:
        p.error(f"unknown provider(s) {unknown or providers}; known: {', '.join(PROVIDERS)}")
    if a.steps < 2:
        p.error(f"--steps {a.steps}: at least 2 (the issue's criterion is two training steps)")
    if a.limit_seq < SEQ_STEP:
        p.error(f"--limit-seq {a.limit_seq} is below the search step {SEQ_STEP}")
    if not 0 < a.growth <= 1:
        p.error(f"--growth {a.growth}: a fraction in (0, 1]")
    if a.memory_cap and a.gpu_bytes:
        p.error("--memory-cap names the GPU the planner plans for; drop --gpu-bytes")
    from relaymoe.planner.plan import parse_gpu

    gpus = a.gpus
    try:
        cfg = planner_config(a.config, gpus)
        trial_flags(a.config, providers[0], SEQ_STEP, gpus=gpus, steps=a.steps)  # bad flags now
        gpu_bytes = parse_gpu(a.gpu_bytes or a.memory_cap) if a.gpu_bytes or a.memory_cap else None
    except ValueError as e:
        p.error(str(e))
    cap_bytes = predict(cfg, gpu_bytes, providers).usable_bytes if a.memory_cap else None
    tm = TimeModel(cfg, steps=a.steps)
    if a.dry_run:
        pred = predict(cfg, gpu_bytes or parse_gpu(DEFAULT_GPU), providers)
        print_plan(providers, pred, tm, a, gpus)
        return 0
    facts = device_facts(gpus)
    if facts["count"] < gpus:
        print(f"max_seq: needs {gpus} CUDA GPUs, found {facts['count']}; nothing measured")
        return 3
    if cap_bytes is not None and cap_bytes > facts["total_bytes"]:
        print(f"max_seq: --memory-cap {a.memory_cap} ({cap_bytes} usable bytes) exceeds this "
              f"GPU's {facts['total_bytes']} bytes; nothing measured")  # fmt: skip
        return 2
    if facts["free_bytes"] < 0.9 * facts["total_bytes"]:
        free, total = facts["free_bytes"] / 2**30, facts["total_bytes"] / 2**30
        print(f"max_seq: warning: only {free:.1f} of {total:.1f} GiB free on a GPU: another "
              "process uses it, and the trials will fit less than the planner assumes")  # fmt: skip
    pred = predict(cfg, gpu_bytes or facts["total_bytes"], providers)
    print_plan(providers, pred, tm, a, gpus)
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="relaymoe_max_seq_"))
    writer = JsonlWriter(a.out, env=environment(facts["gpu"]))
    marker = () if _have_te() else (SDPA_MARKER,)
    if cap_bytes is not None:
        from benchmarks.capped_pretrain import MARKER as CAP_MARKER

        marker += (CAP_MARKER,)
        print(f"trials capped at {cap_bytes} bytes per GPU (the planner's usable bytes of "
              f"{a.memory_cap})", flush=True)  # fmt: skip
    print(f"PYTORCH_CUDA_ALLOC_CONF={a.alloc_conf or '(default)'}", flush=True)
    t_all = time.monotonic()
    rows = []
    for i, name in enumerate(providers):
        share = None
        if a.budget_s is not None:
            share = (a.budget_s - (time.monotonic() - t_all)) / (len(providers) - i)
        budget = "-" if share is None else f"{share:.0f} s"
        print(f"== {name}: search (budget {budget}, trial timeout {a.max_trial_s:.0f} s, logs "
              f"under {workdir / name})", flush=True)  # fmt: skip

        def run_one(seq: int, timeout_s: float, name=name) -> Trial:
            busy = wait_gpus_free(gpus)
            if busy is not None:
                return Trial(seq, "error", 0.0, detail=busy)
            flags = trial_flags(a.config, name, seq, gpus=gpus, steps=a.steps, seed=a.seed)
            r = launch(
                flags, gpus=gpus, timeout_s=timeout_s, workdir=workdir / name / f"s{seq}",
                alloc_conf=a.alloc_conf, cap_bytes=cap_bytes,
            )  # fmt: skip
            t = trial_from_log(
                seq, returncode=r["returncode"], timed_out=r["timed_out"], timeout_s=timeout_s,
                wall_s=r["wall_s"], steps=r["steps"], log=r["log"], expected_steps=a.steps,
                marker=marker, log_dir=r["log_dir"],
            )  # fmt: skip
            if t.ok and t.step_s:
                tm.calibrate(seq, t.step_s[-1], t.wall_s)
            if t.reason == "error":
                print(f"--- {name} seq {seq}: ERROR\ncommand: {r['command']}\n{t.detail}\n---",
                      file=sys.stderr, flush=True)  # fmt: skip
            return t

        t0 = time.monotonic()
        res = search_max_seq(
            run_one,
            start=first_trial(a.start_seq or pred.max_seq.get(name), 32768),
            max_trial_s=a.max_trial_s,
            estimate_s=tm.trial_s,
            limit=a.limit_seq,
            budget_s=share,
            growth=a.growth,
            log=lambda s: print(s, flush=True),
        )
        peak = planner_peak_bytes(cfg, name, res.max_seq) / 2**20 if res.max_seq else None
        row = provider_row(
            name, res, config=a.config, gpus=gpus, steps=a.steps, pred=pred,
            planner_peak_MiB=peak, facts=facts, wall_s=time.monotonic() - t0,
            budget_s=share, max_trial_s=a.max_trial_s, alloc_conf=a.alloc_conf,
            memory_cap=a.memory_cap, cap_bytes=cap_bytes,
        )  # fmt: skip
        writer.write(row)
        rows.append(row)
        print(f"== {name}: max_seq {res.max_seq} ({res.stop_reason}"
              f"{', a lower bound' if res.bracket_open else ''}), first OOM "
              f"{res.first_oom_seq}, predicted {row['predicted_max_seq']}", flush=True)  # fmt: skip
    print_summary(rows)
    print(f"rows appended to {a.out}; {time.monotonic() - t_all:.0f} s in all; logs in {workdir}")
    return 0 if all(r["stop_reason"] != "error" for r in rows) else 1


def print_summary(rows: list[dict]) -> None:
    from benchmarks.common import print_table

    print_table(
        rows,
        ["provider", "predicted_max_seq", "max_seq", "first_oom_seq", "upper_reason",
         "bracket_open", "stop_reason", "n_trials", "peak_MiB_at_max_seq",
         "planner_peak_at_max_seq_MiB", "wall_s"],
    )  # fmt: skip
    base = next((r for r in rows if r["provider"] == "mcore_alltoall" and r["max_seq"]), None)
    for r in rows:
        if base and r is not base and r["max_seq"]:
            print(f"{r['provider']}: {r['max_seq'] / base['max_seq']:.2f}x mcore_alltoall's "
                  "longest sequence")  # fmt: skip


__all__ = [
    "PROVIDERS",
    "SearchResult",
    "TimeModel",
    "Trial",
    "classify",
    "main",
    "search_max_seq",
    "trial_flags",
]

if __name__ == "__main__":
    sys.exit(main())
