"""Measure what a plan predicts: real training steps, the peak memory they reach on this machine and how fast the
last of them runs.

On a GPU the peak is torch's `max_memory_allocated` in the steps (the plan's tensors, without the CUDA context and
the allocator's slack); on the CPU the process's peak resident memory twice: while the weights load (the plan's
`loading`) and from the start of training (the plan's total).
"""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
import time
from dataclasses import dataclass

from transformers import TrainerCallback

PROBE_STEPS = 2


def _resident_peak() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_resident_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
        clear.write("5")  # resets VmHWM to the current resident size


class PeakMemory(TrainerCallback):
    """The peak memory of training steps, `peak` after training, and on the CPU the resident peak before them,
    `loading` (bytes)."""

    def __init__(self):
        self.peak = self.loading = 0
        self.cuda = False

    def on_train_begin(self, args, state, control, **kwargs):
        import torch

        self.cuda = torch.cuda.is_available() and not args.use_cpu
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self.loading = _resident_peak()
            _reset_resident_peak()

    def on_step_end(self, args, state, control, **kwargs):
        import torch

        self.peak = max(self.peak, torch.cuda.max_memory_allocated() if self.cuda else _resident_peak())


class StepSpeed(TrainerCallback):
    """The last step's seconds and tokens (TRL's cumulative num_tokens, logged at every step)."""

    def __init__(self):
        self.started = self.seconds = 0.0
        self.tokens_before = self.tokens = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self.started

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "num_tokens" in logs:
            seen = int(logs["num_tokens"])
            self.tokens, self.tokens_before = seen - self.tokens_before, seen


@dataclass(frozen=True)
class Probed:
    peak: int  # bytes, in the steps
    loading: int  # bytes, before the steps (the CPU's resident memory; 0 on a GPU)
    step_s: float  # the last step, after the first warmed up
    tokens: int  # of that step


def probe(recipe_path: str, overrides: list[str]) -> Probed:
    """Train PROBE_STEPS steps of the recipe (the longest batch comes first) in a scratch folder."""
    from finetune.training.run import run

    meter, speed = PeakMemory(), StepSpeed()
    scratch = tempfile.mkdtemp(prefix="finetune-probe-")
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the run's report and status: of a scratch run, soon gone
            run(recipe_path, [*overrides, f"output_dir={scratch}/run", f"train.max_steps={PROBE_STEPS}",
                              "train.save_strategy=no", "train.eval_strategy=no", "train.eval_on_start=false",
                              "train.report_to=none", "train.logging_steps=1"], callbacks=(meter, speed))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return Probed(meter.peak, meter.loading, speed.seconds, speed.tokens)
