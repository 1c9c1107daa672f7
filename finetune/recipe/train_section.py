"""The recipe's train section: any field of TRL's SFTConfig over the toolkit's defaults, plus two keys of its own
(global_batch_size, and `auto` for per_device_train_batch_size), each checked before anything loads; and the
options that need the machine that trains to have a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any

from finetune.errors import UserError
from finetune.recipe.typecheck import coerce

# Where the toolkit's defaults differ from SFTConfig's. The learning rate depends on the method (see `train_defaults`).
TRAIN_DEFAULTS: dict[str, Any] = {
    "max_length": 2048,
    "packing": True,
    "logging_steps": 10,
    "report_to": "none",
    "save_total_limit": 3,
    "seed": 42,  # SFTConfig's own default, stated because the eval split and the data cache use it too
}
LEARNING_RATES = {"lora": 2e-4, "qlora": 2e-4, "full": 2e-5}
# Preference and reward stages move a trained model a little: rates as in TRL's and Unsloth's examples.
STAGE_LEARNING_RATES = {"lora": 5e-6, "qlora": 5e-6, "full": 5e-7}

# train.* keys of the toolkit's own, beside SFTConfig's fields. With global_batch_size the accumulation steps follow
# from the process count (the same global batch on any number of processes); per_device_train_batch_size may then
# be `auto`: the largest micro-batch that the memory plan fits on the device.
GLOBAL_BATCH = "global_batch_size"
AUTO = "auto"

# SFTConfig fields that this toolkit decides elsewhere: under train.* they would be silently ignored, so they are refused.
NOT_USED = {
    "output_dir": "set the top-level output_dir",
    "assistant_only_loss": "set data.loss_on (assistant | all)",
    "completion_only_loss": "set data.loss_on (assistant | all)",
    "dataset_text_field": "map your field with data.columns, e.g. {text: my_field}",
    "chat_template_path": "set model.chat_template",
    "model_init_kwargs": "use the model.* keys",
    "trust_remote_code": "set model.trust_remote_code",
    "dataset_kwargs": "use the data.* keys",
    "eos_token": "examples end with the tokenizer's own end-of-turn token",
    "padding_free": "packed rows are batched with next to no padding (FlashAttention: none); set train.packing",
    "packing_strategy": "packing keeps whole examples (best-fit decreasing); train.packing turns it on or off",
    "resume_from_checkpoint": "continue a run with `finetune train RECIPE --resume [CHECKPOINT]`",
    "logging_nan_inf_filter": "a non-finite loss stops the run, naming the step",
    "ignore_data_skip": "a resumed run always continues the data order where it stopped",
}


@functools.cache
def sft_fields() -> dict[str, Any]:
    from trl import SFTConfig

    hints = typing.get_type_hints(SFTConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(SFTConfig) if f.init}


def resolve(given: dict[str, Any], method: str, has_eval: bool, output_dir: str | None, origin, suggest,
            for_training: bool, stage: str = "sft", section: dict | None = None) -> dict[str, Any]:
    """train.* over the toolkit defaults, each key checked against the stage's TRL config (SFTConfig, DPOConfig,
    ...), then that config's own checks. `origin(key)` names where a key was set; `suggest(key)` offers the closest
    valid key."""
    from finetune.recipe import stage_sections

    fields = stage_sections.train_fields(stage)
    rates = LEARNING_RATES if stage == "sft" else STAGE_LEARNING_RATES
    train = {**TRAIN_DEFAULTS, "learning_rate": rates[method]}
    if stage != "sft":
        del train["packing"]  # SFT's: pairs and prompts are batched whole
    for key, value in given.items():
        where = origin(f"train.{key}")
        if key == GLOBAL_BATCH or (key == "per_device_train_batch_size" and value == AUTO):
            train[key] = value if value == AUTO else coerce(value, int, f"train.{key}", where)
            continue
        if key in NOT_USED:
            raise UserError(f"{where}: train.{key} is not used here: {NOT_USED[key]}")
        if key not in fields:
            if stage != "sft" and key in stage_sections.section_fields(stage):
                raise UserError(f"{where}: train.{key} is a setting of stage {stage}: write it as {stage}.{key}")
            if stage != "sft" and key in sft_fields():
                raise UserError(f"{where}: train.{key} is SFT's (stage sft); stage {stage} does not use it")
            raise UserError(f"{where}: unknown key 'train.{key}' (not a field of TRL's "
                            f"{stage_sections.config_class(stage).__name__})" + suggest(f"train.{key}"))
        train[key] = coerce(value, fields[key], f"train.{key}", where)
    if for_training:
        _check_report_to(train.get("report_to"), origin("train.report_to"))
    _check_numbers(train, origin)
    _check_batch(train, origin)
    _check_memory_options(train, origin)
    if train.get("bf16") and train.get("fp16"):
        raise UserError(f"{origin('train.fp16')}: train.bf16 and train.fp16 both ask for mixed precision; keep one")
    for key in ("eval_strategy", "eval_on_start", "load_best_model_at_end"):
        if train.get(key) not in (None, False, "no") and not has_eval:
            raise UserError(
                f"{origin('train.' + key)}: train.{key} needs eval data; set data.eval or data.eval_fraction"
            )
    try:  # the config's own checks, without devices
        config = stage_sections.config_class(stage)
        names = {f.name for f in dataclasses.fields(config)}
        values = {key: value for key, value in sft_values(train).items() if key in names}
        stage_values = {key: value for key, value in (section or {}).items() if key != "rewards"}
        config(output_dir=output_dir, **{**values, **stage_values, "use_cpu": True})
    except ValueError as error:
        raise UserError(f"{origin(stage if stage != 'sft' else 'train')}: {error}") from None
    except Exception as error:  # other checks of the config's (a settings file that is not there, a bad count)
        raise UserError(f"{origin(stage if stage != 'sft' else 'train')}: TRL's {config.__name__} does not take "
                        f"these settings: {type(error).__name__}: {error}") from None
    return train


def sft_values(train: dict[str, Any]) -> dict[str, Any]:
    """train.* without the toolkit's own keys (their values reach SFTConfig through `Recipe.batch_split`)."""
    values = {key: value for key, value in train.items() if key != GLOBAL_BATCH}
    if values.get("per_device_train_batch_size") == AUTO:
        values["per_device_train_batch_size"] = 1
    return values


def _check_batch(train: dict[str, Any], origin) -> None:
    if train.get("per_device_train_batch_size") == AUTO and GLOBAL_BATCH not in train:
        raise UserError(f"{origin('train.per_device_train_batch_size')}: train.per_device_train_batch_size auto "
                        f"needs the global batch it splits: set train.{GLOBAL_BATCH} (rows per optimizer step, all "
                        "processes together)")
    if GLOBAL_BATCH in train:
        if "gradient_accumulation_steps" in train:
            raise UserError(f"{origin('train.gradient_accumulation_steps')}: train.gradient_accumulation_steps and "
                            f"train.{GLOBAL_BATCH} both set the global batch; keep {GLOBAL_BATCH} (the accumulation "
                            "steps follow from it and the process count)")
        if not 0 < train[GLOBAL_BATCH] <= LARGEST_COUNT:
            raise UserError(f"{origin('train.' + GLOBAL_BATCH)}: train.{GLOBAL_BATCH} must be a positive whole number")


def _check_memory_options(train: dict[str, Any], origin) -> None:
    """Memory options that do not work together."""
    if train.get("use_liger_kernel"):
        if train.get("loss_type") == "chunked_nll":
            raise UserError(f"{origin('train.loss_type')}: train.use_liger_kernel computes the loss with Liger's "
                            "fused linear cross-entropy, which replaces TRL's chunked loss; leave train.loss_type "
                            "unset (or nll) with Liger, or turn Liger off to keep the chunked loss")
        if train.get("activation_offloading"):
            raise UserError(f"{origin('train.activation_offloading')}: train.activation_offloading does not work "
                            "with train.use_liger_kernel (Liger's fused kernels keep activations that the offload "
                            "hooks do not see); choose one")


GPU_ONLY = {
    "use_liger_kernel": "Liger's kernels are written in Triton, for GPUs",
    "activation_offloading": "it moves activations from the GPU to CPU memory",
}


def trains_on_cpu(train: dict[str, Any]) -> bool:
    """Whether a run with these settings trains on this machine's CPU (use_cpu, or no GPU)."""
    import torch

    return train.get("use_cpu", not torch.cuda.is_available())


def check_device_options(train: dict[str, Any], cuda: bool) -> None:
    """Options that need a GPU (or a package only GPU machines have), checked on the machine that trains."""
    on_cpu = not cuda or train.get("use_cpu")
    for key, why in GPU_ONLY.items():
        if train.get(key) and on_cpu:
            raise UserError(f"train.{key} needs a CUDA GPU ({why}) and this run trains on the CPU; remove it here")
    if str(train.get("optim", "")).startswith("paged_") and on_cpu:
        raise UserError(f"train.optim {train['optim']}: paged optimizers page GPU memory out to the CPU, and this run "
                        "trains on the CPU; use adamw_8bit (8-bit states) or adamw_torch here")
    if train.get("use_liger_kernel") and not on_cpu:
        import importlib.util

        if importlib.util.find_spec("liger_kernel") is None:
            raise UserError("train.use_liger_kernel needs Liger's kernels: pip install liger-kernel")


LARGEST_COUNT = 2**31 - 1  # beyond it counts overflow, and no run is that long
LONGEST_EPOCHS = 100_000


def _check_numbers(train: dict[str, Any], origin) -> None:
    """Sizes, counts and rates that SFTConfig accepts but that would fail (or run forever) once training starts."""
    def refuse(key: str, allowed: str) -> None:
        raise UserError(f"{origin('train.' + key)}: train.{key} must be {allowed}, got {train[key]!r}")

    for key in ("max_length", "per_device_train_batch_size", "per_device_eval_batch_size",
                "gradient_accumulation_steps"):
        if train.get(key) == AUTO:
            continue
        if train.get(key) is None and key == "max_length":
            raise UserError(f"{origin('train.max_length')}: train.max_length must be a positive whole number")
        if train.get(key) is not None and not 0 < train[key] <= LARGEST_COUNT:
            refuse(key, f"a positive whole number (at most {LARGEST_COUNT:,})")
    epochs = train.get("num_train_epochs")
    if epochs is not None and not (math.isfinite(epochs) and 0 < epochs <= LONGEST_EPOCHS):
        refuse("num_train_epochs", f"above 0 and at most {LONGEST_EPOCHS:,}")
    steps = train.get("max_steps")
    if steps is not None and steps != -1 and not 0 < steps <= LARGEST_COUNT:
        refuse("max_steps", f"-1 (train for num_train_epochs) or a positive whole number up to {LARGEST_COUNT:,}")
    rate = train.get("learning_rate")
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        refuse("learning_rate", "a finite number above 0")


def _check_report_to(report_to: Any, where: str) -> None:
    from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        if name in ("none", "all"):
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            raise UserError(
                f"{where}: train.report_to {name!r} is not a logging back-end; choose from "
                + ", ".join(["none", *INTEGRATION_TO_CALLBACK])
            )
        if name not in get_available_reporting_integrations():
            raise UserError(f"{where}: train.report_to {name!r} is not installed; pip install {name}")
