"""Encoding a split's examples into rows with their loss masks, written to an Arrow file as they come: on worker
processes for large splits, with a line on how far it is every few seconds (terminal and train.log)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from array import array
from pathlib import Path

from finetune.data.formats import BadRow
from finetune.data.stage_rows import RowEncoder

PARALLEL_FROM = 2000  # rows: below it, starting worker processes costs more than it saves
RATE_AFTER_S = 1.0
PROGRESS_EVERY_S = 5.0
logger = logging.getLogger("finetune")


def encode_split(examples, spool, encoder: RowEncoder, max_length: int, bad: list[str], too_long: list[str],
            path: Path, processes: int, split: str):
    """Encode `examples` into an Arrow file at `path`, row by row (nothing held but the lengths), on `processes`
    worker processes for large splits, saying how far it is; (the rows as a Dataset, their statistics)."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    lengths, truncated, untrainable, tokens, trained = array("q"), 0, 0, 0, 0
    progress = _Progress(split, len(examples))
    with ArrowWriter(features=encoder.features(), path=str(path), writer_batch_size=256) as writer:  # few rows held
        for index, encoded in zip(examples, _encoded(examples, spool, encoder, processes)):
            progress.advance()
            if isinstance(encoded, BadRow):
                bad.append(f"{spool.where(index)}: {encoded}")
                continue
            lengths.append(encoder.counts(encoded)[0])
            row, cut = encoder.fit(encoded, max_length)
            if row is None:
                untrainable += 1  # the whole answer lies past max_length: nothing left to learn from
                too_long.append(f"{spool.where(index)}: {lengths[-1]:,} tokens")
                continue
            truncated += cut  # rows kept, cut short; the dropped ones are counted apart
            _, row_tokens, row_trained = encoder.counts(row)
            tokens += row_tokens
            trained += row_trained
            writer.write(row)
        writer.finalize()
    progress.finish()
    table = datasets.Dataset.from_file(str(path))
    return table, {
        "tokens": tokens,
        "trained_tokens": trained,
        "trained_fraction": trained / tokens if tokens else 0.0,
        "length_percentiles": _percentiles(lengths),
        "truncated_rows": truncated,
        "dropped_no_trained_tokens": untrainable,
    }


_worker_encoder: RowEncoder | None = None  # a worker process's encoder


def _start_worker(encoder: RowEncoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode_one(example: dict):
    try:
        return _worker_encoder(example)
    except BadRow as reason:
        return reason


def _encoded(examples, spool, encoder: RowEncoder, processes: int):
    """Each example's row, or its BadRow, in order; the workers get a window of examples at a time."""
    global _worker_encoder
    _worker_encoder = encoder
    if processes <= 1 or len(examples) < PARALLEL_FROM:
        yield from (_encode_one(spool.get(index)) for index in examples)
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers each tokenize on one thread
    window = 256 * processes
    # spawned, not forked: a fork of this process (torch's and the tokenizer's threads) can inherit a held lock
    pool = multiprocessing.get_context("spawn").Pool(processes, _start_worker, (encoder,))
    try:
        for start in range(0, len(examples), window):
            batch = [spool.get(index) for index in examples[start:start + window]]
            yield from pool.imap(_encode_one, batch, chunksize=16)
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
        self.first_row: float | None = None  # when the first row was done: the workers had started

    def advance(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.first_row is None:
            self.first_row = now
        if now - self.said >= PROGRESS_EVERY_S:
            self.said = now
            line = f"preparing {self.split}: {self.done:,} of {self.total:,} rows"
            if self.done > 1 and now - self.first_row >= RATE_AFTER_S:  # a rate (and so a time left) from rows actually flowing
                rate = (self.done - 1) / (now - self.first_row)
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
