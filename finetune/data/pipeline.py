"""load -> normalize -> render and mask -> truncate -> pack -> cache.

`prepare` returns the tokenized train and eval datasets (columns input_ids, labels, and seq_lengths when packed)
and a report of what happened to the data. The result is cached on disk under a key made of the data's contents,
the tokenizer, the chat template, the settings and this package's code, so it is computed once and reused by every
DDP process and by later runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune import builtin
from finetune.data import formats, sources
from finetune.data.formats import BadRow
from finetune.data.render import IGNORE, Renderer
from finetune.errors import UserError

SHOWN_BAD_ROWS = 10
MARK_OPEN, MARK_CLOSE = "⟦", "⟧"


@dataclass
class PreparedData:
    train: Any  # datasets.Dataset
    eval: Any | None
    report: dict[str, Any]


def prepare(recipe, tokenizer, template: str | None) -> PreparedData:
    """The tokenized datasets for `recipe`, from the cache when the same data was prepared before."""
    data = recipe.data
    train_sources = [sources.resolve(s, "data.train") for s in _as_list(data.train)]
    eval_sources = [sources.resolve(s, "data.eval") for s in _as_list(data.eval)]
    settings = {
        "data": dataclasses.asdict(data),
        "max_length": recipe.train["max_length"],
        "packing": recipe.train["packing"],
        "seed": recipe.train["seed"],
    }
    key = _cache_key(train_sources, eval_sources, settings, tokenizer, template)
    folder = builtin.home() / "data" / key
    if not (folder / "report.json").exists():
        started = time.monotonic()
        _build(folder, recipe, tokenizer, template, train_sources, eval_sources)
        print(f"Prepared the data in {time.monotonic() - started:.1f}s; cached in {folder}", flush=True)
    return _load(folder)


def _as_list(value) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def _cache_key(train_sources, eval_sources, settings, tokenizer, template) -> str:
    digest = hashlib.sha256()
    for part in (
        [s.fingerprint() for s in train_sources],
        [s.fingerprint() for s in eval_sources],
        settings,
        tokenizer.backend_tokenizer.to_str(),
        tokenizer.special_tokens_map,
        template,
        [p.read_text(encoding="utf-8") for p in sorted(Path(__file__).parent.glob("*.py"))],
        _library_versions(),
    ):
        digest.update(json.dumps(part, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:24]


def _library_versions() -> dict[str, str]:
    """The libraries whose code shapes the prepared data: rendering and masks (transformers, tokenizers), TRL's
    packing and training templates, and the datasets format on disk."""
    from importlib.metadata import version

    return {name: version(name) for name in ("trl", "transformers", "tokenizers", "datasets")}


def _load(folder: Path) -> PreparedData:
    import datasets

    report = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    train = datasets.load_from_disk(str(folder / "train"))
    evaluation = datasets.load_from_disk(str(folder / "eval")) if (folder / "eval").exists() else None
    return PreparedData(train, evaluation, report)


def _build(folder: Path, recipe, tokenizer, template, train_sources, eval_sources) -> None:
    import datasets

    datasets.disable_progress_bars()
    data = recipe.data
    bad: list[str] = []
    train_examples = _examples(train_sources, data, bad)
    if eval_sources:
        eval_examples = _examples(eval_sources, data, bad)
    else:
        train_examples, eval_examples = _hold_out(train_examples, data.eval_fraction, recipe.train["seed"])

    if template is None and any("messages" in example for _, example in train_examples + eval_examples):
        raise UserError(f"model.name_or_path: the tokenizer of {recipe.model.name_or_path} has no chat template, "
                        "and the data holds conversations; set model.chat_template to a .jinja template file")
    renderer = Renderer(tokenizer, template, data.template_date, data.loss_on, data.train_thinking,
                        data.template_kwargs)
    max_length = recipe.train["max_length"]
    too_long: list[str] = []
    train_rows, train_stats = _encode(train_examples, renderer, max_length, bad, too_long)
    eval_rows, eval_stats = _encode(eval_examples, renderer, max_length, bad, too_long)
    if bad and data.bad_rows == "fail":
        raise _bad_rows_error(bad)
    if too_long and data.too_long == "fail":
        raise _listed_rows_error(
            too_long, f"longer than train.max_length ({max_length}) before any token that carries loss",
            "Raise train.max_length, shorten them, or set data.too_long=drop to leave them out (the count is "
            "reported)")
    if not train_rows:
        raise UserError("data.train: no usable rows" + (f" ({len(bad)} bad rows dropped)" if bad else ""))

    report = {
        "rows": {"train": len(train_rows), "eval": len(eval_rows)},
        "bad_rows": {"count": len(bad), "shown": bad[:SHOWN_BAD_ROWS], "policy": data.bad_rows},
        "train": train_stats,
        "eval": eval_stats,
        "max_length": max_length,
        "example": _marked_example(tokenizer, *train_rows[0]),
    }
    splits = {"train": train_rows, "eval": eval_rows}
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".prepare-"))
    for name, rows in splits.items():
        if not rows:
            continue
        table = datasets.Dataset.from_dict({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]})
        if recipe.train["packing"]:
            table = _pack(table, max_length)
            report[name]["packed_rows"] = len(table)
            report[name]["packed_fill"] = report[name]["tokens"] / (len(table) * max_length)
        table.save_to_disk(str(staging / name))
    (staging / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    try:
        staging.rename(folder)
    except OSError:  # another process finished the same preparation first
        shutil.rmtree(staging)


def _hold_out(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): a random `fraction` of the examples, at least one, held out for evaluation."""
    if not fraction:
        return examples, []
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    held_out = set(order[: max(1, round(len(order) * fraction))])
    return ([e for i, e in enumerate(examples) if i not in held_out],
            [e for i, e in enumerate(examples) if i in held_out])


def _bad_rows_error(bad: list[str]) -> UserError:
    return _listed_rows_error(bad, "bad", "Fix them, or set data.bad_rows=drop to skip them (the count is reported).")


def _listed_rows_error(rows: list[str], what: str, advice: str) -> UserError:
    shown = "\n".join(f"  {line}" for line in rows[:SHOWN_BAD_ROWS])
    more = f"\n  ... and {len(rows) - SHOWN_BAD_ROWS} more" if len(rows) > SHOWN_BAD_ROWS else ""
    plural = "s" if len(rows) != 1 else ""
    heading = f"{len(rows)} bad data row{plural}" if what == "bad" else f"{len(rows)} data row{plural} {what}"
    return UserError(f"{heading}:\n{shown}{more}\n{advice}")


def _examples(source_list, data, bad: list[str]) -> list[tuple[str, dict]]:
    """(where, normalized example) for every usable row; the others go to `bad` as 'where: reason'."""
    examples = []
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
                    fmt = found[name] = _detect_format(row, data.columns, where)
                    _check_one_format(source, found)
                try:
                    example = formats.normalize(row, fmt, data.columns, data.system_prompt, data.thinking_marker)
                    examples.append((where, example))
                except BadRow as reason:
                    bad.append(f"{where}: {reason}")
    return examples


def _detect_format(row: dict, columns: dict, where: str) -> str:
    fmt = formats.detect_format(row, columns)
    if fmt is None:
        raise UserError(
            f"{where}: cannot tell the data format from its fields ({', '.join(map(str, row)) or 'none'}); "
            f"set data.format ({', '.join(formats.FORMATS)}) and data.columns to map your fields"
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


def _encode(examples, renderer: Renderer, max_length: int, bad: list[str], too_long: list[str]):
    rows, lengths, truncated, untrainable = [], [], 0, 0
    for where, example in examples:
        try:
            ids, labels = renderer.encode(example)
        except BadRow as reason:
            bad.append(f"{where}: {reason}")
            continue
        lengths.append(len(ids))
        if len(ids) > max_length:
            truncated += 1
            ids, labels = ids[:max_length], labels[:max_length]
        if all(label == IGNORE for label in labels):
            untrainable += 1  # the whole answer lies past max_length: nothing left to learn from
            too_long.append(f"{where}: {lengths[-1]:,} tokens")
            continue
        rows.append((ids, labels))
    tokens = sum(len(ids) for ids, _ in rows)
    trained = sum(label != IGNORE for _, labels in rows for label in labels)
    return rows, {
        "tokens": tokens,
        "trained_tokens": trained,
        "trained_fraction": trained / tokens if tokens else 0.0,
        "length_percentiles": _percentiles(lengths),
        "truncated_rows": truncated,
        "dropped_no_trained_tokens": untrainable,
    }


def _percentiles(lengths: list[int]) -> dict[str, int]:
    if not lengths:
        return {}
    if len(lengths) == 1:
        return {"p50": lengths[0], "p90": lengths[0], "p99": lengths[0], "max": lengths[0]}
    cuts = statistics.quantiles(lengths, n=100, method="inclusive")
    return {"p50": round(cuts[49]), "p90": round(cuts[89]), "p99": round(cuts[98]), "max": max(lengths)}


def _pack(table, max_length: int):
    """Several examples per row (best-fit decreasing, TRL's); seq_lengths keeps their boundaries for attention."""
    from trl.data_utils import pack_dataset

    return pack_dataset(table, max_length, strategy="bfd")


def _marked_example(tokenizer, ids: list[int], labels: list[int]) -> str:
    """The example as text, with the tokens that carry loss between ⟦ and ⟧."""
    pieces, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or (labels[end] != IGNORE) != (labels[start] != IGNORE):
            text = tokenizer.decode(ids[start:end], clean_up_tokenization_spaces=False)
            pieces.append(f"{MARK_OPEN}{text}{MARK_CLOSE}" if labels[start] != IGNORE else text)
            start = end
    return "".join(pieces)
