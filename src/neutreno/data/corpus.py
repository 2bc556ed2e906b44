"""Word-level language-modelling corpora in the WikiText layout (``wiki.{train,valid,test}.tokens``).

As in Transformer-XL (the lmtool-fwp setting of SPEC §4): every line, blank ones included, is split on
whitespace and ends with ``<eos>``; the vocabulary comes from the training file only, ``<eos>`` first,
then words by falling count (ties in order of first appearance); ``<unk>`` is an ordinary word of the
files. Token streams are cached as a safetensors file keyed by a hash of the files' bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path

import torch
from torch import Tensor

from neutreno.io import atomic_path

EOS = "<eos>"
SPLITS = ("train", "valid", "test")


class Vocabulary:
    """Words ↔ ids. ``encode`` maps an unknown word to ``<unk>`` when the vocabulary has it."""

    def __init__(self, words: list[str]) -> None:
        if len(set(words)) != len(words):
            raise ValueError("vocabulary words must be unique")
        self.words = list(words)
        self.ids = {word: i for i, word in enumerate(self.words)}
        self.unk = self.ids.get("<unk>")

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, line: str) -> list[int]:
        """A line → ids of its whitespace-separated words and a final ``<eos>``."""
        ids = []
        for word in [*line.split(), EOS]:
            index = self.ids.get(word, self.unk)
            if index is None:
                raise KeyError(f"word {word!r} is not in the vocabulary (and it has no <unk>)")
            ids.append(index)
        return ids

    def decode(self, ids: list[int] | Tensor) -> list[str]:
        return [self.words[i] for i in (ids.tolist() if isinstance(ids, Tensor) else ids)]


def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file; a clear error for a missing, empty or non-UTF-8 file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such text file: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {error.start}: {data[error.start : error.start + 1]!r})"
        ) from None
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text.splitlines()


def build_vocabulary(lines: list[str]) -> Vocabulary:
    """``<eos>`` then every word of ``lines`` by falling count, ties in order of first appearance."""
    counts = Counter(word for line in lines for word in line.split())
    return Vocabulary([EOS, *(word for word, _ in counts.most_common() if word != EOS)])


def encode_lines(lines: list[str], vocab: Vocabulary) -> Tensor:
    """One int64 stream (T,) of all lines, each ending with ``<eos>``."""
    return torch.tensor([i for line in lines for i in vocab.encode(line)], dtype=torch.int64)


def load_wikitext(
    folder: str | Path, cache_dir: str | Path | None = None
) -> tuple[Vocabulary, dict[str, Tensor]]:
    """The vocabulary and the train/valid/test token streams of a WikiText-style folder.

    Args:
        folder: holds ``wiki.train.tokens``, ``wiki.valid.tokens`` and ``wiki.test.tokens``.
        cache_dir: where the encoded streams are cached (default ``~/.cache/neutreno/corpora``), under a
            name that hashes the three files' bytes, so an edited file is re-encoded.
    Returns:
        (vocabulary, {"train": (T,), "valid": (T,), "test": (T,)} int64 streams).
    """
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    paths = {split: folder / f"wiki.{split}.tokens" for split in SPLITS}
    for path in paths.values():
        if not path.is_file():
            raise FileNotFoundError(
                f"no such text file: {path} (a WikiText folder holds wiki.{{train,valid,test}}.tokens)"
            )
    digest = hashlib.sha256()
    for split in SPLITS:
        digest.update(paths[split].read_bytes())
    cache_dir = (
        Path(cache_dir or os.environ.get("NEUTRENO_CACHE", Path.home() / ".cache" / "neutreno")) / "corpora"
    )
    cache = cache_dir / f"{folder.name}-{digest.hexdigest()[:16]}.safetensors"
    if cache.is_file():
        from safetensors import safe_open

        with safe_open(str(cache), "pt") as f:
            words = json.loads(f.metadata()["vocabulary"])
        return Vocabulary(words), load_file(str(cache))
    lines = {split: read_lines(path) for split, path in paths.items()}
    vocab = build_vocabulary(lines["train"])
    streams = {split: encode_lines(split_lines, vocab) for split, split_lines in lines.items()}
    with atomic_path(cache) as tmp:
        save_file(streams, str(tmp), metadata={"vocabulary": json.dumps(vocab.words)})
    return vocab, streams


def batchify(stream: Tensor, batch_size: int) -> Tensor:
    """A stream (T,) → ``batch_size`` contiguous rows (batch_size, T // batch_size), the tail dropped.

    Row ``b`` continues where it left off from one training window to the next, so a model with
    memory could carry state along it (Transformer-XL's ordered iterator).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    length = stream.numel() // batch_size
    if length < 2:
        raise ValueError(f"a stream of {stream.numel()} tokens is too short for {batch_size} rows")
    return stream[: length * batch_size].view(batch_size, length)
