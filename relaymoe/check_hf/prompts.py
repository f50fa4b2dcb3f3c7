"""The fixed prompts ``relaymoe check-hf`` runs through both models.

With the folder's tokenizer (``tokenizer.json``), a few sentences of different kinds (prose,
code, numbers) tokenised; without one, or where it does not load, token ids drawn from a fixed
seed. Either way the same ids every run, so that two checks of one pair print the same errors.
"""

from __future__ import annotations

from pathlib import Path

TEXTS = (
    "The capital of France is Paris, and the capital of Japan is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Mixture-of-experts layers send each token to a few of many feed-forward networks, so",
    "1, 1, 2, 3, 5, 8, 13, 21, 34,",
)
RANDOM_LENGTHS = (8, 16, 32)  # tokens of each prompt drawn from the seed
SEED = 0


def prompts(hf_dir: str, vocab_size: int) -> tuple[list[list[int]], str]:
    """(token ids of each prompt, where they came from: ``tokenizer`` or ``seed``)."""
    if (Path(hf_dir) / "tokenizer.json").is_file():
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(hf_dir)
            ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
            if all(ids) and all(0 <= i < vocab_size for p in ids for i in p):
                return ids, "tokenizer"
        except Exception:  # noqa: BLE001  (any tokenizer trouble: fall back to fixed ids)
            pass
    import torch

    g = torch.Generator().manual_seed(SEED)
    return [
        torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in RANDOM_LENGTHS
    ], "seed"
