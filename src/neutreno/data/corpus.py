"""Language-modelling corpora: token streams and the tokenizer that made them.

Two layouts, told apart by their file names (:func:`load_corpus`):

- WikiText, word level (``wiki.{train,valid,test}.tokens``), as in Transformer-XL (the lmtool-fwp
  setting of math.md §4): every line, blank ones included, is split on whitespace and ends with ``<eos>``;
  the vocabulary comes from the training file only, ``<eos>`` first, then words by falling count (ties
  in order of first appearance); ``<unk>`` is an ordinary word of the files (:class:`Vocabulary`).
- Users' own raw text (``train.txt``, ``valid.txt``, optional ``test.txt``) with a Hugging Face
  ``tokenizers`` tokenizer (:class:`SubwordTokenizer`).

Token streams are cached as a safetensors file keyed by a hash of the files' (and tokenizer's) bytes.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections import Counter
from pathlib import Path

import torch
from torch import Tensor

from neutreno.io import atomic_path
from neutreno.progress import note

EOS = "<eos>"
SPLITS = ("train", "valid", "test")
# Hashed into a WikiText cache's name: streams cached when lines also ended at \x0c, \x1c-\x1e, \x85,
# \u2028 or \u2029 (str.splitlines) hold extra <eos>, and must not be reused.
_WORD_STREAMS = b"word-level streams, lines ending at newlines only"
# Hashed into a raw-text cache's name: caches from before hold no count of the characters dropped, or
# the count of before dropped_characters encoded with an unknown-token copy (bytes, added tokens).
_DROPPED_COUNTED = b"subword streams, dropped characters counted with an unknown-token copy"


class Vocabulary:
    """Words ↔ ids. ``encode`` maps an unknown word to ``<unk>`` when the vocabulary has it, and raises
    ValueError (naming the word) when it has none."""

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
                raise ValueError(f"word {word!r} is not in the vocabulary (and it has no <unk>)")
            ids.append(index)
        return ids

    def decode(self, ids: list[int] | Tensor) -> list[str]:
        return [self.words[i] for i in (ids.tolist() if isinstance(ids, Tensor) else ids)]

    def encode_text(self, text: str) -> list[int]:
        """Free text → ids, an ``<eos>`` for each line break (a prompt gets no final ``<eos>``)."""
        lines = text.split("\n")
        ids = [i for line in lines[:-1] for i in self.encode(line)]
        return ids + self.encode(lines[-1])[:-1]

    def decode_text(self, ids: list[int] | Tensor) -> str:
        """Ids → text: words joined by spaces, ``<eos>`` as a line break."""
        return "\n".join(" ".join(line.split()) for line in " ".join(self.decode(ids)).split(EOS))

    def metadata(self) -> dict:
        """What :func:`tokenizer_from_metadata` rebuilds this from (stored with model weights)."""
        return {"kind": "words", "words": self.words}


class SubwordTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer with :class:`Vocabulary`'s text interface.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokenizer) -> None:
        # A model's tokenizer.json may pad or truncate to its input size; a corpus stream must not.
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.tokenizer = tokenizer
        # dropped_characters' (a copy with an unknown token, its id), or False where nothing can be dropped
        self._counter: tuple | bool | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> SubwordTokenizer:
        """Load ``tokenizer.json``, or the one inside a folder (a Hugging Face model folder)."""
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(
                f"no tokenizer file: {file} (a tokenizers JSON file or a folder holding one)"
            )
        return cls(Tokenizer.from_file(str(file)))

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode_text(self, text: str) -> list[int]:
        """Free text (a prompt) → ids, encoded as a corpus is (:meth:`encode_document`): encoded whole,
        a prompt with a blank line got tokens the model never saw in training (GPT-2's ``ĊĊ``)."""
        return self.encode_document(text)

    def encode_document(self, text: str) -> list[int]:
        """A whole file's text → ids, its lines (line ends kept) encoded in batches, in parallel. So no
        token spans a line break (a run of blank lines is a token per line), unlike the tokenizer's
        encoding of the whole text at once, which a corpus of hundreds of MB cannot afford."""
        batch = self.tokenizer.encode_batch(text.splitlines(keepends=True), add_special_tokens=False)
        return [i for encoding in batch for i in encoding.ids]

    def decode_text(self, ids: list[int] | Tensor) -> str:
        """Ids → text, special tokens included (``[UNK]`` for what the tokenizer did not know: its
        ``decode`` drops them by default, so a prompt printed "as the model read it" lost them)."""
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def unknown_token(self) -> tuple[str, int] | None:
        """The tokenizer's unknown token and its id; None where it has none (a byte-level BPE's)."""
        unk = getattr(self.tokenizer.model, "unk_token", None)
        unk_id = self.tokenizer.token_to_id(unk) if unk else None
        return None if unk_id is None else (unk, unk_id)

    def dropped_characters(self, text: str) -> int:
        """How many non-space characters of ``text`` no token stands for.

        A BPE without an unknown token (and without byte fallback) drops, without a word, a symbol that
        is not in its vocabulary (a character; a byte-level BPE's byte), so a corpus can lose text that
        a perplexity then never scores. Counted by encoding ``text`` as :meth:`encode_document` does
        with a copy of the tokenizer that has an unknown token: BPE gives it for exactly the symbols it
        drops otherwise, and its offsets name their characters (each counted once, however many of its
        bytes were dropped). Added tokens (``<|endoftext|>``) never reach the model, so they count as kept.
        Other models give an unknown token instead (:func:`unknown_tokens`), or refuse the text."""
        if self._counter is None:  # decided once per tokenizer (a corpus counts each split)
            self._counter = self._with_unknown_token() if self._can_drop() else False
        if not self._counter:
            return 0
        counter, unknown = self._counter
        lines = text.splitlines(keepends=True)
        dropped = 0
        for line, encoding in zip(lines, counter.encode_batch(lines, add_special_tokens=False), strict=True):
            spans = [span for i, span in zip(encoding.ids, encoding.offsets, strict=True) if i == unknown]
            chars = {c for start, end in spans for c in range(start, end)}
            dropped += sum(not line[c].isspace() for c in chars)
        return dropped

    def _can_drop(self) -> bool:
        """Whether this tokenizer can drop text: a BPE without an unknown token or byte fallback, unless
        it is byte-level (a ByteLevel pre-tokenizer, alone or in a sequence) with all 256 byte symbols in
        its vocabulary and no subword prefix or word-end suffix (GPT-2's kind: any text is bytes it has)."""
        from tokenizers.pre_tokenizers import ByteLevel

        model = self.tokenizer.model
        if type(model).__name__ != "BPE" or model.unk_token is not None or model.byte_fallback:
            return False
        if model.continuing_subword_prefix or model.end_of_word_suffix:
            return True
        pre_tokenizer = json.loads(self.tokenizer.to_str()).get("pre_tokenizer") or {}
        steps = (
            pre_tokenizer.get("pretokenizers", [pre_tokenizer])
            if pre_tokenizer.get("type") == "Sequence"
            else [pre_tokenizer]
        )
        vocab = self.tokenizer.get_vocab(with_added_tokens=False)
        byte_level = any(step.get("type") == "ByteLevel" for step in steps)
        return not (byte_level and all(b in vocab for b in ByteLevel.alphabet()))

    def _with_unknown_token(self) -> tuple:
        """This BPE tokenizer with an unknown token of its own (a new id, unfused), and that id."""
        from tokenizers import Tokenizer

        data = json.loads(self.tokenizer.to_str())
        vocab = data["model"]["vocab"]
        unknown = "<neutreno-dropped>"
        while unknown in vocab:
            unknown += "_"
        # after the model's own ids: loading numbers the added tokens after those again
        vocab[unknown] = max(vocab.values(), default=-1) + 1
        data["model"].update(unk_token=unknown, fuse_unk=False)
        counter = Tokenizer.from_str(json.dumps(data))
        counter.no_padding()
        counter.no_truncation()
        added = [token["content"] for token in data.get("added_tokens") or []]
        if counter.token_to_id(unknown) != vocab[unknown] or vocab[unknown] in map(
            counter.token_to_id, added
        ):
            raise RuntimeError(f"cannot give {unknown} an id of its own in this tokenizer")
        return counter, vocab[unknown]

    def metadata(self) -> dict:
        return {"kind": "tokenizers", "json": self.tokenizer.to_str()}


def tokenizer_from_metadata(metadata: dict) -> Vocabulary | SubwordTokenizer:
    """The tokenizer described by ``Vocabulary.metadata()`` or ``SubwordTokenizer.metadata()``; a
    ValueError for a record that is neither (a hand-made or damaged file)."""
    if not isinstance(metadata, dict):
        raise ValueError(f"its tokenizer metadata is a {type(metadata).__name__}, not a record")
    kind = metadata.get("kind")
    fields = {"words": ("words", list), "tokenizers": ("json", str)}  # where each kind keeps its tokens
    field, wanted = fields.get(kind, (None, None)) if isinstance(kind, str) else (None, None)
    if field is None:
        raise ValueError(f"unknown tokenizer metadata kind {kind!r}")
    value = metadata.get(field)
    if not isinstance(value, wanted):
        raise ValueError(f"its tokenizer metadata of kind {kind!r} lacks its {field}")
    if kind == "words":
        if not all(isinstance(word, str) for word in value):
            raise ValueError("its tokenizer metadata holds words that are not strings")
        return Vocabulary(value)
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(value)
    except Exception as error:  # tokenizers raises a bare Exception for JSON it cannot read
        raise ValueError(f"its tokenizer metadata is not a tokenizers JSON ({error})") from None
    return SubwordTokenizer(tokenizer)


def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file; a clear error for a missing, empty or non-UTF-8 file.

    As Transformer-XL reads WikiText (a text-mode file, line by line), lines end at ``\n``, ``\r\n``
    or ``\r`` only: form feeds, ``\x85``, ``\u2028`` and the like stay inside their line (unlike
    ``str.splitlines``)."""
    lines = read_text(path).replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return lines[:-1] if lines[-1] == "" else lines  # a final line break ends the last line


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's text, without a leading byte-order mark; a clear error for a missing, empty
    or non-UTF-8 file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such text file: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # -sig: a byte-order mark (Windows editors write one) is not text
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {error.start}: {data[error.start : error.start + 1]!r})"
        ) from None
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text


def encode_file(path: str | Path, tokenizer: Vocabulary | SubwordTokenizer) -> Tensor:
    """A text file → int64 stream (T,): word level, each line's words and ``<eos>``; subword, the whole
    text, line ends kept."""
    if isinstance(tokenizer, Vocabulary):
        return encode_lines(read_lines(path), tokenizer, path)
    return torch.tensor(tokenizer.encode_document(read_text(path)), dtype=torch.int64)


def unknown_tokens(path: str | Path, tokenizer: Vocabulary | SubwordTokenizer, ids: Tensor) -> int:
    """How many of the tokens of ``ids`` (``path`` encoded by :func:`encode_file`) stand for text the
    tokenizer does not know: word level, the words of the file outside the vocabulary (a literal
    ``<unk>`` of the file is a word of it); subword, the tokens equal to the tokenizer's unknown token
    (none for a byte-level BPE such as GPT-2's)."""
    if isinstance(tokenizer, Vocabulary):
        return sum(word not in tokenizer.ids for line in read_lines(path) for word in line.split())
    unknown = tokenizer.unknown_token()
    return 0 if unknown is None else int((ids == unknown[1]).sum())


def unread_text(path: str | Path, tokenizer: Vocabulary | SubwordTokenizer, ids: Tensor) -> tuple[int, int]:
    """What of ``path`` (encoded as ``ids`` by :func:`encode_file`) a model does not read as written: the
    tokens standing for text the tokenizer does not know (:func:`unknown_tokens`), and the characters
    it drops (:meth:`SubwordTokenizer.dropped_characters`; a word-level vocabulary drops none)."""
    dropped = tokenizer.dropped_characters(read_text(path)) if isinstance(tokenizer, SubwordTokenizer) else 0
    return unknown_tokens(path, tokenizer, ids), dropped


def split_file(folder: str | Path, split: str) -> Path:
    """The file of ``split`` in a corpus folder: ``wiki.{split}.tokens`` or ``{split}.txt``."""
    folder = Path(folder)
    for path in (folder / f"wiki.{split}.tokens", folder / f"{split}.txt"):
        if path.is_file():
            return path
    raise FileNotFoundError(f"no {split} split in {folder} (wiki.{split}.tokens or {split}.txt)")


def build_vocabulary(lines: list[str]) -> Vocabulary:
    """``<eos>`` then every word of ``lines`` by falling count, ties in order of first appearance."""
    counts = Counter(word for line in lines for word in line.split())
    return Vocabulary([EOS, *(word for word, _ in counts.most_common() if word != EOS)])


def encode_lines(lines: list[str], vocab: Vocabulary, source: str | Path | None = None) -> Tensor:
    """One int64 stream (T,) of all lines, each ending with ``<eos>``. ``source``: the file the lines
    come from, named (with the line number) in the error for a word the vocabulary lacks."""
    ids: list[int] = []
    for number, line in enumerate(lines, start=1):
        try:
            ids += vocab.encode(line)
        except ValueError as error:
            if source is None:
                raise
            raise ValueError(f"{source}:{number}: {error}") from None
    return torch.tensor(ids, dtype=torch.int64)


def load_corpus(
    folder: str | Path, tokenizer: str | Path | None = None, cache_dir: str | Path | None = None
) -> tuple[Vocabulary | SubwordTokenizer, dict[str, Tensor]]:
    """The tokenizer and token streams of a corpus folder, WikiText or raw text (see the module docstring).

    Args:
        folder: ``wiki.{train,valid,test}.tokens`` (word level), or ``train.txt``, ``valid.txt`` and
            optionally ``test.txt`` (raw text, tokenized with ``tokenizer``).
        tokenizer: a ``tokenizers`` JSON file or a folder holding ``tokenizer.json``; raw text only.
        cache_dir: see :func:`load_wikitext`.
    Returns:
        (tokenizer, {split: (T,) int64 stream}).
    """
    folder = Path(folder)
    if (folder / "wiki.train.tokens").is_file():
        if tokenizer is not None:
            raise ValueError(f"{folder} is a word-level WikiText folder; it takes no tokenizer")
        return load_wikitext(folder, cache_dir)
    if (folder / "train.txt").is_file():
        if tokenizer is None:
            raise ValueError(f"{folder} holds raw text (train.txt): give a tokenizer (data.tokenizer)")
        return load_text_corpus(folder, tokenizer, cache_dir)
    raise FileNotFoundError(
        f"{folder} is not a corpus folder: expected wiki.{{train,valid,test}}.tokens, or train.txt and "
        "valid.txt (and optionally test.txt) with a tokenizer"
    )


def load_wikitext(
    folder: str | Path, cache_dir: str | Path | None = None
) -> tuple[Vocabulary, dict[str, Tensor]]:
    """The vocabulary and the train/valid/test token streams of a WikiText-style folder.

    Args:
        folder: holds ``wiki.train.tokens``, ``wiki.valid.tokens`` and ``wiki.test.tokens``.
        cache_dir: where the encoded streams are cached (default ``~/.cache/neutreno/corpora``, or
            ``$NEUTRENO_CACHE/corpora``), under a name that hashes the files' bytes, so an edited
            file is re-encoded.
    Returns:
        (vocabulary, {"train": (T,), "valid": (T,), "test": (T,)} int64 streams).
    """
    folder = Path(folder)
    paths = {split: folder / f"wiki.{split}.tokens" for split in SPLITS}
    for path in paths.values():
        if not path.is_file():
            raise FileNotFoundError(
                f"no such text file: {path} (a WikiText folder holds wiki.{{train,valid,test}}.tokens)"
            )
    # keyed without a byte-order mark: caches from before, which kept it as a word, are not reused
    texts = [paths[split].read_bytes().removeprefix(codecs.BOM_UTF8) for split in SPLITS]
    cache = _cache_file(folder, [_WORD_STREAMS, *texts], cache_dir)
    cached = _read_cache(cache, list(SPLITS), ("vocabulary",))
    if cached is not None:
        streams, metadata = cached
        return Vocabulary(json.loads(metadata["vocabulary"])), streams
    lines = {split: read_lines(path) for split, path in paths.items()}
    vocab = build_vocabulary(lines["train"])
    streams = {split: encode_lines(lines[split], vocab, paths[split]) for split in SPLITS}
    _write_cache(cache, streams, {"vocabulary": json.dumps(vocab.words)})
    return vocab, streams


def load_text_corpus(
    folder: str | Path, tokenizer: str | Path, cache_dir: str | Path | None = None
) -> tuple[SubwordTokenizer, dict[str, Tensor]]:
    """Raw-text ``train.txt``, ``valid.txt`` (and ``test.txt`` if present) tokenized with a Hugging Face
    tokenizer, line ends kept; streams cached as in :func:`load_wikitext`, keyed by the files' and the
    tokenizer's bytes."""
    folder = Path(folder)
    subword = SubwordTokenizer.from_file(tokenizer)
    paths = {
        split: folder / f"{split}.txt"
        for split in SPLITS
        if split != "test" or (folder / "test.txt").exists()
    }
    texts = {split: read_text(path) for split, path in paths.items()}
    parts = [_DROPPED_COUNTED, subword.metadata()["json"].encode()]
    cache = _cache_file(folder, [*parts, *(f"{s}\0{t}".encode() for s, t in texts.items())], cache_dir)
    cached = _read_cache(cache, list(paths), ("dropped_characters",))
    if cached is not None:
        streams, dropped = cached[0], json.loads(cached[1]["dropped_characters"])
    else:
        streams = {split: torch.tensor(subword.encode_document(text)) for split, text in texts.items()}
        for split, stream in streams.items():
            if stream.numel() < 2:
                raise ValueError(f"{paths[split]} has fewer than 2 tokens")
        dropped = {split: subword.dropped_characters(text) for split, text in texts.items()}
        _write_cache(cache, streams, {"dropped_characters": json.dumps(dropped)})
    for split, count in dropped.items():
        if count:  # said at every load, the cache's or not: a model trained on it never saw that text
            note(
                f"warning: {paths[split]}: the tokenizer drops {count} of its {len(texts[split])} characters "
                "(no token stands for them, and it has no unknown token)"
            )
    return subword, streams


def _cache_file(folder: Path, parts: list[bytes], cache_dir: str | Path | None) -> Path:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    # an empty variable (NEUTRENO_CACHE= in a script) is unset, not the working directory
    root = Path(cache_dir or os.environ.get("NEUTRENO_CACHE") or Path.home() / ".cache" / "neutreno")
    return root / "corpora" / f"{folder.resolve().name}-{digest.hexdigest()[:16]}.safetensors"


def _read_cache(
    cache: Path, splits: list[str], keys: tuple[str, ...] = ()
) -> tuple[dict[str, Tensor], dict[str, str]] | None:
    """The cached streams (and metadata) of ``splits``; None when there is no cache, or when it is damaged
    (truncated, written by something else, a split or a metadata ``keys`` missing, a stream not int64
    ids): it is only a copy, so it is rebuilt, with a warning, rather than failing every later run."""
    if not cache.is_file():
        return None
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(cache), "pt") as f:
            metadata = f.metadata() or {}
        streams = load_file(str(cache))
        if sorted(streams) != sorted(splits) or any(k not in metadata for k in keys):
            raise ValueError(f"it holds {sorted(streams)} and metadata {sorted(metadata)}")
        ids = all(t.dtype == torch.int64 and t.ndim == 1 for t in streams.values())
        if not ids or any(t.numel() and t.min() < 0 for t in streams.values()):
            raise ValueError("its streams are not token ids")
        if "vocabulary" in keys:
            words = json.loads(metadata["vocabulary"])
            if any(t.numel() and t.max() >= len(words) for t in streams.values()):
                raise ValueError("its streams hold ids beyond its vocabulary")
    except Exception as error:  # SafetensorError, OSError, ValueError, …
        note(f"warning: the corpus cache {cache} is damaged ({error}); building it again")
        return None
    return streams, metadata


def _write_cache(cache: Path, streams: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """Keep the encoded streams for the next run; a cache that cannot be written (a full disk, a
    read-only cache folder) is said and skipped: the streams are in memory, and the run needs no copy."""
    from safetensors.torch import save_file

    try:
        with atomic_path(cache) as tmp:
            save_file(streams, str(tmp), metadata=metadata)
    except OSError as error:
        note(f"warning: the corpus is not cached ({error}); the next run encodes it again")


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
