"""``relaymoe data``: a corpus to Megatron's indexed dataset, read back with megatron-core.

The tokenizer is a small byte-level BPE trained here, offline, with the ``tokenizers`` library on
a corpus the test writes (seeded), saved as a Hugging Face tokenizer directory. Checks:

* every document of the dataset (megatron-core's ``IndexedDataset``) holds exactly the ids the
  tokenizer gives for its text, then the EOD id; empty lines are skipped, nothing else;
* those ids are what Megatron's own ``build_tokenizer`` (``--tokenizer-type
  HuggingFaceTokenizer --tokenizer-model DIR``, parsed by Megatron's parser) gives, EOD included;
* an interrupted run continues: the parts made before the interruption are kept, the output is
  byte-identical to an uninterrupted run's and to a 2-worker run's; a completed output is not
  redone, and a changed tokenizer redoes it;
* plain text and a bare ``tokenizer.json`` (with ``--eod-token``), and the refusals.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from relaymoe import data
from tests.fixtures import needs

pytestmark = needs("tokenizers", "transformers", "megatron.core")

WORDS = "the a cat dog sat ran on under mat hat big small red blue über naïve 東京 42 7".split()


def _corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def _train_tokenizer(folder: Path, texts: list[str], vocab: int = 400) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    texts = _corpus(300, seed=1)
    tok_dir = _train_tokenizer(root / "tok", texts)
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)]
    lines.insert(7, "")  # a blank line: no document
    (root / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    return root, texts, tok_dir


def _read(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    assert len(ds.document_indices) == len(ds) + 1  # one sequence per document
    return [ds[i].tolist() for i in range(len(ds))]


def _prepare(root, tok, prefix, **kw):
    kw.setdefault("progress", False)
    return data.prepare([str(root / "corpus.jsonl")], str(root / prefix), str(tok), **kw)


def test_dataset_holds_the_tokenizers_ids_and_eod(corpus):
    from tokenizers import Tokenizer

    root, texts, tok_dir = corpus
    r = _prepare(root, tok_dir, "out/a", chunk_mib=0.004)  # ~4 KiB parts: several
    assert r.parts_made > 2 and not r.skipped, r
    reference = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eod = reference.token_to_id("<|endoftext|>")
    docs = _read(r.outputs["text"])
    assert len(docs) == len(texts) == r.documents
    for got, text in zip(docs, texts, strict=True):
        assert got == reference.encode(text).ids + [eod], text
    assert r.tokens["text"] == sum(map(len, docs))
    manifest = json.loads(Path(r.outputs["text"] + ".json").read_text())
    assert manifest["megatron_flags"] == r.megatron_flags() and manifest["documents"] == 300
    assert r.megatron_flags() == [
        "--data-path", r.outputs["text"], "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(tok_dir.resolve()),
    ]  # fmt: skip


def test_ids_match_megatrons_build_tokenizer(corpus):
    """The tokenizer ``relaymoe data`` builds is the one training builds from the flags."""
    import argparse

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import arguments

    root, texts, tok_dir = corpus
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ns = parser.parse_args(
        ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok_dir)]
    )
    ns.rank, ns.tensor_model_parallel_size = 0, 1
    training = build_tokenizer(ns)
    ours = data.build_megatron_tokenizer(str(tok_dir))
    assert ours.eod == training.eod is not None and ours.vocab_size == training.vocab_size
    for text in texts[:50]:
        assert ours.tokenize(text) == training.tokenize(text)


def test_interrupted_run_continues_and_matches(corpus, monkeypatch):
    root, _, tok_dir = corpus
    whole = _prepare(root, tok_dir, "out/whole", chunk_mib=0.004)
    n_parts = whole.parts_made
    real = data.make_part
    made = []

    def dies_after_two(parts_dir, chunk, settings):
        if len(made) == 2:
            raise KeyboardInterrupt  # the user's Ctrl-C, mid-run
        made.append(chunk.index)
        return real(parts_dir, chunk, settings)

    monkeypatch.setattr(data.build, "make_part", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        _prepare(root, tok_dir, "out/resumed", chunk_mib=0.004)
    assert not Path(root / "out/resumed_text_document.bin").exists()
    monkeypatch.setattr(data.build, "make_part", real)
    r = _prepare(root, tok_dir, "out/resumed", chunk_mib=0.004)
    assert (r.parts_kept, r.parts_made) == (2, n_parts - 2), r
    a, b = whole.outputs["text"], r.outputs["text"]
    for ext in (".bin", ".idx"):
        assert Path(a + ext).read_bytes() == Path(b + ext).read_bytes(), ext
    assert not Path(root / "out/resumed.parts").exists()  # removed after the merge
    again = _prepare(root, tok_dir, "out/resumed", chunk_mib=0.004)
    assert again.skipped and again.documents == whole.documents


def test_two_workers_write_the_same_bytes(corpus):
    root, _, tok_dir = corpus
    one = _prepare(root, tok_dir, "out/w1", chunk_mib=0.004)
    two = _prepare(root, tok_dir, "out/w2", chunk_mib=0.004, workers=2)
    for ext in (".bin", ".idx"):
        assert (
            Path(one.outputs["text"] + ext).read_bytes()
            == Path(two.outputs["text"] + ext).read_bytes()
        )


def test_another_tokenizer_redoes_the_output(corpus, tmp_path):
    root, texts, tok_dir = corpus
    first = _prepare(root, tok_dir, "out/t")
    other = _train_tokenizer(tmp_path / "tok2", texts, vocab=300)
    second = _prepare(root, other, "out/t")
    assert not second.skipped and second.parts_made >= 1
    assert _read(first.outputs["text"]) != _read(second.outputs["text"]) or first.tokens != (
        second.tokens
    )


def test_plain_text_and_a_bare_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer

    texts = _corpus(40, seed=2)
    tok_dir = _train_tokenizer(tmp_path / "tok", texts)
    (tmp_path / "c.txt").write_text("\n".join(texts[:20]) + "\n\n" + "\n".join(texts[20:]))
    bare = tok_dir / "tokenizer.json"
    with pytest.raises(data.DataError, match="--eod-token"):
        data.prepare([str(tmp_path / "c.txt")], str(tmp_path / "o"), str(bare), progress=False)
    with pytest.raises(data.DataError, match="not a token of"):
        data.prepare([str(tmp_path / "c.txt")], str(tmp_path / "o"), str(bare),
                     eod_token="<eos>", progress=False)  # fmt: skip
    r = data.prepare([str(tmp_path / "c.txt")], str(tmp_path / "o"), str(bare),
                     eod_token="<|endoftext|>", progress=False)  # fmt: skip
    assert Path(r.tokenizer_dir) == (tmp_path / "o_tokenizer").resolve()
    ref = Tokenizer.from_file(str(bare))
    eod = ref.token_to_id("<|endoftext|>")
    assert _read(r.outputs["text"]) == [ref.encode(t).ids + [eod] for t in texts]
    para = data.prepare([str(tmp_path / "c.txt")], str(tmp_path / "p"), str(tok_dir),
                        text_mode="paragraph", progress=False)  # fmt: skip
    assert para.documents == 2


def test_bad_inputs_are_refused_with_the_line_and_the_fix(tmp_path, corpus):
    _, _, tok_dir = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text key"}\n')
    with pytest.raises(data.DataError, match=r"byte 15 has no key 'text'.*--json-keys body"):
        data.prepare([str(bad)], str(tmp_path / "o"), str(tok_dir), progress=False)
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(data.DataError, match="byte 15 is not JSON.*--input-format text"):
        data.prepare([str(bad)], str(tmp_path / "o"), str(tok_dir), progress=False)
    with pytest.raises(data.DataError, match="no such file"):
        data.prepare([str(tmp_path / "nope.jsonl")], str(tmp_path / "o"), str(tok_dir))
    with pytest.raises(data.DataError, match="no such file or directory"):
        data.prepare([str(bad)], str(tmp_path / "o"), str(tmp_path / "no_tokenizer"))
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(b"\x1f\x8b")
    with pytest.raises(data.DataError, match="decompress"):
        data.prepare([str(gz)], str(tmp_path / "o"), str(tok_dir))


def test_cli_prints_the_flags_to_train_with(corpus, capsys):
    from relaymoe.cli import main

    root, _, tok_dir = corpus
    rc = main(["data", "--input", str(root / "corpus.jsonl"), "--output-prefix",
               str(root / "out/cli"), "--tokenizer", str(tok_dir), "--workers", "1",
               "--no-progress"])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    prefix = str((root / "out/cli_text_document").resolve())
    assert out.split() == ["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                           "--tokenizer-model", str(tok_dir.resolve())]  # fmt: skip
    assert f"DATA_PATH='{prefix}'" in err and "300 documents" in err
    rc = main(["data", "--input", str(root / "missing.jsonl"), "--output-prefix",
               str(root / "x"), "--tokenizer", str(tok_dir)])  # fmt: skip
    assert rc == 2 and "relaymoe data: error: --input" in capsys.readouterr().err
