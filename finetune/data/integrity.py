"""Know the data before step 0: duplicates, overlap with evaluation sets (contamination), and rows that teach
nothing, found while the data is prepared, reported by `finetune validate` (and at the start of training), and
dropped or refused as the recipe says.

What is compared is an example's text as its author wrote it, not the chat template's rendering of it (the
template's glue, the same in every row, would make short rows look alike):

    exact duplicates   the messages' roles and texts with runs of whitespace made one space
    near duplicates    the sets of its word 3-grams (words: lowercased letters and digits) with a Jaccard
                       similarity of at least data.near_duplicate_threshold; candidates come from MinHash/LSH
                       (datasketch), each then checked on the exact sets, so none is reported on an estimate
    contamination      word 13-grams (lm-evaluation-harness's decontamination length) shared with an evaluation
                       set's items (every text field of an item: question and answer); an item shorter than 13
                       words is matched whole. The longest run of shared words is reported with each match

Memory holds a digest per example, the LSH index (a few band hashes per example) and the evaluation sets'
n-gram hashes; the texts stay in the spool.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import zlib
from array import array
from dataclasses import dataclass

import numpy as np

from finetune.data import formats, sources, workers
from finetune.data.formats import BadRow
from finetune.data.spool import read_at
from finetune.data.stage_rows import answer_example
from finetune.errors import UserError
from finetune.resources import eval_tasks_dir

SHINGLE = 3  # words per shingle of the near-duplicate check
NGRAM = 13  # words per n-gram of the contamination check
NUM_PERM = 64  # MinHash permutations
LSH_WEIGHTS = (0.2, 0.8)  # (false positive, false negative): candidates are checked exactly, misses are not found
SHOWN = 5  # groups or matches listed per finding
MOST_COMPARED = 64  # groups an example is compared with among those sharing a band with it
SNIPPET = 160  # characters of a row shown beside its match
WORD = re.compile(r"\w+")
LM_EVAL = "lm-eval:"
UNSTABLE = "differently from the full conversation"  # render.py's reason for such a row
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd: the n-gram hash's polynomial base


@dataclass
class EvalSet:
    """An evaluation set the training data is checked against: its name and each item's (where, text)."""
    name: str
    items: list[tuple[str, str]]


def check(spool, train: array, eval_: array, data, eval_sets: list[EvalSet], stage: str, template: dict,
          processes: int = 1) -> tuple[array, dict]:
    """The checks data.duplicates, data.decontaminate and data.teaches_nothing ask for, on the examples (offsets in
    `spool`): a UserError where a policy is fail and a check finds rows; the rows dropped where it is drop.
    `template`: what template_findings found. (The training examples kept, the report.)"""
    report: dict = {}
    drop: set[int] = set()  # positions in train
    threshold = data.near_duplicate_threshold if data.duplicates != "unchecked" else None
    scanned = scan(spool, train, eval_, eval_sets, threshold, processes,
                   teaching=template["thinking_dropped"] if stage == "sft" else None)
    duplicates, contamination = scanned.duplicates, scanned.contamination
    if duplicates:
        report["duplicates"] = _duplicates_report(duplicates, spool, train, data.near_duplicate_threshold)
        report["duplicates"]["policy"] = data.duplicates
        _apply(data.duplicates, duplicates.dropped(), drop, lambda: _duplicates_error(report["duplicates"]))
    if eval_sets:
        contaminated = {match.position for match in contamination}
        report["contamination"] = _contamination_report(contamination, spool, train, eval_sets)
        report["contamination"].update(policy=data.contaminated, max_share=data.contamination_max_share)
        over = report["contamination"]["share"] > data.contamination_max_share
        _apply(data.contaminated if over or data.contaminated != "fail" else "report", contaminated, drop,
               lambda: _contamination_error(report["contamination"]))
    report["template"] = list(template["findings"])
    if stage == "sft":
        report["teaches_nothing"] = _teaches_nothing_report(scanned.idle, spool, train)
        report["teaches_nothing"]["policy"] = data.teaches_nothing
        if template["ignores_system"] and scanned.system_rows:
            report["template"].append(
                f"the chat template leaves out system messages, and {counted(scanned.system_rows, 'row')} have one "
                "(data.system_prompt adds one to every row): the model never sees them")
        _apply(data.teaches_nothing, {position for position, _ in scanned.idle}, drop,
               lambda: _teaches_nothing_error(report["teaches_nothing"]))
    report["dropped"] = len(drop)
    kept = array("q", (example for position, example in enumerate(train) if position not in drop)) if drop else train
    return kept, report


def _apply(policy: str, rows: set[int], drop: set[int], error) -> None:
    if rows and policy == "fail":
        raise error()
    if policy == "drop":
        drop |= rows


def template_findings(renderer, train_thinking: bool) -> dict:
    """What rendering a probe conversation shows of the chat template: whether an assistant turn ends with a token
    (the model learns to stop), whether system messages reach the model, whether the reasoning of the answer does.
    {"findings": [what to tell], "ignores_system": bool, "thinking_dropped": bool}."""
    from finetune.data.render import IGNORE

    found = {"findings": [], "ignores_system": False, "thinking_dropped": False}
    if renderer.template is None:
        return found
    question, answer = {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}
    tokenizer = renderer.tokenizer
    try:
        _, labels = renderer.encode({"messages": [question, answer], "tools": None})
    except BadRow:  # the template cannot render a plain exchange: every row will say why
        return found
    found["ignores_system"] = not _renders("system-probe-7d1c", renderer, [
        {"role": "system", "content": "system-probe-7d1c"}, question])
    found["thinking_dropped"] = train_thinking and not _renders("thinking-probe-7d1c", renderer, [
        question, {**answer, "thinking": "thinking-probe-7d1c"}])
    last = [label for label in labels if label != IGNORE][-1]
    if last not in set(tokenizer.get_added_vocab().values()) | {tokenizer.eos_token_id}:
        found["findings"].append(
            f"the chat template ends an assistant turn with {tokenizer.decode([last])!r}, not an end-of-turn token: "
            "a model trained on it never learns to stop (chat and serve run to max_new_tokens); use a template "
            "that ends each turn with one (model.chat_template)")
    return found


def _renders(probe: str, renderer, messages: list[dict]) -> bool:
    """Whether the rendering of the messages holds the probe text; True where the template refuses them (a row of
    such messages is a bad row, with the template's own reason)."""
    try:
        return probe in renderer.render_text({"messages": messages})
    except Exception:  # jinja's raise_exception: "System role not supported", for one
        return True


def add_encoding_findings(report: dict, encoded: dict, bad: list[str]) -> None:
    """What encoding found that belongs with the checks: rows with nothing to learn within train.max_length, and
    conversations the template renders differently as they grow (bad rows, said once as the template's fault)."""
    if "teaches_nothing" in report:
        report["teaches_nothing"]["nothing_within_max_length"] = encoded["too_long"]
    unstable = [entry for entry in bad if UNSTABLE in entry]
    if unstable:
        report["template"].append(unstable_template(len(unstable), unstable[0]))


def unstable_template(rows: int, first: str) -> str:
    return (f"the chat template renders {counted(rows, 'conversation')} differently as they grow "
            f"(the first: {first.split(': ')[0]}), so their loss masks cannot be derived; use a template with "
            "{% generation %} markers (model.chat_template)")


def read_eval_sets(specs: list[str]) -> list[EvalSet]:
    """data.decontaminate's sets, each item's text every text field of its row (question, answer, choices)."""
    found = []
    for spec in specs:
        if spec.startswith(LM_EVAL):
            items = _lm_eval_items(spec)
        else:
            items = [(where, _item_text(row)) for where, row in sources.resolve(spec, "data.decontaminate").rows()
                     if not isinstance(row, BadRow)]
        if not items:
            raise UserError(f"data.decontaminate: {spec} has no rows")
        found.append(EvalSet(spec, items))
    return found


def fingerprint(spec: str) -> str:
    """Changes whenever the set's items could."""
    if spec.startswith(LM_EVAL):
        from importlib.metadata import version

        return f"{spec} lm-eval {version('lm_eval')}"
    return sources.resolve(spec, "data.decontaminate").fingerprint()


def _lm_eval_items(spec: str) -> list[tuple[str, str]]:
    name = spec.removeprefix(LM_EVAL)
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError(f"data.decontaminate: {spec} needs lm-evaluation-harness: pip install -e \".[eval]\"") from None
    quiet = logging.getLogger("lm_eval")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its notes on task options, printed as warnings
    try:
        manager = TaskManager(include_path=[str(eval_tasks_dir())])
        if name not in manager.all_tasks:
            raise UserError(f"data.decontaminate: {spec}: lm-evaluation-harness knows no task {name!r}")
        try:
            task = manager.load([name])["tasks"][name]
            docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
        except Exception as error:  # its data is not local (offline), or the task cannot load it
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise UserError(f"data.decontaminate: {spec}: lm-evaluation-harness could not load the task's data "
                            f"({first_line}); a task is checked from data on this machine") from None
    finally:
        quiet.setLevel(level)
    return [(f"{spec} item {number}", _strings(doc)) for number, doc in enumerate(docs or [], 1)]


def _item_text(row: dict) -> str:
    """An evaluation item's text: a row of a format training reads as its messages' texts (no roles, as training rows
    are compared), any other row as all its text fields."""
    fmt = formats.detect_format(row, {}) or formats.detect_format(row, {}, preference=True)
    if fmt:
        try:
            return _text(formats.normalize(row, fmt, {}, None), roles=False)
        except BadRow:
            pass
    return _strings(row)


def _strings(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        value = value.values()
    if isinstance(value, (list, tuple, type({}.values()))):
        return "\n".join(text for text in map(_strings, value) if text)
    return ""


def _words(example: dict) -> list[str]:
    """The example's words, lowercased, its messages' texts one after the other (no roles: a verbatim copy of an
    evaluation item shows as one run of words)."""
    return WORD.findall(_text(example, roles=False).lower())


def _text(example: dict, roles: bool = True) -> str:
    example = answer_example(example)
    if "segments" in example:
        return "".join(segment["text"] for segment in example["segments"])
    return "\n".join((f"{m['role']}: " if roles else "") + f"{m.get('thinking') or ''} {m['content']} "
                     f"{m.get('tool_calls') or ''}" for m in example["messages"])


def _exact_key(example: dict) -> int:
    """The same for examples with the same roles and texts, up to whitespace."""
    digest = hashlib.blake2b(" ".join(_text(example).split()).encode(), digest_size=8).digest()
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


def _duplicates_report(found: Duplicates, spool, train: array, threshold: float) -> dict:
    where = spool.where
    return {
        "threshold": threshold,
        "exact": _groups_found(found.exact, train, where),
        "near": _groups_found(found.near, train, where),
        "eval_overlap": {"rows": len(found.eval_overlaps),
                         "shown": [{"eval": where(offset), "train": where(train[position]), "kind": kind}
                                   for offset, position, kind in found.eval_overlaps[:SHOWN]]},
    }


def _groups_found(groups: list[list[int]], train: array, where) -> dict:
    return {"groups": len(groups), "rows": sum(len(group) - 1 for group in groups),
            "shown": [{"size": len(group), "rows": [where(train[p]) for p in group[:3]]}
                      for group in sorted(groups, key=len, reverse=True)[:SHOWN]]}


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


def _contamination_report(found: list[Contamination], spool, train: array, eval_sets: list[EvalSet]) -> dict:
    sets = []
    for set_index, eval_set in enumerate(eval_sets):
        matches = [match for match in found if match.set_index == set_index]
        sets.append({"set": eval_set.name, "items": len(eval_set.items), "rows": len(matches),
                     "items_found": len({match.item for match in matches}),
                     "shown": [{"row": spool.where(train[match.position]),
                                "row_text": _snippet(_text(spool.get(train[match.position]))),
                                "item": eval_set.items[match.item][0],
                                "item_text": _snippet(eval_set.items[match.item][1]),
                                "shared_words": match.shared_words} for match in matches[:SHOWN]]})
    rows = len({match.position for match in found})
    return {"ngram": NGRAM, "sets": sets, "rows": rows, "share": rows / len(train) if len(train) else 0.0}


def _longest_run(hit: np.ndarray) -> int:
    longest = run = 0
    for value in hit:
        run = run + 1 if value else 0
        longest = max(longest, run)
    return longest


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SNIPPET else text[:SNIPPET - 1] + "…"


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


def _teaches_nothing_report(idle: list[tuple[int, str]], spool, train: array) -> dict:
    counts = {why: sum(1 for _, found in idle if found == why) for why in IDLE}
    return {"rows": len(idle), **counts,
            "shown": [f"{spool.where(train[position])}: {IDLE[why]}" for position, why in idle[:SHOWN]]}


def _duplicates_error(found: dict) -> UserError:
    lines = [f"  {' = '.join(group['rows'])}" + (f" (and {group['size'] - 3} more)" if group["size"] > 3 else "")
             for kind in ("exact", "near") for group in found[kind]["shown"]]
    lines += [f"  {match['train']} = eval {match['eval']}" for match in found["eval_overlap"]["shown"]]
    return UserError(f"data.train: {summary_of_duplicates(found)}:\n" + "\n".join(lines) + "\nRemove them, set "
                     "data.duplicates=drop to keep the first of each group (and no row an eval row duplicates), or "
                     "data.duplicates=report to train on them")


def summary_of_duplicates(found: dict) -> str:
    exact, near, overlap = found["exact"], found["near"], found["eval_overlap"]["rows"]
    return (f"{counted(exact['rows'], 'exact duplicate row')} in {counted(exact['groups'], 'group')}, "
            f"{counted(near['rows'], 'near duplicate')} (Jaccard >= {found['threshold']:g}) in "
            f"{counted(near['groups'], 'group')}, {counted(overlap, 'row')} duplicating an eval row")


def counted(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def _contamination_error(found: dict) -> UserError:
    lines = [f"  {match['row']} shares {match['shared_words']} words with {match['item']}"
             for one in found["sets"] for match in one["shown"]]
    return UserError(f"data.train: {counted(found['rows'], 'row')} ({found['share']:.2%}) "
                     f"overlap{'s' if found['rows'] == 1 else ''} data.decontaminate's sets, "
                     f"above data.contamination_max_share {found['max_share']:g}:\n" + "\n".join(lines)
                     + "\nRemove them, set data.contaminated=drop to leave them out, or raise "
                     "data.contamination_max_share")


def _teaches_nothing_error(found: dict) -> UserError:
    lines = [f"  {line}" for line in found["shown"]]
    more = f"\n  ... and {found['rows'] - len(lines)} more" if found["rows"] > len(lines) else ""
    return UserError(f"data.train: rows that teach nothing ({found['rows']:,}):\n" + "\n".join(lines) + more
                     + "\nFix them, or set data.teaches_nothing=drop to leave them out (report: train on them)")


def summary(found: dict, shown=str) -> str:
    """What the checks found, in a line (the model card's); `shown` names an evaluation set (the card: never by a
    local path)."""
    parts = []
    if "duplicates" in found:
        parts.append(f"{summary_of_duplicates(found['duplicates'])} (data.duplicates={found['duplicates']['policy']})")
    if "contamination" in found:
        against = ", ".join(shown(one["set"]) for one in found["contamination"]["sets"])
        parts.append(f"{counted(found['contamination']['rows'], 'row')} sharing {NGRAM} words with {against} "
                     f"(data.contaminated={found['contamination']['policy']})")
    if "teaches_nothing" in found:
        parts.append(f"{counted(found['teaches_nothing']['rows'], 'row')} teaching nothing "
                     f"(data.teaches_nothing={found['teaches_nothing']['policy']})")
    parts += found.get("template", [])
    if found.get("dropped"):
        parts.append(f"{counted(found['dropped'], 'train row')} dropped")
    return "; ".join(parts)
