"""YAML files the user hands in (recipes, accelerate configs): read strictly, and every way one can be wrong said
in one message naming the file and line: not UTF-8, empty, a list or a value where keys belong, tabs, a key given
twice (which plain YAML readers resolve silently, keeping the last)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from finetune.errors import UserError
from finetune.resources import find_accelerate_config

MERGE = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == MERGE:
                continue  # `<<: *anchor` (SafeLoader merges it in); a key written beside it overrides the merged one
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise UserError(f"{self.name} line {line}: key {key!r} appears twice (first on line {seen[key]}); "
                                "keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_mapping(path: Path, what: str, hint: str) -> dict[str, Any]:
    """The mapping in the YAML file at `path` (a `what`: recipe, accelerate config); `hint` says what it holds."""
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; pass a {what} file (.yaml)")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[:error.start].count(b"\n") + 1
        raise UserError(f"{path} line {line}: not UTF-8 text; save the {what} as UTF-8") from None
    if not text.strip():
        raise UserError(f"{path} is empty; a {what} is a mapping of keys ({hint})")
    loader = None
    try:
        loader = _StrictLoader(text)
        loader.name = str(path)
        raw = loader.get_single_data()
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        tabs = "; YAML indents with spaces, never tabs" if "\\t" in problem or "\t" in problem else ""
        raise UserError(f"{path}{where}: not valid YAML: {problem}{tabs}") from None
    finally:
        if loader is not None:
            loader.dispose()
    if not isinstance(raw, dict):
        kind = "a list" if isinstance(raw, list) else f"the value {raw!r}"
        raise UserError(f"{path}: a {what} is a mapping of keys ({hint}), not {kind}")
    return raw


def accelerate_settings(config: str | Path | None) -> dict:
    """What an accelerate config (a file, or a shipped config's name; None: none) says about the processes it
    starts (num_processes, distributed_type, ...)."""
    if config is None:
        return {}
    return read_mapping(find_accelerate_config(config), "accelerate config", "distributed_type:, num_processes:, ...")
