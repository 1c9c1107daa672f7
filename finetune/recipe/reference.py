"""The recipe reference page, docs/recipe-reference.md, written from the recipe's own types and help strings (the
ones the schema checks against), so it cannot drift from what a recipe takes:

    python -m finetune.recipe.reference > docs/recipe-reference.md
"""

from __future__ import annotations

import dataclasses
import typing

from finetune.recipe.schema import SECTIONS, Recipe
from finetune.recipe.train_section import LEARNING_RATES, TRAIN_DEFAULTS


def markdown() -> str:
    lines = ["# Recipe reference", "",
             "Every key a recipe takes, with its type, default and meaning; written from the recipe's own types and "
             "help strings by `python -m finetune.recipe.reference`. How recipes are written, overridden and "
             "shared: [recipes.md](recipes.md).", ""]
    top = [f for f in dataclasses.fields(Recipe) if f.name not in SECTIONS]
    lines += _table("Top level", "", top, typing.get_type_hints(Recipe))
    for name, section in SECTIONS.items():
        lines += _table(f"`{name}:`", f"{name}.", dataclasses.fields(section), typing.get_type_hints(section))
    defaults = ", ".join(f"`{key}: {value}`" for key, value in TRAIN_DEFAULTS.items())
    rates = ", ".join(f"{method} {rate:g}" for method, rate in LEARNING_RATES.items())
    lines += ["## `train:`", "",
              "Any field of TRL's `SFTConfig` (for stage sft; the training arguments of the stage's TRL config for the "
              f"others), over the toolkit's defaults: {defaults}, and `learning_rate` by method ({rates}). Two keys "
              "of the toolkit's own: `global_batch_size` (rows per optimizer step, all processes together: the "
              "accumulation steps follow from the process count) and `per_device_train_batch_size: auto` (the "
              "largest micro-batch that the memory plan fits; needs `global_batch_size`).", ""]
    return "\n".join(lines)


def _table(title: str, prefix: str, fields, hints: dict) -> list[str]:
    rows = [f"## {title}", "", "| key | type | default | what it does |", "|---|---|---|---|"]
    for f in fields:
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        rows.append(f"| `{prefix}{f.name}` | {_type(hints[f.name])} | `{default!r}` | "
                    f"{f.metadata['help'].replace('|', '/').replace('<', '&lt;')} |")
    return rows + [""]


def _type(hint) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " / ".join(f"`{value}`" for value in typing.get_args(hint))
    return f"`{str(hint).replace('typing.', '').replace('|', 'or')}`".replace("<class '", "").replace("'>", "")


if __name__ == "__main__":
    print(markdown(), end="")
