"""Logits of a Hugging Face folder on the host, in fp32, through transformers' own model."""

from __future__ import annotations

from relaymoe.check_hf.errors import CheckError


def hf_logits(hf_dir: str, prompts: list[list[int]]) -> tuple[list, list[str]]:
    """(fp32 logits (tokens, vocabulary) of each prompt, what transformers reported missing or
    unexpected while loading: a folder that loads with fresh weights somewhere is no match)."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise CheckError(
            "relaymoe check-hf runs transformers: pip install 'relaymoe[data]' (or transformers)"
        ) from None
    transformers.utils.logging.disable_progress_bar()  # the report is the output
    major = int(transformers.__version__.split(".")[0])
    dtype_arg = {"dtype" if major >= 5 else "torch_dtype": torch.float32}
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            hf_dir, output_loading_info=True, **dtype_arg
        )
    except (OSError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckError(f"transformers cannot load {hf_dir}: {first}") from None
    problems = [
        f"{what}: {sorted(names)[:4]}"
        for what, names in info.items()
        if names and what in ("missing_keys", "unexpected_keys", "mismatched_keys")
    ]
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            out.append(model(input_ids=torch.tensor([ids])).logits[0].float())
    return out, problems
