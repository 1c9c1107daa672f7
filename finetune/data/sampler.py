"""The training order: random, with rows of similar length batched together, so little padding is computed."""

from __future__ import annotations

import itertools
import math

import torch
from torch.utils.data import Sampler

WINDOW = 50  # global batches sorted together: wider means less padding, narrower means more randomness


class SimilarLengthSampler(Sampler[int]):
    """Rows are shuffled, cut into windows of WINDOW global batches, sorted by length inside each window and cut
    into global batches; the batches are then shuffled, except that the one holding the longest row comes first,
    so a batch that does not fit in memory fails at the first step, not hours in.

    Every global batch is full: the last one of an epoch is completed with rows of the nearest lengths from its own
    window (seen twice that epoch). The order depends on the global batch (per-device batch x processes x
    accumulation steps), never on how it is split across processes, so N processes see exactly the batches one
    process would, and no launcher has to pad an uneven end with rows of its own choosing.

    `start_at(epoch, batch)` makes that epoch's order start at its batch-th global batch (for a resumed run),
    without producing the ones before it.
    """

    def __init__(self, lengths: list[int], global_batch: int, seed: int):
        self.lengths, self.global_batch, self.seed, self.epoch = lengths, global_batch, seed, 0
        self._start: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_at(self, epoch: int, batch: int) -> None:
        self._start = (epoch, batch)

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.global_batch) * self.global_batch

    def __iter__(self):
        batches = self.batches(self.epoch)
        skip = 0
        if self._start is not None and self._start[0] == self.epoch:
            skip, self._start = self._start[1], None
        for batch in batches[skip:]:
            yield from batch

    def batches(self, epoch: int) -> list[list[int]]:
        """The epoch's global batches, in training order."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        span = self.global_batch * WINDOW
        batches = []
        for start in range(0, len(order), span):
            window = sorted(order[start:start + span], key=lambda i: -self.lengths[i])
            batches += [window[i:i + self.global_batch] for i in range(0, len(window), self.global_batch)]
        short = batches[-1]
        if len(short) < self.global_batch:
            nearest = list(reversed(window[:-len(short)])) or short  # the rows just longer than the short batch's
            short += itertools.islice(itertools.cycle(nearest), self.global_batch - len(short))
        longest = max(range(len(batches)), key=lambda b: self.lengths[batches[b][0]])
        rest = [batches[b] for b in torch.randperm(len(batches), generator=generator).tolist() if b != longest]
        return [batches[longest], *rest]
