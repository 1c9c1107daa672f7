"""`finetune estimate`: the memory plan per device, then the time and cost plan of the run, for one launch or, with
--compare, for several side by side. `cli.py` defines its options."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

from finetune.errors import UserError
from finetune.models import backends
from finetune.plan import devices, flops, memory_plan, shapes, time_plan

TOKENS_SOURCE = "from --tokens: rows of max_length, every token carrying loss"
COMPARE = re.compile(r"^(?P<card>[a-z0-9-]+)x(?P<count>\d+)$")


def estimate_command(args) -> int:
    from finetune.models.loading import model_config
    from finetune.recipe.schema import load_recipe
    from finetune.recipe.yaml_files import accelerate_settings

    _check_numbers(args)
    launches = _compared(args.compare) if args.compare else None
    prices = _prices(args)
    if args.probe:
        backends.import_first(args.recipe, args.overrides)  # the probe trains: Unsloth, if used, loads first
    recipe = load_recipe(args.recipe, args.overrides)
    launch = memory_plan.launch_of(accelerate_settings(args.accelerate_config), args.num_gpus)
    on_cpu = args.device == "cpu" or (not args.gpu and not _has_cuda())
    if on_cpu and args.device != "cpu" and not launches:
        print("No CUDA GPU here: the plan is for this machine's CPU and memory; name a card with --gpu "
              "(a10, h100, 48GB, ...) to plan for it", flush=True)
    device = None if launches else devices.device_named(args.gpu) if args.gpu else devices.this_machine(cpu=on_cpu)
    tokens = _tokens(args.tokens)
    config = model_config(recipe)
    shape, layout = shapes.model_shape(config, recipe), flops.layout_of(config)
    work = _work(recipe, tokens)
    if launches:
        print(_comparison(recipe, shape, layout, work, launches, prices))
        return 0
    plan = memory_plan.plan(recipe, shape, device, launch, memory_plan.micro_batch_of(recipe, device, launch, shape))
    print(memory_plan.describe(plan, args.recipe))
    speed = time_plan.assumed_speed(device, _backend(recipe, device, shape.model_type))
    if args.probe:
        speed = _probe(args, recipe, shape, layout, work) or speed
    elif not args.gpu and not isinstance(work, str):
        per_token = time_plan.flops_per_token(recipe, shape, layout, work[0])
        speed = time_plan.speed_of_past_runs(recipe, per_token, device) or speed
    print()
    if isinstance(work, str):
        print(f"Time and cost: not planned: {work}")
    elif speed is None and args.gpu:
        print(f"Time and cost: not planned: {device.name}'s speed is not known; name the card instead "
              f"(--gpu {', '.join(devices.SPEEDS)}) to plan from its table figures, or run --probe on that card "
              "to measure it")
    elif speed is None:
        print("Time and cost: not planned: this machine's speed is not in the table of cards; --probe measures "
              "it here, or name a card with --gpu")
    else:
        epoch, rows, evaluation, source = work
        bus = args.bus_gb_s * 1e9 if args.bus_gb_s else None
        timed = time_plan.plan_time(recipe, shape, layout, epoch, rows, evaluation, device, launch,
                                    plan.micro_batch, speed, bus)
        print(describe_time(timed, work, prices.get((args.gpu or "").lower(), args.price_per_gpu_hour), recipe.method))
    return 0


LARGEST_LAUNCH = 8192  # 1,024 nodes of 8 GPUs: beyond it a count is a typing slip, not a fine-tuning run


def _check_numbers(args) -> None:
    if args.num_gpus is not None and not 1 <= args.num_gpus <= LARGEST_LAUNCH:
        raise UserError(f"--num-gpus {args.num_gpus}: plan for 1 to {LARGEST_LAUNCH:,} GPUs")
    if args.bus_gb_s is not None and not args.bus_gb_s > 0:
        raise UserError("--bus-gb-s must be above 0 (GB/s, as `finetune doctor --ddp` prints it)")
    if args.price_per_gpu_hour is not None and not args.price_per_gpu_hour >= 0:
        raise UserError(f"--price-per-gpu-hour {args.price_per_gpu_hour:g}: a price is 0 or more (USD per GPU-hour)")


def _tokens(text: str | None) -> int | None:
    """--tokens as a whole number: 50000000, 50_000_000 or 5e7."""
    if text is None:
        return None
    try:
        value = float(text.replace("_", "").replace(",", ""))
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1 and value == int(value)):
        raise UserError(f"--tokens {text}: give the training tokens per epoch as a whole number of at least 1 "
                        "(e.g. 50000000 or 5e7)")
    return int(value)


def _work(recipe, tokens: int | None):
    """(one epoch of the training set, its rows, the eval set, where they come from): from the prepared data, or
    from --tokens N as rows of max_length tokens that all carry loss; a sentence saying why not when the data
    cannot be prepared here."""
    if recipe.stage != "sft":
        return time_plan.UNPLANNED_STAGE.format(stage=recipe.stage)
    max_length = int(recipe.train_setting("max_length"))
    if tokens is not None:
        rows = max(tokens // max_length, 1)
        return flops.Work(rows * max_length, rows * max_length, (max_length,) * rows), rows, None, TOKENS_SOURCE
    from finetune.data.pipeline import prepare
    from finetune.models.loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(recipe)
        data = prepare(recipe, tokenizer, tokenizer.chat_template)
    except (UserError, OSError) as error:
        return f"{error} (--tokens N plans from a token count instead)"
    evaluation = time_plan.work_of(data.eval) if data.eval is not None else None
    return time_plan.work_of(data.train), len(data.train), evaluation, "counted from the prepared data"


def describe_time(timed: time_plan.TimePlan, work: tuple, price: float | None, method: str) -> str:
    epoch, rows, _, source = work
    per_device = timed.tokens_per_s / timed.processes
    run = timed.flops
    rule = "6N" if method == "full" else "4N"
    lines = [
        f"Time plan: {_count(timed.steps, 'step')} over {epoch.tokens:,} tokens per epoch in {rows:,} rows "
        f"({source}; {epoch.trained_tokens:,} carry loss)",
        f"  FLOPs             {run.total:.3g} in all (counted: forward {run.forward:.3g}, backward {run.backward:.3g}, "
        f"recompute {run.recompute:.3g}); {run.per_token:.3g} per token, where the {rule} rule of thumb says "
        f"{run.rule_of_thumb / run.tokens:.3g}",
        f"  speed             {timed.speed.source}",
        f"  step              {_seconds(timed.step_s)} (compute {_seconds(timed.compute_s)}"
        + (f" with 4-bit dequantization {_seconds(timed.dequantize_s)}" if timed.dequantize_s else "")
        + f", communication {_seconds(timed.communication_s)})",
        f"  tokens/s          {per_device:,.0f} per device, {timed.tokens_per_s:,.0f} in all",
        f"  evaluations       {_seconds(timed.evaluation_s)}",
        *[f"  {note}" for note in timed.notes],
        f"  run time          {_seconds(timed.total_s)}",
    ]
    if price is not None:
        gpus = f"{timed.processes} GPU{'s' if timed.processes > 1 else ''}"
        lines.append(f"  cost              ${timed.cost(price):,.2f} ({gpus} x "
                     f"{_seconds(timed.total_s)} at ${price:,.2f} per GPU-hour)")
    return "\n".join(lines)


def _comparison(recipe, shape, layout, work, launches, prices) -> str:
    if isinstance(work, str):
        raise UserError(f"--compare needs the data: {work}")
    epoch, rows, evaluation, _ = work
    lines = [f"{'launch':<12} {'fits':<5} {'micro-batch':>11} {'step':>9} {'tokens/s':>10} {'run time':>9} "
             f"{'cost':>10}"]
    for card, count in launches:
        device = devices.device_named(card)
        launch = memory_plan.launch_of(None, count)
        try:
            micro = memory_plan.micro_batch_of(recipe, device, launch, shape)
            fits = memory_plan.plan(recipe, shape, device, launch, micro).verdict != "does not fit"
        except UserError:  # an `auto` micro-batch that not one row fits
            fits = False
        if not fits:
            lines.append(f"{f'{card}x{count}':<12} {'no':<5} {'–':>11} {'–':>9} {'–':>10} {'–':>9} {'–':>10}")
            continue
        speed = time_plan.assumed_speed(device, _backend(recipe, device, shape.model_type))
        timed = time_plan.plan_time(recipe, shape, layout, epoch, rows, evaluation, device, launch, micro, speed)
        price = prices.get(card)
        cost = f"${timed.cost(price):,.2f}" if price is not None else "–"
        lines.append(f"{f'{card}x{count}':<12} {'yes':<5} {micro:>11} {_seconds(timed.step_s):>9} "
                     f"{timed.tokens_per_s:>10,.0f} {time_plan.format_duration(timed.total_s):>9} {cost:>10}")
    shares = ", ".join(f"{backend} {share:.0%}" for backend, share in time_plan.ASSUMED_MFU.items())
    lines.append(f"Speeds assumed: {shares} of each card's dense bf16 peak by backend; "
                 + ("cost at the prices given" if prices else "--prices FILE (card: price per GPU-hour) adds the cost"))
    return "\n".join(lines)


def _compared(text: str) -> list[tuple[str, int]]:
    launches = []
    for item in text.split(","):
        match = COMPARE.match(item.strip().lower())
        if not match or match["card"] not in devices.SPEEDS or int(match["count"]) < 1:
            raise UserError(f"--compare {item.strip()!r}: write CARDxCOUNT with a card of {', '.join(devices.SPEEDS)}"
                            ", e.g. --compare a10x8,h100x8,h200x1")
        launches.append((match["card"], int(match["count"])))
    return launches


def _prices(args) -> dict[str, float]:
    """Prices per GPU-hour by card: --prices FILE, else --price-per-gpu-hour for the card compared or named."""
    if not args.prices:
        price = args.price_per_gpu_hour
        return {} if price is None else {card: price for card in devices.SPEEDS}
    from finetune.recipe.yaml_files import read_mapping

    if not Path(args.prices).is_file():
        raise UserError(f"--prices {args.prices}: no such file; write one line per card (h100: 3.50)")
    prices = read_mapping(Path(args.prices), "prices file", "a10: 1.10, h100: 3.50 (per GPU-hour)")
    for card, price in prices.items():
        if card not in devices.SPEEDS or not isinstance(price, (int, float)) or price < 0:
            raise UserError(f"{args.prices}: {card}: {price!r}: write a card of {', '.join(devices.SPEEDS)} and its "
                            "price per GPU-hour, e.g. h100: 3.50")
    return {card: float(price) for card, price in prices.items()}


def _backend(recipe, device: devices.Device, model_type: str) -> str:
    """The backend a run would train with, for its assumed speed (backends.resolve, on the planned card)."""
    if recipe.model.backend != "auto":
        return recipe.model.backend
    unsloth = device.cuda and importlib.util.find_spec("unsloth") and model_type not in backends.UNSLOTH_SWAPS
    return "unsloth" if unsloth else "hf"


def _probe(args, recipe, shape, layout, work) -> time_plan.Speed | None:
    """Two real training steps here: their measured peak beside this machine's plan, and their speed."""
    from finetune.recipe.train_section import trains_on_cpu
    from finetune.training.probe import PROBE_STEPS, probe

    here = devices.this_machine(trains_on_cpu(recipe.train))
    alone = memory_plan.launch_of(None, 1)
    local = memory_plan.plan(recipe, shape, here, alone, memory_plan.micro_batch_of(recipe, here, alone, shape))
    print(f"\nProbe: {PROBE_STEPS} training steps on {here.name}, one process, "
          f"{local.micro_batch} x {local.max_length} tokens ...", flush=True)
    measured = probe(args.recipe, args.overrides)
    if here.cuda:
        print(f"Probe: measured {_against(measured.peak, local.tensors())} (torch.cuda.max_memory_allocated)")
    else:
        print(f"Probe: peak resident memory {_against(measured.loading, local.loading)} while loading, "
              f"{_against(measured.peak, local.total())} in the steps")
    if isinstance(work, str) or not measured.step_s:
        return None
    per_token = time_plan.flops_per_token(recipe, shape, layout, work[0])
    return time_plan.measured_speed(per_token * measured.tokens / measured.step_s,
                                    f"--probe: {measured.tokens:,} tokens in {measured.step_s:.2f} s here")


def _against(measured: float, planned: float) -> str:
    return (f"{devices.format_bytes(measured)} (planned {devices.format_bytes(planned)}, "
            f"{(planned - measured) / measured:+.1%} off)")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _seconds(value: float) -> str:
    """729 ms, 4.5 s, 2m05s: as people read a duration."""
    if value < 1:
        return f"{value * 1000:,.3g} ms"
    return f"{value:.3g} s" if value < 60 else time_plan.format_duration(value)


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"
