"""Where rows come from: local files and folders, Hugging Face Hub datasets, and builtin datasets.

A source is written as a path (a .jsonl/.json/.parquet/.csv file, or a folder of them), `builtin:NAME`, or a Hub
dataset `owner/name`, optionally `owner/name:subset@split` (split defaults to train).

JSON, JSONL and CSV are read with Python's own json and csv modules rather than through Arrow: Arrow unifies the
keys of nested objects across rows (adding null-valued keys to tool-call arguments), rejects a row with a number
where others have text before we could say which row it was, and guesses types for CSV text ("42" becomes 42).
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune import builtin, hub
from finetune.data.formats import BadRow
from finetune.errors import UserError

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass
class Source:
    spec: str
    files: list[Path]
    hub: tuple[str, str | None, str] | None = None  # (name, subset, split)
    _hub_dataset: Any = None

    def fingerprint(self) -> str:
        """Changes whenever the rows could: file contents, or the Hub dataset's revision."""
        digest = hashlib.sha256()
        for path in self.files:
            digest.update(str(path.name).encode())
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
        if self.hub:
            # its Arrow files: their paths name the dataset's revision (a commit of the Hub repository)
            digest.update("\n".join(part["filename"] for part in self._load_hub().cache_files).encode())
        return digest.hexdigest()

    def parts(self) -> Iterator[tuple[str, Iterator[tuple[str, dict | BadRow]]]]:
        """(name, rows) for each file of the source, or its Hub dataset; rows are (where, row) pairs, where saying
        file and row number; unreadable rows come as BadRow."""
        for path in self.files:
            yield str(path), _file_rows(path)
        if self.hub:
            yield self.spec, ((f"{self.spec} row {number}", row) for number, row in enumerate(self._load_hub(), 1))

    def rows(self) -> Iterator[tuple[str, dict | BadRow]]:
        for _, rows in self.parts():
            yield from rows

    def _load_hub(self):
        if self._hub_dataset is None:
            import datasets

            name, subset, split = self.hub
            try:
                self._hub_dataset = datasets.load_dataset(name, subset, split=split)
            except Exception as error:  # offline, unknown name, gated, missing subset: all the user's to fix
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise UserError(
                    f"data source {self.spec!r}: not a local file or folder, and loading it from the Hugging Face "
                    f"Hub failed: {first_line}"
                ) from None
        return self._hub_dataset


def resolve(spec: str, key: str) -> Source:
    """The Source for one data.train / data.eval entry; `key` names the setting in error messages."""
    path = Path(builtin.resolve_dataset(spec)).expanduser()
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise UserError(f"{key}: {spec} is a {path.suffix or 'suffix-less'} file; use {', '.join(SUFFIXES)}")
        return Source(spec, [path])
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise UserError(f"{key}: folder {spec} has no {', '.join(SUFFIXES)} files")
        return Source(spec, files)
    name, _, split = spec.partition("@")
    name, _, subset = name.partition(":")
    if not hub.looks_like_hub_name(name):
        relative = "" if path.is_absolute() else f"; relative paths start from the folder finetune runs in, {Path.cwd()}"
        raise UserError(f"{key}: {spec} does not exist (no such file or folder{relative})")
    hub.check_available(name, key, "dataset")
    return Source(spec, [], hub=(name, subset or None, split or "train"))


def _file_rows(path: Path) -> Iterator[tuple[str, dict | BadRow]]:
    _check_text(path)
    count = 0
    for count, item in enumerate(_READERS[path.suffix](path), 1):
        yield item
    if count == 0:
        raise UserError(f"{path} is empty: it holds no rows")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict | BadRow]]:
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = _decoded(raw[3:] if number == 1 and raw.startswith(BOM) else raw, path, number)
            except UserError as error:  # one line's bytes: a bad row, which data.bad_rows=drop can leave out
                yield f"{path} line {number}", BadRow(str(error).split(": ", 1)[1])
                continue
            if not line.strip():
                continue
            if number == 1 and line.lstrip().startswith("["):
                raise UserError(f"{path} holds a JSON array, not one JSON object per line: name it .json, or write "
                                "each row on a line of its own")
            try:
                yield f"{path} line {number}", _object(json.loads(line))
            except json.JSONDecodeError as error:
                yield f"{path} line {number}", BadRow(f"not valid JSON ({error.msg})")
            except BadRow as bad:
                yield f"{path} line {number}", bad


def _json_rows(path: Path) -> Iterator[tuple[str, dict | BadRow]]:
    text = _decoded(path.read_bytes().removeprefix(BOM), path)
    if not text.strip():
        raise UserError(f"{path} is empty: it holds no rows")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":
            raise UserError(f"{path} holds one JSON value per line (JSON Lines), not one JSON document: name it "
                            ".jsonl") from None
        raise UserError(f"{path}: not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]} style
    if not isinstance(data, list):
        raise UserError(f"{path}: a .json data file holds a list of rows; use .jsonl for one row per line")
    for number, row in enumerate(data, 1):
        try:
            yield f"{path} row {number}", _object(row)
        except BadRow as bad:
            yield f"{path} row {number}", bad


def _csv_rows(path: Path) -> Iterator[tuple[str, dict | BadRow]]:
    with open(path, encoding="utf-8-sig", newline="") as handle:
        number = 0
        try:
            for number, row in enumerate(csv.DictReader(handle), 1):
                yield f"{path} row {number}", row
        except UnicodeDecodeError:
            raise UserError(f"{path} row {number + 1}: not UTF-8 text; save the file as UTF-8") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict | BadRow]]:
    import pyarrow
    import pyarrow.parquet

    try:
        batches = pyarrow.parquet.ParquetFile(path).iter_batches()
        number = 0
        for batch in batches:
            for row in batch.to_pylist():
                number += 1
                yield f"{path} row {number}", row
    except pyarrow.ArrowException as error:  # not Parquet, or broken
        raise UserError(f"{path}: not a readable Parquet file ({_first_line(error)})") from None


_READERS = {".jsonl": _jsonl_rows, ".json": _json_rows, ".csv": _csv_rows, ".parquet": _parquet_rows}
BOM = b"\xef\xbb\xbf"


def _check_text(path: Path) -> None:
    """Refuse, with the reason, a text data file that is not UTF-8 text at all (binary, compressed, UTF-16)."""
    if path.suffix == ".parquet":
        return
    with open(path, "rb") as handle:
        start = handle.read(8192)
    if start.startswith((b"\xff\xfe", b"\xfe\xff")) or (start[1::2].count(0) > len(start) // 4 > 0):
        raise UserError(f"{path} is UTF-16 text; save it as UTF-8")
    if start.startswith(b"\x1f\x8b"):
        raise UserError(f"{path} is gzip-compressed; decompress it first (gunzip)")
    if b"\x00" in start:
        raise UserError(f"{path} is not a text file (it holds binary data); pass a {path.suffix} text file")


def _decoded(raw: bytes, path: Path, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        at = line if line is not None else raw[:error.start].count(b"\n") + 1
        raise UserError(f"{path} line {at}: not UTF-8 text (byte 0x{raw[error.start]:02x}); save the file as UTF-8 "
                        "(it may be Latin-1 or Windows-1252)") from None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _object(value: Any) -> dict:
    if not isinstance(value, dict):
        raise BadRow(f"a row must be a JSON object, not {type(value).__name__}")
    return value
