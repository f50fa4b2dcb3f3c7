"""How far the fp8 experts are from bf16 and from float64, per recipe (issue #55): one shape,
one process.

For each recipe (``tensorwise``, ``delayed``, ``blockwise``, and the tensor-scaled ones with bf16
weight gradients), ``moe_experts(fp8=...)`` on bf16 inputs against the bf16 experts (the same
call without fp8) and against the float64 oracle (``relaymoe.reference``), the relative error
``||got - want|| / ||want||`` of the output and of every gradient (dx, dw13, dw2, dprobs). The
bf16 experts' own error against float64 is the first row, for scale. Delayed scaling runs
``--steps`` calls on one state and reports the last (its first call scales by 1). Rows
``bench: fp8_error`` with ``fp8`` (the recipe), ``against`` (``bf16`` or ``float64``) and
``err_<tensor>``.

    PYTHONPATH=. python3 benchmarks/lab/fp8_error.py [--shape T,H,I,E,K] [--steps 3]
        [--out F.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import gpu_writer, print_table, rel_err  # noqa: E402

NAMES = ("out", "dx", "dw13", "dw2", "dprobs")
RECIPES = {  # label -> (recipe name, Fp8Recipe fields beyond it)
    "tensorwise": ("tensorwise", {}),
    "tensorwise_e4m3": ("tensorwise", {"fmt": "e4m3"}),
    "tensorwise_bf16wgrad": ("tensorwise", {"fp8_wgrad": False}),
    "delayed": ("delayed", {}),
    "blockwise": ("blockwise", {}),
}


def problem(t: int, h: int, i: int, e: int, k: int, seed: int = 0):
    """bf16 x, w13, w2, router probabilities and upstream gradient; softmax top-k routing."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = {"generator": gen, "device": "cuda"}
    x = torch.randn(t, h, **kw).to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * i, h, **kw) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, **kw) / i**0.5).to(torch.bfloat16)
    probs, idx = torch.topk(torch.softmax(torch.randn(t, e, **kw), -1), k, dim=-1)
    dy = torch.randn(t, h, **kw).to(torch.bfloat16)
    return x, w13, w2, idx.to(torch.int32), probs.to(torch.bfloat16), dy


def run(fn, x, w13, w2, idx, probs, dy, dtype=None) -> dict:
    """Output and gradients of ``fn`` (``moe_experts``' signature), inputs cast to ``dtype``."""
    leaves = [v.detach().to(dtype or v.dtype).requires_grad_() for v in (x, w13, w2, probs)]
    out = fn(leaves[0], leaves[1], leaves[2], idx, leaves[3])
    out.backward(dy.to(out.dtype))
    return dict(zip(NAMES, [out.detach()] + [v.grad for v in leaves], strict=True))


def errors(label: str, name: str | None, got: dict, refs: dict) -> list[dict]:
    return [{"bench": "fp8_error", "variant": label, **({"fp8": name} if name else {}),
             "against": against, **{f"err_{n}": round(rel_err(got[n], ref[n]), 5) for n in NAMES}}
            for against, ref in refs.items()]  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32768,2048,768,128,8", help="T,H,I,E,K (qwen3 T32k)")
    ap.add_argument("--steps", type=int, default=3, help="calls of delayed scaling's state")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    writer = gpu_writer("fp8_error", "fp8_error", args.out)
    if writer is None:
        return 1
    from relaymoe.experts import moe_experts
    from relaymoe.fp8_recipe import Fp8Recipe
    from relaymoe.fp8_state import Fp8State
    from relaymoe.reference import moe_experts_reference

    dims = tuple(int(v) for v in args.shape.split(","))
    inputs = problem(*dims)
    exact = run(moe_experts_reference, *inputs, dtype=torch.float64)
    bf16 = run(lambda *a: moe_experts(*a, backend="triton"), *inputs)
    rows = errors("bf16", None, bf16, {"float64": exact})
    for label, (name, fields) in RECIPES.items():
        state = Fp8State(Fp8Recipe(name, **fields))
        fn = lambda *a, s=state: moe_experts(*a, backend="triton", fp8=s)  # noqa: E731
        for _ in range(args.steps if name == "delayed" else 1):
            got = run(fn, *inputs)
        rows += errors(label, name, got, {"bf16": bf16, "float64": exact})
        del got
        torch.cuda.empty_cache()
    for row in rows:
        writer.write({"shape": args.shape, **row})
    print_table(rows, ["variant", "fp8", "against", *(f"err_{n}" for n in NAMES)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
