"""The time plan: how long a recipe trains, and what it costs, before launch.

    work       the prepared data's tokens, the tokens that carry loss and each example's length, over the run's steps
    FLOPs      flops.count on that work: forward, backward and recompute, as the method and the settings make them
    speed      the FLOP/s one device reaches on these shapes: measured where there is a measure (`--probe`, or a
               finished run of the same model and method in the run folder's parent), else assumed: a share (MFU)
               of the card's dense bf16 peak, per backend, said as an assumption
    many GPUs  DDP's ring all-reduce of the gradients once per optimizer step over the link between cards, of which
               what the last micro-step's backward pass cannot hide shows; FSDP and ZeRO-3 gather the parameters in
               each forward and backward and scatter the gradients
    the rest   evaluations (forward passes over the eval set, at the recipe's cadence) and checkpoint writes

Every figure the plan prints says whether it is counted, measured or assumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.recipe import flops
from finetune.recipe.devices import Device

# The share of a card's dense bf16 peak that training reaches (model FLOPs utilization), by backend. Assumed: a
# LoRA fine-tune of a 1B-8B model with sequence packing and FlashAttention is commonly reported at 30-45% on A100 and
# H100 through transformers, higher through Unsloth's kernels; a probe or a finished run replaces it.
ASSUMED_MFU = {"hf": 0.35, "unsloth": 0.45}
LINK_ACHIEVED = 0.75  # of a link's bandwidth that NCCL's ring all-reduce reaches (assumed)
MICRO_STEP_OVERHEAD_S = 0.015  # kernel launches, the collator and the Trainer's own work per micro-step (assumed)
CHECKPOINT_WRITE = 1e9  # bytes/s to the run folder's disk (assumed)
DDP_BUCKET = 25 * 1024**2  # bytes: DDP's gradient bucket; the last one's all-reduce starts after the backward ends


@dataclass(frozen=True)
class Speed:
    flops_per_s: float  # per device
    source: str  # where the figure comes from, as the plan prints it
    assumed: bool  # a share of the peak, to which the optimizer and per-step overheads add; a measure has them


@dataclass(frozen=True)
class TimePlan:
    steps: int
    tokens: int  # of the whole run, all devices
    flops: flops.Flops  # of the whole run
    speed: Speed
    compute_s: float  # per step, per device
    communication_s: float  # per step, what the backward pass does not hide
    evaluation_s: float  # the whole run
    checkpoint_s: float  # the whole run
    processes: int
    notes: tuple[str, ...]

    @property
    def step_s(self) -> float:
        return self.compute_s + self.communication_s

    @property
    def total_s(self) -> float:
        return self.steps * self.step_s + self.evaluation_s + self.checkpoint_s

    @property
    def tokens_per_s(self) -> float:
        """All devices together, while training steps run."""
        return self.tokens / (self.steps * self.step_s) if self.steps and self.step_s else 0.0

    def cost(self, price_per_gpu_hour: float) -> float:
        return self.total_s / 3600 * self.processes * price_per_gpu_hour


def assumed_speed(device: Device, backend: str) -> Speed | None:
    """A share of the card's peak, said as an assumption; None for a device without table figures."""
    if device.speeds is None:
        return None
    mfu = ASSUMED_MFU.get(backend, ASSUMED_MFU["hf"])
    peak = device.speeds.bf16_flops / 1e12
    return Speed(device.speeds.bf16_flops * mfu, assumed=True,
                 source=f"assumed: {mfu:.0%} of the card's {peak:,.0f} TFLOPS dense bf16 peak "
                 f"({backend} backend; --probe measures it)")


def measured_speed(flops_per_s: float, where: str) -> Speed:
    return Speed(flops_per_s, f"measured: {flops_per_s / 1e12:,.3g} TFLOPS per device ({where})", assumed=False)


def plan_time(recipe, shape, layout: flops.Layout, train: flops.Work, rows: int, evaluation: flops.Work | None,
              device: Device, launch, micro_batch: int, speed: Speed) -> TimePlan:
    """The run's time on `launch.processes` devices like `device`: `train` is one epoch of the prepared training set
    in `rows` rows (packed or not), `evaluation` the eval set (None without one)."""
    settings = recipe.train
    micro, accumulation = recipe.batch_split(launch.processes, micro_batch)
    global_rows = micro * accumulation * launch.processes
    steps = steps_of(settings, rows, micro, accumulation, launch.processes)
    epochs = steps * global_rows / rows
    checkpointing = bool(settings.get("gradient_checkpointing"))
    run = flops.count(shape, layout, recipe.method, checkpointing, train).times(epochs)
    compute_s = run.total / steps / launch.processes / speed.flops_per_s
    if speed.assumed:
        compute_s += _optimizer_s(shape, recipe.method, device) + accumulation * MICRO_STEP_OVERHEAD_S
    backward_s = run.backward / steps / launch.processes / speed.flops_per_s / accumulation  # the last micro-step
    notes = []
    communication_s = 0.0
    if launch.processes > 1:
        communication_s, note = _communication(shape, recipe.method, launch, device, compute_s, backward_s)
        notes.append(note)
    evaluation_s = _evaluation_s(recipe, shape, layout, evaluation, steps, launch.processes, speed)
    checkpoint_s, note = _checkpoints(recipe, shape, steps)
    notes.append(note)
    return TimePlan(steps, run.tokens, run, speed, compute_s, communication_s, evaluation_s, checkpoint_s,
                    launch.processes, tuple(notes))


def steps_of(settings: dict, rows: int, micro: int, accumulation: int, processes: int) -> int:
    """Optimizer steps as transformers' Trainer counts them: max_steps, else the epochs over each process's batches."""
    if settings.get("max_steps", -1) > 0:
        return int(settings["max_steps"])
    batches = math.ceil(rows / (micro * processes))
    per_epoch = max(batches // accumulation + (1 if batches % accumulation else 0), 1)
    return math.ceil(float(settings.get("num_train_epochs", 1)) * per_epoch)


def _optimizer_s(shape, method: str, device: Device) -> float:
    """AdamW's step is memory-bound: it reads and writes each trained parameter, its gradient and two moments."""
    trained = shape.adapter if method != "full" else shape.parameters
    return 2 * trained * (4 + 4 + 8) / device.speeds.memory


def _communication(shape, method: str, launch, device: Device, compute_s: float, backward_s: float):
    """(seconds per step the compute does not hide, the line that says how it was counted)."""
    if device.speeds is None:
        return 0.0, "communication between devices: not planned (no link figures for this device)"
    processes = launch.processes
    link = device.speeds.link_bytes * LINK_ACHIEVED
    ring = 2 * (processes - 1) / processes  # each byte of a ring all-reduce crosses the link twice
    trained = shape.adapter if method != "full" else shape.parameters
    gradient_bytes = trained * (4 if method != "full" else 2)  # LoRA's adapters train in fp32, full in bf16
    if launch.sharded:
        moved = 3 * (processes - 1) / processes * shape.parameters * 2  # gather twice, scatter once, bf16
        seconds = moved / link
        exposed = max(0.0, seconds - compute_s)
        return exposed, (f"FSDP/ZeRO-3: {moved / 1e9:,.2f} GB over {device.speeds.link} per step, "
                         f"{exposed * 1000:,.0f} ms of it not hidden behind compute")
    seconds = ring * gradient_bytes / link
    last_bucket = ring * min(gradient_bytes, DDP_BUCKET) / link
    exposed = max(last_bucket, seconds - backward_s)
    return exposed, (f"DDP: all-reduce of {gradient_bytes / 1e6:,.1f} MB of gradients per step over "
                     f"{device.speeds.link} ({LINK_ACHIEVED:.0%} of {device.speeds.link_bytes / 1e9:,.0f} GB/s "
                     f"assumed), {exposed * 1000:,.1f} ms of it after the backward pass")


def _evaluation_s(recipe, shape, layout, evaluation: flops.Work | None, steps: int, processes: int,
                  speed: Speed) -> float:
    settings = recipe.train
    if evaluation is None or settings.get("eval_strategy", "steps") == "no":
        return 0.0
    every = int(settings.get("eval_steps") or steps)
    count = steps // every + (1 if settings.get("eval_on_start") else 0)
    forward = flops.count(shape, layout, recipe.method, False, evaluation).forward
    return count * forward / processes / speed.flops_per_s


def _checkpoints(recipe, shape, steps: int) -> tuple[float, str]:
    settings = recipe.train
    if settings.get("save_strategy", "steps") == "no":
        return 0.0, "checkpoints: none (train.save_strategy no)"
    every = int(settings.get("save_steps") or steps)
    count = steps // every + 1  # and final/
    trained = shape.adapter if recipe.method != "full" else shape.parameters
    size = trained * (4 + 8) if recipe.method != "full" else shape.parameters * (2 + 8 + 4)  # weights, Adam, masters
    seconds = count * size / CHECKPOINT_WRITE
    return seconds, (f"checkpoints: {count} of {size / 1e9:,.2f} GB (weights and optimizer state) at "
                     f"{CHECKPOINT_WRITE / 1e9:.0f} GB/s assumed")


def format_duration(seconds: float | None) -> str:
    """1h05m, 4m07s; "–" for an unknown duration."""
    if seconds is None:
        return "–"
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"
