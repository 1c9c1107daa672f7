"""Which library loads and wraps the model: `hf` (transformers + PEFT + bitsandbytes) or `unsloth`.

`auto` takes unsloth where a CUDA GPU and the package are present, else hf, and says which in one line. Asking for
unsloth where it cannot run is a UserError before anything loads. Unsloth patches transformers, TRL and PEFT when it
is imported, so a process that trains with it imports it first (`import_first`), and no other process imports it:
not the CLI at start-up, not validation, not the panel (finding the package does not import it).
"""

from __future__ import annotations

import importlib.util

import yaml

from finetune.errors import UserError
from finetune.resources import find_recipe


def resolve(requested: str) -> tuple[str, str]:
    """(backend, the line that says why) for model.backend = auto | unsloth | hf."""
    if requested == "hf":
        return "hf", "backend: hf (model.backend)"
    import torch

    cuda = torch.cuda.is_available()
    installed = importlib.util.find_spec("unsloth") is not None
    if requested == "unsloth":
        if not cuda:
            raise UserError("model.backend: unsloth needs a CUDA GPU and this machine has none; "
                            "use model.backend=hf (or auto, which picks hf here)")
        if not installed:
            raise UserError("model.backend: unsloth is not installed; pip install -e \".[unsloth]\", "
                            "or use model.backend=hf")
        return "unsloth", "backend: unsloth (model.backend)"
    if cuda and installed:
        return "unsloth", "backend: unsloth (auto: a CUDA GPU and the unsloth package are here)"
    return "hf", f"backend: hf (auto: {'unsloth is not installed' if cuda else 'no CUDA GPU'})"


def requested(recipe_path: str, overrides: list[str]) -> str:
    """model.backend as the recipe and its overrides set it, read without validating or importing anything heavy;
    whatever is malformed is left for the real validation to report."""
    for override in reversed(overrides):
        if override.startswith("model.backend="):
            return override.partition("=")[2]
    try:
        raw = yaml.safe_load(find_recipe(recipe_path).read_text(encoding="utf-8")) or {}
        return str(raw.get("model", {}).get("backend", "auto"))
    except (UserError, yaml.YAMLError, AttributeError, OSError, ValueError):
        return "auto"


def import_first(recipe_path: str, overrides: list[str]) -> None:
    """Import unsloth now if this training process will use it, before anything imports transformers."""
    if resolve(requested(recipe_path, overrides))[0] == "unsloth":
        import unsloth  # noqa: F401  (its import patches transformers, TRL and PEFT)


def check_launch(backend: str, distributed_type: str) -> None:
    """Unsloth trains one whole model per process (DDP); it does not run under FSDP or DeepSpeed."""
    if backend == "unsloth" and distributed_type in ("FSDP", "DEEPSPEED"):
        raise UserError(f"model.backend: unsloth keeps a whole model on each GPU (DDP) and does not run under "
                        f"{distributed_type}; use a DDP launch config (ddp_8gpu, ddp_8xa10, ddp_8xh100), or "
                        "model.backend=hf to shard the model")
