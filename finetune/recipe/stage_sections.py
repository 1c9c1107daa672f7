"""Training stages, each TRL's trainer for it:

    stage: sft    SFTTrainer on conversations and text (the default)
    stage: dpo    DPOTrainer on preference pairs (a prompt, a chosen and a rejected answer); settings in `dpo:`
    stage: kto    KTOTrainer on answers labelled desirable or not (pairs are split in two); settings in `kto:`
    stage: grpo   GRPOTrainer: answers generated and scored by reward functions (rewards.py); settings in `grpo:`

A stage's section takes the fields of TRL's config for it beyond the training arguments (DPOConfig's beta and
loss_type, GRPOConfig's num_generations, ...), each checked against its type; `grpo.rewards` lists the rewards.
The training arguments themselves (learning rate, batch, steps, ...) stay under `train:` for every stage.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

from finetune.errors import UserError
from finetune.recipe.typecheck import coerce

STAGES = ("sft", "dpo", "kto", "grpo")
PREFERENCE_STAGES = ("dpo", "kto")

# Stage-config fields the toolkit decides elsewhere: in a stage section they would be silently overridden.
DECIDED_ELSEWHERE = {
    "model_init_kwargs": "use the model.* keys",
    "trust_remote_code": "set model.trust_remote_code",
    "max_length": "set train.max_length (prompt and answer together)",
    "truncation_mode": "pairs keep their start: the data report counts the truncated ones",
    "dataset_num_proc": "set data.num_proc",
    "chat_template_kwargs": "set data.template_kwargs",
    "padding_free": "set train.packing (SFT) or leave it: pairs are padded per batch",
    "pad_token": "the tokenizer's own pad token is used",
    "pad_to_multiple_of": "set train.pad_to_multiple_of",
    "activation_offloading": "set train.activation_offloading",
    "router_aux_loss_coef": "set train.router_aux_loss_coef",
    "reward_weights": "give each reward its weight in grpo.rewards",
    "log_completions_hub_repo": "completions are logged in the run folder",
}
# Fields of SFTConfig beyond the training arguments that every stage's config has too: they stay under train.*.
SHARED = ("max_length", "activation_offloading", "router_aux_loss_coef", "pad_to_multiple_of")


def config_class(stage: str):
    from trl import DPOConfig, GRPOConfig, KTOConfig, SFTConfig

    return {"sft": SFTConfig, "dpo": DPOConfig, "kto": KTOConfig, "grpo": GRPOConfig}[stage]


@functools.cache
def _training_argument_names() -> frozenset[str]:
    from transformers import TrainingArguments

    return frozenset(f.name for f in dataclasses.fields(TrainingArguments))


@functools.cache
def train_fields(stage: str) -> dict[str, Any]:
    """The fields train.* takes for `stage`: all of SFTConfig's for sft; for the others, the training arguments of
    the stage's config and SHARED (max_length bounds prompt and answer together in every stage)."""
    from trl import SFTConfig

    sft_hints = typing.get_type_hints(SFTConfig)
    if stage == "sft":
        return {f.name: sft_hints[f.name] for f in dataclasses.fields(SFTConfig) if f.init}
    hints = typing.get_type_hints(config_class(stage))
    fields = {f.name: hints[f.name] for f in dataclasses.fields(config_class(stage))
              if f.init and f.name in _training_argument_names() | set(SHARED)}
    return {**fields, "max_length": sft_hints["max_length"]}


@functools.cache
def section_fields(stage: str) -> dict[str, Any]:
    """The fields of `stage`'s section: its config's own fields, beyond the training arguments."""
    cls = config_class(stage)
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if f.init and f.name not in _training_argument_names() and f.name not in SHARED
            and f.name not in DECIDED_ELSEWHERE}


def resolve_section(stage: str, given: dict[str, Any], origin, suggest) -> dict[str, Any]:
    """The stage section, each key checked against TRL's config for the stage."""
    fields = section_fields(stage)
    values: dict[str, Any] = {}
    for key, value in given.items():
        dotted = f"{stage}.{key}"
        where = origin(dotted)
        if stage == "grpo" and key == "rewards":
            from finetune.recipe import rewards

            values[key] = rewards.check(value, where)
            continue
        if key in DECIDED_ELSEWHERE:
            raise UserError(f"{where}: {dotted} is not used here: {DECIDED_ELSEWHERE[key]}")
        if key not in fields:
            raise UserError(f"{where}: unknown key {dotted!r} (not a field of TRL's {config_class(stage).__name__})"
                            + suggest(dotted))
        values[key] = coerce(value, fields[key], dotted, where)
    if stage == "grpo" and not values.get("rewards"):
        raise UserError(f"{origin('grpo.rewards')}: stage grpo needs grpo.rewards: the reward functions that score "
                        "each generated answer, e.g. [{function: answer, extract: gsm8k}]")
    return values


# vLLM pins one torch per release: 0.27 to 0.29 pin torch 2.13.0, and TRL 1.14.2 supports 0.20 to 0.30 (the `vllm`
# extra in pyproject.toml installs this range).
VLLM_VERSIONS = ">=0.27,<0.30"


def check_device_options(recipe, cuda: bool) -> None:
    """Stage options that need what only some machines have, checked on the machine that trains."""
    if recipe.stage == "grpo" and recipe.grpo.get("use_vllm"):
        if not cuda:
            raise UserError("grpo.use_vllm generates with vLLM, which needs a CUDA GPU, and this run trains on the "
                            "CPU; remove it (transformers' generate is used then)")
        if found := unusable_vllm():
            raise UserError(f"grpo.use_vllm needs vLLM {VLLM_VERSIONS} (the releases built on this toolkit's torch "
                            f"that TRL supports) and {found}: pip install -e \".[vllm]\" (or remove it: "
                            "transformers' generate is used then)")


def unusable_vllm() -> str | None:
    """What is wrong with the vLLM installed here ("vLLM is not installed", "vllm X is installed" for a release
    outside VLLM_VERSIONS), or None."""
    import importlib.metadata
    import importlib.util

    import packaging.specifiers

    installed = importlib.metadata.version("vllm") if importlib.util.find_spec("vllm") else None
    if installed is None:
        return "vLLM is not installed"
    return None if packaging.specifiers.SpecifierSet(VLLM_VERSIONS).contains(installed) else \
        f"vllm {installed} is installed"


def section_keys() -> list[str]:
    """Every stage section's keys, dotted (for suggestions)."""
    keys = []
    for stage in STAGES[1:]:
        keys += [f"{stage}.{name}" for name in section_fields(stage)]
    return keys + ["grpo.rewards"]


def trainer_config(recipe, train_values: dict[str, Any], runtime: dict[str, Any]):
    """TRL's config for the recipe's stage: train.* and the stage section, plus what is decided at run time
    (runtime values the stage's config has no field for are SFT's and left out)."""
    cls = config_class(recipe.stage)
    names = {f.name for f in dataclasses.fields(cls)}
    section = {key: value for key, value in recipe.stage_section.items() if key != "rewards"}
    if recipe.stage == "grpo":
        section["reward_weights"] = [reward["weight"] for reward in recipe.stage_section["rewards"]]
    values = {key: value for key, value in {**train_values, **section, **runtime}.items() if key in names}
    return cls(output_dir=recipe.output_dir, **values)
