"""The devices a plan is for: the GPU cards by name, a card of a given size, or this machine (its GPU, or its memory
when training on the CPU), with what the time plan needs of a card: its dense bf16 peak and the link between cards.

The figures are the vendors' datasheets' (NVIDIA A10, L4, A100, H100 and H200 datasheets: dense Tensor Core bf16
without sparsity, memory bandwidth, and NVLink's or PCIe Gen4 x16's bandwidth in one direction); what training
reaches of them is the time plan's business, and it says where each of its figures comes from."""

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
TFLOPS = 1e12
GBPS = 1e9


@dataclass(frozen=True)
class Speeds:
    bf16_flops: float  # dense peak, FLOP/s
    memory: float  # bytes/s
    link: str
    link_bytes: float  # bytes/s between two cards, one direction


SPEEDS = {
    "a10": Speeds(125 * TFLOPS, 600 * GBPS, "PCIe Gen4 x16", 32 * GBPS),
    "l4": Speeds(121 * TFLOPS, 300 * GBPS, "PCIe Gen4 x16", 32 * GBPS),
    "a100-40": Speeds(312 * TFLOPS, 1555 * GBPS, "NVLink 3", 300 * GBPS),
    "a100-80": Speeds(312 * TFLOPS, 2039 * GBPS, "NVLink 3", 300 * GBPS),
    "h100": Speeds(989 * TFLOPS, 3350 * GBPS, "NVLink 4", 450 * GBPS),
    "h200": Speeds(989 * TFLOPS, 4800 * GBPS, "NVLink 4", 450 * GBPS),
}


@dataclass(frozen=True)
class Device:
    name: str
    capacity: int  # bytes
    cuda: bool
    speeds: Speeds | None = None  # a card of the table; None for this machine or a card known by its size only


def device_named(text: str) -> Device:
    """`a10`, `h100`, ... (see GPUS), `<N>GB` or `<N>GiB` for another card, or `cpu` for this machine's memory."""
    key = text.strip().lower()
    if key == "cpu":
        return Device(f"this machine's memory ({_total_ram() / GIB:.1f} GiB)", _total_ram(), cuda=False)
    if key in GPUS:
        name, gib = GPUS[key]
        return Device(name, int(gib * GIB), cuda=True, speeds=SPEEDS[key])
    size = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(gb|gib)", key)
    if size:
        amount = float(size.group(1)) * (GIB if size.group(2) == "gib" else 1e9)
        if amount < GIB:
            raise UserError(f"--gpu {text!r}: a card's memory is at least 1 GB; write it as 24GB or 80GiB")
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
    return Device(f"{properties.name} ({properties.total_memory / GIB:.1f} GiB)", properties.total_memory, cuda=True,
                  speeds=_speeds_of(properties.name, properties.total_memory))


def _speeds_of(name: str, memory: int) -> Speeds | None:
    """The table's figures for this card: its model in torch's name and its memory (A100 40 GB or 80 GB)."""
    for key, (card, gib) in GPUS.items():
        if card.split()[1] in name and abs(memory / GIB - gib) < 3:
            return SPEEDS[key]
    return None


def _total_ram() -> int:
    import psutil

    return psutil.virtual_memory().total

def format_bytes(value: float) -> str:
    return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / MIB:.0f} MiB"
