"""``check``: a Megatron checkpoint and a Hugging Face folder, the same logits on fixed prompts?

What the check compares is the two implementations' forward on the host in fp32: Megatron's
GPT model as training builds it, loaded by Megatron's ``load_checkpoint``
(``megatron_logits``), and transformers' ``Qwen3MoeForCausalLM`` from the folder
(``hf_logits``). Both hold the same weights when the conversion is right, so they agree to fp32
rounding (about 1e-7 relative on the tiny test models); a transposed, swapped or missing tensor
moves the logits by orders of magnitude more. ``TOLERANCE`` is the bound, per prompt, on
``|megatron - hf| / |hf|`` (Frobenius norms over the prompt's logits).

Before any model is built the pair is checked to be one architecture: the checkpoint's saved
arguments turned into a ``config.json`` (``relaymoe.export_hf.hf_config``) against the folder's.

Memory: one model at a time, in fp32 (4 bytes a parameter: about 122 GB for Qwen3-30B-A3B;
under torchrun with ``ep`` processes the Megatron side is spread over them, transformers'
runs on rank 0 alone).
"""

from __future__ import annotations

from dataclasses import dataclass

from relaymoe.check_hf.errors import CheckError
from relaymoe.convert_hf.errors import ConvertError
from relaymoe.convert_hf.hf_config import (
    architecture_differences,
    megatron_model_flags,
    read_hf_config,
)
from relaymoe.export_hf.architecture import hf_config
from relaymoe.export_hf.checkpoint import TRACKER, TorchDistCheckpoint
from relaymoe.export_hf.errors import ExportError

TOLERANCE = 1e-4  # relative logits error per prompt, fp32 on both sides


@dataclass
class PromptResult:
    tokens: int
    rel_err: float  # |megatron - hf| / |hf| over the prompt's logits
    top1_agree: int  # positions whose arg-max token is the same


@dataclass
class CheckResult:
    prompts: list[PromptResult]
    source: str  # where the prompts' ids came from: tokenizer or seed
    tolerance: float
    load_problems: list[str]  # what transformers found missing or unexpected in the folder

    @property
    def worst(self) -> float:
        return max(p.rel_err for p in self.prompts)

    @property
    def passed(self) -> bool:
        return not self.load_problems and self.worst <= self.tolerance


def check(
    load: str,
    hf_dir: str,
    *,
    iteration: int | None = None,
    ep: int = 1,
    tolerance: float = TOLERANCE,
    dispatcher: str = "ring",
) -> CheckResult | None:
    """Compare; the result on rank 0, None on the other ranks of a torchrun world. CheckError
    for a pair it cannot compare (not one architecture, a bad folder, an EP that does not divide
    the experts)."""
    if not tolerance > 0:
        raise CheckError(f"--tol {tolerance}: a bound must be positive (default {TOLERANCE})")
    import torch

    if torch.cuda.is_available():
        raise CheckError(
            "check-hf runs both models on the host, and this process sees a GPU; "
            "fix: CUDA_VISIBLE_DEVICES= relaymoe check-hf ..."
        )
    try:
        cfg = read_hf_config(hf_dir)
        ckpt = TorchDistCheckpoint(load, iteration)
        ckpt_cfg = hf_config(
            ckpt.args, ckpt.tensors["embedding.word_embeddings.weight"].size[0], "float32"
        )
    except (ConvertError, ExportError) as e:
        raise CheckError(str(e)) from None
    except KeyError as e:
        raise CheckError(f"{load}: the checkpoint has no tensor {e}: not a GPT model's") from None
    diff = architecture_differences(ckpt_cfg, cfg, ("checkpoint", "config.json"))
    if diff:
        raise CheckError(
            f"{hf_dir} is not the checkpoint's architecture ({'; '.join(diff)}); "
            "fix: pass the folder converted from, or exported from, this "
            "checkpoint"
        )
    experts = cfg["num_experts"]
    if ep < 1 or experts % ep:
        fits = [d for d in range(1, experts + 1) if experts % d == 0]
        raise CheckError(
            f"--ep {ep}: the checkpoint's {experts} experts per layer do not split "
            f"evenly over {ep} processes; fix: --ep one of {fits} (under torchrun "
            "--nproc-per-node EP)"
        )
    folder = ckpt.folder
    tracker = folder.parent / TRACKER
    if folder.name == "release" and not (
        tracker.is_file() and tracker.read_text().strip() == "release"
    ):
        raise CheckError(
            f"{folder}: Megatron loads a release checkpoint through {tracker} "
            "saying 'release'; fix: write that file"
        )
    from relaymoe.check_hf.prompts import prompts

    ids, source = prompts(hf_dir, cfg["vocab_size"])
    impl = getattr(ckpt.args, "transformer_impl", None) or "transformer_engine"
    from relaymoe.check_hf.megatron_logits import megatron_logits

    ours = megatron_logits(
        folder, megatron_model_flags(cfg), ids, transformer_impl=impl, ep=ep, dispatcher=dispatcher
    )
    if ours is None:  # not rank 0
        return None
    from relaymoe.check_hf.hf_logits import hf_logits

    theirs, problems = hf_logits(hf_dir, ids)
    results = [
        PromptResult(len(p), _rel(a, b), int((a.argmax(-1) == b.argmax(-1)).sum()))
        for p, a, b in zip(ids, ours, theirs, strict=True)
    ]
    return CheckResult(results, source, tolerance, problems)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
