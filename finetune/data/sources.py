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

from finetune import builtin
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
        """Changes whenever the rows could: file contents, or the Hub dataset's own fingerprint."""
        digest = hashlib.sha256()
        for path in self.files:
            digest.update(str(path.name).encode())
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
        if self.hub:
            digest.update(self._load_hub()._fingerprint.encode())
        return digest.hexdigest()

    def rows(self) -> Iterator[tuple[str, dict | BadRow]]:
        """(where, row) pairs, where saying file and row number; unreadable rows come as BadRow."""
        for path in self.files:
            yield from _file_rows(path)
        if self.hub:
            for number, row in enumerate(self._load_hub(), 1):
                yield f"{self.spec} row {number}", row

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
    looks_like_path = spec.startswith((".", "/", "~")) or Path(spec).suffix in SUFFIXES or spec.count("/") > 1
    if looks_like_path:
        raise UserError(f"{key}: {spec} does not exist (no such file or folder)")
    name, _, split = spec.partition("@")
    name, _, subset = name.partition(":")
    return Source(spec, [], hub=(name, subset or None, split or "train"))


def _file_rows(path: Path) -> Iterator[tuple[str, dict | BadRow]]:
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path} line {number}", _object(json.loads(line))
                except json.JSONDecodeError as error:
                    yield f"{path} line {number}", BadRow(f"not valid JSON ({error.msg})")
                except BadRow as bad:
                    yield f"{path} line {number}", bad
        return
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
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
        return
    if path.suffix == ".csv":
        with open(path, encoding="utf-8", newline="") as handle:
            for number, row in enumerate(csv.DictReader(handle), 1):
                yield f"{path} row {number}", row
        return
    import datasets

    table = datasets.load_dataset("parquet", data_files=str(path), split="train")
    for number, row in enumerate(table, 1):
        yield f"{path} row {number}", row


def _object(value: Any) -> dict:
    if not isinstance(value, dict):
        raise BadRow(f"a row must be a JSON object, not {type(value).__name__}")
    return value
