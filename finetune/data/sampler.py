"""The training order: random, with rows of similar length batched together, so little padding is computed."""

from __future__ import annotations

import torch
from torch.utils.data import Sampler

WINDOW = 50  # global batches sorted together: wider means less padding, narrower means more randomness


class SimilarLengthSampler(Sampler[int]):
    """Rows are shuffled, cut into windows of WINDOW global batches, sorted by length inside each window and cut
    into global batches; the batches are then shuffled, except that the one holding the longest row comes first,
    so a batch that does not fit in memory fails at the first step, not hours in.

    The order depends on the global batch (per-device batch x processes x accumulation steps), never on how it is
    split across processes, so N processes see exactly the batches one process would.
    """

    def __init__(self, lengths: list[int], global_batch: int, seed: int):
        self.lengths, self.global_batch, self.seed, self.epoch = lengths, global_batch, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        span = self.global_batch * WINDOW
        batches = []
        for start in range(0, len(order), span):
            window = sorted(order[start:start + span], key=lambda i: -self.lengths[i])
            batches += [window[i:i + self.global_batch] for i in range(0, len(window), self.global_batch)]
        longest = max(range(len(batches)), key=lambda b: self.lengths[batches[b][0]])
        rest = [batches[b] for b in torch.randperm(len(batches), generator=generator).tolist() if b != longest]
        for batch in [batches[longest], *rest]:
            yield from batch
