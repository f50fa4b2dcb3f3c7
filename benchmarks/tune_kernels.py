"""Regenerate the shipped kernel configurations (relaymoe/kernels/tuned_configs.json) here.

    python benchmarks/tune_kernels.py [--configs qwen3_30b_a3b,qwen2_57b_a14b,qwen3_5_35b_a3b]
        [--ep 1,2,4,8,16] [--extra H2048,I2048,E64,K8] [--tokens 8192] [--dtype bfloat16]
        [--budget-s S] [--dry-run] [--out relaymoe/kernels/tuned_configs.json]

For every model config and expert-parallel size (``E_local = num_experts / ep``) it runs, with the
autotuner forced on (``RELAYMOE_AUTOTUNE=1``), what the runtime launches: ``moe_experts`` fwd+bwd
under each recompute policy and a world-of-one ``ring_moe`` fwd+bwd in expert and token mode
(the hop primitives, ``save="none"`` with per-hop recompute). Then it reads each grouped-GEMM
autotuner's cache (its key values and the winning configuration), turns each key into its bucket
(``relaymoe.kernels.tuned.bucket``) and merges the winners into the table under this GPU's name
(``torch.cuda.get_device_name``), with the commit, versions and date as provenance. Other GPUs'
entries stay. ``--extra`` adds shapes outside the model configs (``H..,I..,E..,K..``, E the
experts per rank). The table is rewritten after every shape, so a run cut short keeps what it
tuned; ``--budget-s`` starts no new shape past that many seconds. The weight gradient's key
holds the mean pairs an expert (``WGRAD_KEY``'s ``PAIRS``, a power of two), so ``--tokens``
decides which of its buckets a run fills (tokens x top-k / experts a rank); the other kernels'
keys hold no pair count, and ``--tokens`` only has to give them a representative timing. One
run a regime: e.g. ``--tokens 4096`` (one micro-batch at EP 1) and ``--tokens 32768``.

Prints one line per (kernel, bucket) and the seconds the search took; ``--dry-run`` lists the
shapes without a GPU. Commit the table from a clean tree with the command in the note.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import commit  # noqa: E402

DEFAULT_CONFIGS = ("qwen3_30b_a3b", "qwen2_57b_a14b", "qwen3_5_35b_a3b")
DEFAULT_EP = (1, 2, 4, 8, 16)
KERNELS = ("up_swiglu", "up_single", "rows_gemm", "wgrad")


def shapes(configs, eps) -> list[dict]:
    """(config, H, I, E_local, K) of every config and EP that divides its experts."""
    from relaymoe.config import load_config

    out = []
    for name in configs:
        m = load_config(name).model
        for ep in eps:
            if m.num_experts % ep:
                continue
            out.append(dict(config=name, ep=ep, H=m.hidden_size, I=m.moe_ffn_hidden_size,
                            El=m.num_experts // ep, K=m.moe_router_topk))  # fmt: skip
    return out


def parse_extra(text: str) -> list[dict]:
    """``H2048,I2048,E64,K8;H..`` -> shapes (``config`` "extra", ``ep`` 1, ``El`` = E)."""
    out = []
    for item in (t for t in text.split(";") if t.strip()):
        try:
            d = {part[0]: int(part[1:]) for part in item.strip().split(",")}
            out.append(dict(config="extra", ep=1, H=d["H"], I=d["I"], El=d["E"], K=d["K"]))
        except (KeyError, ValueError, IndexError):
            raise SystemExit(f"--extra {item!r}: expected H<int>,I<int>,E<int>,K<int>") from None
    return out


def run_shape(s: dict, tokens: int, dtype, config) -> None:
    """Every launch the runtime makes for this shape, fwd+bwd, once (the autotuner searches),
    with ``config`` (a ``RingConfig``: its kernels search)."""
    import torch

    from relaymoe.experts import moe_experts
    from relaymoe.ring import ring_moe

    g = torch.Generator(device="cuda").manual_seed(0)
    kw = {"device": "cuda", "generator": g}
    T, H, I, El, K = tokens, s["H"], s["I"], s["El"], min(s["K"], s["El"])
    x = torch.randn(T, H, **kw).to(dtype).requires_grad_()
    w13 = (torch.randn(El, 2 * I, H, **kw) / H**0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(El, H, I, **kw) / I**0.5).to(dtype).requires_grad_()
    idx = torch.rand(T, El, **kw).argsort(1)[:, :K]
    probs = torch.rand(T, K, **kw).requires_grad_()
    dy = torch.randn(T, H, **kw).to(dtype)
    for recompute in ("act", "act_retain", "fc1"):
        moe_experts(x, w13, w2, idx, probs, recompute=recompute,
                    kernels=config.kernels).backward(dy)  # fmt: skip
    for mode in ("expert", "token"):
        ring_moe(x, w13, w2, idx, probs, config=config.replace(mode=mode)).backward(dy)
    torch.cuda.synchronize()


def winners() -> dict:
    """{kernel: {bucket: config}} from the autotuners' caches of this process."""
    from relaymoe.kernels import grouped
    from relaymoe.kernels.tuned import OPTIONAL_CONFIG_KEYS, bucket

    out: dict = {}
    for name, (tuner, names) in grouped.TUNED_KERNELS.items():
        for key, cfg in tuner.cache.items():
            values, rest = key[: len(names)], key[len(names) :]
            dtype = next((str(v) for v in rest if "float" in str(v)), "unknown")
            b = bucket(dict(zip(names, values, strict=True)), dtype)
            out.setdefault(name, {})[b] = {
                **{k: cfg.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")},
                "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                **{k: cfg.kwargs[k] for k in OPTIONAL_CONFIG_KEYS if k in cfg.kwargs},
            }  # fmt: skip
    return out


def merge(table: dict, gpu: str, found: dict, provenance: dict) -> dict:
    """``table`` with ``gpu``'s entries updated by ``found`` (other GPUs untouched)."""
    from relaymoe.kernels.tuned import VERSION

    new = {"version": VERSION, "gpus": dict(table.get("gpus", {})),
           "provenance": dict(table.get("provenance", {}))}  # fmt: skip
    mine = {k: dict(v) for k, v in new["gpus"].get(gpu, {}).items()}
    for kernel, buckets in found.items():
        mine.setdefault(kernel, {}).update(buckets)
    new["gpus"][gpu] = {k: dict(sorted(v.items())) for k, v in sorted(mine.items())}
    new["provenance"][gpu] = provenance
    return new


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--ep", default=",".join(map(str, DEFAULT_EP)))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--extra", default="", help="more shapes: H2048,I2048,E64,K8;...")
    ap.add_argument("--budget-s", type=float, default=None, help="start no shape after this")
    ap.add_argument("--out", default=None, help="default: the package's tuned_configs.json")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    todo = shapes([c for c in a.configs.split(",") if c], [int(e) for e in a.ep.split(",") if e])
    todo += parse_extra(a.extra)
    for s in todo:
        print(f"shape {s}")
    if a.dry_run:
        return 0
    import torch
    import triton

    from relaymoe import options
    from relaymoe.kernels import tuned

    if not torch.cuda.is_available():
        print("tune_kernels: needs a CUDA GPU; nothing tuned")
        return 3
    # always the full search; the Triton kernels are the ones tuned: on sm90 the gathered GEMMs
    # default to the Gluon kernels (fixed configurations), and the Triton ones stay their fallback
    config = options.from_env().replace(kernels={"autotune": "search", "gather_ws": "off"})
    out = Path(a.out) if a.out else tuned.TABLE
    gpu = torch.cuda.get_device_name()
    provenance = {
        "commit": commit(), "torch": torch.__version__, "triton": triton.__version__,
        "date": _dt.date.today().isoformat(), "tokens": a.tokens, "dtype": a.dtype,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }  # fmt: skip
    base = tuned.load_table(str(out)) if out.exists() else {"version": tuned.VERSION}
    t0 = time.perf_counter()
    found: dict = {}
    for n, s in enumerate(todo):
        if a.budget_s is not None and time.perf_counter() - t0 > a.budget_s:
            print(f"budget of {a.budget_s:.0f} s spent: {len(todo) - n} shapes not tuned")
            break
        t1 = time.perf_counter()
        run_shape(s, a.tokens, getattr(torch, a.dtype), config)
        found = winners()
        out.write_text(json.dumps(merge(base, gpu, found, provenance), indent=1) + "\n")
        print(f"tuned {s['config']} ep={s['ep']} (El={s['El']}): {time.perf_counter() - t1:.1f} s",
              flush=True)  # fmt: skip
    for kernel, buckets in sorted(found.items()):
        for b, cfg in sorted(buckets.items()):
            print(f"{gpu} {kernel} {b}: {cfg}")
    print(f"{sum(len(v) for v in found.values())} configurations for {gpu} written to {out} "
          f"({time.perf_counter() - t0:.0f} s of search)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
