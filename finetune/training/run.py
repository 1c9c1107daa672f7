"""One training run, the same on one process and on N: recipe -> tokenizer -> data -> model -> trainer -> train ->
save. `finetune train` and `python -m finetune.train` (what accelerate launches) both end here, and so does a
resumed run (`--resume`), which continues from a checkpoint exactly where the run was.

Import this module only after `backends.import_first` (Unsloth must come before transformers, TRL and PEFT).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import time
from pathlib import Path

import torch
import transformers
from accelerate import PartialState

from finetune.data.collate import PackedRowsCollator
from finetune.data.report import describe_data
from finetune.errors import RunFailed, UserError
from finetune.hooks.transformers import hide_resume_arguments_warning
from finetune.models import backends
from finetune.models.loading import load_model, load_reference_model, model_config, training_precision
from finetune.plan import devices, memory_plan, shapes, time_plan
from finetune.recipe.schema import load_recipe
from finetune.recipe.train_section import trains_on_cpu
from finetune.run_folder import FINAL_NAME, LOG_NAME, STOP_NAME, RunFolder, planned, read_rows
from finetune.training import faults, preflight, trainers
from finetune.training.arguments import flattens_packed_rows, runtime_arguments, unused_parameter_search
from finetune.training.callbacks import ProgressCallback, SamplesCallback
from finetune.training.resuming import ResumePoint
from finetune.training.signals import StopRequest
from finetune.training.tracking import MlflowTracking

logger = logging.getLogger("finetune")
# What a checkpoint holds besides the model that final/ holds: the Trainer's state and ours.
TRAINER_STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*.pth", "trainer_state.json",
                       "finetune_state.json")


def run(recipe_path: str, overrides: list[str], resume: bool | str = False, callbacks: tuple = ()) -> str:
    """Train; return the final status (completed or stopped). UserError for anything the user must fix first,
    RunFailed for a run that failed on the way.

    `resume`: True for the run's newest complete checkpoint, or a checkpoint's path. `callbacks` are extra
    TrainerCallbacks (the benchmarks use one to measure)."""
    recipe = load_recipe(recipe_path, overrides)
    transformers.utils.logging.disable_progress_bar()  # weight loading and saving bars; the training bar stays
    state = PartialState()
    try:
        with StopRequest(Path(recipe.output_dir) / STOP_NAME) as stop:
            status = _train(recipe, state, stop, resume, callbacks)
        state.wait_for_everyone()  # no process tears the group down while another still uses it
        return status
    finally:
        # The trainer lives on in reference cycles, its DDP wrapper holding the process group's last work: freed
        # at interpreter exit, that aborts the process. Free it now, then end the group (whose threads, still alive
        # at exit, abort it too).
        gc.collect()
        state.destroy_process_group()


def _return_freed_blocks() -> None:
    """Training on the CPU: glibc's malloc hands freed blocks of HEAP_BLOCK and more back to the system, instead of
    keeping every block below a threshold that rises to 32 MiB (see memory_plan.HEAP_BLOCK). Elsewhere (no glibc)
    nothing changes."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    if hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, memory_plan.HEAP_BLOCK)


M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _train(recipe, state, stop: StopRequest, resume, callbacks) -> str:
    launch = preflight.Launch(state.num_processes, state.distributed_type.value)
    checked = preflight.check(recipe, launch, resume, one_at_a_time=state.local_main_process_first)
    backend, model_type, data, tokenizer = checked.backend, checked.model_type, checked.data, checked.tokenizer
    micro, accumulation = _batch_split(recipe, state)
    precision = training_precision(recipe)
    search, search_why = unused_parameter_search(recipe, backend, model_type)
    if state.is_main_process:
        data_parallel = state.num_processes > 1 and state.distributed_type.value not in backends.SHARDING
        print(checked.why, *([search_why] if data_parallel else []), describe_data(data.report), sep="\n", flush=True)
    flash = "flash" in (recipe.model.attn_implementation or "")
    args = recipe.trainer_config(**precision, **runtime_arguments(recipe, data, flash, backend, model_type),
                                 ddp_find_unused_parameters=search, per_device_train_batch_size=micro,
                                 gradient_accumulation_steps=accumulation)
    packed_as_rows = recipe.train_setting("packing") and not flattens_packed_rows(recipe, flash, backend)
    rows_collator = PackedRowsCollator(tokenizer.pad_token_id) if packed_as_rows else None
    point, notes = checked.resume, checked.notes
    if point:
        args.eval_on_start = False  # the run evaluated at its start already
    tracked = "mlflow" in args.report_to
    args.report_to = [name for name in args.report_to if name != "mlflow"]  # ours logs it (tracking.py), not HF's
    transformers.set_seed(args.seed)  # adapter initialization is random: same seed, same start, any process count
    if args.use_cpu:
        _return_freed_blocks()
    model, peft_config = load_model(recipe, precision, backend, recipe.train_setting("gradient_checkpointing"))
    reference = load_reference_model(recipe, precision)
    coefficient = getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0)
    if coefficient and "router_aux_loss_coef" not in recipe.train:
        # TRL adds coefficient x load-balancing loss to every micro-batch's loss, and the Trainer multiplies each
        # process's loss by the process count (right for the token-normalized cross-entropy only), so the MoE term
        # would weigh accumulation steps x processes times more than the model's config says.
        args.router_aux_loss_coef = coefficient / (args.gradient_accumulation_steps * state.num_processes)

    run_folder = RunFolder(recipe.output_dir)
    with contextlib.ExitStack() as cleanup:
        if state.is_main_process:
            run_folder.hold()
            cleanup.callback(run_folder.release)
            if point:
                _continue_from(run_folder, point, state.num_processes, notes)
            run_folder.save_recipe(recipe.to_yaml())  # a resumed run's too: the length and cadence it now follows
            if "integrity" in data.report:  # a folder `finetune prepare` wrote before there were checks has none
                run_folder.save_data_checks(data.report["integrity"])
            _plan_time(recipe, run_folder, data, state, micro, backend)
            cleanup.enter_context(_log_to(run_folder.path / LOG_NAME))
            logger.info("run folder %s", run_folder.path)
        tracker = MlflowTracking(recipe, run_folder) if tracked and state.is_main_process else None
        if tracker:
            tracker.start()
        state.wait_for_everyone()  # the folder is there (and rewound) before any process writes into it
        prepared = trainers.Prepared(recipe, tokenizer, _renderer(recipe, tokenizer), data, model, peft_config,
                                     reference, args, rows_collator, list(callbacks))
        return _fit(prepared, state, stop, point, run_folder, tracker)


def _fit(prepared: trainers.Prepared, state, stop, point: ResumePoint | None, run_folder: RunFolder,
         tracker: MlflowTracking | None) -> str:
    recipe, tokenizer, data, renderer = prepared.recipe, prepared.tokenizer, prepared.data, prepared.renderer
    trainer = None
    try:
        trainer = trainers.build(prepared, run_folder, stop, point.state if point else None)
        progress = ProgressCallback(trainer.elapsed, run_folder, trainer.real_tokens,
                                    also=tracker.log_row if tracker else None)
        trainer.add_callback(progress)
        if point:
            hide_resume_arguments_warning()
        board = _log_to_tensorboard(trainer, run_folder, point)
        samples = _samples_callback(recipe, data, renderer, progress, board) if recipe.eval.samples else None
        if samples:
            trainer.add_callback(samples)
        elif recipe.eval.samples and state.is_main_process:
            print("note: eval.samples answers held-out prompts, and this run holds none out that the chat template "
                  "renders (data.eval, data.eval_fraction): no samples", flush=True)
        if point and point.step >= trainer.planned_steps():
            # The checkpoint is the run's last step (it was cut off before final/ was written): nothing to train.
            status, final = "completed", _final_from_checkpoint(point, run_folder, recipe, state)
        else:
            trainer.train(resume_from_checkpoint=str(point.checkpoint) if point else None)
            status = "stopped" if trainer.stopped else "completed"
            final = _save_final(trainer, run_folder, tokenizer, recipe, state)
        if state.is_main_process:
            step = max(trainer.state.global_step, point.step if point else 0)
            run_folder.finish(status, step, trainer.elapsed())
            logger.info("run %s at step %d", status, step)
            if tracker:
                tracker.finish(status)
            print(f"{status}: {final}", flush=True)
        return status
    except BaseException as error:
        alone = isinstance(error, RunFailed) and not error.every_process_alike  # this process's failure only
        if state.is_main_process or alone:
            message = "interrupted" if isinstance(error, KeyboardInterrupt) else \
                str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
            step = trainer.state.global_step if trainer is not None else (point.step if point else 0)
            run_folder.finish("failed", step, trainer.elapsed() if trainer else 0.0, message)
            logger.error("run failed at step %d: %s", step, message)
            if tracker:
                tracker.finish("failed")
        raise


def _plan_time(recipe, folder: RunFolder, data, state, micro: int, backend: str) -> None:
    """The run's time plan, made at its start where a speed is known (a card of the table, or a run here that
    measured one), in progress.jsonl for the panel to set beside the measured ETA. A resumed run keeps its plan."""
    if planned(read_rows(folder.path)):
        return
    device = devices.this_machine(trains_on_cpu(recipe.train))
    plan = time_plan.plan_of_run(recipe, model_config(recipe), data, device, _launch(state), micro, backend)
    if plan is None:
        return
    where = device.name if device.cuda else "this machine's CPU"
    # One figure for the record and the line: 2.53 s would print as 0m03s while its record, 2.5, reads 0m02s.
    total_s = round(plan.total_s, 1)
    folder.append({"step": 0, "plan": {"total_s": total_s, "steps": plan.steps,
                                       "processes": plan.processes, "device": where, "speed": plan.speed.source}})
    print(f"time plan: {plan.steps:,} steps in {time_plan.format_duration(total_s)} on {where} "
          f"({plan.speed.source})", flush=True)


def _continue_from(run_folder: RunFolder, point: ResumePoint, processes: int, notes: list[str]) -> None:
    """Forget what happened after the checkpoint (later checkpoints, progress rows), and say where it resumes."""
    removed = run_folder.remove_checkpoints_after(point.step)
    run_folder.rewind(point.step, {"from": point.checkpoint.name, "processes": processes, "at": time.time()})
    shutil.rmtree(run_folder.path / FINAL_NAME, ignore_errors=True)  # the final model of an earlier stop
    print(f"resuming {run_folder.path} from {point.checkpoint.name} (step {point.step})"
          + (f"; removed {', '.join(removed)}, written after it or cut off" if removed else ""), flush=True)
    for note in notes:
        print(f"note: {note}", flush=True)


def _renderer(recipe, tokenizer):
    from finetune.data.render import Renderer

    return Renderer(tokenizer, tokenizer.chat_template, recipe.data.template_date,
                    template_kwargs=recipe.data.template_kwargs)


def _samples_callback(recipe, data, renderer, progress: ProgressCallback, board) -> SamplesCallback | None:
    """eval.samples: answers to the first held-out prompts at each evaluation, in progress.jsonl (and so in MLflow)
    and as TensorBoard text; None without such prompts."""
    from finetune.trained_model.evaluate import held_out, samples_markdown

    def record(row: dict) -> None:
        progress.write(row)
        if board is not None:
            board.add_text("samples", samples_markdown(row["samples"]), row["step"])
            board.add_scalar("eval/samples_stop_rate", row["samples_stop_rate"], row["step"])
            board.flush()

    examples = held_out(data.eval_examples, recipe.eval.samples, renderer) if data.eval is not None else []
    return SamplesCallback(examples, renderer.tokenizer, renderer, recipe.eval.max_new_tokens, record) \
        if examples else None


def _log_to_tensorboard(trainer, run_folder: RunFolder, point: ResumePoint | None):
    """With report_to tensorboard: one log per run, in RUN/tensorboard, that a resumed run continues (the steps
    after its checkpoint, written before the interruption, are purged). Its writer, or None."""
    from transformers.integrations import TensorBoardCallback

    board = next((callback for callback in trainer.callback_handler.callbacks
                  if isinstance(callback, TensorBoardCallback)), None)
    if board is None or not trainer.is_world_process_zero():
        return None
    from torch.utils.tensorboard import SummaryWriter  # there: the callback above exists only with tensorboard

    trainer.remove_callback(board)
    writer = SummaryWriter(log_dir=str(run_folder.path / "tensorboard"), purge_step=point.step + 1 if point else None)
    trainer.add_callback(TensorBoardCallback(tb_writer=writer))
    return writer


def _save_final(trainer, run_folder: RunFolder, tokenizer, recipe, state):
    """final/ appears whole: written beside it, then renamed."""
    final = run_folder.path / FINAL_NAME
    staging = run_folder.path / f".{FINAL_NAME}.partial"
    if state.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    try:
        with whole_state_dict(trainer):
            trainer.save_model(str(staging))  # the adapter, or the full model; every process joins, the main one writes
        faults.reached("final", trainer.state.global_step)
        if state.is_main_process:
            check_final_weights(staging, recipe.method, trainer.state.global_step)
            tokenizer.save_pretrained(staging)
            run_folder.save_recipe(recipe.to_yaml(), staging)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise RunFailed(f"could not write the final model to {final}: {error}. The run's checkpoints are kept; "
                        "free some space, then continue the run with --resume") from None
    return final


@contextlib.contextmanager
def whole_state_dict(trainer):
    """Under FSDP with a sharded state dict (as the launch configs save checkpoints), the Trainer's save_model writes
    no weights at all (transformers 5.17 saves them only for FULL_STATE_DICT): final/ gathers them whole, the
    final save that accelerate's set_state_dict_type is there for."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if not trainer.is_fsdp_enabled or "FULL_STATE_DICT" in str(plugin.state_dict_type):
        yield
        return
    sharded = plugin.state_dict_type
    plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        yield
    finally:
        plugin.set_state_dict_type(sharded)


def check_final_weights(folder: Path, method: str, step: int) -> None:
    """A run is completed only with the weights it trained in final/ (the adapter, or the whole model): a staged
    final folder without them is removed, and the run fails."""
    names = ["adapter_model.safetensors"] if method in ("lora", "qlora") else ["model.safetensors",
                                                                             "model.safetensors.index.json"]
    if not any((folder / name).is_file() for name in names):
        shutil.rmtree(folder, ignore_errors=True)
        raise RunFailed(f"the final model of step {step} was saved without its weights (no {' or '.join(names)}); "
                        "the run's checkpoints are kept (FSDP's sharded ones: `accelerate merge-weights` makes them "
                        "whole)",
                        every_process_alike=False)


def _final_from_checkpoint(point: ResumePoint, run_folder: RunFolder, recipe, state) -> Path:
    """final/ as the last step's checkpoint holds the model: its files less the trainer's state, written whole."""
    final = run_folder.path / FINAL_NAME
    if state.is_main_process:
        staging = run_folder.path / f".{FINAL_NAME}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(point.checkpoint, staging, ignore=shutil.ignore_patterns(*TRAINER_STATE_FILES))
        check_final_weights(staging, recipe.method, point.step)
        run_folder.save_recipe(recipe.to_yaml(), staging)
        os.replace(staging, final)
    state.wait_for_everyone()
    return final


@contextlib.contextmanager
def _log_to(path):
    """train.log gets the info of the toolkit and its libraries while the run lasts; the terminal keeps warnings."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = []
    for name in ("finetune", "transformers", "trl", "peft", "accelerate", "py.warnings"):
        library = logging.getLogger(name)
        saved.append((library, library.level, [(console, console.level) for console in library.handlers]))
        for console in library.handlers:
            console.setLevel(max(console.level, logging.WARNING))
        library.addHandler(handler)
        library.setLevel(logging.INFO)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for library, level, consoles in saved:
            library.removeHandler(handler)
            library.setLevel(level)
            for console, console_level in consoles:
                console.setLevel(console_level)
        handler.close()


def _batch_split(recipe, state) -> tuple[int, int]:
    """(micro-batch, accumulation steps); an `auto` micro-batch is the largest that the memory plan fits on every
    process's device, said at the start."""
    if not recipe.auto_micro_batch:
        return recipe.batch_split(state.num_processes)
    device, launch = devices.this_machine(trains_on_cpu(recipe.train)), _launch(state)
    shape = shapes.model_shape(model_config(recipe), recipe)
    chosen = torch.tensor([memory_plan.micro_batch_of(recipe, device, launch, shape)], device=state.device)
    if state.num_processes > 1:
        torch.distributed.all_reduce(chosen, op=torch.distributed.ReduceOp.MIN)  # one split on unlike devices
    micro, accumulation = recipe.batch_split(state.num_processes, int(chosen.item()))
    if state.is_main_process:
        fitted = memory_plan.plan(recipe, shape, device, launch, micro)
        print(f"micro-batch auto: {micro} rows of {fitted.max_length} tokens per process (planned "
              f"{fitted.total() / devices.GIB:.1f} of {device.capacity / devices.GIB:.1f} GiB on "
              f"{device.name}; up to {fitted.largest_micro_batch} fit) x {accumulation} accumulation steps x "
              f"{state.num_processes} process{'es' if state.num_processes > 1 else ''} = global batch "
              f"{micro * accumulation * state.num_processes}", flush=True)
    return micro, accumulation


def _launch(state) -> memory_plan.Launch:
    """How the processes share the model, as the memory and time plans count it."""
    from accelerate.utils import DistributedType

    sharded = state.distributed_type == DistributedType.FSDP or (
        state.distributed_type == DistributedType.DEEPSPEED and state.deepspeed_plugin.zero_stage == 3)
    return memory_plan.Launch(state.num_processes, sharded, f"{state.num_processes} processes")
