"""The tiny Qwen3 example's real-data path on CPU, up to the first training batch.

``examples/tiny_qwen3/make_corpus.py`` writes a corpus (the stdlib's modules, cut small here)
and trains its 1024-token tokenizer, ``relaymoe data`` tokenises it, and then, in a fresh
process as ``relaymoe.megatron.pretrain`` does: Megatron's parser and validation take the
real-data flags of ``benchmarks.e2e.pretrain_args(data=...)`` (what ``train.sh DATA=real``
runs on the GPU), Megatron builds the HuggingFaceTokenizer from them (the model keeps the
config's 1024 rows), and ``pretrain``'s dataset provider returns training samples whose tokens
are consecutive tokens of the indexed dataset, labels shifted by one. The training itself
needs a GPU (``tests/gpu/test_e2e_gpu.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.fixtures import MEGATRON_CPU_PRELUDE, needs, run_python

pytestmark = needs("tokenizers", "transformers", "megatron.training")

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = MEGATRON_CPU_PRELUDE + textwrap.dedent(
    """
    import json, numpy
    from benchmarks.e2e import pretrain_args
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import get_tokenizer
    from relaymoe.megatron.pretrain import datasets_provider, use_prebuilt_dataset_helpers
    prefix, tokenizer = sys.argv[1:3]
    flags = pretrain_args("tiny_qwen3", gpus=1, steps=4, dispatcher="ring", seed=1,
                          data=(prefix, tokenizer))
    assert "--mock-data" not in flags, flags
    sys.argv = ["pretrain", *flags, "--use-cpu-initialization"]
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    tok = get_tokenizer()
    use_prebuilt_dataset_helpers()
    train, valid, _ = datasets_provider([8, 2, 0])
    ds = IndexedDataset(prefix)  # kept alive: its items are views of its memory map
    stream = numpy.concatenate([ds[i] for i in range(len(ds))]).astype(numpy.int32).tobytes()

    def occurs(piece):  # a run of consecutive tokens of one document, at a token boundary
        b = numpy.asarray(piece, dtype=numpy.int32).tobytes()
        at = stream.find(b)
        while at >= 0 and at % 4:
            at = stream.find(b, at + 1)
        return at >= 0

    checked = 0
    for i in range(4):  # documents are shuffled: a sample joins pieces of several, EOD between
        s = train[i]
        tokens, labels = s["tokens"].tolist(), s["labels"].tolist()
        assert tokens[1:] == labels[:-1], i
        window, piece, pieces = tokens + labels[-1:], [], []
        for t in window:
            piece.append(t)
            if t == tok.eod:
                pieces.append(piece)
                piece = []
        pieces.append(piece)
        assert all(occurs(p) for p in pieces if p), i
        checked += 1
    print("REAL", json.dumps({"padded_vocab": args.padded_vocab_size, "eod": tok.eod,
                               "vocab": tok.vocab_size, "checked": checked,
                               "valid": len(valid)}))
    """
)


def test_real_data_flags_reach_megatrons_dataset(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    work = tmp_path / "tq"
    p = subprocess.run([sys.executable, str(ROOT / "examples/tiny_qwen3/make_corpus.py"),
                        str(work), "--max-mib", "0.3"], capture_output=True, text=True,
                       timeout=120, env=env)  # fmt: skip
    assert p.returncode == 0, p.stderr
    from relaymoe import data

    r = data.prepare([str(work / "corpus.jsonl")], str(work / "stdlib"), str(work / "tokenizer"),
                     progress=False)  # fmt: skip
    assert r.documents > 50 and r.tokens["text"] > 50_000, r
    env = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    p = run_python(["-c", _SCRIPT, r.outputs["text"], r.tokenizer_dir], timeout=240, env=env,
                   cwd=tmp_path)  # fmt: skip
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("REAL ")]
    assert p.returncode == 0 and line, p.stdout[-2000:] + p.stderr[-4000:]
    got = json.loads(line[0][5:])
    assert got["padded_vocab"] == 1024 and got["vocab"] == 1024 and got["checked"] == 4, got
    assert got["eod"] == 0 and got["valid"] > 0, got  # <|endoftext|> is the first token
