"""Chunks of examples worked on by forked worker processes, their results in order.

Forked, as datasets' map forks: a spawned worker would import transformers again, seconds before its first row. The
workers run no torch op and tokenize on one thread, so no lock of those libraries' threads is inherited. What a
worker needs (an encoder, the evaluation sets' n-grams) it inherits from module state its caller sets before."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable, Iterator

PARALLEL_FROM = 2000  # rows: below it, starting worker processes costs more than it saves


def in_order(work: Callable, tasks: Iterable, processes: int) -> Iterator:
    """work(task) for each task, in order: here for one process, else on `processes` forked workers."""
    if processes <= 1:
        yield from map(work, tasks)
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers each tokenize on one thread
    pool = multiprocessing.get_context("fork").Pool(processes, _start)
    try:
        yield from pool.imap(work, tasks)
    except BaseException:
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()


def _start() -> None:
    import datasets

    # a run's handlers (stop at the next step on SIGTERM or SIGINT), inherited by the fork, would keep the pool
    # from terminating its workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    datasets.disable_progress_bars()  # packing's; the main process says how far the workers are
