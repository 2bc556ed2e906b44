"""Sentences from a text file (WikiText-style: blank lines and `` = Heading = `` lines skipped)."""

from __future__ import annotations

from pathlib import Path


def load_sentences(path: str | Path, limit: int | None = None, min_words: int = 5) -> list[str]:
    """The first ``limit`` lines of running text with at least ``min_words`` words.

    Raises:
        FileNotFoundError: no such file. ValueError: not UTF-8, or no usable line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such text file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text: {error}") from None
    sentences = []
    for line in text.splitlines():
        line = line.strip()
        if len(line.split()) >= min_words and not (line.startswith("=") and line.endswith("=")):
            sentences.append(line)
            if limit is not None and len(sentences) == limit:
                break
    if not sentences:
        raise ValueError(f"{path} has no line of at least {min_words} words")
    return sentences
