"""One pass over the examples for the data checks (integrity.py): each example read once from the spool, on the data
workers, and turned into what the checks compare; the groups of duplicates kept in order in the main process.

What is compared is an example's text as its author wrote it, not the chat template's rendering of it (the
template's glue, the same in every row, would make short rows look alike):

    exact duplicates   the messages' roles and texts with runs of whitespace made one space
    near duplicates    the sets of its word 3-grams (words: lowercased letters and digits) with a Jaccard
                       similarity of at least the threshold; candidates are the examples that share a band of their
                       MinHash signatures (datasketch computes the signatures and chooses the bands), each then
                       checked on the exact sets, so none is reported on an estimate
    contamination      word 13-grams (lm-evaluation-harness's decontamination length) shared with an evaluation
                       set's items; an item shorter than 13 words is matched whole, and the longest run of shared
                       words is reported with each match
    teaching nothing   conversations that end with another turn than the assistant's, blank answers, reasoning
                       the template leaves out

Memory holds an exact key and the band hashes of each example (72 bytes) and the evaluation sets' n-gram hashes;
the texts stay in the spool.
"""

from __future__ import annotations

import functools
import hashlib
import re
import zlib
from array import array
from dataclasses import dataclass

import numpy as np

from finetune.data import workers
from finetune.data.spool import read_at
from finetune.data.stage_rows import answer_example

SHINGLE = 3  # words per shingle of the near-duplicate check
NGRAM = 13  # words per n-gram of the contamination check
NUM_PERM = 64  # MinHash permutations
LSH_WEIGHTS = (0.2, 0.8)  # (false positive, false negative): candidates are checked exactly, misses are not found
MOST_COMPARED = 64  # groups an example is compared with among those sharing a band with it
WORD = re.compile(r"\w+")
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd: the n-gram hash's polynomial base


@dataclass
class EvalSet:
    """An evaluation set the training data is checked against: its name and each item's (where, text)."""
    name: str
    items: list[tuple[str, str]]


IDLE = {"ends_without_answer": "ends with another message than the assistant's, which carries no loss",
        "blank_answer": "an assistant message is only whitespace",
        "thinking_dropped": "the chat template leaves out its reasoning (thinking): it is not trained"}


def _teaches_nothing(messages: list[dict], thinking_dropped: bool) -> str | None:
    """Why a conversation teaches nothing (a key of IDLE), or None."""
    if not messages[-1]["role"] or messages[-1]["role"] == "assistant":
        if any(m["role"] == "assistant" and m["content"] and not m["content"].strip() and not m.get("tool_calls")
               for m in messages):
            return "blank_answer"
        if thinking_dropped and any(m.get("thinking") for m in messages if m["role"] == "assistant"):
            return "thinking_dropped"
        return None
    return "ends_without_answer"


def _words(example: dict) -> list[str]:
    """The example's words, lowercased, its messages' texts one after the other (no roles: a verbatim copy of an
    evaluation item shows as one run of words)."""
    return WORD.findall(text_of(example, roles=False).lower())


def text_of(example: dict, roles: bool = True) -> str:
    example = answer_example(example)
    if "segments" in example:
        return "".join(segment["text"] for segment in example["segments"])
    return "\n".join((f"{m['role']}: " if roles else "") + f"{m.get('thinking') or ''} {m['content']} "
                     f"{m.get('tool_calls') or ''}" for m in example["messages"])


def _exact_key(example: dict) -> int:
    """The same for examples with the same roles and texts, up to whitespace."""
    digest = hashlib.blake2b(" ".join(text_of(example).split()).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@functools.lru_cache(maxsize=1 << 18)  # a corpus's vocabulary: bounded, whatever the rows
def _word_hash(word: str) -> int:
    return zlib.crc32(word.encode())


def _word_hashes(example: dict) -> np.ndarray:
    """A hash of each of the example's words, in order."""
    tokens = _words(example)
    return np.fromiter(map(_word_hash, tokens), dtype=np.uint64, count=len(tokens))


def _ngram_hashes(hashes: np.ndarray, n: int) -> np.ndarray:
    """A 64-bit hash of each run of `n` words (a polynomial over the words' hashes, wrapping)."""
    if len(hashes) < n:
        return np.empty(0, dtype=np.uint64)
    powers = _MULTIPLIER ** np.arange(n - 1, -1, -1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return np.lib.stride_tricks.sliding_window_view(hashes, n) @ powers


def _shingles(hashes: np.ndarray) -> np.ndarray:
    """The example's distinct word 3-grams (a short example's words together are one)."""
    return np.unique(_ngram_hashes(hashes, min(SHINGLE, len(hashes))))


def _jaccard(a: np.ndarray, b: np.ndarray) -> float:
    union = len(np.union1d(a, b))
    return len(np.intersect1d(a, b, assume_unique=True)) / union if union else 1.0


class _Groups:
    """Union-find over example positions: the groups of duplicates."""

    def __init__(self):
        self.parent: dict[int, int] = {}

    def root(self, x: int) -> int:
        parent = self.parent
        while parent.get(x, x) != x:
            parent[x] = parent.get(parent[x], parent[x])  # halving the path as it goes
            x = parent[x]
        return x

    def join(self, a: int, b: int) -> None:
        a, b = self.root(a), self.root(b)
        if a != b:
            self.parent[max(a, b)] = min(a, b)  # the group's first row is its root

    def groups(self) -> list[list[int]]:
        found: dict[int, list[int]] = {}
        for x in self.parent:
            found.setdefault(self.root(x), []).append(x)
        return [sorted({root, *members}) for root, members in sorted(found.items())]


@dataclass
class Duplicates:
    """Groups of positions in the training examples (each sorted, its first the row a drop keeps), and the eval
    examples that duplicate a training one: (eval offset, train position, "exact" or "near")."""
    exact: list[list[int]]
    near: list[list[int]]
    eval_overlaps: list[tuple[int, int, str]]

    def dropped(self) -> set[int]:
        """All but the first of each group, and every row of a group an eval row duplicates."""
        group_of = {position: group for group in self.exact + self.near for position in group}
        drop = {position for group in self.exact + self.near for position in group[1:]}
        for _, position, _ in self.eval_overlaps:
            drop |= set(group_of.get(position, [position]))
        return drop


@dataclass
class Contamination:
    """A training example that shares words with an evaluation set's item: its position in the training examples,
    the set, the item (its index) with the most n-grams in common, and the longest run of words they share."""
    position: int
    set_index: int
    item: int
    shared_words: int


@dataclass
class Scanned:
    """What one pass over the training examples found: duplicates (None: not looked for), contamination, rows that
    teach nothing (position, why), and how many rows have a system message."""
    duplicates: Duplicates | None
    contamination: list[Contamination]
    idle: list[tuple[int, str]]
    system_rows: int


def scan(spool, train: array, eval_: array, eval_sets: list[EvalSet], threshold: float | None,
         processes: int = 1, teaching: bool | None = None) -> Scanned:
    """The duplicates (threshold None: not looked for), the contamination and (teaching not None: whether the
    template leaves out reasoning) the rows that teach nothing of the training examples (offsets in `spool`), in one
    pass: each example is read, and its words, exact key, MinHash and n-gram matches computed, on `processes` worker
    processes; the LSH index and the groups are kept here, in order."""
    global _scanned
    found = Scanned(None, [], [], 0)
    if not len(train) or threshold is None and not eval_sets and teaching is None:
        return found
    spool.file.flush()  # the workers read the examples from it
    _scanned = _Scanning(spool.file.name, [_NgramIndex(eval_set) for eval_set in eval_sets], threshold, teaching)
    deduplication = _Deduplication(spool, train, threshold) if threshold is not None else None
    for start, chunk in _fingerprinted(train, processes):
        if deduplication:
            deduplication.add(start, chunk)
        found.contamination += [Contamination(start + at, *match) for at, *match in chunk.matches]
        found.idle += [(start + at, why) for at, why in chunk.idle]
        found.system_rows += chunk.system_rows
    if deduplication:
        _scanned = _Scanning(spool.file.name, [], threshold, None)
        chunks = [chunk for _, chunk in _fingerprinted(eval_, processes)]
        keys = np.concatenate([chunk.keys for chunk in chunks]) if chunks else np.empty(0, dtype=np.uint64)
        bands = np.concatenate([chunk.bands for chunk in chunks]) if chunks else \
            np.empty((0, deduplication.bands.shape[1]), dtype=np.uint64)
        found.duplicates = deduplication.groups(eval_, keys, bands)
    return found


class _Deduplication:
    """The exact keys and LSH band hashes of the training examples, and the groups they form. Memory holds 8 bytes
    of key and 8 bytes a band of band hashes an example (datasketch's own index holds a Python set per band and
    example: 2.7 KB an example, measured). Candidates, examples that share a band, are checked on their exact word
    3-grams; two examples of one data row (a KTO pair's answers) are not each other's duplicates."""

    def __init__(self, spool, train: array, threshold: float):
        self.spool, self.examples, self.threshold = spool, train, threshold
        self.keys = np.empty(len(train), dtype=np.uint64)
        self.bands = np.empty((len(train), _lsh_shape(threshold)[0]), dtype=np.uint64)
        self.exact, self.near = _Groups(), _Groups()

    def add(self, start: int, chunk: _Fingerprints) -> None:
        self.keys[start:start + len(chunk.keys)] = chunk.keys
        self.bands[start:start + len(chunk.keys)] = chunk.bands

    def groups(self, eval_: array, eval_keys: np.ndarray, eval_bands: np.ndarray) -> Duplicates:
        order = np.argsort(self.keys, kind="stable")
        keys = self.keys[order]
        first = np.ones(len(keys), dtype=bool)
        first[1:] = keys[1:] != keys[:-1]
        starts = np.flatnonzero(first)
        for begin, end in zip(starts, [*starts[1:], len(keys)]):
            for position in order[begin + 1:end]:
                self.exact.join(int(order[begin]), int(position))
        kept = np.sort(order[first])  # the first example of each key: the others are exact duplicates
        overlaps = {}
        at = np.searchsorted(keys, eval_keys)
        for index in np.flatnonzero((at < len(keys)) & (keys[np.minimum(at, len(keys) - 1)] == eval_keys)):
            overlaps[int(index)] = (int(order[at[index]]), "exact")
        for band in range(self.bands.shape[1]):
            hashes = self.bands[kept, band]
            by_hash = np.argsort(hashes, kind="stable")
            sorted_hashes, members = hashes[by_hash], kept[by_hash]
            new = np.ones(len(sorted_hashes), dtype=bool)
            new[1:] = sorted_hashes[1:] != sorted_hashes[:-1]
            starts = np.flatnonzero(new)
            for begin, end in zip(starts, [*starts[1:], len(members)]):
                if end - begin > 1:
                    self._bucket([int(p) for p in members[begin:end]])
            at = np.searchsorted(sorted_hashes, eval_bands[:, band])
            hit = (at < len(sorted_hashes)) & (sorted_hashes[np.minimum(at, len(sorted_hashes) - 1)] ==
                                               eval_bands[:, band])
            for index in np.flatnonzero(hit):
                if int(index) not in overlaps and self._similar(eval_[index], int(members[at[index]])):
                    overlaps[int(index)] = (int(members[at[index]]), "near")
        return Duplicates(self.exact.groups(), self.near.groups(),
                          [(eval_[index], *found) for index, found in sorted(overlaps.items())])

    def _bucket(self, members: list[int]) -> None:
        """Examples that share a band, in order: each is compared with the first example of every group among those
        before it (at most MOST_COMPARED groups), and joins the groups it is similar to."""
        seen: dict[int, int] = {}  # root -> its first example here
        for position in members:
            for root, other in list(seen.items())[:MOST_COMPARED]:
                if root != self.near.root(position) and self._similar(self.examples[position], other) and \
                        self.spool.where(self.examples[position]) != self.spool.where(self.examples[other]):
                    self.near.join(other, position)
            seen.setdefault(self.near.root(position), position)

    def _similar(self, offset: int, position: int) -> bool:
        """Whether the example at `offset` in the spool and the training example at `position` are near duplicates."""
        return _jaccard(_shingles(_word_hashes(self.spool.get(offset))),
                        _shingles(_word_hashes(self.spool.get(self.examples[position])))) >= self.threshold


@functools.cache
def _lsh_shape(threshold: float) -> tuple[int, int]:
    """(bands, rows per band) for the threshold: datasketch's choice, weighing misses (LSH_WEIGHTS)."""
    from datasketch import MinHashLSH

    index = MinHashLSH(threshold=threshold, num_perm=NUM_PERM, weights=LSH_WEIGHTS)
    return index.b, index.r


def _band_hashes(signature: np.ndarray, threshold: float) -> np.ndarray:
    """A 64-bit hash of each band of a MinHash signature."""
    bands, rows = _lsh_shape(threshold)
    values = signature[:bands * rows].reshape(bands, rows).astype(np.uint64)
    with np.errstate(over="ignore"):
        return values @ (_MULTIPLIER ** np.arange(1, rows + 1, dtype=np.uint64))


@dataclass
class _Scanning:
    """What the workers fork with."""
    spool_file: str
    indexes: list  # the evaluation sets' n-grams
    threshold: float | None  # of near duplicates; None: duplicates are not looked for
    teaching: bool | None  # rows that teach nothing looked for (not None), and whether the template drops reasoning


_scanned: _Scanning | None = None


@dataclass
class _Fingerprints:
    """A chunk of examples as the checks compare them."""
    keys: np.ndarray  # (examples,) uint64: _exact_key
    bands: np.ndarray  # (examples, bands) uint64: their MinHash signature's band hashes
    matches: list[tuple[int, int, int, int]]  # (place in the chunk, evaluation set, item, words shared)
    idle: list[tuple[int, str]]  # (place in the chunk, why it teaches nothing)
    system_rows: int


CHUNK = 2000  # examples a worker fingerprints at a time


def _fingerprinted(examples: array, processes: int):
    """(the chunk's first position, its _Fingerprints) for each chunk of the examples, in order."""
    starts = range(0, len(examples), CHUNK)
    parallel = processes if len(examples) >= workers.PARALLEL_FROM else 1
    # the chunks first: zip ends on them, after their pool has closed (ended on `starts`, it would leave the pool's
    # generator open, to be closed later: the pool then terminated instead of joined)
    found = workers.in_order(_fingerprint, (examples[start:start + CHUNK] for start in starts), parallel)
    return ((start, chunk) for chunk, start in zip(found, starts))


def _fingerprint(offsets: array) -> _Fingerprints:
    from datasketch import MinHash

    scanning = _scanned
    bands = _lsh_shape(scanning.threshold)[0] if scanning.threshold is not None else 0
    found = _Fingerprints(np.empty(len(offsets), dtype=np.uint64), np.empty((len(offsets), bands), dtype=np.uint64),
                          [], [], 0)
    with open(scanning.spool_file, "rb") as handle:
        for at, offset in enumerate(offsets):
            example = read_at(handle, offset)[1]
            if scanning.teaching is not None:
                messages = answer_example(example).get("messages") or [{"role": ""}]
                found.system_rows += messages[0]["role"] == "system"
                why = _teaches_nothing(messages, scanning.teaching)
                if why:
                    found.idle.append((at, why))
            if scanning.threshold is None and not scanning.indexes:
                continue
            hashes = _word_hashes(example)
            if scanning.threshold is not None:
                found.keys[at] = _exact_key(example)
                minhash = MinHash(num_perm=NUM_PERM, hashfunc=int, permutations=_permutations(), scheme="affine32")
                minhash.update_batch((_shingles(hashes) & 0xFFFFFFFF).tolist())  # affine32 hashes 32 bits
                found.bands[at] = _band_hashes(minhash.hashvalues, scanning.threshold)
            for set_index, index in enumerate(scanning.indexes):
                match = index.match(hashes)
                if match:
                    found.matches.append((at, set_index, *match))
    return found


@functools.cache
def _permutations():
    from datasketch import MinHash

    return MinHash(num_perm=NUM_PERM, scheme="affine32").permutations  # made once, not per example


class _NgramIndex:
    """An evaluation set's n-grams, sorted, each with the item it comes from."""

    def __init__(self, eval_set: EvalSet):
        hashes, owners, self.lengths = [], [], set()
        for item, (_, text) in enumerate(eval_set.items):
            tokens = WORD.findall(text.lower())
            n = min(NGRAM, len(tokens))  # an item shorter than NGRAM words is one n-gram of its length
            if n:
                grams = np.unique(_ngram_hashes(np.fromiter(map(_word_hash, tokens), dtype=np.uint64), n))
                hashes.append(grams)
                owners.append(np.full(len(grams), item, dtype=np.int64))
                self.lengths.add(n)
        hashes = np.concatenate(hashes) if hashes else np.empty(0, dtype=np.uint64)
        order = np.argsort(hashes, kind="stable")
        self.hashes, self.owners = hashes[order], np.concatenate(owners)[order] if owners else hashes

    def match(self, hashes: np.ndarray) -> tuple[int, int] | None:
        """(the item with the most n-grams among the words (their hashes), the longest run of words they share), or
        None."""
        for n in sorted(self.lengths, reverse=True):
            grams = _ngram_hashes(hashes, n)
            at = np.searchsorted(self.hashes, grams)
            hit = (at < len(self.hashes)) & (self.hashes[np.minimum(at, len(self.hashes) - 1)] == grams)
            if hit.any():
                return int(np.bincount(self.owners[at[hit]]).argmax()), _longest_run(hit) + n - 1
        return None


def _longest_run(hit: np.ndarray) -> int:
    longest = run = 0
    for value in hit:
        run = run + 1 if value else 0
        longest = max(longest, run)
    return longest
