"""The WikiText word-level corpus on the real WikiText-103 excerpt: vocabulary, streams, cache, batching."""

import json
import re
from collections import Counter

import pytest
import torch

from neutreno.data.corpus import (
    EOS,
    batchify,
    build_vocabulary,
    encode_file,
    encode_lines,
    load_wikitext,
    read_lines,
)


def test_vocabulary_and_streams_round_trip_real_wikitext(shared_data, tmp_path):
    folder = shared_data / "wikitext103-mini"
    vocab, streams = load_wikitext(folder, cache_dir=tmp_path)
    raw = (folder / "wiki.valid.tokens").read_text(encoding="utf-8").splitlines()
    # Every line, blank ones too, is its words and one <eos> (counted here independently).
    assert streams["valid"].numel() == sum(len(line.split()) + 1 for line in raw)
    assert (streams["valid"] == vocab.ids[EOS]).sum().item() == len(raw)
    train_words = set((folder / "wiki.train.tokens").read_text(encoding="utf-8").split())
    decoded, position = vocab.decode(streams["valid"]), 0
    for line in raw[:400]:
        words = line.split()
        expected = [w if w in train_words else "<unk>" for w in words] + [EOS]
        assert decoded[position : position + len(expected)] == expected
        position += len(expected)
    # Vocabulary: <eos>, then the training words by falling count.
    counts = Counter((folder / "wiki.train.tokens").read_text(encoding="utf-8").split())
    assert vocab.words[0] == EOS and len(vocab) == len(counts) + 1
    assert [counts[w] for w in vocab.words[1:50]] == sorted(
        (counts[w] for w in vocab.words[1:50]), reverse=True
    )
    assert vocab.words[1] == counts.most_common(1)[0][0]


def test_cache_is_reused_and_keyed_by_the_files_bytes(shared_data, tmp_path):
    folder = tmp_path / "wt"
    folder.mkdir()
    for split in ("train", "valid", "test"):
        lines = (shared_data / "wikitext103-mini" / f"wiki.{split}.tokens").read_text().splitlines()[:200]
        (folder / f"wiki.{split}.tokens").write_text("\n".join(lines) + "\n")
    cache = tmp_path / "cache"
    vocab, streams = load_wikitext(folder, cache_dir=cache)
    (cached,) = (cache / "corpora").iterdir()
    vocab2, streams2 = load_wikitext(folder, cache_dir=cache)
    assert vocab2.words == vocab.words and all(torch.equal(streams[s], streams2[s]) for s in streams)
    (folder / "wiki.test.tokens").write_text("a brand new line\n")
    _, streams3 = load_wikitext(folder, cache_dir=cache)
    assert len(list((cache / "corpora").iterdir())) == 2 and cached.exists()
    assert streams3["test"].numel() == 5


def test_a_damaged_cache_is_built_again_with_a_warning(shared_data, tmp_path, capsys):
    """A truncated cache file was a SafetensorError traceback on every later run, naming no file."""
    from safetensors.torch import save_file

    folder = tmp_path / "wt"
    folder.mkdir()
    for split in ("train", "valid", "test"):
        lines = (shared_data / "wikitext103-mini" / f"wiki.{split}.tokens").read_text().splitlines()[:50]
        (folder / f"wiki.{split}.tokens").write_text("\n".join(lines) + "\n")
    vocab, streams = load_wikitext(folder, cache_dir=tmp_path / "cache")
    (cached,) = (tmp_path / "cache" / "corpora").iterdir()
    whole = cached.read_bytes()
    words = json.dumps(vocab.words)
    for damage in (
        lambda: cached.write_bytes(whole[: len(whole) // 2]),  # truncated
        lambda: save_file({"train": streams["train"]}, str(cached), {"vocabulary": words}),  # a split missing
        lambda: save_file(
            {**streams, "test": streams["test"] + len(vocab)}, str(cached), {"vocabulary": words}
        ),
        lambda: save_file({k: v.float() for k, v in streams.items()}, str(cached), {"vocabulary": words}),
    ):
        damage()
        again, rebuilt = load_wikitext(folder, cache_dir=tmp_path / "cache")
        assert f"the corpus cache {cached} is damaged" in capsys.readouterr().err
        assert again.words == vocab.words and all(torch.equal(rebuilt[s], streams[s]) for s in streams)
        assert cached.read_bytes() == whole  # written again


def test_batchify_makes_contiguous_rows():
    stream = torch.arange(23)
    rows = batchify(stream, 4)
    assert rows.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    with pytest.raises(ValueError, match="too short"):
        batchify(torch.arange(5), 4)


def test_bad_text_files_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such text file"):
        read_lines(tmp_path / "missing.tokens")
    (tmp_path / "empty.tokens").write_text(" \n\n")
    with pytest.raises(ValueError, match=r"empty\.tokens is empty"):
        read_lines(tmp_path / "empty.tokens")
    (tmp_path / "latin1.tokens").write_bytes("café au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.tokens is not UTF-8 text \(byte 3"):
        read_lines(tmp_path / "latin1.tokens")
    with pytest.raises(FileNotFoundError, match=r"wiki.train.tokens"):
        load_wikitext(tmp_path, cache_dir=tmp_path)


def test_unknown_words_map_to_unk_and_without_unk_fail():
    vocab = build_vocabulary(["the cat <unk>", "the dog"])
    assert vocab.words == [EOS, "the", "cat", "<unk>", "dog"]
    assert encode_lines(["the bird"], vocab).tolist() == [1, 3, 0]
    # ValueError, not KeyError: the CLI prints it as one line (a `generate` prompt, a corpus without <unk>)
    with pytest.raises(ValueError, match="'bird' is not in the vocabulary"):
        build_vocabulary(["the cat"]).encode("bird")
    with pytest.raises(ValueError, match="'bird' is not in the vocabulary"):
        build_vocabulary(["the cat"]).encode_text("the bird")


def test_a_word_missing_from_a_vocabulary_without_unk_names_the_file_and_line(tmp_path):
    folder = tmp_path / "wt"
    folder.mkdir()
    for split, text in [("train", "the cat sat\n"), ("valid", "the cat\nthe dog sat\n"), ("test", "sat\n")]:
        (folder / f"wiki.{split}.tokens").write_text(text)
    with pytest.raises(
        ValueError, match=re.escape(f"{folder / 'wiki.valid.tokens'}:2: word 'dog' is not in")
    ):
        load_wikitext(folder, cache_dir=tmp_path / "cache")
    vocab = build_vocabulary(["the cat sat"])
    with pytest.raises(ValueError, match=re.escape(f"{folder / 'wiki.valid.tokens'}:2: word 'dog'")):
        encode_file(folder / "wiki.valid.tokens", vocab)


def test_lines_end_at_newlines_only_as_transformer_xl_reads_them(tmp_path):
    """Transformer-XL reads a text-mode file line by line: \\n, \\r\\n and \\r end a line; a form feed,
    \\x85, \\u2028 … (where str.splitlines also breaks) stay in it."""
    text = "a\x0cb c\x1cd\r\ne\x85f\u2028g\u2029h\x0bi\x1d\x1ej\rk\n\nl"
    path = tmp_path / "wiki.x.tokens"
    path.write_bytes(text.encode("utf-8"))
    with open(path, encoding="utf-8") as f:  # Python's text mode: universal newlines, as Transformer-XL's
        expected = [line.removesuffix("\n") for line in f]
    assert expected == ["a\x0cb c\x1cd", "e\x85f\u2028g\u2029h\x0bi\x1d\x1ej", "k", "", "l"]
    assert read_lines(path) == expected
    path.write_bytes((text + "\n").encode("utf-8"))  # a final line break ends the last line, adds none
    assert read_lines(path) == expected

    folder = tmp_path / "wt"
    folder.mkdir()
    for split in ("train", "valid", "test"):
        (folder / f"wiki.{split}.tokens").write_text("the cat\x0csat on\u2028the mat\n = Title = \n")
    vocab, streams = load_wikitext(folder, cache_dir=tmp_path / "cache")
    # \x0c and \u2028 are whitespace to str.split, so they separate words, but end no line: 2 <eos>
    words = ["the", "cat", "sat", "on", "the", "mat", EOS, "=", "Title", "=", EOS]
    assert vocab.decode(streams["valid"]) == words
    # A stream cached before (when \x0c also ended a line), named by the files' bytes only, is not reused.
    from neutreno.data.corpus import _cache_file, _write_cache

    files = [(folder / f"wiki.{split}.tokens").read_bytes() for split in ("train", "valid", "test")]
    stale = {split: torch.zeros(4, dtype=torch.int64) for split in ("train", "valid", "test")}
    _write_cache(_cache_file(folder, files, tmp_path / "old"), stale, {"vocabulary": json.dumps(vocab.words)})
    assert torch.equal(load_wikitext(folder, cache_dir=tmp_path / "old")[1]["valid"], streams["valid"])


def test_sentence_limit_below_one_and_a_csv_with_a_byte_order_mark(tmp_path):
    from neutreno.data.text import load_labelled_texts, load_sentences

    text = tmp_path / "text.txt"
    text.write_text("one two three four five six\nseven eight nine ten eleven twelve\n")
    assert load_sentences(text, limit=1) == ["one two three four five six"]
    for limit in (0, -2):
        with pytest.raises(ValueError, match=f"limit must be >= 1, got {limit}"):
            load_sentences(text, limit=limit)
    table = tmp_path / "bom.csv"
    table.write_bytes("text,label\r\ngood film,pos\r\nbad film,neg\r\n".encode("utf-8-sig"))  # Excel's CSV
    assert table.read_bytes().startswith(b"\xef\xbb\xbf")
    assert load_labelled_texts(table) == [("good film", None, "pos"), ("bad film", None, "neg")]


def test_a_byte_order_mark_is_not_text_in_a_corpus_or_a_sentence_file(shared_data, tmp_path):
    """A file saved by a Windows editor starts with U+FEFF: WikiText's first word became "\ufeff=" (a
    word of its own in the vocabulary; in valid, an <unk>), and the first sentence began with it. Real
    WikiText lines, once with the mark and once without: the same vocabulary and streams."""
    from neutreno.data.text import load_sentences

    folders = {}
    for mark in ("", "\ufeff"):
        folder = folders[mark] = tmp_path / f"wt{len(mark)}"
        folder.mkdir()
        for split in ("train", "valid", "test"):
            lines = (shared_data / "wikitext103-mini" / f"wiki.{split}.tokens").read_text().splitlines()[:80]
            (folder / f"wiki.{split}.tokens").write_text(mark + "\n".join(lines) + "\n", encoding="utf-8")
    assert (folders["\ufeff"] / "wiki.train.tokens").read_bytes().startswith(b"\xef\xbb\xbf")
    plain_vocab, plain = load_wikitext(folders[""], cache_dir=tmp_path / "cache")
    vocab, streams = load_wikitext(folders["\ufeff"], cache_dir=tmp_path / "cache")
    assert vocab.words == plain_vocab.words and not any("\ufeff" in word for word in vocab.words)
    assert all(torch.equal(streams[split], plain[split]) for split in plain)
    sentences = folders["\ufeff"] / "wiki.valid.tokens"
    assert load_sentences(sentences)[0] == load_sentences(folders[""] / "wiki.valid.tokens")[0]


def test_a_cache_holding_the_old_count_of_dropped_characters_is_not_reused(tmp_path, monkeypatch, capsys):
    """The count changed (characters, not bytes; added tokens kept): caches written before kept their
    old count, warned of at every load. Such a cache (here with a count of 0) is not read."""
    tokenizers = pytest.importorskip("tokenizers")
    from neutreno.data import corpus

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    bpe.train_from_iterator(["the cat sat on the mat\n" * 20], tokenizers.trainers.BpeTrainer(vocab_size=40))
    bpe.save(str(tmp_path / "bpe.json"))
    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "train.txt").write_text("the cat sat on the mat\n" * 4)
    (folder / "valid.txt").write_text("the cat § sat ¶\n")  # two characters it has no symbol for
    monkeypatch.setattr(corpus, "_DROPPED_COUNTED", b"subword streams, dropped characters counted")  # before
    monkeypatch.setattr(corpus.SubwordTokenizer, "dropped_characters", lambda self, text: 0)  # a wrong count
    corpus.load_corpus(folder, tmp_path / "bpe.json", cache_dir=tmp_path / "cache")
    monkeypatch.undo()
    assert "drops" not in capsys.readouterr().err
    corpus.load_corpus(folder, tmp_path / "bpe.json", cache_dir=tmp_path / "cache")
    assert "valid.txt: the tokenizer drops 2 of its 16 characters" in capsys.readouterr().err
