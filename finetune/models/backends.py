"""Which library loads and wraps the model: `hf` (transformers + PEFT + bitsandbytes) or `unsloth`.

`auto` takes unsloth only on the path it is checked on here: a CUDA GPU and the package present, SFT, one whole model
per process (DDP), neither Liger nor activation offloading (both replace the forward Unsloth patches), and a family
Unsloth trains as named (not Phi-3: see UNSLOTH_SWAPS); else hf, and it says which and why in one line. Asking for
unsloth where it cannot run is a UserError before anything loads.
Unsloth patches transformers, TRL and PEFT when it is imported, so a process that trains with it imports it first
(`import_first`), and no other process imports it: not the CLI at start-up, not validation, not the panel (finding
the package does not import it).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path
from typing import Callable

import yaml

from finetune import builtin
from finetune.errors import UserError
from finetune.resources import find_recipe

SHARDING = ("FSDP", "DEEPSPEED")  # accelerate distributed types that shard the model: Unsloth keeps it whole
REPLACE_THE_FORWARD = ("use_liger_kernel", "activation_offloading")  # train keys that replace what Unsloth patches

# What the pinned Unsloth (2026.10.9: models/loader.py, models/mapper.py) does differently per model type. It trains
# Llama, Mistral, Qwen 2/2.5/3 and Gemma 1/2 through its own models, and Gemma 3 and GPT-OSS through its generic
# FastModel, each as named. Microsoft's Phi-3 checkpoints it maps to its own copies, laid out as Mistral (q/k/v and
# gate/up split): the adapter it trains names modules the Phi-3 a recipe names does not have.
UNSLOTH_SWAPS = {"phi3": "Unsloth 2026.10.9 trains Microsoft's Phi-3 checkpoints as its own copies laid out as Mistral "
                         "(q/k/v and gate/up split), whose adapter does not load on the Phi-3 the recipe names"}
# Asked for float16, Unsloth loads these in bf16 and trains them without mixed precision, in fp32 ("forced float32").
UNSLOTH_FP32_FOR_FP16 = ("gpt_oss", "gemma3", "gemma3_text")


def resolve(requested: str, stage: str = "sft", train: dict | None = None, distributed_type: str = "NO",
            model_type: Callable[[], str | None] = lambda: None) -> tuple[str, str]:
    """(backend, the line that says why) for model.backend = auto | unsloth | hf, given the recipe's stage and train
    section, the launch's accelerate distributed type and the model's type (read only where it decides)."""
    train = train or {}
    if requested == "hf":
        return "hf", "backend: hf (model.backend)"
    replacing = [key for key in REPLACE_THE_FORWARD if train.get(key)]
    if requested == "unsloth" and replacing:
        raise UserError(f"model.backend: unsloth patches the model's forward, and train.{replacing[0]} replaces it; "
                        f"remove train.{replacing[0]}, or use model.backend=hf")
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
        if (kind := model_type()) in UNSLOTH_SWAPS:
            raise UserError(f"model.backend: unsloth: {UNSLOTH_SWAPS[kind]}; name Unsloth's copy as "
                            "model.name_or_path (unsloth/Phi-3-mini-4k-instruct, for one) to train that, or use "
                            "model.backend=hf")
        return "unsloth", "backend: unsloth (model.backend)"
    if not cuda:
        return "hf", "backend: hf (auto: no CUDA GPU)"
    if not installed:
        return "hf", "backend: hf (auto: unsloth is not installed)"
    if stage != "sft":
        return "hf", (f"backend: hf (auto: Unsloth is checked here for SFT only, and this is stage {stage}; "
                      "model.backend=unsloth asks for it)")
    if distributed_type in SHARDING:
        return "hf", f"backend: hf (auto: Unsloth does not run under {distributed_type})"
    if replacing:
        return "hf", f"backend: hf (auto: train.{replacing[0]} replaces the forward Unsloth patches)"
    if (kind := model_type()) in UNSLOTH_SWAPS:
        return "hf", f"backend: hf (auto: {UNSLOTH_SWAPS[kind]})"
    return "unsloth", "backend: unsloth (auto: a CUDA GPU and the unsloth package are here, SFT, a model per process)"


def requested(recipe_path: str, overrides: list[str]) -> tuple[str, str, dict, dict]:
    """(model.backend, stage, train section, model section) as the recipe and its overrides set them, read without
    validating or importing anything heavy (the training process must know before transformers loads whether
    Unsloth comes first); whatever is malformed is left for the real validation to report."""
    try:
        raw = yaml.safe_load(find_recipe(recipe_path).read_text(encoding="utf-8")) or {}
        model = dict(raw.get("model") or {})
        backend = str(model.get("backend", "auto"))
        stage, train = str(raw.get("stage", "sft")), dict(raw.get("train") or {})
    except (UserError, yaml.YAMLError, AttributeError, OSError, ValueError, TypeError):
        backend, stage, train, model = "auto", "sft", {}, {}
    for override in overrides:
        key, _, value = override.partition("=")
        if key == "model.backend":
            backend = value
        elif key in ("model.name_or_path", "model.revision"):
            model[key.removeprefix("model.")] = value
        elif key == "stage":
            stage = value
        elif key.removeprefix("train.") in REPLACE_THE_FORWARD:
            try:
                train[key.removeprefix("train.")] = yaml.safe_load(value)
            except yaml.YAMLError:
                pass
    return backend, stage, train, model


def model_type_of(name_or_path: str, revision: str | None = None) -> str | None:
    """The `model_type` in a model's config.json, read without transformers (which must not load before Unsloth):
    a builtin's, a local folder's, or the Hub's (from its cache, else fetched as loading would). None where it
    cannot be read: loading then says why."""
    if not name_or_path:
        return None
    if builtin.is_builtin(name_or_path):
        return builtin.MODEL_TYPE
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        folder = Path(str(name_or_path))
        config = folder / "config.json" if folder.is_dir() else Path(
            hf_hub_download(str(name_or_path), "config.json", revision=revision))
        return json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, EntryNotFoundError, AttributeError):
        return None


def launched_distributed_type() -> str:
    """The sharding this process was launched with, as accelerate's launcher tells its processes."""
    for name, flag in (("FSDP", "ACCELERATE_USE_FSDP"), ("DEEPSPEED", "ACCELERATE_USE_DEEPSPEED")):
        if os.environ.get(flag, "false").lower() == "true":
            return name
    return "NO"


def import_first(recipe_path: str, overrides: list[str]) -> None:
    """Import unsloth now if this training process will use it, before anything imports transformers."""
    backend, stage, train, model = requested(recipe_path, overrides)
    model_type = functools.partial(model_type_of, model.get("name_or_path"), model.get("revision"))
    if resolve(backend, stage, train, launched_distributed_type(), model_type)[0] == "unsloth":
        import unsloth  # noqa: F401  (its import patches transformers, TRL and PEFT)


def check_packing(backend: str, model_type: str, packing: bool) -> None:
    """Packed examples must not attend to each other. Unsloth's GPT-OSS attention takes no mask while training (its
    flex attention with sinks builds only causal or sliding-window masks), so it cannot keep them apart."""
    if backend == "unsloth" and model_type == "gpt_oss" and packing:
        raise UserError("train.packing: under Unsloth, GPT-OSS's attention takes no mask while training, so examples "
                        "packed into one row would attend to each other; set train.packing=false (one example a "
                        "row), or use model.backend=hf")


def check_launch(backend: str, distributed_type: str) -> None:
    """Unsloth trains one whole model per process (DDP); it does not run under FSDP or DeepSpeed."""
    if backend == "unsloth" and distributed_type in SHARDING:
        raise UserError(f"model.backend: unsloth keeps a whole model on each GPU (DDP) and does not run under "
                        f"{distributed_type}; use a DDP launch config (ddp_8gpu, ddp_8xa10, ddp_8xh100), or "
                        "model.backend=hf to shard the model")
