"""Sentences from a text file (WikiText-style: blank lines and `` = Heading = `` lines skipped)."""

from __future__ import annotations

from pathlib import Path

from neutreno.progress import note


def load_sentences(path: str | Path, limit: int | None = None, min_words: int = 5) -> list[str]:
    """The first ``limit`` (>= 1) lines of running text with at least ``min_words`` words.

    Raises:
        FileNotFoundError: no such file. ValueError: not UTF-8, no usable line, or a limit below 1.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such text file: {path}")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is not text
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text: {error}") from None
    sentences, short = [], 0
    for line in text.splitlines():
        line = line.strip()
        if not line or (line.startswith("=") and line.endswith("=")):
            continue
        if len(line.split()) < min_words:
            short += 1
            continue
        sentences.append(line)
        if limit is not None and len(sentences) == limit:
            break
    if not sentences:
        raise ValueError(f"{path} has no line of at least {min_words} words")
    if short:  # fewer texts than asked for, and which ones is not the file's order
        note(f"note: {path}: {short} line(s) of fewer than {min_words} words skipped")
    return sentences


def _read_rows(path: Path) -> tuple[list[tuple[int, object]], dict[str, int]]:
    """(line number, row) of a .csv (a dict per row; the line a row ends on) or .jsonl file (a parsed
    value per non-blank line), and the names given twice in the header or in a JSON object, with their
    line (csv and json keep the last copy's value: refused where such a name is read).

    Raises:
        ValueError: naming the file and line: a malformed row.
    """
    import csv
    import json

    repeated: dict[str, int] = {}
    with path.open(encoding="utf-8-sig", newline="") as f:  # -sig: a byte-order mark is not text
        if path.suffix == ".csv":
            reader = csv.DictReader(f)
            limit = csv.field_size_limit()
            csv.field_size_limit(2**31 - 1)  # a long text is read (then cut to the model's length): no crash
            try:
                header = reader.fieldnames or []
                repeated = {c: 1 for c in header if header.count(c) > 1}
                # reader.line_num: a quoted text over several lines (or a blank line) moves the rows down
                return [(reader.line_num, row) for row in reader], repeated
            except csv.Error as error:
                raise ValueError(f"{path}:{reader.line_num}: not CSV: {error}") from None
            finally:
                csv.field_size_limit(limit)
        rows = []
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue

            def unique(pairs: list[tuple[str, object]], line: int = line) -> dict:
                keys = [key for key, _ in pairs]
                repeated.update({key: line for key in keys if keys.count(key) > 1 and key not in repeated})
                return dict(pairs)

            try:
                rows.append((line, json.loads(text, object_pairs_hook=unique)))
            except (ValueError, RecursionError) as error:  # (nesting, a 5,000-digit number: no file named)
                raise ValueError(f"{path}:{line}: not JSON: {error}") from None
        return rows, repeated


class MissingColumnError(ValueError):
    """A CSV header without a column asked for; ``header`` holds the names it has."""

    def __init__(self, message: str, header: list[str]) -> None:
        super().__init__(message)
        self.header = header


def load_labelled_texts(
    path: str | Path, text_column: str = "text", label_column: str = "label", pair_column: str | None = None
) -> list[tuple[str, str | None, str]]:
    """Rows of a ``.csv`` (with a header row) or ``.jsonl`` file as (text, second text or None, label);
    labels are kept as strings, without surrounding whitespace (``1``, ``"1"`` and ``" 1"`` are one
    class; a JSON label must be a string or an integer, so that ``1.0`` or ``true`` is not a class of
    its own).

    Raises:
        FileNotFoundError: no such file. ValueError: another format, a ``pair`` column that
            ``pair_column`` does not name, or a row (named by its line) without the columns, with an
            empty text or label, with more fields than the CSV header (a text with an unquoted comma),
            with a JSON text that is not a string, or with a JSON label of another type.
            MissingColumnError (a ValueError): a CSV header without a column asked for.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such text file: {path}")
    if path.suffix not in (".csv", ".jsonl"):
        raise ValueError(f"{path}: labelled texts are read from .csv or .jsonl files")
    try:
        rows, repeated = _read_rows(path)
    except UnicodeDecodeError:  # the codec's message named neither the file nor where (in its chunk)
        raw = path.read_bytes()
        try:
            raw.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            line = raw[: error.start].count(b"\n") + 1
            raise ValueError(f"{path}:{line}: not UTF-8 text ({error.reason}); save it as UTF-8") from None
        raise
    columns = [c for c in (text_column, pair_column, label_column) if c is not None]
    read = {text_column, pair_column, label_column}
    twice = next((c for c in columns if c in repeated), None)
    if twice is not None:  # the last copy would be read: a translation beside the text, say
        where = "in the header" if path.suffix == ".csv" else "in an object"
        raise ValueError(f"{path}:{repeated[twice]}: column {twice!r} appears twice {where}")
    header = [key for key in rows[0][1] if key is not None] if path.suffix == ".csv" and rows else None
    missing = [c for c in columns if header is not None and c not in header]
    if missing:  # (it said: line 2 "needs non-empty columns", after a hint about unread columns)
        raise MissingColumnError(
            f"{path}: the header has no column {missing[0]!r} (it has {header}; comma-separated, names "
            "as written): name the columns with text_column, label_column, pair_column (data.… in a config)",
            header,
        )
    has_pair = any(isinstance(row, dict) and "pair" in row for _, row in rows)
    if pair_column is None and "pair" not in read and has_pair:
        # the README's "text (optionally a pair column)": read as single texts, the pairs were lost unseen
        raise ValueError(
            f"{path} has a 'pair' column, which pair_column=None leaves unread: name it (data.pair_column: "
            "pair) to classify sentence pairs, or rename the column to classify the texts alone"
        )
    unread = sorted({key for _, row in rows if isinstance(row, dict) for key in row if key} - read)
    if unread:  # GLUE's sentence1, sentence2: the second text would go unseen
        hint = " (a second text is read only where pair_column, data.pair_column in a config, names it)"
        note(f"warning: {path}: columns {unread[:5]} are not read{hint if pair_column is None else ''}")
    examples = []
    for line, row in rows:
        if isinstance(row, dict) and None in row:  # csv.DictReader keeps fields beyond the header there
            raise ValueError(
                f"{path}:{line}: {len(row) - 1 + len(row[None])} fields, the header has {len(row) - 1} "
                "(quote a text that holds a comma)"
            )
        values = [row.get(c) if isinstance(row, dict) else None for c in columns]
        if any(v is None or str(v).strip() == "" for v in values):
            raise ValueError(f"{path}:{line}: needs non-empty columns {columns}, got {row!r}"[:300])
        if isinstance(values[-1], bool) or not isinstance(values[-1], str | int):
            raise ValueError(f"{path}:{line}: label {values[-1]!r} is not a string or an integer")
        for column, value in zip(columns[:-1], values[:-1], strict=True):
            if not isinstance(value, str):  # str(true) would train on the word "True"
                raise ValueError(f"{path}:{line}: {column} {value!r} is not a string"[:300])
        # "pos" and " pos" (a space after the CSV's comma) are one class, not two
        text, label = str(values[0]), str(values[-1]).strip()
        examples.append((text, str(values[1]) if pair_column else None, label))
    if not examples:
        raise ValueError(f"{path} has no rows")
    return examples
