"""The evaluation sets of data.decontaminate: data files, builtin:NAME, or lm-eval:TASK (an lm-evaluation-harness
task whose data is on this machine), each item's text as the contamination check compares it."""

from __future__ import annotations

import logging

from finetune.data import formats, sources
from finetune.data.formats import BadRow
from finetune.data.scan import EvalSet, text_of
from finetune.errors import UserError
from finetune.resources import eval_tasks_dir

LM_EVAL = "lm-eval:"


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
            return text_of(formats.normalize(row, fmt, {}, None), roles=False)
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
