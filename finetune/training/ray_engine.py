"""Ray Train as the engine: `finetune train RECIPE --engine ray --num-workers N` runs the same `run()` in N Ray
workers (ray.train.torch.TorchTrainer), which form the torch process group as `accelerate launch` would.

- The run folder (output_dir) is written by rank 0 as in every run; every worker reads the checkpoint it resumes
  from there, so on several machines it must be on storage they all reach (a shared file system).
- Each complete checkpoint is reported to Ray as a pointer to the run folder's checkpoint-N; Ray keeps its own
  state under --storage. When a worker dies, Ray starts the group again (up to --max-failures times) and the new
  workers resume from the run's newest complete checkpoint, through the same resume as `--resume`.
- A run that fails for a reason that would fail again (bad input, a non-finite loss, out of memory, no space) is
  not retried: the workers return and the run folder says why.

Nothing heavy is imported at the top: Ray imports this module in each worker before the backend (Unsloth) loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

from finetune.errors import RunFailed, UserError
from finetune.run_folder import (
    FINAL_NAME,
    LOG_NAME,
    PROGRESS_NAME,
    STOP_NAME,
    final_status,
    finish_unfinished,
    read_rows,
)

POINTER_NAME = "finetune_checkpoint.json"


def launch(recipe_path: str, overrides: list[str], resume: bool | str, output_dir: str, workers: int,
           gpus_per_worker: float | None, address: str | None, storage: str | None, max_failures: int) -> int:
    """Train under Ray Train; returns the exit status (0: completed or stopped)."""
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
    except ImportError:
        raise UserError("--engine ray needs Ray Train: pip install -e \".[ray]\"") from None

    # Ray Train sends a worker's prints through its logger as well as to the console: each line would show twice.
    ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}})
    try:
        if gpus_per_worker is None:
            gpus_per_worker = 1 if ray.cluster_resources().get("GPU", 0) else 0
        resources = {"CPU": 1, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
        trainer = TorchTrainer(
            _work,
            train_loop_config={"recipe": recipe_path, "overrides": overrides, "resume": resume, "cwd": os.getcwd()},
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=bool(gpus_per_worker),
                                         resources_per_worker=resources),
            run_config=RunConfig(name=Path(output_dir).name, storage_path=storage,
                                 failure_config=FailureConfig(max_failures=max_failures)),
        )
        with _stop_at_sigterm(Path(output_dir)):
            result = trainer.fit()
    finally:
        ray.shutdown()
        finish_unfinished(output_dir, "the Ray workers ended without a status: stopped at once (Ctrl-C is Ray's "
                          f"abort), or lost (see {Path(output_dir) / LOG_NAME} and Ray's logs)")
    status = final_status(read_rows(output_dir)) or {"status": "failed", "error": "the run did not start"}
    print(f"ray: the run's Ray state is in {result.path}", flush=True)
    if status["status"] == "failed":
        raise RunFailed(status.get("error") or "the run failed")
    print(f"{status['status']}: {Path(output_dir) / FINAL_NAME}", flush=True)
    return 0


@contextlib.contextmanager
def _stop_at_sigterm(run: Path):
    """SIGTERM to this process (the panel's Stop, a scheduler) stops the workers at the end of their step with a
    checkpoint, through the run folder's .stop file; before training started there is nothing to save. (Ctrl-C is
    Ray's: it aborts the run at once.)"""
    marker = run / STOP_NAME

    def on_sigterm(signum, frame):
        if not (run / PROGRESS_NAME).exists():
            raise KeyboardInterrupt
        print("stopping at the end of this step, with a checkpoint", flush=True)
        marker.touch()

    marker.unlink(missing_ok=True)
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        marker.unlink(missing_ok=True)


def _work(config: dict) -> None:
    """One Ray worker: `run()`; after a restart, resumed from the run's newest complete checkpoint."""
    import ray.train
    import torch.distributed

    from finetune.hooks import ray as ray_hooks
    from finetune.models import backends

    if os.path.isdir(config["cwd"]):
        os.chdir(config["cwd"])  # relative paths (recipe, data, output_dir) mean what they meant at the launch
    backends.import_first(config["recipe"], config["overrides"])
    from finetune.recipe.schema import load_recipe
    from finetune.run_folder import latest_checkpoint
    from finetune.training.run import run

    output_dir = load_recipe(config["recipe"], config["overrides"]).output_dir
    resume = [config["resume"]]
    if ray.train.get_context().get_world_rank() == 0 and ray_hooks.started_before():
        if latest_checkpoint(output_dir) is not None:
            resume = [True]
        elif not config["resume"]:
            shutil.rmtree(output_dir, ignore_errors=True)  # an earlier try that failed before its first checkpoint
    torch.distributed.broadcast_object_list(resume)
    try:
        run(config["recipe"], config["overrides"], resume[0], callbacks=(_reporter(),))
    except (UserError, RunFailed):
        pass  # it would fail again if Ray retried it; the run folder says why, and the launch reads it there


def _reporter():
    """A TrainerCallback that reports each complete checkpoint (a pointer to it) with the latest logged metrics to
    Ray, on every worker (Ray's report is collective). Made here: in a worker, transformers loads after the
    backend."""
    from transformers import TrainerCallback

    class ReportToRay(TrainerCallback):
        def __init__(self):
            self.metrics: dict = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.metrics.update({key: value for key, value in (logs or {}).items() if isinstance(value, (int, float))})

        def on_save(self, args, state, control, **kwargs):
            import ray.train

            metrics = {**self.metrics, "step": state.global_step}
            if not state.is_world_process_zero:
                ray.train.report(metrics)
                return
            checkpoint = Path(args.output_dir).absolute() / f"checkpoint-{state.global_step}"
            with tempfile.TemporaryDirectory() as pointer:
                (Path(pointer) / POINTER_NAME).write_text(json.dumps({"checkpoint": str(checkpoint)}))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(pointer),
                                 checkpoint_dir_name=checkpoint.name)

    return ReportToRay()
