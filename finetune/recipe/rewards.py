"""GRPO's reward functions, listed in the recipe's `grpo.rewards`, each with a weight (1.0 unless given):

    {function: answer, extract: gsm8k}        1 when the answer, extracted (gsm8k | last-number | none |
                                              regex:PATTERN, as `finetune eval --extract`), equals the reference's
    {function: format, pattern: REGEX}        1 when the answer matches the regular expression (re.search, dotall),
                                              special tokens included (harmony's <|channel|>final<|message|>)
    {function: length, max_tokens: N}         1 up to N tokens, falling to 0 at 2N
    {function: path/to/file.py:name}          your function, TRL's signature: name(completions, **columns) -> floats

The reference is the last assistant turn of each data row (its `answer` column for your functions). TRL logs each
reward's mean as rewards/<name>/mean; the weighted sum is the `reward` that GRPO's advantages come from.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any, Callable

from finetune.answers import check_extraction, extract_answer
from finetune.errors import UserError

BUILTIN = {"answer": ("extract",), "format": ("pattern",), "length": ("max_tokens",)}


def check(value: Any, where: str) -> list[dict[str, Any]]:
    """grpo.rewards, each entry checked (a user function is imported and looked up now); as plain data."""
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: grpo.rewards is a list of rewards, e.g. [{{function: answer, extract: gsm8k}}]")
    checked = []
    for index, entry in enumerate(value):
        key = f"grpo.rewards[{index}]"
        if isinstance(entry, str):
            entry = {"function": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("function"), str):
            raise UserError(f"{where}: {key} needs function: answer, format, length or path/to/file.py:name")
        function = entry["function"]
        allowed = ("function", "weight", *BUILTIN.get(function, ()))
        unknown = [name for name in entry if name not in allowed]
        if unknown:
            raise UserError(f"{where}: {key} ({function}) takes {', '.join(allowed)}; {unknown[0]!r} is not one "
                            "of them")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise UserError(f"{where}: {key}.weight must be a number, got {weight!r}")
        checked.append({**_checked_settings(entry, key, where), "function": function, "weight": float(weight)})
    return checked


def _checked_settings(entry: dict, key: str, where: str) -> dict[str, Any]:
    function = entry["function"]
    if function == "answer":
        extract = entry.get("extract", "none")
        check_extraction(extract, f"{where}: {key}.extract")
        return {"extract": extract}
    if function == "format":
        if not isinstance(entry.get("pattern"), str):
            raise UserError(f"{where}: {key} (format) needs pattern: the regular expression an answer must match")
        _compiled(entry["pattern"], f"{key}.pattern", where)
        return {"pattern": entry["pattern"]}
    if function == "length":
        limit = entry.get("max_tokens")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise UserError(f"{where}: {key} (length) needs max_tokens: a positive whole number")
        return {"max_tokens": limit}
    _user_function(function, f"{where}: {key}")
    return {}


def _compiled(pattern: str, key: str, where: str) -> re.Pattern:
    try:
        return re.compile(pattern, re.S)
    except re.error as error:
        raise UserError(f"{where}: {key} is not a valid regular expression ({error})") from None


def _user_function(spec: str, where: str) -> Callable:
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise UserError(f"{where}: function {spec!r} is not a built-in reward ({', '.join(BUILTIN)}) nor "
                        "path/to/file.py:function_name")
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{where}: {file} does not exist (reward function {spec!r})")
    module_spec = importlib.util.spec_from_file_location(f"finetune_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # the user's file: say which, and what went wrong in it
        raise UserError(f"{where}: importing {file} failed: {type(error).__name__}: {error}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"{where}: {file} has no function {name!r}")
    return function


def build(rewards: list[dict[str, Any]], tokenizer) -> list[Callable]:
    """The reward functions TRL calls, named for its logs (rewards/<name>/mean)."""
    functions, seen = [], {}
    for reward in rewards:
        function = _builtin(reward, tokenizer) if reward["function"] in BUILTIN else _user_function(
            reward["function"], "grpo.rewards")
        name = function.__name__
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:  # TRL logs each reward by its name: a second use of one gets a name of its own
            function = _named(function, f"{name}_{seen[name]}")
        functions.append(function)
    return functions


def _named(function: Callable, name: str) -> Callable:
    def reward(*args, **kwargs):
        return function(*args, **kwargs)

    reward.__name__ = name
    return reward


def answer_text(completion) -> str:
    """A completion as text: TRL gives conversational completions as [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, list):
        return "".join(str(message.get("content") or "") for message in completion)
    return completion


def _raw_texts(tokenizer, completions, completion_ids) -> list[str]:
    """The answers as generated, special tokens included (harmony's channels), without the end token that closed
    them: what the built-in rewards read. TRL's text drops the special tokens."""
    if tokenizer is None or completion_ids is None:
        return [answer_text(completion) for completion in completions]
    special = set(tokenizer.all_special_ids)
    texts = []
    for ids in completion_ids:
        ids = list(ids)
        while ids and ids[-1] in special:
            ids.pop()
        texts.append(tokenizer.decode(ids, skip_special_tokens=False))
    return texts


def _builtin(reward: dict[str, Any], tokenizer) -> Callable:
    if reward["function"] == "answer":
        extract = reward["extract"]

        def answer(completions, answer, completion_ids=None, **_):
            scores = []
            for text, reference in zip(_raw_texts(tokenizer, completions, completion_ids), answer):
                mine, theirs = extract_answer(text, extract), extract_answer(reference, extract)
                scores.append(float(mine is not None and mine == theirs))
            return scores

        return answer
    if reward["function"] == "format":
        pattern = re.compile(reward["pattern"], re.S)

        def format(completions, completion_ids=None, **_):
            return [float(bool(pattern.search(text))) for text in _raw_texts(tokenizer, completions, completion_ids)]

        return format
    limit = reward["max_tokens"]

    def length(completions, completion_ids, **_):
        return [max(0.0, 1.0 - max(0, len(ids) - limit) / limit) for ids in completion_ids]

    return length
