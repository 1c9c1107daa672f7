"""The devices a plan is for: the GPU cards by name, a card of a given size, or this machine (its GPU, or its memory
when training on the CPU)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from finetune.errors import UserError

GIB = 1024**3
MIB = 1024**2

# Memory a CUDA process can use on each card (what torch reports as total_memory), in GiB.
GPUS = {
    "a10": ("NVIDIA A10 24 GB", 22.1),
    "l4": ("NVIDIA L4 24 GB", 22.0),
    "a100-40": ("NVIDIA A100 40 GB", 39.4),
    "a100-80": ("NVIDIA A100 80 GB", 79.2),
    "h100": ("NVIDIA H100 80 GB", 79.1),
    "h200": ("NVIDIA H200 141 GB", 139.8),
}

@dataclass(frozen=True)
class Device:
    name: str
    capacity: int  # bytes
    cuda: bool


def device_named(text: str) -> Device:
    """`a10`, `h100`, ... (see GPUS), `<N>GB` or `<N>GiB` for another card, or `cpu` for this machine's memory."""
    key = text.strip().lower()
    if key == "cpu":
        return Device(f"this machine's memory ({_total_ram() / GIB:.1f} GiB)", _total_ram(), cuda=False)
    if key in GPUS:
        name, gib = GPUS[key]
        return Device(name, int(gib * GIB), cuda=True)
    size = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(gb|gib)", key)
    if size:
        amount = float(size.group(1)) * (GIB if size.group(2) == "gib" else 1e9)
        return Device(f"a {text.strip()} GPU", int(amount), cuda=True)
    raise UserError(f"--gpu {text!r}: name a card ({', '.join(GPUS)}), a size such as 48GB, or use --device cpu")


def this_machine(cpu: bool) -> Device:
    """This machine's first GPU, or its memory when training on the CPU."""
    if cpu:
        return device_named("cpu")
    import torch

    if not torch.cuda.is_available():
        raise UserError("this machine has no CUDA GPU to plan for: name the card with --gpu (e.g. --gpu A10, "
                        "--gpu H100, --gpu 48GB), or plan for training on this CPU with --device cpu")
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    return Device(f"{properties.name} ({properties.total_memory / GIB:.1f} GiB)", properties.total_memory, cuda=True)


def _total_ram() -> int:
    import psutil

    return psutil.virtual_memory().total

def format_bytes(value: float) -> str:
    return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / MIB:.0f} MiB"
