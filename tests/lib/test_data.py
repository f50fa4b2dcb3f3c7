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
import re
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
    assert out.splitlines() == [
        f"--data-path {prefix}",
        "--tokenizer-type HuggingFaceTokenizer",
        f"--tokenizer-model {tok_dir.resolve()}",
    ]  # one flag a line
    assert f"DATA_PATH='{prefix}'" in err and "300 documents" in err
    rc = main(["data", "--input", str(root / "missing.jsonl"), "--output-prefix",
               str(root / "x"), "--tokenizer", str(tok_dir)])  # fmt: skip
    assert rc == 2 and "relaymoe data: error: --input" in capsys.readouterr().err


# ------------------------------------------------ refusals, locking, cleaning up (issue #52)
def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_an_empty_corpus_is_refused_and_leaves_nothing(corpus, tmp_path):
    """Item 4: no 0-byte ``.bin`` (Megatron cannot memory-map it), nothing left behind."""
    _, _, tok_dir = corpus
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('\n{"text": "  "}\n\n')
    out = tmp_path / "o"
    with pytest.raises(data.DataError, match=r"empty \(0 bytes\), nothing to tokenise"):
        data.prepare([str(tmp_path / "empty.jsonl")], str(out / "e"), str(tok_dir))
    with pytest.raises(data.DataError, match="no document .every line or field is empty"):
        data.prepare([str(tmp_path / "blank.jsonl")], str(out / "b"), str(tok_dir),
                     progress=False)  # fmt: skip
    assert _files(out) == []


def test_a_refused_run_leaves_no_folder_it_made(corpus, tmp_path):
    """Bad input leaves nothing behind: not even the output folders the run created for its
    prefix (a folder that existed before stays)."""
    root, _, _ = corpus
    src = str(next(root.glob("*.jsonl")))
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "kept").mkdir()
    for prefix in (tmp_path / "new" / "deep" / "p", tmp_path / "kept" / "sub" / "p"):
        with pytest.raises(data.DataError, match="no such file or directory"):
            data.prepare([src], str(prefix), str(tmp_path / "no_tokenizer"), progress=False)
        with pytest.raises(data.DataError, match=r"empty \(0 bytes\)"):
            data.prepare([str(tmp_path / "empty.jsonl")], str(prefix), str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl", "kept"]
    assert list((tmp_path / "kept").iterdir()) == []


def test_the_dataset_check_refuses_an_empty_bin_and_another_tokenizer(corpus, tmp_path):
    """Items 4-5, the dry run's side: ``dataset_problems`` (train.sh's preflight) refuses an
    empty ``.bin`` and a TOKENIZER other than the one the manifest records; a copy of the same
    tokenizer elsewhere passes (the files decide, not the path)."""
    import shutil

    root, texts, tok_dir = corpus
    prefix = _prepare(root, tok_dir, "out/chk").outputs["text"]
    assert data.dataset_problems(prefix, str(tok_dir)) == []
    shutil.copytree(tok_dir, tmp_path / "copy")
    assert data.dataset_problems(prefix, str(tmp_path / "copy")) == []
    other = _train_tokenizer(tmp_path / "tok300", texts, vocab=300)
    (p,) = data.dataset_problems(prefix, str(other))
    assert p.startswith(f"TOKENIZER={other} is not the tokenizer DATA_PATH {prefix} was made")
    assert f"fix: TOKENIZER={tok_dir.resolve()}" in p
    empty = tmp_path / "e_text_document"
    Path(f"{empty}.bin").write_bytes(b"")
    Path(f"{empty}.idx").write_bytes(Path(prefix + ".idx").read_bytes())
    (p,) = data.dataset_problems(str(empty), None)
    assert f"DATA_PATH: {empty}.bin is empty (no token)" in p and "fix:" in p
    (p,) = data.dataset_problems(str(tmp_path / "x"), None)
    assert f"no {tmp_path}/x.bin or {tmp_path}/x.idx" in p


def test_an_output_prefix_that_cannot_be_written_is_one_line(corpus, tmp_path, capsys):
    """Item 9: NotADirectoryError / FileNotFoundError became one line and exit status 2."""
    from relaymoe.cli import main

    root, _, tok_dir = corpus
    (tmp_path / "afile").write_text("x")
    bad = [str(tmp_path / "afile" / "sub" / "x")]
    if Path("/proc/self").is_dir():
        bad.append("/proc/relaymoe_x")
    for prefix in bad:
        rc = main(["data", "--input", str(root / "corpus.jsonl"), "--output-prefix", prefix,
                   "--tokenizer", str(tok_dir)])  # fmt: skip
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith("relaymoe data: error: --output-prefix") and "fix:" in err, err


def test_a_second_run_on_one_prefix_is_refused_while_the_first_runs(corpus, tmp_path):
    """Item 11: an exclusive lock on the prefix, naming the run that holds it."""
    import os

    from relaymoe.data.lock import PrefixLock

    root, _, tok_dir = corpus
    prefix = str((tmp_path / "o").resolve())
    with PrefixLock(prefix):
        with pytest.raises(data.DataError, match=rf"another relaymoe data run \(process "
                           rf"{os.getpid()}\) is writing this output prefix"):  # fmt: skip
            _prepare(root, tok_dir, tmp_path / "o")
    assert not Path(f"{prefix}.lock").exists()
    r = _prepare(root, tok_dir, tmp_path / "o")
    assert r.documents == 300 and not Path(f"{prefix}.lock").exists()


def test_a_failed_run_leaves_no_temporary_file(corpus, tmp_path):
    """Item 12: a run that stops on a bad line keeps its completed parts and removes the part
    it was writing (``.tmpPID.bin``), and those a killed run left."""
    root, _, tok_dir = corpus
    lines = (root / "corpus.jsonl").read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*lines[:150], "not json", *lines[150:]]) + "\n")
    parts = tmp_path / "o.parts"
    parts.mkdir()
    (parts / "000000_text.tmp999.bin").write_bytes(b"left by a killed run")
    with pytest.raises(data.DataError, match="is not JSON"):
        data.prepare([str(bad)], str(tmp_path / "o"), str(tok_dir), chunk_mib=0.004,
                     progress=False)  # fmt: skip
    left = _files(tmp_path)
    assert not [f for f in left if ".tmp" in f or f.endswith(".lock")], left
    assert "o.parts/000000.json" in left  # the completed parts, for a rerun


def test_the_json_keys_hint_names_only_text_fields(corpus, tmp_path):
    """Item 13: the fix suggested for a missing key is a string field, never ``id``."""
    _, _, tok_dir = corpus
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 7, "body": "some text", "score": 1.5}\n')
    with pytest.raises(data.DataError, match=r"has no key 'text' .*; fix: --json-keys body$"):
        data.prepare([str(rows)], str(tmp_path / "o"), str(tok_dir), progress=False)
    rows.write_text('{"id": 7}\n')
    with pytest.raises(data.DataError, match="no field of that line is a string"):
        data.prepare([str(rows)], str(tmp_path / "o"), str(tok_dir), progress=False)


@pytest.mark.slow
def test_ctrl_c_is_one_line_saying_a_rerun_continues(tmp_path):
    """Item 10: Ctrl-C (SIGINT to the whole process group, as a terminal sends it) during a
    2-worker run, once a part is made: exit status 130 and one line on stderr, saying that a
    rerun continues; no traceback from the command or its workers, and none of the host
    warnings they printed when importing megatron-core (item 14); no temporary file, the
    completed parts kept (``test_interrupted_run_continues_and_matches`` reruns such a run).
    Its own tokenizer and corpus, not the module's: pytest-xdist may then run it beside them."""
    import os
    import signal
    import subprocess
    import sys
    import time

    texts = _corpus(300, seed=1)
    tok_dir = _train_tokenizer(tmp_path / "tok", texts)
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) * 20)  # ~37 parts
    prefix = tmp_path / "o"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.Popen(
        [sys.executable, "-m", "relaymoe", "data", "--input", str(big), "--output-prefix",
         str(prefix), "--tokenizer", str(tok_dir), "--workers", "2", "--chunk-mib", "0.016",
         "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    parts = Path(f"{prefix}.parts")
    t0 = time.monotonic()
    while not list(parts.glob("*.json")) and p.poll() is None and time.monotonic() - t0 < 240:
        time.sleep(0.02)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err)  # 0: it finished before the signal
    assert err.splitlines() == [
        f"relaymoe data: interrupted; the parts made so far are kept in {prefix}.parts/: rerun "
        "the same command to continue from them"
    ], err
    left = _files(tmp_path)
    assert not [f for f in left if ".tmp" in f or f.endswith(".lock")], left
    assert [f for f in left if re.fullmatch(r"o\.parts/\d+\.json", f)], left
