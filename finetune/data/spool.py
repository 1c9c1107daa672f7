"""Normalized examples, with where each comes from (file and row), kept in a file while the data is prepared: an
example is known by its offset in the file, so memory holds one number per example whatever the rows' sizes, and
worker processes read the examples they encode from the file themselves."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

from finetune.data.stage_rows import answer_example


class Spool:
    def __init__(self, folder: Path | None = None):
        self.file = tempfile.NamedTemporaryFile(dir=folder, prefix=".examples-")
        self.conversations = False  # whether any example needs a chat template

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def add(self, example: dict, where: str) -> int:
        """The example's offset in the file, by which it is read back."""
        offset = self.file.seek(0, os.SEEK_END)
        pickle.dump((where, example), self.file)
        self.conversations = self.conversations or "messages" in answer_example(example)
        return offset

    def get(self, offset: int) -> dict:
        return read_at(self.file, offset)[1]

    def where(self, offset: int) -> str:
        return read_at(self.file, offset)[0]


def read_at(handle, offset: int) -> tuple[str, dict]:
    """(where, example) at `offset` of a spool's file."""
    handle.seek(offset)
    return pickle.load(handle)
