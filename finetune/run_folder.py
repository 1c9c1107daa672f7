"""The run folder: the contract between the trainer and everything that reads a run (CLI, panel, chat, export).

    finetune.yaml          the resolved recipe (also in every checkpoint-N/ and in final/)
    progress.jsonl         one JSON object per line: the time plan made at the start ({"step": 0, "plan": ...}, where
                           the plan knew a speed), training rows (TRAIN_KEYS), eval rows (EVAL_KEYS), a row for
                           each time the run resumed ({"resumed": ...}), and last the final status row (STATUSES);
                           the rows of DPO, KTO and GRPO also carry their own metrics (is_stage_metric)
    train.log              the plain-text log
    checkpoint-N/          Trainer checkpoints; one is complete, and may be used, once its finetune_state.json
                           (written last) is there
    final/                 the adapter (or full model) and the tokenizer with its chat template; appears whole
    .lock                  held by the run's main process while it runs (with its process id inside)
    .stop                  asks the run to stop at the end of its step, with a checkpoint, where its processes
                           cannot take signals (Ray workers); the launch that wrote it removes it

This module imports nothing heavy: the panel reads runs with it alone. Only a run's main process writes.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from finetune.errors import UserError

CONFIG_NAME = "finetune.yaml"
PROGRESS_NAME = "progress.jsonl"
LOG_NAME = "train.log"
DATA_CHECKS_NAME = "data_checks.json"  # what the data checks looked for and found (data/integrity.py)
FINAL_NAME = "final"
LOCK_NAME = ".lock"
STOP_NAME = ".stop"
CHECKPOINT_STATE_NAME = "finetune_state.json"
CHECKPOINT = re.compile(r"checkpoint-(\d+)")

TRAIN_KEYS = ("step", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_second", "tokens", "trained_tokens",
              "total_steps", "peak_memory_gb", "elapsed_s")
EVAL_KEYS = ("eval_loss", "eval_mean_token_accuracy")
STAGE_METRICS = ("reward", "reward_std", "kl", "completions/mean_length", "completions/clipped_ratio")


def is_stage_metric(key: str) -> bool:
    """The metrics of the preference and reward stages that progress.jsonl keeps: DPO's and KTO's rewards/chosen,
    rewards/rejected, rewards/margins and rewards/accuracies; GRPO's reward, rewards/<function>/mean and /std and
    its answers' length; and their eval_ versions."""
    key = key.removeprefix("eval_")
    return key.startswith("rewards/") or key in STAGE_METRICS


def plotted_stage_metric(key: str) -> bool:
    """The stage metrics the panel plots: DPO's and KTO's margins and accuracies, GRPO's reward and each
    function's mean reward."""
    return key in ("rewards/margins", "rewards/accuracies", "reward") or (
        key.startswith("rewards/") and key.endswith("/mean"))
STATUSES = ("completed", "stopped", "failed")


# Reading

def read_rows(run: str | Path) -> list[dict[str, Any]]:
    """progress.jsonl's rows; a last line still being written is left out."""
    path = Path(run) / PROGRESS_NAME
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def training_rows(rows: list[dict]) -> list[dict]:
    return [row for row in rows if "loss" in row]


def last_step(rows: list[dict]) -> int:
    """The step the run reached: its end row's, else its latest row's (the last logged loss may be earlier)."""
    return max((row.get("step", 0) for row in rows), default=0)


def tokens_per_second(rows: list[dict]) -> float | None:
    """The run's speed: the median of its logged tokens/s, the first interval (its warm-up) left out. The one figure
    that the panel shows and that the time plan of a later run reads."""
    import statistics

    rates = [row["tokens_per_second"] for row in training_rows(rows)[1:] if row.get("tokens_per_second")]
    return statistics.median(rates) if rates else None


def eta_s(row: dict) -> float | None:
    """The time a running run has left, at the pace of its steps so far (its progress row at `step`)."""
    if not row.get("total_steps") or not row.get("step") or "elapsed_s" not in row:
        return None
    return row["elapsed_s"] / row["step"] * (row["total_steps"] - row["step"])


def planned_left_s(plan: dict | None, step: int) -> float | None:
    """What the run's time plan leaves of it after `step`, to set beside the measured ETA."""
    if not plan or not step or not plan.get("steps"):
        return None
    return plan["total_s"] * max(0.0, 1 - step / plan["steps"])


def planned(rows: list[dict]) -> dict | None:
    """The time plan the run made at its start: total_s, steps, processes, device, speed (where it came from)."""
    return next((row["plan"] for row in rows if "plan" in row), None)


def final_status(rows: list[dict]) -> dict | None:
    """The status row that ends the run, if it has ended."""
    return rows[-1] if rows and "status" in rows[-1] else None


def finish_unfinished(run: str | Path, reason: str) -> None:
    """A run whose processes ended without saying how (killed before the main one could): status failed."""
    rows = read_rows(run)
    if rows and final_status(rows) is None:
        RunFolder(run).finish("failed", max((row.get("step", 0) for row in rows), default=0), 0.0, reason)


def checkpoint_step(path: str | Path) -> int | None:
    """N for a folder named checkpoint-N, else None."""
    match = CHECKPOINT.fullmatch(Path(path).name)
    return int(match[1]) if match else None


def is_complete(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / CHECKPOINT_STATE_NAME).is_file()


def checkpoints(run: str | Path, complete: bool = True) -> list[Path]:
    """The run's checkpoint-N folders by step, oldest first: the complete ones, or (complete=False) all."""
    found = [path for path in Path(run).glob("checkpoint-*") if path.is_dir() and checkpoint_step(path) is not None]
    return sorted((path for path in found if not complete or is_complete(path)), key=checkpoint_step)


def latest_checkpoint(run: str | Path) -> Path | None:
    found = checkpoints(run)
    return found[-1] if found else None


def checkpoint_state(checkpoint: str | Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / CHECKPOINT_STATE_NAME).read_text(encoding="utf-8"))


def running(run: str | Path) -> dict[str, Any] | None:
    """Who runs the run right now ({pid, process_group, host, started}), or None when nothing does."""
    path = Path(run) / LOCK_NAME
    try:
        handle = open(path, encoding="utf-8")
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return json.loads(handle.read() or "{}")
            except json.JSONDecodeError:
                return {}
        fcntl.flock(handle, fcntl.LOCK_UN)
        return None


def check_free(output_dir: str) -> None:
    """Refuse to mix two runs in one folder, before anything is loaded."""
    path = Path(output_dir)
    if path.exists() and (path.is_file() or any(path.iterdir())):
        raise UserError(f"output_dir {output_dir} already exists and is not empty: continue that run with --resume, "
                        f"or choose another folder, e.g. output_dir={output_dir}-2")


def check_writable(output_dir: str) -> None:
    """Refuse an output_dir that cannot be created or written, before anything is loaded; leaves nothing behind."""
    existing = Path(output_dir).expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"output_dir {output_dir}: {existing} is a file, so the run folder cannot be made there; "
                        "choose another output_dir")
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".finetune-write-check-"))
    except OSError as error:
        raise UserError(f"output_dir {output_dir}: cannot write in {existing} ({error.strerror}); choose a folder "
                        "you can write to") from None


# Writing (the run's main process only)

class RunFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = None

    @property
    def progress_path(self) -> Path:
        return self.path / PROGRESS_NAME

    def hold(self) -> None:
        """Take the run's lock for as long as this process lives (or until `release`); refuse a run in use."""
        self.path.mkdir(parents=True, exist_ok=True)
        handle = open(self.path / LOCK_NAME, "a+", encoding="utf-8")
        for _ in range(50):  # readers hold it shared for an instant
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.1)
        else:
            handle.seek(0)
            holder = handle.read()
            handle.close()
            raise UserError(f"{self.path} is in use by another process ({holder.strip() or 'unknown'}); "
                            "wait for it to end, or stop it first")
        handle.truncate(0)
        handle.write(json.dumps({"pid": os.getpid(), "process_group": os.getpgid(0), "host": socket.gethostname(),
                                 "started": time.time()}))
        handle.flush()
        self._lock = handle

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file releases the lock
            self._lock = None

    def save_recipe(self, recipe_yaml: str, folder: Path | None = None) -> None:
        _write_atomically((folder or self.path) / CONFIG_NAME, recipe_yaml)

    def save_data_checks(self, checks: dict[str, Any]) -> None:
        _write_atomically(self.path / DATA_CHECKS_NAME, json.dumps(checks, indent=1))

    def append(self, row: dict[str, Any]) -> None:
        with open(self.progress_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")

    def finish(self, status: str, step: int, elapsed: float, error: str | None = None) -> None:
        row: dict[str, Any] = {"status": status, "step": step, "elapsed_s": round(elapsed, 2)}
        if error:
            row["error"] = error
        self.append(row)

    def rewind(self, step: int, resumed: dict[str, Any]) -> None:
        """Make progress.jsonl end where a resumed run continues: rows after `step` (and the previous status)
        go; a row saying where and how the run resumed is added."""
        rows = read_rows(self.path)
        previous = final_status(rows)
        kept = [row for row in rows if "status" not in row and row.get("step", 0) <= step]
        if previous:
            resumed = {**resumed, "after": {key: previous[key] for key in ("status", "step", "error") if key in previous}}
        text = "".join(json.dumps(row) + "\n" for row in [*kept, {"step": step, "resumed": resumed}])
        _write_atomically(self.progress_path, text)

    def mark_complete(self, checkpoint: Path, state: dict[str, Any]) -> None:
        """The last write of a checkpoint: from now on it may be used."""
        _write_atomically(checkpoint / CHECKPOINT_STATE_NAME, json.dumps(state, indent=1))

    def remove_checkpoints_after(self, step: int) -> list[str]:
        """Checkpoints past `step` (from a later stretch of the run that a resume from `step` replaces), and any
        incomplete ones; returns their names."""
        removed = []
        for path in checkpoints(self.path, complete=False):
            if checkpoint_step(path) > step or not is_complete(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        return removed

    def rotate(self, limit: int | None, keep: str | None = None) -> None:
        """Keep the newest `limit` complete checkpoints (and the one named `keep`, the best); older ones go, complete
        or not.
        Only complete checkpoints count, so the newest complete one is never removed."""
        if not limit or limit <= 0:
            return
        complete = checkpoints(self.path)
        if not complete:
            return
        kept = {path.name for path in complete[-limit:]} | {keep}
        newest = checkpoint_step(complete[-1])
        for path in checkpoints(self.path, complete=False):
            if path.name not in kept and checkpoint_step(path) < newest:
                shutil.rmtree(path, ignore_errors=True)


def _write_atomically(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.partial")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)
