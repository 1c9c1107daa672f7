"""load -> normalize -> render and mask -> truncate -> pack -> a prepared folder.

`prepare` returns the tokenized train and eval datasets (columns input_ids, labels, and seq_lengths when packed)
and a report of what happened to the data. They are written once, to a folder named by what they depend on (the
data's contents, the tokenizer, the chat template, the settings and this package's code) in the cache, or to the
folder `finetune prepare --out` names, and read from there, memory-mapped, by every DDP process and by later runs
(prepared_folder.py).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from array import array
from pathlib import Path

from finetune import builtin
from finetune.data import encoding, eval_sets, formats, integrity, prepared_folder, sources
from finetune.data.formats import BadRow
from finetune.data.prepared_folder import PreparedData
from finetune.data.render import IGNORE, Renderer
from finetune.data.spool import Spool
from finetune.data.stage_rows import RowEncoder, answer_example
from finetune.errors import UserError
from finetune.recipe.schema import Recipe
from finetune.recipe.sections import FORMATS, PREFERENCE_FORMATS

SHOWN_BAD_ROWS = 10
MARK_OPEN, MARK_CLOSE = "⟦", "⟧"
MOST_PROCESSES = 8
SAMPLE_POOL = 64  # the first held-out examples kept: the prompts of eval.samples

logger = logging.getLogger("finetune")


def prepare(recipe: Recipe, tokenizer, template: str | None) -> PreparedData:
    """The tokenized datasets training reads: those of data.prepared, checked against the recipe; else those of the
    cache folder named by what the data depends on, prepared there first unless they were before."""
    if recipe.data.prepared:
        train_sources, eval_sources = _sources(recipe)
        inputs = prepared_folder.inputs_of(recipe, tokenizer, template, train_sources, eval_sources)
        return _checked(recipe.data.prepared, inputs, with_data=bool(train_sources))
    return prepared_folder.load(prepare_into(recipe, tokenizer, template)[0])


def prepare_into(recipe: Recipe, tokenizer, template: str | None,
                 into: str | None = None) -> tuple[Path, str, bool]:
    """(the folder here, where the data is, whether it was prepared now): prepared into `into`, a folder or a URL
    (fsspec; the folder is made in the cache and copied there), by default the cache; nothing is done where the
    same inputs were prepared before. The rows are not read: the caller loads the folder, or reads its report."""
    train_sources, eval_sources = _sources(recipe)
    if not train_sources:
        raise UserError("data.train is required to prepare data (a file, a folder, or a Hub dataset name)")
    inputs = prepared_folder.inputs_of(recipe, tokenizer, template, train_sources, eval_sources)
    remote = into is not None and prepared_folder.is_url(into)
    cache = builtin.home() / "data" / prepared_folder.key_of(inputs)
    folder = cache if into is None or remote else prepared_folder.local_path(into)
    if into is not None and not remote:
        prepared_folder.check_target(folder)
    made = not prepared_folder.matches(prepared_folder.read_inputs(folder), inputs)
    if made:
        started = time.monotonic()
        _build(folder, inputs, recipe, tokenizer, template, train_sources, eval_sources)
        print(f"Prepared the data in {time.monotonic() - started:.1f}s; "
              f"{'cached in' if folder == cache else 'written to'} {folder}", flush=True)
    if remote:
        made = prepared_folder.upload(folder, into) or made
    return folder, into or str(folder), made


def _sources(recipe: Recipe) -> tuple[list, list]:
    return ([sources.resolve(_path(s), "data.train") for s in _as_list(recipe.data.train)],
            [sources.resolve(_path(s), "data.eval") for s in _as_list(recipe.data.eval)])


def _checked(location: str, inputs: dict, with_data: bool) -> PreparedData:
    """The data prepared at `location`, refused with what differs when the recipe would prepare other rows."""
    folder = prepared_folder.local_copy(location, builtin.home() / "data")
    found = prepared_folder.read_inputs(folder)
    if found is None:
        raise UserError(f"data.prepared: {location} is not a complete prepared folder (it has no "
                        f"{prepared_folder.INPUTS}); run `finetune prepare RECIPE --out {location}`")
    differences = prepared_folder.differences(found, inputs, with_data)
    if differences:
        listed = "\n".join(f"  {line}" for line in differences)
        raise UserError(f"data.prepared: {location} was prepared from other inputs than this recipe's:\n{listed}\n"
                        f"Prepare it again (finetune prepare RECIPE --out {location}), or train without "
                        "data.prepared")
    return prepared_folder.load(folder)


def _as_list(value) -> list:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def _path(entry) -> str:
    """A data entry's source: the entry itself, or a mixture entry's path."""
    return entry["path"] if isinstance(entry, dict) else entry


def _mix(per_source: list[list], entries: list, seed: int) -> tuple[list, list[dict]]:
    """The examples of every source, each source cut to its share (rows, fraction, or weight: its part of the
    weighted sources' rows together), sampled with the seed (a share above the source's size repeats rows);
    and what each source gave."""
    weighted = [(i, entry["weight"]) for i, entry in enumerate(entries) if isinstance(entry, dict) and "weight" in entry]
    weighted_rows = sum(len(per_source[i]) for i, _ in weighted)
    total_weight = sum(weight for _, weight in weighted)
    mixed, shares = array("q"), []
    for index, (examples, entry) in enumerate(zip(per_source, entries)):
        share = {key: entry[key] for key in ("rows", "fraction", "weight") if isinstance(entry, dict) and key in entry}
        count = len(examples)
        if "rows" in share:
            count = share["rows"]
        elif "fraction" in share:
            count = round(share["fraction"] * len(examples))
        elif "weight" in share:
            count = round(share["weight"] / total_weight * weighted_rows)
        taken = _sample(examples, count, random.Random(f"{seed}:{index}")) if examples else array("q")
        mixed += taken
        shares.append({"source": _path(entry), "available": len(examples), "used": len(taken), **share})
    return mixed, shares


def _sample(examples: array, count: int, rng: random.Random) -> array:
    if count == len(examples):
        return examples
    repeats, rest = divmod(count, len(examples))
    chosen = sorted(rng.sample(range(len(examples)), rest))  # in file order: the sampler shuffles later
    taken = examples * repeats
    taken.extend(examples[i] for i in chosen)
    return taken


def _build(folder: Path, inputs: dict, recipe: Recipe, tokenizer, template, train_sources, eval_sources) -> None:
    import datasets

    datasets.disable_progress_bars()
    data = recipe.data
    bad: list[str] = []
    folder.parent.mkdir(parents=True, exist_ok=True)
    with Spool(folder.parent) as spool:
        train_examples, mixture = _mix([read_examples([source], data, bad, spool, recipe.stage)
                                        for source in train_sources], _as_list(data.train), recipe.train_setting("seed"))
        if eval_sources:
            eval_examples = read_examples(eval_sources, data, bad, spool, recipe.stage)
        else:
            train_examples, eval_examples = _hold_out(train_examples, data.eval_fraction, recipe.train_setting("seed"))
        _build_rows(folder, inputs, recipe, tokenizer, template, spool, train_examples, eval_examples, mixture, bad)


def _build_rows(folder: Path, inputs: dict, recipe: Recipe, tokenizer, template, spool, train_examples, eval_examples,
                mixture, bad) -> None:
    data = recipe.data
    if template is None and spool.conversations:
        raise UserError(f"model.name_or_path: the tokenizer of {recipe.model.name_or_path} has no chat template, "
                        "and the data holds conversations; set model.chat_template to a .jinja template file")
    renderer = Renderer(tokenizer, template, data.template_date, data.loss_on, data.train_thinking,
                        data.template_kwargs)
    train_examples, checks = integrity.check(spool, train_examples, eval_examples, data,
                                             eval_sets.read_eval_sets(data.decontaminate), recipe.stage,
                                             integrity.template_findings(renderer, data.train_thinking),
                                             _processes(data))
    encoder = RowEncoder(renderer, recipe.stage)
    staging = prepared_folder.staging(folder)
    try:
        report = _encode_splits(staging, recipe, tokenizer, encoder, spool, train_examples, eval_examples, bad)
        integrity.add_encoding_findings(checks, report, bad)
        report["integrity"] = checks
        if len(mixture) > 1:
            report["sources"] = mixture
        (staging / prepared_folder.REPORT).write_text(json.dumps(report, indent=1), encoding="utf-8")
        prepared_folder.publish(staging, folder, inputs)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _encode_splits(staging: Path, recipe: Recipe, tokenizer, encoder: RowEncoder, spool, train_examples, eval_examples,
                   bad) -> dict:
    """Encode and pack both splits into shards in `staging` (train/, eval/), check the rows; the report."""
    data, max_length, packing = recipe.data, recipe.train_setting("max_length"), recipe.train_setting("packing")
    too_long: list[str] = []
    splits = {name: encoding.encode_split(examples, spool, encoder, max_length, packing, bad, too_long,
                                          staging / name, _processes(data), name)
              for name, examples in (("train", train_examples), ("eval", eval_examples))}
    bad.sort(key=_in_file_order(bad))  # read (JSON, format) and encoded (template, masks) rows in one order
    if bad and data.bad_rows == "fail":
        raise bad_rows_error(bad)
    if too_long and data.too_long == "fail":
        raise _listed_rows_error(
            too_long, f"longer than train.max_length ({max_length}) before any token that carries loss",
            "Raise train.max_length, shorten them, or set data.too_long=drop to leave them out (the count is "
            "reported)")
    train = splits["train"]
    if not train.rows:
        raise _no_usable_rows(len(train_examples) + len(bad), train.stats["dropped_no_trained_tokens"], len(bad),
                              max_length, train.stats["length_percentiles"])
    report = {
        "stage": recipe.stage,
        "rows": {name: split.rows for name, split in splits.items()},
        "bad_rows": {"count": len(bad), "shown": bad[:SHOWN_BAD_ROWS], "policy": data.bad_rows},
        "too_long": {"count": len(too_long), "shown": too_long[:SHOWN_BAD_ROWS], "policy": data.too_long},
        **{name: split.stats for name, split in splits.items()},
        "max_length": max_length,
        "example": encoder.marked(train.first_row, lambda ids, labels: _marked_example(tokenizer, ids, labels)),
    }
    for name, split in splits.items():
        if packing and split.rows:
            report[name]["packed_rows"] = split.packed_rows
            report[name]["packed_fill"] = split.stats["tokens"] / (split.packed_rows * max_length)
    pool = [{"where": spool.where(example), **answer_example(spool.get(example))}
            for example in eval_examples[:SAMPLE_POOL]]
    (staging / prepared_folder.EVAL_EXAMPLES).write_text(json.dumps(pool, ensure_ascii=False), encoding="utf-8")
    return report


def _processes(data) -> int:
    return data.num_proc or min(os.cpu_count() or 1, MOST_PROCESSES)


def _no_usable_rows(rows: int, too_long: int, bad: int, max_length: int, lengths: dict) -> UserError:
    """What left data.train without a row, and what to change."""
    reasons = []
    if too_long:
        longest = f" (their lengths: p50 {lengths['p50']:,}, max {lengths['max']:,} tokens)" if lengths else ""
        reasons.append(f"{too_long:,} have nothing to learn within train.max_length {max_length}{longest}: raise "
                       "train.max_length")
    if bad:
        reasons.append(f"{bad:,} are bad rows (run `finetune validate` to see them with their reasons)")
    return UserError(f"data.train: none of its {rows:,} rows can be trained on: " + "; ".join(reasons or ["it is empty"]))


def _hold_out(examples: array, fraction: float, seed: int) -> tuple[array, array]:
    """(train, eval): a random `fraction` of the examples, at least one, held out for evaluation."""
    if not fraction:
        return examples, []
    order = array("q", range(len(examples)))  # 8 bytes an example; a list of ints would be about 36
    random.Random(seed).shuffle(order)
    held_out = set(order[: max(1, round(len(order) * fraction))])
    return (array("q", (e for i, e in enumerate(examples) if i not in held_out)),
            array("q", (e for i, e in enumerate(examples) if i in held_out)))


def _in_file_order(bad: list[str]):
    """A sort key for 'FILE line N: reason' entries: the files in the order they first appear, then by N."""
    files: dict[str, int] = {}

    def key(entry: str) -> tuple[int, int]:
        found = WHERE.match(entry)
        if not found:
            return (len(bad), 0)
        return files.setdefault(found["file"], len(files)), int(found["number"])

    for entry in bad:
        key(entry)
    return key


WHERE = re.compile(r"^(?P<file>.*?) (?:line|row) (?P<number>\d+): ")


def bad_rows_error(bad: list[str]) -> UserError:
    """The bad rows listed; those the chat template renders differently as they grow are its fault, said once."""
    count = len(bad)
    unstable = [entry for entry in bad if integrity.UNSTABLE in entry]
    if unstable:
        bad = [integrity.unstable_template(len(unstable), unstable[0])] + \
            [entry for entry in bad if integrity.UNSTABLE not in entry]
    return _listed_rows_error(bad, "bad", "Fix them, or set data.bad_rows=drop to skip them (the count is reported).",
                              count)


def _listed_rows_error(rows: list[str], what: str, advice: str, count: int | None = None) -> UserError:
    """`count`: the rows, where `rows` says some of them in one line."""
    count = len(rows) if count is None else count
    shown = "\n".join(f"  {line}" for line in rows[:SHOWN_BAD_ROWS])
    more = f"\n  ... and {len(rows) - SHOWN_BAD_ROWS} more" if len(rows) > SHOWN_BAD_ROWS else ""
    plural = "s" if count != 1 else ""
    heading = f"{count} bad data row{plural}" if what == "bad" else f"{count} data row{plural} {what}"
    return UserError(f"{heading}:\n{shown}{more}\n{advice}")


def read_examples(source_list, data, bad: list[str], spool: Spool, stage: str = "sft") -> array:
    """The offsets in `spool` of every usable row, normalized for `stage` (kto: a pair becomes its chosen answer,
    desirable, and its rejected one; "any": the rows of any format, SFT's or preference data); the others go to
    `bad` as 'where: reason'."""
    examples = array("q")
    for source in source_list:
        found: dict[str, str] = {}  # file -> the format of its rows
        number = 0
        for name, rows in source.parts():
            fmt = None if data.format == "auto" else data.format
            for where, row in rows:
                number += 1
                if data.max_rows is not None and number > data.max_rows:
                    break
                if isinstance(row, BadRow):
                    bad.append(f"{where}: {row}")
                    continue
                if fmt is None:
                    fmt = found[name] = _detect_format(row, data.columns, where, stage)
                    _check_one_format(source, found)
                try:
                    example = formats.normalize(row, fmt, data.columns, data.system_prompt, data.thinking_marker)
                    if stage == "kto" and "chosen" in example:
                        examples += array("q", [spool.add({"completion": example["chosen"], "label": True}, where),
                                                spool.add({"completion": example["rejected"], "label": False}, where)])
                    else:
                        examples.append(spool.add(example, where))
                except BadRow as reason:
                    bad.append(f"{where}: {reason}")
    return examples


def _detect_format(row: dict, columns: dict, where: str, stage: str) -> str:
    preference = stage in ("dpo", "kto")
    if stage in ("sft", "grpo") and formats.detect_format(row, columns, preference=True) in ("preference", "hh",
                                                                                            "sharegpt_preference"):
        raise UserError(f"{where}: this looks like preference data (chosen and rejected answers), which stage "
                        f"{stage} does not train on; set stage: dpo (or kto) to learn from the pairs, or point "
                        "data.train at conversations")
    fmt = formats.detect_format(row, columns, preference)
    if fmt is None and stage == "any":
        fmt = formats.detect_format(row, columns, preference=True)
    if fmt is None:
        choices = PREFERENCE_FORMATS if preference else FORMATS
        what = (f"the preference data format of stage {stage} (chosen and rejected answers, or a labelled "
                "completion)" if preference else "the data format")
        raise UserError(
            f"{where}: cannot tell {what} from its fields ({', '.join(map(str, row)) or 'none'}); "
            f"set data.format ({', '.join(choices)}) and data.columns to map your fields"
        )
    return fmt


def _check_one_format(source, found: dict[str, str]) -> None:
    """A folder is one dataset, in one format; another format in it is usually a stray file."""
    if len(set(found.values())) > 1:
        (first, first_format), (other, other_format) = list(found.items())[0], list(found.items())[-1]
        raise UserError(
            f"data folder {source.spec} mixes data formats: {first} holds {first_format} rows, {other} holds "
            f"{other_format} rows. Move the stray file out, or list the files in data.train one by one (each file "
            "may have a format of its own)"
        )


def _marked_example(tokenizer, ids: list[int], labels: list[int]) -> str:
    """The example as text, with the tokens that carry loss between ⟦ and ⟧."""
    pieces, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or (labels[end] != IGNORE) != (labels[start] != IGNORE):
            text = tokenizer.decode(ids[start:end], clean_up_tokenization_spaces=False)
            pieces.append(f"{MARK_OPEN}{text}{MARK_CLOSE}" if labels[start] != IGNORE else text)
            start = end
    return "".join(pieces)
