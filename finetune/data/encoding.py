"""Encoding a split's examples into rows with their loss masks, in chunks of rows that each worker process encodes
and writes to an Arrow file of its own (the main process sends where the examples are and gets counts back, never
the rows), with a line on how far it is every few seconds (terminal and train.log)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from finetune.data.formats import BadRow
from finetune.data.spool import read_at
from finetune.data.stage_rows import RowEncoder

PARALLEL_FROM = 2000  # rows: below it, starting worker processes costs more than it saves
CHUNK_ROWS = 1024  # rows a worker encodes into one file: a worker holds one chunk's examples
RATE_AFTER_S = 1.0
PROGRESS_EVERY_S = 5.0
logger = logging.getLogger("finetune")


def encode_split(examples: array, spool, encoder: RowEncoder, max_length: int, bad: list[str], too_long: list[str],
                 folder: Path, processes: int, split: str):
    """Encode `examples` (their indices in `spool`) into Arrow files in `folder`, a chunk of rows at a time, on
    `processes` worker processes for large splits, saying how far it is; (the rows as one Dataset in example
    order, their statistics)."""
    import datasets

    folder.mkdir()
    spool.file.flush()  # the workers read the examples from it
    tasks = [(str(folder / f"{start // CHUNK_ROWS:06d}.arrow"), spool.file.name,
              array("q", (spool.offsets[index] for index in examples[start:start + CHUNK_ROWS])), max_length)
             for start in range(0, len(examples), CHUNK_ROWS)]
    total = _Chunk()
    progress = _Progress(split, len(examples))
    for start, chunk in zip(range(0, len(examples), CHUNK_ROWS), _chunks(tasks, encoder, processes)):
        chunk_examples = examples[start:start + CHUNK_ROWS]
        progress.advance(len(chunk_examples))
        bad += [f"{spool.where(chunk_examples[at])}: {reason}" for at, reason in chunk.bad]
        too_long += [f"{spool.where(chunk_examples[at])}: {length:,} tokens" for at, length in chunk.too_long]
        total.add(chunk)
    progress.finish()
    files = [path for path, *_ in tasks]
    table = (datasets.concatenate_datasets([datasets.Dataset.from_file(path) for path in files]) if files else
             datasets.Dataset.from_dict({name: [] for name in encoder.features()}, features=encoder.features()))
    return table, {
        "tokens": total.tokens,
        "trained_tokens": total.trained,
        "trained_fraction": total.trained / total.tokens if total.tokens else 0.0,
        "length_percentiles": _percentiles(total.lengths),
        "truncated_rows": total.truncated,
        "dropped_no_trained_tokens": total.untrainable,
    }


@dataclass
class _Chunk:
    """What encoding a chunk of examples gave, besides its rows: counts, and where bad and too long rows are in it."""
    lengths: array = field(default_factory=lambda: array("q"))  # of each encoded example, before truncation
    truncated: int = 0  # rows kept, cut short; the dropped ones are counted apart
    untrainable: int = 0  # rows whose whole answer lies past max_length: nothing left to learn from
    tokens: int = 0
    trained: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)
    too_long: list[tuple[int, int]] = field(default_factory=list)

    def add(self, other: _Chunk) -> None:
        self.lengths += other.lengths
        self.truncated += other.truncated
        self.untrainable += other.untrainable
        self.tokens += other.tokens
        self.trained += other.trained


_worker_encoder: RowEncoder | None = None  # a worker process's encoder


def _start_worker(encoder: RowEncoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode_chunk(task: tuple[str, str, array, int]) -> _Chunk:
    """Encode a chunk's examples, read at their offsets in the spool's file, into the Arrow file at `path`."""
    from datasets.arrow_writer import ArrowWriter

    path, spool_file, offsets, max_length = task
    encoder, chunk = _worker_encoder, _Chunk()
    with open(spool_file, "rb") as spool, \
            ArrowWriter(features=encoder.features(), path=path, writer_batch_size=256) as writer:
        for at, offset in enumerate(offsets):
            try:
                encoded = encoder(read_at(spool, offset)[1])
            except BadRow as reason:
                chunk.bad.append((at, str(reason)))
                continue
            counts = encoder.counts(encoded)
            chunk.lengths.append(counts[0])
            row, cut = encoder.fit(encoded, max_length)
            if row is None:
                chunk.untrainable += 1
                chunk.too_long.append((at, chunk.lengths[-1]))
                continue
            chunk.truncated += cut
            _, row_tokens, row_trained = encoder.counts(row) if cut else counts
            chunk.tokens += row_tokens
            chunk.trained += row_trained
            writer.write(row)
        writer.finalize()
    return chunk


def _chunks(tasks: list, encoder: RowEncoder, processes: int):
    """Each task's _Chunk, in order: here for small splits, else on worker processes."""
    global _worker_encoder
    _worker_encoder = encoder
    if processes <= 1 or len(tasks) * CHUNK_ROWS < PARALLEL_FROM:
        yield from map(_encode_chunk, tasks)
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers each tokenize on one thread
    # spawned, not forked: a fork of this process (torch's and the tokenizer's threads) can inherit a held lock
    pool = multiprocessing.get_context("spawn").Pool(processes, _start_worker, (encoder,))
    try:
        yield from pool.imap(_encode_chunk, tasks)
    except BaseException:
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()


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


def _percentiles(lengths: array) -> dict[str, int]:
    import numpy

    if not lengths:
        return {}
    values = numpy.frombuffer(lengths, dtype=numpy.int64)  # no Python int per row
    p50, p90, p99 = numpy.percentile(values, [50, 90, 99])  # interpolated between the nearest lengths
    return {"p50": round(p50), "p90": round(p90), "p99": round(p99), "max": int(values.max())}
