"""Normalized examples, with where each comes from (file and row), kept in a file while the data is prepared:
memory holds an offset per example, so it does not grow with the rows' sizes, and worker processes read the
examples they encode from the file themselves."""

from __future__ import annotations

import os
import pickle
import tempfile
from array import array
from pathlib import Path

from finetune.data.stage_rows import answer_example


class Spool:
    def __init__(self, folder: Path | None = None):
        self.file = tempfile.NamedTemporaryFile(dir=folder, prefix=".examples-")
        self.offsets = array("q")
        self.conversations = False  # whether any example needs a chat template

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def add(self, example: dict, where: str) -> int:
        self.file.seek(0, os.SEEK_END)
        self.offsets.append(self.file.tell())
        pickle.dump((where, example), self.file)
        self.conversations = self.conversations or "messages" in answer_example(example)
        return len(self.offsets) - 1

    def get(self, index: int) -> dict:
        return read_at(self.file, self.offsets[index])[1]

    def where(self, index: int) -> str:
        return read_at(self.file, self.offsets[index])[0]


def read_at(handle, offset: int) -> tuple[str, dict]:
    """(where, example) at `offset` of a spool's file."""
    handle.seek(offset)
    return pickle.load(handle)
