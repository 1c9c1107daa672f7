"""Faults injected on purpose, for the reliability tests: `FINETUNE_FAULTS` lists them, comma-separated.

    pause@micro:N    stop moving inside step N+1, after its first micro-batch (mid gradient accumulation)
    pause@step:N     stop moving right after optimizer step N
    pause@save:N     stop moving while checkpoint-N is being written (its weights are written, the rest is not)
    pause@final:N    stop moving while final/ is being written after step N (its weights are written, beside it)
    enospc@save:N    writing checkpoint-N fails: no space left on device
    oom@forward:N    the forward pass of step N runs out of GPU memory
    slow-save:S      writing each checkpoint takes S seconds longer
    die@step:N       the last process is killed (SIGKILL) right after optimizer step N, once: FINETUNE_FAULT_READY
                     is written first, and a process started again after that goes on (a worker that Ray restarts)

A paused process writes the file named by `FINETUNE_FAULT_READY` (so a test knows it is there) and sleeps until
it is killed. Without the variable, nothing here does anything.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path


def _parse(text: str) -> list[tuple[str, str, int]]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item.startswith("slow-save:"):
            faults.append(("slow", "save", int(item.split(":")[1])))
            continue
        action, _, where = item.partition("@")
        point, _, step = where.partition(":")
        faults.append((action, point, int(step)))
    return faults


FAULTS = _parse(os.environ.get("FINETUNE_FAULTS", ""))


def reached(point: str, step: int, path: Path | None = None) -> None:
    """Act out the faults set for `point` (micro, step, save, final or forward) at `step`."""
    for action, where, value in FAULTS:
        if where != point:
            continue
        if action == "slow":
            time.sleep(value)
        elif value != step:
            continue
        elif action == "pause":
            Path(os.environ["FINETUNE_FAULT_READY"]).write_text(f"{point}:{step}\n")
            while True:
                time.sleep(60)
        elif action == "die":
            ready = Path(os.environ["FINETUNE_FAULT_READY"])
            if os.environ.get("RANK", "0") == str(int(os.environ.get("WORLD_SIZE", "1")) - 1) and not ready.exists():
                ready.write_text(f"{point}:{step} {os.getpid()}\n")
                os.kill(os.getpid(), signal.SIGKILL)
        elif action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        elif action == "oom":
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by FINETUNE_FAULTS)")
