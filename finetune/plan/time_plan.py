"""The time plan: how long a recipe trains, and what it costs, before launch.

    work       the prepared data's tokens, the tokens that carry loss and each example's length, over the run's steps
    FLOPs      flops.count on that work: forward, backward and recompute, as the method and the settings make them
    speed      the FLOP/s one device reaches on these shapes: measured where there is a measure (`--probe`, or a
               finished run of the same model and method in the run folder's parent), else assumed: a share (MFU)
               of the card's dense bf16 peak, per backend, said as an assumption
    4-bit      QLoRA dequantizes every 4-bit weight to bf16 in each forward, backward and recomputed forward: memory
               traffic, timed at the card's memory bandwidth
    many GPUs  DDP's ring all-reduce of the gradients once per optimizer step over the link between cards (or at the
               bus bandwidth `finetune doctor --ddp` measured), of which what the last micro-step's backward pass
               cannot hide shows; FSDP and ZeRO-3 gather the parameters in each forward and backward and scatter the
               gradients
    the rest   evaluations (forward passes over the eval set, at the recipe's cadence) and checkpoint writes

Every figure the plan prints says whether it is counted, measured or assumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from finetune import run_folder
from finetune.plan import flops, shapes
from finetune.plan.devices import Device, format_bytes

# The share of a card's dense bf16 peak that training reaches (model FLOPs utilization), by backend. Assumed: a
# LoRA fine-tune of a 1B-8B model with sequence packing and FlashAttention is commonly reported at 30-45% on A100 and
# H100 through transformers, higher through Unsloth's kernels; a probe or a finished run replaces it.
ASSUMED_MFU = {"hf": 0.35, "unsloth": 0.45}
LINK_ACHIEVED = 0.75  # of a link's bandwidth that NCCL's ring all-reduce reaches (assumed)
MICRO_STEP_OVERHEAD_S = 0.015  # kernel launches, the collator and the Trainer's own work per micro-step (assumed)
CHECKPOINT_WRITE = 1e9  # bytes/s to the run folder's disk (assumed)
DDP_BUCKET = 25 * 1024**2  # bytes: DDP's gradient bucket; the last one's all-reduce starts after the backward ends
UNPLANNED_STAGE = ("the time plan counts supervised fine-tuning's work; stage {stage}'s (two answers per pair and a "
                   "reference model's forward passes, or GRPO's generation) is not counted yet")
# Per 4-bit weight and pass: bitsandbytes reads the NF4 weight (half a byte; its block scales are a few percent more),
# writes the bf16 copy and the matmul reads that copy back.
DEQUANTIZE_BYTES = 0.5 + 2 + 2


@dataclass(frozen=True)
class Speed:
    flops_per_s: float  # per device (a CPU is one device, whose cores its processes share)
    source: str  # where the figure comes from, as the plan prints it
    assumed: bool  # a share of the peak, to which the optimizer and per-step overheads add; a measure has them


@dataclass(frozen=True)
class TimePlan:
    steps: int
    tokens: int  # of the whole run, all devices
    flops: flops.Flops  # of the whole run
    speed: Speed
    compute_s: float  # per step, per device (dequantization included)
    dequantize_s: float  # per step, of compute_s: QLoRA's 4-bit weights to bf16 and back into the matmuls
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


def plan_of_run(recipe, config, data, device: Device, launch, micro_batch: int, backend: str) -> TimePlan | None:
    """The plan a run makes at its start from its prepared data (`data.train`, `data.eval`), for the device it trains
    on; None where no speed is known (a CPU, before any run of the recipe here measured one), or for a stage the plan
    does not count."""
    if recipe.stage != "sft":
        return None
    shape, layout = shapes.model_shape(config, recipe), flops.layout_of(config)
    epoch = work_of(data.train)
    speed = speed_of_past_runs(recipe, flops_per_token(recipe, shape, layout, epoch), device) or \
        assumed_speed(device, backend)
    if speed is None:
        return None
    evaluation = work_of(data.eval) if data.eval is not None else None
    return plan_time(recipe, shape, layout, epoch, len(data.train), evaluation, device, launch, micro_batch, speed)


def flops_per_token(recipe, shape, layout: flops.Layout, epoch: flops.Work) -> float:
    checkpointing = recipe.train_setting("gradient_checkpointing")
    return flops.count(shape, layout, recipe.method, checkpointing, epoch).per_token


def speed_of_past_runs(recipe, flops_per_token: float, device: Device) -> Speed | None:
    """This machine's speed as a run measured it: the run in output_dir (one being resumed), else the newest run
    beside it of the same model and method. The median of its logged tokens/s, the first interval (its warm-up) left
    out: per GPU, or on the CPU the whole machine's (its processes shared the cores)."""
    here = Path(recipe.output_dir)
    beside = sorted((path.parent for path in here.parent.glob(f"*/{run_folder.PROGRESS_NAME}")
                     if path.parent != here and _same_model(recipe, path.parent)),
                    key=lambda run: (run / run_folder.PROGRESS_NAME).stat().st_mtime, reverse=True)
    for run in (here, *beside):
        rows = run_folder.read_rows(run)
        measured = run_folder.tokens_per_second(rows)
        if measured:
            processes = _processes(rows)
            rate = measured / (processes if device.cuda else 1)
            how = "" if processes == 1 else " per process" if device.cuda else f" ({processes} processes sharing the CPU)"
            where = f"{run}: {rate:,.0f} tokens/s{how} in its progress.jsonl"
            return measured_speed(flops_per_token * rate, where)
    return None


def _same_model(recipe, run: Path) -> bool:
    try:
        saved = yaml.safe_load((run / run_folder.CONFIG_NAME).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return False
    return (isinstance(saved, dict) and (saved.get("model") or {}).get("name_or_path") == recipe.model.name_or_path
            and saved.get("method") == recipe.method)


def _processes(rows: list[dict]) -> int:
    """The run's process count: its last resumption's (a run may resume on another count), else its plan's."""
    counts = [row["resumed"]["processes"] for row in rows if "processes" in row.get("resumed", {})]
    plan = run_folder.planned(rows)
    return counts[-1] if counts else plan["processes"] if plan else 1


def work_of(table, ignore: int = -100) -> flops.Work:
    """The work of a prepared training or eval table: its tokens, those that carry loss, each example's length (a
    packed row's examples by seq_lengths); counted by Arrow a batch of rows at a time, without tokenizing."""
    import pyarrow.compute as pc

    tokens = trained = 0
    lengths: list[int] = []
    for batch in table.with_format("arrow").iter(batch_size=4096):
        tokens += pc.sum(pc.list_value_length(batch["input_ids"])).as_py() or 0
        trained += pc.sum(pc.not_equal(pc.list_flatten(batch["labels"]), ignore)).as_py() or 0
        lengths += (pc.list_flatten(batch["seq_lengths"]) if "seq_lengths" in batch.column_names
                    else pc.list_value_length(batch["input_ids"])).to_pylist()
    return flops.Work(tokens, trained, tuple(lengths))


def plan_time(recipe, shape, layout: flops.Layout, train: flops.Work, rows: int, evaluation: flops.Work | None,
              device: Device, launch, micro_batch: int, speed: Speed, bus_bytes: float | None = None) -> TimePlan:
    """The run's time on `launch.processes` devices like `device`: `train` is one epoch of the prepared training set
    in `rows` rows (packed or not), `evaluation` the eval set (None without one); `bus_bytes` an all-reduce bus
    bandwidth measured between the devices (bytes/s), instead of the card's link figure."""
    micro, accumulation = recipe.batch_split(launch.processes, micro_batch)
    global_rows = micro * accumulation * launch.processes
    steps = steps_of(recipe, rows, micro, accumulation, launch.processes)
    epochs = steps * global_rows / rows
    checkpointing = recipe.train_setting("gradient_checkpointing")
    run = flops.count(shape, layout, recipe.method, checkpointing, train).times(epochs)
    # Processes on one CPU share its cores (and its measured speed); each GPU has its own
    flops_per_s = speed.flops_per_s / (1 if device.cuda else launch.processes)
    compute_s = run.total / steps / launch.processes / flops_per_s
    notes = []
    dequantize_s = 0.0
    if speed.assumed:  # a measured speed has these in it
        compute_s += _optimizer_s(shape, recipe.method, device) + accumulation * MICRO_STEP_OVERHEAD_S
        if recipe.method == "qlora":
            dequantize_s, note = _dequantization(shape, checkpointing, device, accumulation)
            compute_s += dequantize_s
            notes.append(note)
    backward_s = run.backward / steps / launch.processes / flops_per_s / accumulation  # the last micro-step
    communication_s = 0.0
    if launch.processes > 1:
        communication_s, note = _communication(shape, recipe.method, launch, device, compute_s, backward_s, bus_bytes)
        notes.append(note)
    evaluation_s = _evaluation_s(recipe, shape, layout, evaluation, steps, launch.processes, flops_per_s)
    checkpoint_s, note = _checkpoints(recipe, shape, steps)
    notes.append(note)
    return TimePlan(steps, run.tokens, run, speed, compute_s, dequantize_s, communication_s, evaluation_s,
                    checkpoint_s, launch.processes, tuple(notes))


def steps_of(recipe, rows: int, micro: int, accumulation: int, processes: int) -> int:
    """Optimizer steps as transformers' Trainer counts them: max_steps, else the epochs over each process's batches."""
    if recipe.train_setting("max_steps") > 0:
        return int(recipe.train_setting("max_steps"))
    batches = math.ceil(rows / (micro * processes))
    per_epoch = max(batches // accumulation + (1 if batches % accumulation else 0), 1)
    return math.ceil(float(recipe.train_setting("num_train_epochs")) * per_epoch)


def _optimizer_s(shape, method: str, device: Device) -> float:
    """AdamW's step is memory-bound: it reads and writes each trained parameter, its gradient and two moments."""
    trained = shape.adapter if method != "full" else shape.parameters
    return 2 * trained * (4 + 4 + 8) / device.speeds.memory


def _dequantization(shape, checkpointing: bool, device: Device, accumulation: int) -> tuple[float, str]:
    """(seconds per step, the line that says how it was counted): memory-bound, whatever the micro-batch."""
    passes = 3 if checkpointing else 2  # forward, backward (input gradients), and the recomputed forward
    moved = passes * shape.linear * DEQUANTIZE_BYTES * accumulation
    seconds = moved / device.speeds.memory
    return seconds, (f"4-bit dequantization: {shape.linear / 1e6:,.1f}M weights x {passes} passes x "
                     f"{accumulation} micro-steps, {format_bytes(moved)} of memory traffic per step at the card's "
                     f"{device.speeds.memory / 1e9:,.0f} GB/s: {seconds * 1000:,.3g} ms")


def _communication(shape, method: str, launch, device: Device, compute_s: float, backward_s: float,
                   bus_bytes: float | None = None):
    """(seconds per step the compute does not hide, the line that says how it was counted)."""
    if device.speeds is None and bus_bytes is None:
        return 0.0, ("communication between devices: not planned (no link figures for this device; "
                     "`finetune doctor --ddp` measures the bus bandwidth for --bus-gb-s)")
    processes = launch.processes
    if bus_bytes is not None:
        link, over = bus_bytes, f"the measured bus bandwidth ({bus_bytes / 1e9:,.1f} GB/s, --bus-gb-s)"
    else:
        link = device.speeds.link_bytes * LINK_ACHIEVED
        over = (f"{device.speeds.link} ({LINK_ACHIEVED:.0%} of {device.speeds.link_bytes / 1e9:,.0f} GB/s "
                "assumed)")
    ring = 2 * (processes - 1) / processes  # each byte of a ring all-reduce crosses the link twice
    trained = shape.adapter if method != "full" else shape.parameters
    gradient_bytes = trained * (4 if method != "full" else 2)  # LoRA's adapters train in fp32, full in bf16
    if launch.sharded:
        moved = 3 * (processes - 1) / processes * shape.parameters * 2  # gather twice, scatter once, bf16
        seconds = moved / link
        exposed = max(0.0, seconds - compute_s)
        return exposed, (f"FSDP/ZeRO-3: {moved / 1e9:,.2f} GB over {over} per step, "
                         f"{exposed * 1000:,.0f} ms of it not hidden behind compute")
    seconds = ring * gradient_bytes / link
    last_bucket = ring * min(gradient_bytes, DDP_BUCKET) / link
    exposed = max(last_bucket, seconds - backward_s)
    return exposed, (f"DDP: all-reduce of {gradient_bytes / 1e6:,.1f} MB of gradients per step over {over}, "
                     f"{exposed * 1000:,.1f} ms of it after the backward pass")


def _evaluation_s(recipe, shape, layout, evaluation: flops.Work | None, steps: int, processes: int,
                  flops_per_s: float) -> float:
    strategy = recipe.eval_strategy(evaluation is not None)
    if strategy == "no":
        return 0.0
    if strategy == "epoch":
        count = math.ceil(float(recipe.train_setting("num_train_epochs")))
    else:  # transformers evaluates every logging_steps where eval_steps is not given
        every = recipe.train_setting("eval_steps") or recipe.train_setting("logging_steps")
        count = steps // math.ceil(every * steps if every < 1 else every)
    count += 1 if recipe.train_setting("eval_on_start") else 0
    forward = flops.count(shape, layout, recipe.method, False, evaluation).forward
    return count * forward / processes / flops_per_s


def _checkpoints(recipe, shape, steps: int) -> tuple[float, str]:
    strategy = recipe.train_setting("save_strategy")
    if strategy == "no":
        return 0.0, "checkpoints: none (train.save_strategy no)"
    if strategy == "epoch":
        count = math.ceil(float(recipe.train_setting("num_train_epochs")))
    else:  # a fraction below 1 is a share of the run's steps
        every = recipe.train_setting("save_steps")
        count = steps // math.ceil(every * steps if every < 1 else every)
    count += 1  # and final/
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
