"""Continuing a run (`finetune train RECIPE --resume [CHECKPOINT]`): from which checkpoint, and whether the recipe
given now still describes that run.

The saved recipe is the run. What may change on resuming is how long it trains (more epochs, a higher max_steps)
and how it logs, evaluates and saves; the global batch may be split over another number of processes. Anything
else (model, method, adapter, data, masks, learning rate, precision, seed, ...) is refused, naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from finetune.errors import UserError
from finetune.run_folder import (
    CONFIG_NAME,
    FINAL_NAME,
    PROGRESS_NAME,
    checkpoint_state,
    checkpoint_step,
    checkpoints,
    final_status,
    is_complete,
    latest_checkpoint,
    read_rows,
)

LENGTH = ("train.max_steps", "train.num_train_epochs")  # how long the run trains
MAY_CHANGE = {
    "output_dir",
    "train.num_train_epochs",
    "train.max_steps",
    "train.per_device_train_batch_size",  # with gradient_accumulation_steps: the global batch must stay the same
    "train.gradient_accumulation_steps",
    "train.logging_steps",
    "train.logging_strategy",
    "train.logging_first_step",
    "train.save_steps",
    "train.save_strategy",
    "train.save_total_limit",
    "train.eval_steps",
    "train.eval_strategy",
    "train.eval_on_start",
    "train.per_device_eval_batch_size",
    "train.report_to",
    "eval.samples",
    "eval.max_new_tokens",
    "mlflow.tracking_uri",
    "mlflow.experiment",
    "mlflow.log_model",
    "train.run_name",
    "train.disable_tqdm",
    "train.dataloader_num_workers",
    "train.ddp_find_unused_parameters",  # how DDP collects gradients, not which (runs before it was chosen per model)
    "data.num_proc",
}


@dataclass
class ResumePoint:
    checkpoint: Path
    state: dict[str, Any]  # the checkpoint's finetune_state.json

    @property
    def step(self) -> int:
        return self.state["step"]


def plan(recipe, resume: bool | str, processes: int) -> tuple[ResumePoint, list[str]]:
    """Where the run resumes, after every check: the checkpoint, the recipe, the global batch on `processes`.
    Returns the point and the notes to print (a changed process count, a longer run)."""
    point = resume_point(recipe.output_dir, resume)
    longer = check_same_run(recipe.to_dict(), recipe.output_dir)
    if resume is True and (not longer or recipe.train_setting("max_steps") == point.step):
        check_not_completed(recipe.output_dir, point)
    # an `auto` micro-batch is chosen at run time; any choice splits the same global batch
    per_device, accumulation = recipe.batch_split(processes, 1 if recipe.auto_micro_batch else None)
    note = check_global_batch(point, per_device, accumulation, processes)
    notes = [note] if note else []
    if longer:
        notes.append(f"{longer}: the learning-rate schedule is planned again over the new length, and the steps "
                     f"after {point.checkpoint.name} follow it (warm-up and decay as for a run planned that long)")
    return point, notes


def check_not_completed(output_dir: str, point: ResumePoint) -> None:
    """A run that completed at its checkpoint's step, resumed with the same length, has nothing left to train."""
    run = Path(output_dir)
    status = final_status(read_rows(run))
    if status and status["status"] == "completed" and status["step"] == point.step and (run / FINAL_NAME).is_dir():
        raise UserError(f"--resume: {run} already completed at step {point.step}; raise train.max_steps (or "
                        "train.num_train_epochs) to train longer")


def resume_point(output_dir: str, resume: bool | str) -> ResumePoint:
    """The checkpoint to continue from: the run's newest complete one, or the one named."""
    run = Path(output_dir)
    if not (run / PROGRESS_NAME).is_file():
        raise UserError(f"--resume: {run} is not a run folder (it has no {PROGRESS_NAME}); "
                        "to start a new run, leave out --resume")
    if resume is True:
        checkpoint = latest_checkpoint(run)
        if checkpoint is None:
            cut_off = [path.name for path in checkpoints(run, complete=False)]
            detail = f" ({', '.join(cut_off)} {'was' if len(cut_off) == 1 else 'were'} cut off while being written)" \
                if cut_off else ""
            raise UserError(f"--resume: {run} has no complete checkpoint to continue from{detail}; start it again "
                            "in a new output_dir")
    else:
        checkpoint = Path(resume)
        if checkpoint.parent.resolve() != run.resolve() or checkpoint_step(checkpoint) is None:
            raise UserError(f"--resume {resume}: not a checkpoint-N folder of the run {run}")
        if not checkpoint.is_dir():
            raise UserError(f"--resume {resume}: no such checkpoint; the run's complete ones are: "
                            + (", ".join(path.name for path in checkpoints(run)) or "none"))
        if not is_complete(checkpoint):
            raise UserError(f"--resume {resume}: this checkpoint was cut off while being written, so it cannot be "
                            "used; pass another, or --resume alone for the newest complete one")
    return ResumePoint(checkpoint, checkpoint_state(checkpoint))


def check_same_run(now: dict[str, Any], output_dir: str) -> str | None:
    """Refuse a recipe that differs from the run's saved one other than in MAY_CHANGE, naming the first key.
    Returns what changed in the run's length ("train.max_steps 10 -> 20"), or None."""
    saved_path = Path(output_dir) / CONFIG_NAME
    saved = yaml.safe_load(saved_path.read_text(encoding="utf-8")) or {}
    before, after = flat_recipe(saved), flat_recipe(now)
    for key in sorted(before.keys() | after.keys()):
        if key in MAY_CHANGE or before.get(key) == after.get(key):
            continue
        raise UserError(
            f"--resume: {key} is {_shown(after.get(key))} now but {_shown(before.get(key))} in the run "
            f"({saved_path}). A resumed run keeps its recipe; it may only train longer (train.num_train_epochs, "
            "train.max_steps) and log, evaluate or save differently. Drop the change, or start a new run")
    changed = [f"{key} {_shown(before.get(key))} -> {_shown(after.get(key))}" for key in LENGTH
               if before.get(key) != after.get(key)]
    return ", ".join(changed) or None


def check_global_batch(point: ResumePoint, per_device: int, accumulation: int, processes: int) -> str | None:
    """None when the run continues on the same processes; a note when the same global batch is split another way;
    UserError when the global batch would change."""
    state = point.state
    now = per_device * accumulation * processes
    if now != state["global_batch"]:
        raise UserError(
            f"--resume: the global batch would be {now} ({processes} processes x per-device batch {per_device} x "
            f"{accumulation} accumulation steps) but the run's is {state['global_batch']} ({state['processes']} x "
            f"{state['per_device_train_batch_size']} x {state['gradient_accumulation_steps']}); set "
            "train.per_device_train_batch_size and train.gradient_accumulation_steps so that they multiply to "
            f"{state['global_batch']} with {processes} processes")
    if processes == state["processes"]:
        return None
    return (f"the run trained on {state['processes']} processes and continues on {processes}, with the same "
            f"global batch ({now}) and data order; each process's random state starts afresh, so dropout masks "
            "differ from an uninterrupted run")


def flat_recipe(recipe: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train.learning_rate": 0.001, "method": "lora", ...}: each section's keys, their values whole."""
    flat = {}
    for key, value in recipe.items():
        if isinstance(value, dict) and not prefix:  # the sections; values inside them stay whole
            flat.update(flat_recipe(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _shown(value: Any) -> str:
    return "unset" if value is None else repr(value)
