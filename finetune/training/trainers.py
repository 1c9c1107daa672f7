"""TRL's trainers of every stage, bound to a run folder: `RunFolderTrainer` goes before each of them (SFTTrainer,
DPOTrainer, KTOTrainer, GRPOTrainer), and `build` picks the stage's.

- Counts the real (non-padding) tokens and the tokens that carry loss, summed over every process, and carries the
  counts across a resume.
- Trains in SimilarLengthSampler's order; a resumed run starts that order at the batch it stopped at, without
  going through the batches before it.
- A checkpoint becomes usable only when every process has written its part: finetune_state.json is written last.
  Old checkpoints are rotated out only after that (save_total_limit), so the newest complete one always stays.
- A non-finite loss or gradient norm, a stop request, a checkpoint that cannot be written and running out of GPU
  memory end the run the same way on every process, with a message that says at which step and what to do.

The preference and reward stages' data comes prepared by the pipeline (data/stage_rows.py), already tokenized with
exact masks: DPO and KTO take it as is instead of tokenizing again. With an adapter (LoRA, QLoRA) TRL's reference
model is the same model with the adapter switched off (or, for an adapter trained before, a frozen copy of that
adapter): never a second copy of the weights.
"""

from __future__ import annotations

import logging
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from trl import DPOTrainer, GRPOTrainer, KTOTrainer, SFTTrainer

from finetune.data.render import IGNORE
from finetune.data.sampler import SimilarLengthSampler
from finetune.errors import RunFailed
from finetune.hooks import trl as trl_hooks
from finetune.hooks.transformers import TrainerHooks
from finetune.recipe import rewards
from finetune.run_folder import RunFolder, latest_checkpoint
from finetune.training import faults

logger = logging.getLogger("finetune")


class RunFolderTrainer(TrainerHooks):
    """What every stage's trainer gets; mixed in before TRL's trainer class (the Trainer's private methods it needs
    are in hooks/transformers.py, which calls the methods here)."""

    def __init__(self, *args, run_folder: RunFolder, recipe_yaml: str, stop, save_total_limit: int | None,
                 max_length: int, similar_lengths: bool = True, resumed: dict[str, Any] | None = None, **kwargs):
        self.run_folder, self.recipe_yaml, self.stop, self.recipe_max_length = run_folder, recipe_yaml, stop, max_length
        self.save_total_limit = save_total_limit  # ours to apply: HF's rotation could remove the last complete one
        self.similar_lengths = similar_lengths
        self.sampler: SimilarLengthSampler | None = None
        resumed = resumed or {}
        self.real_tokens = resumed.get("tokens", 0)
        self.trained_tokens = resumed.get("trained_tokens", 0)
        self.elapsed_before = resumed.get("elapsed_s", 0.0)
        self.started = time.monotonic()
        self.stopped = False
        self._micro_batches = 0  # in the current optimizer step
        self._last_step_seen = None
        super().__init__(*args, **kwargs)
        self.add_callback(StepsOfThisRecipe())
        # The run prints one line per logging step (callbacks.ProgressCallback), not the Trainer's dicts; its bar
        # only where a terminal shows it (in a log file a nested evaluation bar leaves cursor codes).
        self.remove_callback(PrinterCallback)
        self.remove_callback(ProgressCallback)
        if not self.args.disable_tqdm and sys.stderr.isatty():
            self.add_callback(TerminalBar)

    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started

    # The data order, and where a resumed run starts in it.
    def training_order(self, dataset) -> SimilarLengthSampler | None:
        """Our sampler (None: the trainer's own order)."""
        if not self.similar_lengths:
            return None
        import pyarrow.compute as pc

        lengths = pc.list_value_length(dataset.with_format("arrow")[:]["input_ids"]).to_pylist()
        self.sampler = SimilarLengthSampler(lengths, self.global_batch, self.args.data_seed or self.args.seed)
        return self.sampler

    @property
    def global_batch(self) -> int:
        return self.args.per_device_train_batch_size * self.args.world_size * self.args.gradient_accumulation_steps

    def start_epoch_at(self, epoch: int, micro_batches_done: int) -> bool:
        """A resumed epoch starts at the batch after the checkpoint's, in our sampler's order (the Trainer would
        fast-forward by drawing every batch before it from a rebuilt data loader, which no longer forwards set_epoch
        to our sampler). Each optimizer step takes one global batch of the order. False: not our sampler."""
        if self.sampler is None:
            return False
        self.sampler.start_at(epoch, micro_batches_done // self.args.gradient_accumulation_steps)
        return True

    # Token counts.
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        real = inputs.pop("num_real_tokens", None)  # from PackedRowsCollator; not a model input
        if self.model.training:
            real, trained = _token_counts(inputs, real)
            counts = torch.stack([torch.as_tensor(real, device=trained.device), trained])
            real_sum, trained_sum = self.accelerator.reduce(counts, reduction="sum").tolist()
            self.real_tokens += int(real_sum)
            self.trained_tokens += int(trained_sum)
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if self.model.training:
            trl_hooks.report_tokens(self, self.real_tokens, self.trained_tokens)
        return result

    # Faults.
    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._micro_batches == 1:
            faults.reached("micro", self.state.global_step)
        self._micro_batches += 1
        try:
            faults.reached("forward", self.state.global_step + 1)
            return super().training_step(model, inputs, num_items_in_batch)
        except torch.OutOfMemoryError:
            raise RunFailed(self._out_of_memory(inputs), every_process_alike=False) from None

    def before_log_and_save(self, tr_loss, grad_norm) -> None:
        """At the end of each optimizer step: a non-finite loss ends the run, a stop request is taken."""
        self._micro_batches = 0
        non_finite = self._non_finite(tr_loss, grad_norm)
        flags = torch.tensor([float(bool(non_finite)), float(self.stop.requested)], device=tr_loss.device)
        if self.args.world_size > 1:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        if flags[0]:
            raise RunFailed(self._non_finite_message(non_finite or "loss of another process is not finite"))
        if flags[1] and not self.stopped:  # once: the epoch's end comes through here again
            self.stopped = True
            self.control.should_save = self.control.should_training_stop = True

    def after_log_and_save(self) -> None:
        if self.state.global_step != self._last_step_seen:
            self._last_step_seen = self.state.global_step
            faults.reached("step", self.state.global_step)

    def _non_finite(self, tr_loss, grad_norm) -> str | None:
        """What is not finite ("loss is nan", "gradient norm is inf"), or None. Under fp16 an infinite gradient is
        the loss scaler's to handle (it skips the step), so only the loss counts there."""
        loss = float(tr_loss)
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if grad_norm is not None and self.accelerator.scaler is None and not math.isfinite(float(grad_norm)):
            return f"gradient norm is {float(grad_norm)}"
        return None

    def _non_finite_message(self, what: str) -> str:
        args = self.args
        tries = [f"a lower learning rate (train.learning_rate, now {args.learning_rate:g})"]
        if args.fp16:
            tries.append("bf16 instead of fp16 (train.bf16=true train.fp16=false), where the GPU has it")
        if not args.max_grad_norm or args.max_grad_norm > 1.0:
            tries.append("gradient clipping (train.max_grad_norm=1.0)")
        return (f"step {self.state.global_step}: the {what}, so the run stopped (status failed). "
                f"{self._kept()} Try {', or '.join(tries)}, in a new run.")

    def _out_of_memory(self, inputs) -> str:
        args = self.args
        rows, width = inputs["input_ids" if "input_ids" in inputs else "completion_ids"].shape
        knobs = [f"halve train.per_device_train_batch_size (now {args.per_device_train_batch_size}) and double "
                 f"train.gradient_accumulation_steps (now {args.gradient_accumulation_steps}): the global batch stays "
                 f"{self.global_batch}", f"lower train.max_length (now {self.recipe_max_length})"]
        if not getattr(self.model, "is_loaded_in_4bit", False):
            knobs.append("train the adapter on a 4-bit base (method=qlora)")
        if not args.gradient_checkpointing:
            knobs.append("turn on train.gradient_checkpointing")
        return (f"step {self.state.global_step + 1}: out of GPU memory on a micro-batch of {rows} rows x {width} "
                f"tokens, so the run stopped (status failed). To fit: " + "; or ".join(knobs) + ".")

    def _kept(self) -> str:
        checkpoint = latest_checkpoint(self.run_folder.path)
        return f"Its last good checkpoint is {checkpoint}." if checkpoint else "It has no checkpoint yet."

    # Checkpoints that are complete or unusable, never half of each.
    def save_checkpoint_whole(self, folder: Path, write) -> None:
        """write() the checkpoint into `folder`; it counts only once every process has written its part."""
        if self.args.should_save and folder.exists():
            shutil.rmtree(folder)  # left by a stretch of the run that a resume replaced
        error = None
        try:
            write()
            if self.args.should_save:
                self.run_folder.save_recipe(self.recipe_yaml, folder)
        except OSError as failure:
            error = failure
        failed = torch.tensor([float(error is not None)], device=self.args.device)
        if self.args.world_size > 1:  # every process wrote its part (its RNG state at least)
            torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        if failed[0]:
            if self.args.should_save:
                shutil.rmtree(folder, ignore_errors=True)
            reason = f": {error}" if error else " on another process"
            raise RunFailed(f"could not write checkpoint {folder}{reason}. The run stopped (status failed). "
                            f"{self._kept()} Free some space, then continue the run with --resume.")
        if self.args.should_save:
            self.run_folder.mark_complete(folder, self.resume_state())
            best = self.state.best_model_checkpoint
            self.run_folder.rotate(self.save_total_limit, keep=Path(best).name if best else None)

    def before_optimizer_saved(self, folder: Path) -> None:
        faults.reached("save", self.state.global_step, folder / "optimizer.pt")

    def load_optimizer_state(self, folder: Path) -> bool:
        """Several CPU processes: the Trainer maps the optimizer state to the device "cpu:0", which torch.load cannot
        restore to; loaded here instead (True), else left to the Trainer."""
        if self.args.world_size == 1 or self.args.device.type != "cpu" or self.is_fsdp_enabled \
                or self.is_deepspeed_enabled:
            return False
        self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
        return True

    def after_optimizer_loaded(self) -> None:
        _replan_learning_rate(self.lr_scheduler, self.optimizer)

    def after_model_saved(self, folder: Path) -> None:
        """After every save of the model (checkpoints and final/)."""

    def resume_state(self) -> dict[str, Any]:
        """What a resumed run needs besides what the Trainer saves itself."""
        return {
            "step": self.state.global_step,
            "processes": self.args.world_size,
            "per_device_train_batch_size": self.args.per_device_train_batch_size,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "global_batch": self.global_batch,
            "tokens": self.real_tokens,
            "trained_tokens": self.trained_tokens,
            "elapsed_s": round(self.elapsed(), 2),
        }


def _replan_learning_rate(scheduler, optimizer) -> None:
    """The learning rate of the step after a checkpoint, by the schedule of the run as it is planned now. The
    optimizer's saved state holds the rate the checkpoint's plan gave: for a run made longer on resuming (the
    decay now spread over more steps) that rate (0 at the end of a linear decay) would train the first new step."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return  # schedules that are not functions of the step (reduce_lr_on_plateau) keep their state
    rates = [base * rule(scheduler.last_epoch) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate


def _token_counts(inputs, real) -> tuple:
    """(real tokens, tokens that carry loss) of a batch: SFT's labels, or the completions of the other stages."""
    if real is None:
        if "attention_mask" in inputs:
            real = inputs["attention_mask"].sum()
        elif "completion_mask" in inputs and "prompt_mask" in inputs:  # GRPO's generated batch
            real = inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()
        else:
            real = inputs["input_ids"].numel()
    if "labels" in inputs:
        return real, (inputs["labels"][..., 1:] != IGNORE).sum()
    return real, inputs["completion_mask"].sum()


class RunTrainer(RunFolderTrainer, SFTTrainer):
    pass


class TerminalBar(ProgressCallback):
    """The Trainer's progress bars without its printed logs: each logging step's line is ours."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


class StepsOfThisRecipe(TrainerCallback):
    """A resumed run logs, evaluates and saves at the steps its recipe says now: the Trainer would keep those of the
    checkpoint's saved state and only warn that they differ."""

    def on_train_begin(self, args, state, control, **kwargs):
        state.compute_steps(args, state.max_steps)


class _SavedWithoutReference:
    """TRL keeps the reference of an adapter trained before as a frozen copy named "ref", which PEFT would save beside
    the trained one: the model and its checkpoints keep the trained adapter only (a resumed run copies the reference
    again from model.adapter)."""

    def after_model_saved(self, folder: Path) -> None:
        shutil.rmtree(folder / "ref", ignore_errors=True)


class DpoRunTrainer(_SavedWithoutReference, RunFolderTrainer, trl_hooks.PreparedData, DPOTrainer):
    def prepared(self, dataset, args):
        return dataset  # prompt_ids, chosen_ids, rejected_ids


class KtoRunTrainer(_SavedWithoutReference, RunFolderTrainer, trl_hooks.PreparedData, KTOTrainer):
    def prepared(self, dataset, args):
        if not self.calculate_KL:
            return dataset

        def mismatched(batch):
            # KTO's KL term: each prompt with another row's answer, as TRL pairs them (the batch shifted by one)
            batch["KL_completion_ids"] = [batch["completion_ids"][-1]] + batch["completion_ids"][:-1]
            return batch

        return dataset.map(mismatched, batched=True, batch_size=args.per_device_train_batch_size)


class GrpoRunTrainer(RunFolderTrainer, GRPOTrainer):
    pass


@dataclass
class Prepared:
    """What a run has prepared before its trainer is built: the recipe, tokenizer and renderer, the prepared data,
    the model (with the adapter's PEFT config, where TRL adds it) and the stage's reference model (or None), the
    stage's TRL config, the collator of packed rows batched as rows (None: the trainer's own) and extra callbacks."""

    recipe: Any
    tokenizer: Any
    renderer: Any  # data.render.Renderer
    data: Any  # data.pipeline.PreparedData
    model: Any
    peft_config: Any
    reference: Any
    args: Any
    rows_collator: Any
    callbacks: list


def build(prepared: Prepared, run_folder: RunFolder, stop, resumed: dict[str, Any] | None) -> RunFolderTrainer:
    """The stage's trainer over what the run prepared; `resumed`: the checkpoint's state a resumed run goes on
    from."""
    recipe = prepared.recipe
    common = dict(
        model=prepared.model, args=prepared.args, train_dataset=prepared.data.train,
        eval_dataset=prepared.data.eval, processing_class=prepared.tokenizer, peft_config=prepared.peft_config,
        callbacks=list(prepared.callbacks), run_folder=run_folder, recipe_yaml=recipe.to_yaml(), stop=stop,
        save_total_limit=recipe.train_setting("save_total_limit"), max_length=recipe.train_setting("max_length"),
        similar_lengths="train_sampling_strategy" not in recipe.train, resumed=resumed)
    if recipe.stage == "sft":
        return RunTrainer(data_collator=prepared.rows_collator, **common)
    common["similar_lengths"] = False  # TRL's own order (GRPO's groups of generations need its sampler)
    if recipe.stage == "dpo":
        return DpoRunTrainer(ref_model=prepared.reference, **common)
    if recipe.stage == "kto":
        return KtoRunTrainer(ref_model=prepared.reference, **common)
    trainer = GrpoRunTrainer(reward_funcs=rewards.build(recipe.grpo["rewards"], prepared.tokenizer), **common)
    renderer = prepared.renderer
    trl_hooks.render_prompts_with(trainer, renderer.template, renderer.template_kwargs)  # on the same fixed date
    return trainer
