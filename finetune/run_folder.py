"""The run folder: the contract between the trainer and everything that reads a run (CLI, panel, chat, export).

    finetune.yaml     the resolved recipe (also in every checkpoint-N/ and in final/)
    progress.jsonl    one JSON object per logging step, then one last line with the final status
    train.log         the plain-text log
    checkpoint-N/     Trainer checkpoints
    final/            the adapter (or full model), the tokenizer with its chat template, finetune.yaml

Only the main process writes here.
"""

from __future__ import annotations

import json
import logging
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from finetune.errors import UserError

CONFIG_NAME = "finetune.yaml"
PROGRESS_NAME = "progress.jsonl"
LOG_NAME = "train.log"
FINAL_NAME = "final"
EVAL_KEYS = ("eval_loss", "eval_mean_token_accuracy")

logger = logging.getLogger("finetune")


def check_free(output_dir: str) -> None:
    """Refuse to mix two runs in one folder, before anything is loaded."""
    path = Path(output_dir)
    if path.exists() and (path.is_file() or any(path.iterdir())):
        raise UserError(
            f"output_dir {output_dir} already exists and is not empty; choose another, e.g. output_dir={output_dir}-2"
        )


class RunFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def progress_path(self) -> Path:
        return self.path / PROGRESS_NAME

    def create(self, recipe) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        save_recipe(recipe, self.path)
        handler = logging.FileHandler(self.path / LOG_NAME, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for name in ("finetune", "transformers", "trl", "peft", "accelerate", "py.warnings"):
            library = logging.getLogger(name)
            for console in library.handlers:  # the terminal keeps showing warnings only; the file gets info too
                console.setLevel(max(console.level, logging.WARNING))
            library.addHandler(handler)
            library.setLevel(logging.INFO)
        logging.captureWarnings(True)

    def append(self, row: dict[str, Any]) -> None:
        with open(self.progress_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")

    def finish(self, status: str, step: int, elapsed: float, error: str | None = None) -> None:
        row = {"status": status, "step": step, "elapsed_s": round(elapsed, 2)}
        if error:
            row["error"] = error
        self.append(row)
        logger.info("run %s at step %d%s", status, step, f": {error}" if error else "")


def save_recipe(recipe, folder: Path) -> None:
    (folder / CONFIG_NAME).write_text(recipe.to_yaml(), encoding="utf-8")


def peak_memory_gb() -> float:
    """Peak accelerator memory of this process where there is one, else its peak resident memory."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    kilobytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kilobytes / (2**20 if sys.platform != "darwin" else 2**30)


class StopRequest:
    """SIGTERM or Ctrl-C asks the run to stop at the next step with a checkpoint; a second Ctrl-C stops at once."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        logger.warning("stop requested: saving a checkpoint at the end of this step")

    def agreed(self) -> bool:
        """Whether any process was asked to stop; every process must leave the loop at the same step."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        import torch

        flag = torch.tensor([1.0 if self.requested else 0.0])
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class ProgressCallback(TrainerCallback):
    """Writes progress.jsonl rows and the config into each checkpoint; turns a stop request into a clean stop."""

    def __init__(self, run: RunFolder, recipe, stop: StopRequest):
        self.run, self.recipe, self.stop = run, recipe, stop
        self.start = time.monotonic()
        self.last_time, self.last_tokens = self.start, 0
        self.stopped = False

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop.agreed():
            self.stopped = True
            control.should_save = True
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        now = time.monotonic()
        row: dict[str, Any] = {"step": state.global_step, "epoch": round(state.epoch or 0.0, 4)}
        if "loss" in logs:
            tokens = int(logs.get("num_tokens", 0))
            row.update(
                loss=logs["loss"],
                learning_rate=logs.get("learning_rate"),
                grad_norm=logs.get("grad_norm"),
                tokens_per_second=round((tokens - self.last_tokens) / max(now - self.last_time, 1e-9), 1),
                tokens=tokens,
                trained_tokens=int(logs.get("trained_tokens", 0)),
                total_steps=state.max_steps,
            )
            self.last_time, self.last_tokens = now, tokens
        row.update({key: logs[key] for key in EVAL_KEYS if key in logs})
        if len(row) == 2:
            return  # the end-of-training summary: the status line says it
        row.update(peak_memory_gb=round(peak_memory_gb(), 3), elapsed_s=round(now - self.start, 2))
        self.run.append(row)
        logger.info(" | ".join(f"{key} {value}" for key, value in row.items()))

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if checkpoint.is_dir():
                save_recipe(self.recipe, checkpoint)
