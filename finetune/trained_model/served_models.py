"""What `finetune serve` serves: targets named on the command line, each loaded as it was trained, and those on one
base model sharing it (the base loads once; PEFT switches adapters per row of a batch).

A target is a run (its final/), a checkpoint-N/, a folder written by `finetune export`, or `base:RUN` (the model
the run started from, through the run's chat template), served under `NAME=TARGET`'s name or a name of its own.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import UserError
from finetune.trained_model import saved_model

MAX_REQUEST_MB = 4  # a 128k-token prompt is about 0.5 MB of text: a larger body is a mistake, refused before it is read
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$")


@dataclass(frozen=True)
class Target:
    name: str
    folder: saved_model.SavedModel
    base: bool  # the model the run started from, not the trained one
    given: str  # as the command line gave it

    @property
    def shares_base(self) -> bool:
        return self.folder.is_adapter or self.base

    @property
    def base_key(self) -> tuple:
        """Targets with one key load one base model: where it loads from and how (4-bit for QLoRA, its dtype)."""
        recipe = self.folder.recipe
        return self.folder.base_model(), recipe.method == "qlora", recipe.model.dtype, recipe.precision


def parse_targets(arguments: list[str]) -> list[Target]:
    """Check every target before anything loads: each exists and is a trained model, and the names are unique."""
    targets = [_target(argument) for argument in arguments]
    names = [target.name for target in targets]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise UserError(f"two targets are served as {twice[0]!r}; name them apart with NAME=TARGET")
    return targets


def _target(argument: str) -> Target:
    name, _, given = argument.rpartition("=") if "=" in argument else ("", "", argument)
    base = given.startswith(saved_model.BASE_PREFIX)
    folder = saved_model.locate(given.removeprefix(saved_model.BASE_PREFIX))
    if base and not folder.is_adapter:
        raise UserError(f"{argument}: the run fine-tuned its whole model, so its base is not part of it; serve the "
                        "base model's own export or run instead")
    name = name or _name_of(folder.path, base)
    if not NAME.match(name):
        raise UserError(f"{argument}: {name!r} cannot be a model name; use letters, digits, '.', '_', ':' and '-'")
    return Target(name, folder, base, argument)


def _name_of(path: Path, base: bool) -> str:
    """A run's name for its final/, RUN-checkpoint-N for a checkpoint, the folder's name for an export."""
    run = path.parent if (path.parent / "progress.jsonl").is_file() else None
    name = path.name if run is None else run.name if path.name == "final" else f"{run.name}-{path.name}"
    return f"{name}-base" if base else name


@dataclass
class Loaded:
    """One model in memory and the targets it serves: adapter name per target (BASE for the base model)."""
    model: object
    adapters: dict[str, str]
    has_adapters: bool


def load(targets: list[Target]) -> list[Loaded]:
    """Each base once, with every adapter trained on it; each model fine-tuned in full on its own."""
    from peft import PeftModel

    from finetune.trained_model.batching import BASE

    groups: dict[tuple, list[Target]] = {}
    loaded = []
    for target in targets:
        if target.shares_base:
            groups.setdefault(target.base_key, []).append(target)
        else:
            loaded.append(Loaded(saved_model.load_model(target.folder), {target.name: BASE}, False))
    for group in groups.values():
        first = group[0]
        model = saved_model.load_base(dataclasses.replace(first.folder, is_adapter=True))
        adapters = {}
        for target in group:
            if target.base:
                adapters[target.name] = BASE
                continue
            adapter = f"adapter_{len(adapters)}"  # PEFT's names are module names: a served name such as qwen2.5 is not
            if not isinstance(model, PeftModel):
                model = PeftModel.from_pretrained(model, target.folder.path, adapter_name=adapter)
            else:
                model.load_adapter(target.folder.path, adapter_name=adapter)
            adapters[target.name] = adapter
        loaded.append(Loaded(model.eval(), adapters, isinstance(model, PeftModel)))
    return loaded
