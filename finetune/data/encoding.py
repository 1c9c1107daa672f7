"""Encoding a split's examples into rows with their loss masks, packed where the recipe packs, in chunks that each
worker process encodes and writes as an Arrow shard of its own: the main process sends where the examples are and
gets counts back, never the rows, so its memory does not grow with the data. A line says how far it is every few
seconds (terminal and train.log)."""

from __future__ import annotations

import logging
import math
import os
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.data import workers
from finetune.data.formats import BadRow
from finetune.data.spool import read_at
from finetune.data.stage_rows import RowEncoder

PACK_BATCH = 1000  # rows packed together (best-fit decreasing over each batch, as TRL's pack_dataset does)
CHUNKS_IN_STEP = 16  # a split's chunks come in multiples of it, so 2, 4, 8 or 16 processes end together
LARGEST_CHUNK = 8 * PACK_BATCH  # (fewer, larger shards for a large split)
RATE_AFTER_S = 1.0
PROGRESS_EVERY_S = 5.0
logger = logging.getLogger("finetune")


@dataclass
class Encoded:
    """A split's rows as shards (Arrow files, in example order), and what encoding them gave."""
    shards: list[Path]
    rows: int  # examples kept, before packing
    packed_rows: int
    stats: dict[str, Any]
    first_row: dict | None  # the first kept example's row, unpacked


def encode_split(examples: array, spool, encoder: RowEncoder, max_length: int, packing: bool, bad: list[str],
                 too_long: list[str], folder: Path, processes: int, split: str) -> Encoded:
    """Encode `examples` (their offsets in `spool`) into shards in `folder`, a chunk of rows each, on `processes`
    worker processes for large splits, saying how far it is. A chunk holds a whole number of PACK_BATCH rows, so
    rows are packed in the same batches however many processes encode them."""
    folder.mkdir()
    spool.file.flush()  # the workers read the examples from it
    bounds = _chunk_bounds(len(examples))
    tasks = ((str(folder / f"{number:06d}.arrow"), spool.file.name, examples[start:end], max_length, packing)
             for number, (start, end) in enumerate(bounds))  # made as the workers take them
    total = _Chunk()
    progress = _Progress(split, len(examples))
    parallel = processes > 1 and len(examples) >= workers.PARALLEL_FROM
    # the chunks first: zip ends on them, after their pool has closed (ended on `bounds`, it would leave the pool to
    # the garbage collector, which terminates it, and its semaphores are said to leak)
    global _worker_encoder
    _worker_encoder = encoder
    for chunk, (start, end) in zip(workers.in_order(_encode_chunk, tasks, processes if parallel else 1), bounds):
        chunk_examples = examples[start:end]
        progress.advance(len(chunk_examples))
        bad += [f"{spool.where(chunk_examples[at])}: {reason}" for at, reason in chunk.bad]
        too_long += [f"{spool.where(chunk_examples[at])}: {length:,} tokens" for at, length in chunk.too_long]
        total.add(chunk)
    progress.finish()
    shards = sorted(folder.glob("*.arrow"))
    if not shards:
        folder.rmdir()
    return Encoded(shards, total.rows, total.packed_rows, {
        "tokens": total.tokens,
        "trained_tokens": total.trained,
        "trained_fraction": total.trained / total.tokens if total.tokens else 0.0,
        "length_percentiles": _percentiles(total.lengths),
        "truncated_rows": total.truncated,
        "dropped_no_trained_tokens": total.untrainable,
    }, total.first_row)


def _chunk_bounds(rows: int) -> list[tuple[int, int]]:
    """(start, end) of each chunk: whole PACK_BATCH batches, as even as they allow, at most LARGEST_CHUNK rows, in a
    multiple of CHUNKS_IN_STEP chunks where there are enough batches. Even chunks end together on the processes:
    uneven ones leave a process idle while another encodes the last."""
    batches = math.ceil(rows / PACK_BATCH)
    chunks = min(batches, CHUNKS_IN_STEP * math.ceil(batches / (LARGEST_CHUNK // PACK_BATCH) / CHUNKS_IN_STEP))
    starts = [PACK_BATCH * (batches * number // chunks) for number in range(chunks)]
    return list(zip(starts, [*starts[1:], rows]))


@dataclass
class _Chunk:
    """What encoding a chunk of examples gave, besides its shard: counts, its first row, and where its bad and too
    long rows are in it."""
    lengths: Counter = field(default_factory=Counter)  # how many encoded examples have each length (untruncated)
    rows: int = 0
    packed_rows: int = 0
    truncated: int = 0  # rows kept, cut short; the dropped ones are counted apart
    untrainable: int = 0  # rows whose whole answer lies past max_length: nothing left to learn from
    tokens: int = 0
    trained: int = 0
    first_row: dict | None = None
    bad: list[tuple[int, str]] = field(default_factory=list)
    too_long: list[tuple[int, int]] = field(default_factory=list)

    def add(self, other: _Chunk) -> None:
        self.lengths.update(other.lengths)
        self.rows += other.rows
        self.packed_rows += other.packed_rows
        self.truncated += other.truncated
        self.untrainable += other.untrainable
        self.tokens += other.tokens
        self.trained += other.trained
        self.first_row = self.first_row or other.first_row


_worker_encoder: RowEncoder | None = None  # the split's encoder, which the worker processes fork with


def _encode_chunk(task: tuple[str, str, array, int, bool]) -> _Chunk:
    """Encode a chunk's examples, read at their offsets in the spool's file, into the shard at `path` (packed)."""
    from datasets.arrow_writer import ArrowWriter

    path, spool_file, offsets, max_length, packing = task
    encoder, chunk = _worker_encoder, _Chunk()
    rows_path = f"{path}.rows" if packing else path
    with open(spool_file, "rb") as spool, \
            ArrowWriter(features=encoder.features(), path=rows_path, writer_batch_size=256) as writer:
        for at, offset in enumerate(offsets):
            try:
                encoded = encoder(read_at(spool, offset)[1])
            except BadRow as reason:
                chunk.bad.append((at, str(reason)))
                continue
            counts = encoder.counts(encoded)
            chunk.lengths[counts[0]] += 1
            row, cut = encoder.fit(encoded, max_length)
            if row is None:
                chunk.untrainable += 1
                chunk.too_long.append((at, counts[0]))
                continue
            chunk.truncated += cut
            _, row_tokens, row_trained = encoder.counts(row) if cut else counts
            chunk.tokens += row_tokens
            chunk.trained += row_trained
            chunk.rows += 1
            chunk.first_row = chunk.first_row or row
            writer.write(row)
        writer.finalize()
    if packing and chunk.rows:
        import datasets

        chunk.packed_rows = len(pack(datasets.Dataset.from_file(rows_path), max_length, path))
    else:
        chunk.packed_rows = chunk.rows
    if not chunk.rows or packing:
        os.unlink(rows_path)
    return chunk


def pack(rows, max_length: int, path: str):
    """The rows with several examples in each (best-fit decreasing, TRL's, over each PACK_BATCH rows), written to
    `path`; seq_lengths keeps their boundaries for attention."""
    from trl.data_utils import pack_dataset

    return pack_dataset(rows, max_length, strategy="bfd", map_kwargs={"cache_file_name": path,
                                                                       "batch_size": PACK_BATCH})


class _Progress:
    """Rows done, rows/s and the time left, every few seconds while a split is encoded (terminal and train.log)."""

    def __init__(self, split: str, total: int):
        self.split, self.total, self.done = split, total, 0
        self.started = self.said = time.monotonic()
        self.first_row: float | None = None  # when the first chunk was done: the workers had started
        self.first_rows = 0

    def advance(self, rows: int) -> None:
        self.done += rows
        now = time.monotonic()
        if self.first_row is None:
            self.first_row, self.first_rows = now, self.done
        if now - self.said >= PROGRESS_EVERY_S:
            self.said = now
            line = f"preparing {self.split}: {self.done:,} of {self.total:,} rows"
            if now - self.first_row >= RATE_AFTER_S:  # a rate (and so a time left) from rows actually flowing
                rate = (self.done - self.first_rows) / (now - self.first_row)
                line += f", {rate:,.0f} rows/s, {(self.total - self.done) / rate:,.0f} s left"
            self._say(line)

    def finish(self) -> None:
        seconds = time.monotonic() - self.started
        if seconds >= PROGRESS_EVERY_S:
            self._say(f"prepared {self.split}: {self.done:,} rows in {seconds:,.1f} s "
                      f"({self.done / seconds:,.0f} rows/s)")

    @staticmethod
    def _say(line: str) -> None:
        print(line, flush=True)
        logger.info(line)


def _percentiles(lengths: Counter) -> dict[str, int]:
    """p50, p90, p99 (interpolated between the nearest lengths, as numpy's default) and max, from how many examples
    have each length: exact, in memory that does not grow with the rows."""
    if not lengths:
        return {}
    ordered = sorted(lengths.items())
    rows = sum(lengths.values())

    def nth(n: int) -> int:  # the n-th smallest length, from 0
        seen = 0
        for length, count in ordered:
            seen += count
            if n < seen:
                return length
        return ordered[-1][0]

    def percentile(q: int) -> float:
        position = q / 100 * (rows - 1)
        low = int(position)
        return nth(low) + (position - low) * (nth(min(low + 1, rows - 1)) - nth(low))

    return {"p50": round(percentile(50)), "p90": round(percentile(90)), "p99": round(percentile(99)),
            "max": ordered[-1][0]}
