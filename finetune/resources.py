"""Where the shipped recipes (configs/) and accelerate configs (accelerate_configs/) live.

In a source checkout or an editable install they are the repository's top-level folders; a regular install copies
them into the package as finetune/shipped_recipes and finetune/accelerate_configs (see pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path

from finetune.errors import UserError

_PACKAGE = Path(__file__).resolve().parent


def _shipped(installed_name: str, repo_name: str) -> Path:
    installed = _PACKAGE / installed_name
    return installed if installed.is_dir() else _PACKAGE.parent / repo_name


def recipes_dir() -> Path:
    return _shipped("shipped_recipes", "configs")


def accelerate_configs_dir() -> Path:
    return _shipped("accelerate_configs", "accelerate_configs")


def eval_tasks_dir() -> Path:
    """The toolkit's own lm-evaluation-harness tasks (a package folder: installed as it is)."""
    return _PACKAGE / "eval_tasks"


def _find(name_or_path: str | Path, folder: Path, what: str) -> Path:
    path = Path(name_or_path)
    if path.is_file() or path.is_dir():
        return path  # a folder is refused with the reason by whoever reads it
    shipped = folder / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
    if len(path.parts) == 1 and shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
    raise UserError(f"{what} {str(name_or_path)!r} not found: no such file, and no shipped {what} of that name ({names})")


def find_recipe(name_or_path: str | Path) -> Path:
    """A recipe file path, or the name of a shipped recipe such as `quickstart`."""
    return _find(name_or_path, recipes_dir(), "recipe")


def find_accelerate_config(name_or_path: str | Path) -> Path:
    """An accelerate config file path, or the name of a shipped one such as `ddp_8gpu`."""
    return _find(name_or_path, accelerate_configs_dir(), "accelerate config")
