"""The part of a model's answer that is compared with the reference: `finetune eval --extract` and GRPO's answer
reward read it the same way."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from finetune.errors import UserError

EXTRACTIONS = ("none", "gsm8k", "last-number", "regex:PATTERN")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def check_extraction(extract: str, setting: str = "--extract") -> None:
    """A UserError naming `setting` unless `extract` is one of EXTRACTIONS with a valid pattern."""
    if extract in ("none", "gsm8k", "last-number"):
        return
    if not str(extract).startswith("regex:"):
        raise UserError(f"{setting} {extract}: choose one of {', '.join(EXTRACTIONS)}")
    try:
        re.compile(extract.removeprefix("regex:"))
    except re.error as error:
        raise UserError(f"{setting} {extract}: not a valid regular expression ({error})") from None


def extract_answer(text: str, extract: str) -> str | None:
    """The part of `text` that is compared: the whole text stripped (none), the number after `####` (gsm8k), the
    last number (last-number), or a regex's first group (or whole match); None when there is none. Numbers are
    compared by value: 1,000 and 1000.0 are both 1000."""
    if extract == "none":
        return text.strip()
    if extract == "gsm8k":
        found = GSM8K_ANSWER.search(text)
        return _number(found.group(1)) if found else None
    if extract == "last-number":
        numbers = NUMBER.findall(text)
        return _number(numbers[-1]) if numbers else None
    found = re.search(extract.removeprefix("regex:"), text, re.S)
    if not found:
        return None
    return (found.group(1) if found.groups() else found.group(0)).strip()


def _number(text: str) -> str:
    try:
        value = Decimal(text.replace(",", "").rstrip("."))
    except InvalidOperation:
        return text
    return format(value.normalize(), "f") if value == value.to_integral_value() else str(value.normalize())
