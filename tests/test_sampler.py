"""The training order (finetune/data/sampler.py): global batches of similar lengths, and a resumed epoch that starts
at its batch."""

from __future__ import annotations

from finetune.data.sampler import SimilarLengthSampler


def test_every_global_batch_is_full_and_of_similar_lengths():
    """37 rows of distinct lengths in global batches of 4: each batch is a run of neighbouring lengths, the last
    one completed with the nearest rows of its window, whatever the epoch."""
    lengths = [(7 * i) % 37 + 1 for i in range(37)]  # 1..37, shuffled
    sampler = SimilarLengthSampler(lengths, global_batch=4, seed=3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert len(order) == len(sampler) == 40
        chunks = [sorted(lengths[i] for i in order[k:k + 4]) for k in range(0, 40, 4)]
        assert max(len(set(chunk)) for chunk in chunks) == 4
        assert set(order) == set(range(37))  # every row, every epoch
        for chunk in chunks:
            assert chunk[-1] - chunk[0] <= 6, chunks  # neighbours (the completed batch reaches a little further)
        assert max(chunks, key=max) == chunks[0]  # the longest batch comes first


def test_a_resumed_epoch_starts_at_its_batch():
    lengths = list(range(1, 101))
    sampler = SimilarLengthSampler(lengths, global_batch=8, seed=0)
    sampler.set_epoch(2)
    whole = list(sampler)
    sampler.start_at(2, 5)
    assert list(sampler) == whole[5 * 8:]
    assert list(sampler) == whole  # once only; the next pass over the epoch is whole again
    sampler.start_at(3, 1)
    assert list(sampler) == whole  # for another epoch: nothing changes here
