"""A trained model on disk: a run's final/, a checkpoint-N/, or a folder written by `finetune export`.

Each holds the resolved recipe (finetune.yaml), the tokenizer with the chat template used in training, and either a
PEFT adapter (adapter_config.json) or a full model (config.json). An adapter is loaded onto its base model exactly
as in training (same dtype; 4-bit NF4 for qlora), so chat and export see the model that was trained.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from finetune.errors import UserError
from finetune.recipe.schema import Recipe, recipe_from_dict
from finetune.run_folder import CONFIG_NAME, FINAL_NAME, PROGRESS_NAME, checkpoint_step, is_complete, latest_checkpoint

ADAPTER_CONFIG = "adapter_config.json"
BASE_PREFIX = "base:"  # base:RUN names the model a run started from, where a trained model is asked for
WHAT_TO_PASS = "pass a run's final/, one of its checkpoint-N/ folders, or a folder written by `finetune export`"


@dataclass
class SavedModel:
    path: Path
    recipe: Recipe
    is_adapter: bool

    @property
    def run(self) -> Path | None:
        """The run folder this came from (final/ and checkpoint-N/ sit in one), if there is one."""
        parent = self.path.parent
        return parent if (parent / PROGRESS_NAME).is_file() else None

    def base_model(self, override: str | None = None) -> str:
        """Where the base model loads from: the override, else the recipe's model (builtins built on demand)."""
        from finetune import builtin

        return override or builtin.resolve_model(self.recipe.model.name_or_path)


def locate(path: str | Path) -> SavedModel:
    """Check PATH before anything heavy loads; a run folder stands for its final/."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise UserError(f"{folder} does not exist; {WHAT_TO_PASS}")
    if not folder.is_dir():
        raise UserError(f"{folder} is a file; {WHAT_TO_PASS}")
    if (folder / PROGRESS_NAME).is_file():  # a run folder
        if not (folder / FINAL_NAME).is_dir():
            checkpoint = latest_checkpoint(folder)
            hint = f"pass {checkpoint}" if checkpoint else "it has no complete checkpoint yet either"
            raise UserError(f"{folder} is a run without final/ (not finished); {hint}")
        folder = folder / FINAL_NAME
    if checkpoint_step(folder) is not None and not is_complete(folder):
        raise UserError(f"{folder} is a checkpoint that was cut off while being written; pass a complete one")
    config = folder / CONFIG_NAME
    if not config.is_file():
        raise UserError(f"{folder} has no {CONFIG_NAME}, so the recipe it was trained with is unknown; {WHAT_TO_PASS}")
    try:
        recipe = recipe_from_dict(yaml.safe_load(config.read_text(encoding="utf-8")) or {}, str(config))
    except yaml.YAMLError as error:
        raise UserError(f"{config}: not valid YAML: {error}") from None
    is_adapter = (folder / ADAPTER_CONFIG).is_file()
    if not is_adapter and not (folder / "config.json").is_file():
        raise UserError(f"{folder} has neither an adapter ({ADAPTER_CONFIG}) nor a model (config.json); "
                        + WHAT_TO_PASS)
    return SavedModel(folder, recipe, is_adapter)


def load_tokenizer(folder: SavedModel):
    from transformers import AutoTokenizer

    from finetune.models.loading import exact_decoding

    return exact_decoding(AutoTokenizer.from_pretrained(folder.path))


def load_model(folder: SavedModel, base_model: str | None = None, dtype: str | None = None):
    """The trained model, in eval mode: the base with the adapter on it, or the full model. `dtype` (bfloat16,
    float16, float32) loads an adapter's base unquantized in that dtype instead of as trained: what merging needs."""
    model = load_base(folder, base_model, dtype)
    if folder.is_adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, folder.path)
    return model.eval()


def load_original(folder: SavedModel, base_model: str | None = None):
    """The model the run started from (the recipe's model, loaded as for training), in eval mode."""
    return load_base(dataclasses.replace(folder, is_adapter=True), base_model)


def load_base(folder: SavedModel, base_model: str | None = None, dtype: str | None = None):
    """An adapter's base model loaded as in training (or unquantized in `dtype`); for a full model, the model."""
    from finetune.models.loading import load_hf_model, training_precision

    recipe = folder.recipe
    if folder.is_adapter:
        method = recipe.method if dtype is None else "lora"
        model_settings = {"name_or_path": folder.base_model(base_model), "dtype": dtype or recipe.model.dtype}
    else:  # fine-tuned in full, or merged by export: it loads in the dtype it was saved in
        method = "full"
        model_settings = {"name_or_path": str(folder.path), "dtype": dtype or saved_dtype(folder.path)}
    as_trained = dataclasses.replace(recipe, method=method, model=dataclasses.replace(recipe.model, **model_settings))
    try:
        return load_hf_model(as_trained, training_precision(as_trained)).eval()
    except UserError as error:
        if not folder.is_adapter:
            raise
        raise UserError(f"{error}. The adapter in {folder.path} was trained on it (model.name_or_path in "
                        f"{CONFIG_NAME}); pass --base-model with where that model is now") from None


def saved_dtype(path: Path) -> str:
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    saved = config.get("dtype") or config.get("torch_dtype") or "float32"
    return saved if saved in ("bfloat16", "float16", "float32") else "float32"
