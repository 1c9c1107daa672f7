"""One training run, the same on one process and on N: recipe -> tokenizer -> data -> model -> TRL SFTTrainer ->
train -> save. `finetune train` and `python -m finetune.train` (what accelerate launches) both end here.

Import this module only after `backends.import_first` (Unsloth must come before transformers, TRL and PEFT).
"""

from __future__ import annotations

import logging
import time

import torch
import transformers
from accelerate import PartialState

from finetune import backends
from finetune.config import load_recipe
from finetune.data.collate import PackedRowsCollator
from finetune.data.pipeline import prepare
from finetune.model import load_model, load_tokenizer, training_precision
from finetune.report import describe_data
from finetune.run_folder import FINAL_NAME, ProgressCallback, RunFolder, StopRequest, check_free, save_recipe
from finetune.trainer import Trainer

logger = logging.getLogger("finetune")


def run(recipe_path: str, overrides: list[str], callbacks: tuple = ()) -> str:
    """Train; return the final status (completed or stopped). UserError for anything the user must fix first.

    `callbacks` are extra TrainerCallbacks (the benchmarks use one to measure)."""
    recipe = load_recipe(recipe_path, overrides)
    transformers.utils.logging.disable_progress_bar()  # weight loading and saving bars; the training bar stays
    state = PartialState()
    try:
        return _train(recipe, state, callbacks)
    finally:
        state.destroy_process_group()  # gloo and NCCL threads still alive at exit abort the process


def _train(recipe, state, callbacks) -> str:
    check_free(recipe.output_dir)
    state.wait_for_everyone()  # every process checked before the main one creates the folder

    backend, why = backends.resolve(recipe.model.backend)
    precision = training_precision(recipe.train)
    # On each machine its main process builds builtins and prepares the data first; the others then read them.
    with state.local_main_process_first():
        tokenizer = load_tokenizer(recipe)
        data = prepare(recipe, tokenizer, tokenizer.chat_template)
    if state.is_main_process:
        print(why, describe_data(data.report), sep="\n", flush=True)
    flash = "flash" in (recipe.model.attn_implementation or "")
    args = recipe.sft_config(**precision, **runtime_arguments(recipe, data, flash, backend))
    transformers.set_seed(args.seed)  # adapter initialization is random: same seed, same start, any process count
    model, peft_config = load_model(recipe, precision, backend, recipe.train.get("gradient_checkpointing", True))
    coefficient = getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0)
    if coefficient and "router_aux_loss_coef" not in recipe.train:
        # TRL adds coefficient x load-balancing loss to every micro-batch's loss, and the Trainer multiplies each
        # process's loss by the process count (right for the token-normalized cross-entropy only), so the MoE term
        # would weigh accumulation steps x processes times more than the model's config says.
        args.router_aux_loss_coef = coefficient / (args.gradient_accumulation_steps * state.num_processes)

    run_folder = RunFolder(recipe.output_dir)
    if state.is_main_process:
        run_folder.create(recipe)
        logger.info("run folder %s", run_folder.path)
    progress = ProgressCallback(run_folder, recipe, StopRequest())
    started = time.monotonic()
    trainer = None
    try:
        trainer = Trainer(
            model=model,
            args=args,
            data_collator=PackedRowsCollator(tokenizer.pad_token_id) if recipe.train["packing"] and not flash else None,
            train_dataset=data.train,
            eval_dataset=data.eval,
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=[progress, *callbacks],
            similar_lengths="train_sampling_strategy" not in recipe.train,
        )
        trainer.train()
        final = run_folder.path / FINAL_NAME
        trainer.save_model(str(final))  # the adapter, or the full model; every process joins, the main one writes
        status = "stopped" if progress.stopped else "completed"
        if state.is_main_process:
            tokenizer.save_pretrained(final)
            save_recipe(recipe, final)
            run_folder.finish(status, trainer.state.global_step, time.monotonic() - started)
            print(f"{status}: {final}", flush=True)
        return status
    except BaseException as error:
        if state.is_main_process:
            message = "interrupted" if isinstance(error, KeyboardInterrupt) else f"{type(error).__name__}: {error}"
            step = trainer.state.global_step if trainer is not None else 0
            run_folder.finish("failed", step, time.monotonic() - started, message)
        raise


def runtime_arguments(recipe, data, flash: bool, backend: str) -> dict:
    """SFTConfig values that depend on this machine, model and data rather than on the recipe."""
    arguments = {
        # Our data is already tokenized, truncated and packed: TRL only batches it. FlashAttention takes packed
        # rows flattened into one sequence (TRL's padding-free collator); other attention takes PackedRowsCollator.
        "packing": False,
        "padding_free": recipe.train["packing"] and flash,
        "max_length": None,
        "use_cpu": recipe.train.get("use_cpu", not torch.cuda.is_available()),
    }
    if backend == "unsloth":
        arguments["gradient_checkpointing"] = False  # Unsloth checkpoints its own way (set when loading)
    if data.eval is not None and "eval_strategy" not in recipe.train:
        arguments["eval_strategy"] = "steps" if "eval_steps" in recipe.train else "epoch"
    return arguments
