"""`finetune doctor`: what a run depends on here, and a DDP health check to run before an expensive job.

The health check is plain PyTorch DDP, no toolkit code in the way: a small multilayer perceptron trained for a few
steps on N processes (one per GPU, or two gloo processes on the CPU), each step checking that every rank holds the
same gradients and weights, then a timed all-reduce. Every worker says where it is after each phase; a worker
that stops saying so for STALL_S is named as the rank that hangs, and every process is ended, so the check never
hangs itself.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from finetune.errors import CommandFailed

STEPS = 5
STALL_S = 20.0
BANDWIDTH_BYTES = 64 * 1024**2
WIDTH = 512
FAULT_VARIABLE = "FINETUNE_DOCTOR_FAULT"  # for the tests: `disagree:RANK` or `hang:RANK`


def report(output_dir: str) -> str:
    """The environment a run depends on, one fact per line."""
    import torch

    lines = [f"Python {sys.version.split()[0]}, torch {torch.__version__}"
             + (f", CUDA {torch.version.cuda}" if torch.version.cuda else ", CPU build (no CUDA)")]
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "absent"
        lines.append(f"NCCL {nccl}; {torch.cuda.device_count()} GPU(s):")
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            bf16 = "bf16" if properties.major >= 8 else "no bf16 (fp16 instead)"
            lines.append(f"  {index}: {properties.name}, {properties.total_memory / 1024**3:.1f} GiB, "
                         f"compute {properties.major}.{properties.minor}, {bf16}")
    else:
        lines.append("GPUs: none visible (training runs on the CPU)")
    lines.append("Packages (against this toolkit's pins):")
    lines += [f"  {line}" for line in _package_lines()]
    lines.append("Optional accelerators:")
    for module, name, why in (("flash_attn", "FlashAttention", "attn_implementation flash_attention_2"),
                              ("liger_kernel", "Liger", "train.use_liger_kernel"),
                              ("deepspeed", "DeepSpeed", "the deepspeed_zero3 accelerate config")):
        version = _version(module.replace("_", "-")) or _version(module)
        lines.append(f"  {name}: {version or 'not installed'} ({why})")
    lines.append("Free disk:")
    from finetune.builtin import home

    for label, path in (("output", Path(output_dir)), ("finetune cache", home()), ("Hugging Face cache",
                                                                                   _hf_cache())):
        existing = next(parent for parent in [path, *path.resolve().parents] if parent.exists())
        lines.append(f"  {label} {path}: {shutil.disk_usage(existing).free / 1024**3:.1f} GiB free")
    from huggingface_hub import get_token

    lines.append("Hub token: " + ("configured (not shown)" if get_token() else
                                  "not configured (`hf auth login` or HF_TOKEN, to push exports)"))
    return "\n".join(lines)


def _package_lines() -> list[str]:
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    lines = []
    for text in requires("finetune") or []:
        requirement = Requirement(text)
        extra = _extra(requirement)
        if extra == "test":
            continue
        version = _version(requirement.name)
        where = f" (extra {extra})" if extra else ""
        if version is None:
            state = "not installed" + ("" if extra else ": pip install -e .")
        elif requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
            state = f"{version}, but the pin is {requirement.specifier}: reinstall with pip install -e ."
        else:
            state = version
        lines.append(f"{requirement.name}{where}: {state}")
    return lines


def _extra(requirement) -> str | None:
    marker = str(requirement.marker or "")
    return marker.split("==")[-1].strip().strip("\"'") if "extra" in marker else None


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _hf_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def ddp_check(processes: int | None) -> str:
    """Run the health check on `processes` (default: every visible GPU, or two CPU processes); the summary, or
    CommandFailed naming the rank that disagrees or hangs."""
    import torch

    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus else "gloo"
    processes = processes or gpus or 2
    if gpus and processes > gpus:
        raise CommandFailed(f"--ddp {processes}: only {gpus} GPUs are visible")
    port = _free_port()
    workers = [subprocess.Popen([sys.executable, "-m", "finetune.commands.doctor", str(rank), str(processes),
                                 str(port), backend], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
               for rank in range(processes)]
    try:
        reports = _follow(workers)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait()
    summary = reports[0]["done"]
    return (f"DDP health check passed: {processes} processes ({backend}), {STEPS} steps with gradients and weights "
            f"equal on every rank; all-reduce of {BANDWIDTH_BYTES // 1024**2} MiB: {summary['seconds'] * 1e3:.1f} "
            f"ms, bus bandwidth {summary['bus_gb_s']:.1f} GB/s" + _link_note(backend, summary["bus_gb_s"])
            + f"\nPlan a run's time on these devices with it: finetune estimate RECIPE --num-gpus {processes} "
            f"--bus-gb-s {summary['bus_gb_s']:.1f}")


def _follow(workers: list[subprocess.Popen]) -> list[dict]:
    """Read every worker's progress until all are done; CommandFailed for a disagreement, a crash or a stall."""
    selector = selectors.DefaultSelector()
    for rank, worker in enumerate(workers):
        selector.register(worker.stdout, selectors.EVENT_READ, rank)
    last = [{"phase": "starting"} for _ in workers]
    heard = time.monotonic()
    finished = set()
    while len(finished) < len(workers):
        events = selector.select(timeout=1.0)
        for key, _ in events:
            rank = key.data
            line = key.fileobj.readline()
            if not line:
                selector.unregister(key.fileobj)
                if "done" not in last[rank]:
                    workers[rank].wait()
                    raise CommandFailed(f"DDP health check failed: rank {rank} exited (status "
                                        f"{workers[rank].returncode}) {_where(last[rank])}")
                finished.add(rank)
                continue
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue  # a library's own output
            heard = time.monotonic()
            if "disagree" in message:
                raise CommandFailed(f"DDP health check failed: rank {message['disagree']}'s {message['what']} differ "
                                    f"from rank 0's after step {message['step']} (largest difference "
                                    f"{message['difference']:.3g}): DDP would train different models on different "
                                    "GPUs; check that every process runs the same code and library versions")
            last[rank] = message
        if time.monotonic() - heard > STALL_S:
            behind = min(range(len(workers)), key=lambda r: _progress(last[r]))
            ahead = max(range(len(workers)), key=lambda r: _progress(last[r]))
            raise CommandFailed(f"DDP health check failed: rank {behind} hangs (last heard {_where(last[behind])}) "
                                f"while rank {ahead} waits for it {_where(last[ahead])} (nothing for {STALL_S:.0f} s); check "
                                "that rank's GPU or host (a stuck process, a firewall between machines, "
                                "NCCL_SOCKET_IFNAME)")
    return last


def _progress(message: dict) -> tuple[int, int]:
    phases = ["starting", "joined", "step", "bandwidth", "done"]
    return phases.index(message.get("phase", "starting")), message.get("step", 0)


def _where(message: dict) -> str:
    phase = message.get("phase", "starting")
    if phase == "starting":
        return "before joining the process group"
    if phase == "step":
        return f"in step {message['step']}"
    return f"at {phase}"


def _link_note(backend: str, bus_gb_s: float) -> str:
    if backend == "gloo":
        return " (gloo over local sockets; GPUs use NCCL)"
    if bus_gb_s < 5:
        return (". That is slow for GPUs in one machine (PCIe 4.0 gives about 20 GB/s, NVLink hundreds): check "
                "`nvidia-smi topo -m`, and NCCL_P2P_DISABLE or NCCL_IB_DISABLE settings")
    return ""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _say(**message) -> None:
    print(json.dumps(message), flush=True)


def worker(rank: int, processes: int, port: int, backend: str) -> None:
    """One rank of the health check (run as `python -m finetune.commands.doctor RANK N PORT BACKEND`)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    fault_kind, _, fault_rank = os.environ.get(FAULT_VARIABLE, "").partition(":")
    faulty = fault_rank == str(rank)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=processes, timeout=timedelta(seconds=STALL_S * 3),
                            init_method=f"tcp://127.0.0.1:{port}")
    _say(phase="joined")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[rank] if backend == "nccl" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)  # each rank its own data, as in training
    for step in range(1, STEPS + 1):
        if faulty and fault_kind == "hang" and step == 3:
            time.sleep(3600)
        _say(phase="step", step=step)
        inputs = torch.randn(32, WIDTH, generator=generator).to(device)
        loss = ddp(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if faulty and fault_kind == "disagree" and step == 2:
            with torch.no_grad():
                model[0].weight.add_(1e-3)
        _check_equal([p.grad for p in model.parameters()], "gradients", rank, processes, step)
        optimizer.step()
        _check_equal(list(model.parameters()), "weights", rank, processes, step)
    _say(phase="bandwidth")
    payload = torch.ones(BANDWIDTH_BYTES // 4, device=device)
    dist.all_reduce(payload)  # warm-up
    if backend == "nccl":
        torch.cuda.synchronize()
    started = time.perf_counter()
    repeats = 5
    for _ in range(repeats):
        dist.all_reduce(payload)
    if backend == "nccl":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / repeats
    bus = BANDWIDTH_BYTES / seconds * 2 * (processes - 1) / processes / 1e9
    dist.destroy_process_group()
    _say(phase="done", done={"seconds": seconds, "bus_gb_s": bus})


def _check_equal(tensors, what: str, rank: int, processes: int, step: int) -> None:
    import torch
    import torch.distributed as dist

    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(processes)]
    dist.all_gather(everyone, flat)
    if rank == 0:
        for other in range(1, processes):
            difference = (everyone[other] - flat).abs().max().item()
            if difference > 0:
                _say(disagree=other, what=what, step=step, difference=difference)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
