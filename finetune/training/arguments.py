"""The trainer arguments that depend on this machine, the model and the data rather than on the recipe alone."""

from __future__ import annotations

from finetune.recipe.train_section import trains_on_cpu


def flattens_packed_rows(recipe, flash: bool, backend: str) -> bool:
    """Whether each micro-batch of packed rows reaches the model as one row (TRL's padding-free collator, positions
    restarting at each example) rather than as rows of a batch (PackedRowsCollator's block-diagonal masks).
    FlashAttention's variable-length kernels take the one row. So does Unsloth, which keeps packed examples apart
    only in a batch of one row (it finds their boundaries from position_ids there, and runs plain causal attention
    over each whole row of a larger batch)."""
    return bool(recipe.train_setting("packing")) and (flash or backend == "unsloth")


def unused_parameter_search(recipe, backend: str, model_type: str) -> tuple[bool, str]:
    """Whether DDP looks for parameters that got no gradient in a step (a pass over the graph each step), and the
    launch line that says so."""
    if "ddp_find_unused_parameters" in recipe.train:
        search = bool(recipe.train_setting("ddp_find_unused_parameters"))
        return search, f"DDP unused-parameter search: {'on' if search else 'off'} (train.ddp_find_unused_parameters)"
    if backend == "unsloth" and model_type == "gpt_oss":
        # Unsloth runs each expert on its own and skips those no token reached; their weights and adapters then
        # get no gradient, which DDP must be told to expect (Unsloth's own default for MoE models)
        return True, "DDP unused-parameter search: on (GPT-OSS under Unsloth: experts no token reached get no gradient)"
    return False, "DDP unused-parameter search: off (every trainable parameter gets a gradient in every step)"


def runtime_arguments(recipe, data, flash: bool, backend: str, model_type: str) -> dict:
    """SFTConfig values that depend on this machine, model and data rather than on the recipe."""
    arguments = {
        # Our data is already tokenized, truncated and packed: TRL only batches it (see flattens_packed_rows).
        "packing": False,
        "padding_free": flattens_packed_rows(recipe, flash, backend),
        "max_length": None,  # SFT, DPO and KTO: the pipeline truncated (and counted) what was too long
        "use_cpu": trains_on_cpu(recipe.train),
        "save_total_limit": None,  # RunTrainer rotates checkpoints itself, counting complete ones only
        "logging_nan_inf_filter": False,  # a non-finite loss must show, and stop the run
    }
    if recipe.train_setting("use_liger_kernel") and model_type == "gpt_oss":
        # GPT-OSS's experts gate with a clamped, offset SwiGLU that Liger's kernel does not compute
        arguments["liger_kernel_config"] = {**(recipe.train_setting("liger_kernel_config") or {}), "swiglu": False}
    if backend == "unsloth":
        arguments["gradient_checkpointing"] = False  # Unsloth checkpoints its own way (set when loading)
    if "eval_strategy" not in recipe.train:
        arguments["eval_strategy"] = recipe.eval_strategy(data.eval is not None)
    return arguments

