"""The package's shape: its wings import only downward, and no module imports one that depends on it (imports inside
functions count)."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

from tests.conftest import REPO

# Lowest first. A module may import its own wing's modules and those of the wings below it.
WINGS = [
    ("base", ["finetune.errors", "finetune.resources", "finetune.run_folder", "finetune.builtin", "finetune.hub",
              "finetune.answers", "finetune.mlflow_store", "finetune.hooks", "finetune"]),
    ("recipe", ["finetune.recipe"]),
    ("data", ["finetune.data"]),
    ("models", ["finetune.models"]),
    ("plan", ["finetune.plan"]),
    ("trained model", ["finetune.trained_model"]),
    ("training", ["finetune.training"]),
    ("commands and panel", ["finetune.commands", "finetune.train", "finetune.__main__", "finetune.ui",
                            "finetune.eval_tasks"]),
]


def modules() -> dict[str, Path]:
    found = {}
    for path in (REPO / "finetune").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in (REPO / "ui").glob("*.py"):
        found["finetune.ui" + ("" if path.stem == "__init__" else f".{path.stem}")] = path
    return found


def wing(module: str) -> int:
    matches = [(len(prefix), level) for level, (_, prefixes) in enumerate(WINGS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} belongs to no wing: add it to WINGS"
    return max(matches)[1]


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules that `module` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in known and name != module}
    return found


def test_every_import_goes_down_and_none_closes_a_cycle():
    found = modules()
    graph = {module: imports(module, path, set(found)) for module, path in found.items()}
    upward = [f"{module} ({WINGS[wing(module)][0]}) imports {target} ({WINGS[wing(target)][0]})"
              for module, targets in graph.items() for target in sorted(targets) if wing(target) > wing(module)]
    assert not upward, "\n".join(upward)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(target == goal or (target not in seen and not seen.add(target) and reaches(target, goal, seen))
                   for target in graph[start])

    cycles = sorted(module for module in graph if reaches(module, module, set()))
    assert not cycles, f"modules in an import cycle: {', '.join(cycles)}"


def test_a_library_that_changed_under_its_hooks_is_named(monkeypatch):
    import importlib.metadata

    import pytest

    from finetune.hooks import check_pin

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "5.18.1" if name == "transformers" else real(name))
    with pytest.warns(UserWarning, match=r"finetune reaches into transformers 5\.17\.0's private Trainer\._run_epoch, "
                                         r"Trainer\._save, and transformers 5\.18\.1 is installed"):
        check_pin("transformers", "5.17.0", ("Trainer._run_epoch", "Trainer._save"))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "5.17.3" if name == "transformers" else real(name))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_pin("transformers", "5.17.0", ("Trainer._run_epoch",))  # a patch release: no warning


def test_trainer_settings_are_read_as_the_run_resolves_them():
    """Outside the recipe wing no module reads `recipe.train` by key: a setting is read with `train_setting` (the
    recipe's value, else the stage's TRL config's) or `precision`, so that no reader supplies a default of its own
    (the time plan once read gradient_checkpointing as off while the trainer had it on)."""
    readers = []
    for module, path in modules().items():
        if wing(module) == 1:  # the recipe
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            keyed = isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
            got = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                   and isinstance(node.func.value, ast.Attribute))
            owner = node.value if keyed else node.func.value if got else None
            if owner is not None and owner.attr == "train" and not isinstance(node.ctx if keyed else None, ast.Store):
                readers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not readers, f"recipe.train read by key: {readers}"
