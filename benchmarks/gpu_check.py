"""The GPU check: one script that settles on a GPU what the CPU tests cannot, within 10 minutes on one H200.

Each check prints one line, PASS, FAIL or SKIP, its name and its figure; `results.json` keeps them all.

- packing MODEL BACKEND: two examples packed into one row against the same two apart, through the model as the
  backend loads it and the collator the trainer uses for that backend, micro-batches of 1 and 2 packed rows: the
  largest difference of the second example's logits. A control (the same row with positions running on, so the
  examples attend to each other) shows what a leak looks like; the check passes when the packed logits differ from
  the separate ones by under 5% of the control's difference. GPT-OSS under Unsloth is refused packing before launch
  (its attention takes no mask while training): there the check passes when the refusal holds, and prints the leak.
- speed MODEL WAY: tokens/s and torch.cuda.max_memory_allocated of a real `finetune train` (its own process: Unsloth
  is imported first, and each peak is its own), against `finetune estimate`'s plan of the same recipe on this GPU.
  Llama-3.2-3B's shape with LoRA and QLoRA on both backends; GPT-OSS 20B's shape with fewer layers, bf16 LoRA on both
  backends and Unsloth QLoRA in bf16 and in fp16 (which Unsloth trains in float32).
- fsdp2-save: one FSDP2 process with the launch config's sharded state dict: final/ must hold the adapter.
- ddp: two DDP processes: Llama under hf, and GPT-OSS under Unsloth, whose experts that no token reached get no
  gradient (the unused-parameter search must be on). With one GPU the two processes share it in a gloo group (NCCL
  keeps one process per GPU).

    python benchmarks/gpu_check.py --out DIR                    # on a CUDA machine
    python benchmarks/gpu_check.py --out DIR --tiny             # a dry run on the CPU: tiny shapes, Unsloth skipped
    python benchmarks/gpu_check.py --out DIR --only packing,ddp --models llama

Tokenizers come from $FINETUNE_SHARED_ASSETS, ../shared/assets or .assets (see ../shared/device/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSET_PLACES = [os.environ.get("FINETUNE_SHARED_ASSETS", ""), REPO.parent / "shared" / "assets", REPO / ".assets"]
TOKENIZERS = {"llama": "tokenizers/llama-3.2-instruct", "gpt-oss": "tokenizers/gpt-oss"}
SPEED_WAYS = {
    "llama": {"hf-lora": [], "hf-qlora": ["method=qlora"], "unsloth-lora": [], "unsloth-qlora": ["method=qlora"]},
    "gpt-oss": {"hf-lora": [], "unsloth-lora": [], "unsloth-qlora-bf16": ["method=qlora"],
                "unsloth-qlora-fp16": ["method=qlora", "train.fp16=true", "train.bf16=false"]},
}
LEAK_SHARE = 0.05  # packed logits may differ from separate ones by at most this share of the control's difference
CHECKS = ("packing", "speed", "fsdp2-save", "ddp")


def asset(relative: str) -> Path:
    for place in ASSET_PLACES:
        if place and (Path(place) / relative).exists():
            return Path(place) / relative
    raise SystemExit(f"{relative} not found in $FINETUNE_SHARED_ASSETS, ../shared/assets or .assets")


def make_model(name: str, folder: Path, size: str, gpt_oss_layers: int) -> Path:
    """A random-initialized bf16 checkpoint of the architecture with its real tokenizer. size: tiny (the test
    models), small (a few layers, for the packing and launch checks) or real (the shapes the recipes train)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.models import architectures

    if (folder / "config.json").exists():
        return folder
    if name == "llama":
        config = {"tiny": architectures.tiny_llama_3_2, "real": architectures.llama_3_2_3b,
                  "small": lambda: architectures.llama_3_2_3b(num_hidden_layers=2)}[size]()
    else:
        config = {"tiny": architectures.tiny_gpt_oss, "real": lambda: architectures.gpt_oss_20b(
            num_hidden_layers=gpt_oss_layers), "small": lambda: architectures.gpt_oss_20b(num_hidden_layers=2)}[size]()
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(asset(TOKENIZERS[name])).save_pretrained(folder)
    return folder


def make_data(path: Path, rows: int, words: int) -> Path:
    """Conversations of random words: long rows to pack, whatever the tokenizer."""
    rng = random.Random(0)
    vocabulary = ["alpha", "river", "stone", "quick", "seven", "garden", "signal", "copper", "window", "orbit"]
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(rows):
            text = " ".join(rng.choice(vocabulary) for _ in range(words))
            out.write(json.dumps({"messages": [{"role": "user", "content": text[: len(text) // 3]},
                                               {"role": "assistant", "content": text}]}) + "\n")
    return path


def write_recipe(path: Path, model: Path, data: Path) -> Path:
    path.write_text(f"model: {{name_or_path: {model}}}\ndata: {{train: {data}, eval_fraction: 0}}\n",
                    encoding="utf-8")
    return path


# ---- packing: runs in a child process of its own (Unsloth must be imported before transformers) ----

def packing_child(recipe: Path, backend: str) -> dict:
    """The second example's logits packed against alone, for micro-batches of 1 and 2 packed rows."""
    if backend == "unsloth":
        import unsloth  # noqa: F401  (patches transformers, TRL and PEFT on import)
    import types

    import torch
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from finetune.data.collate import PackedRowsCollator
    from finetune.errors import UserError
    from finetune.models import backends
    from finetune.models.loading import load_model, training_precision
    from finetune.recipe.schema import load_recipe
    from finetune.training.arguments import runtime_arguments

    config = load_recipe(recipe, [f"model.backend={backend}", "train.packing=true"])
    model_type = json.loads((Path(config.model.name_or_path) / "config.json").read_text())["model_type"]
    refused = None
    try:
        backends.check_packing(backend, model_type, config.train_setting("packing"))
    except UserError as error:
        refused = str(error)
    flash = "flash" in (config.model.attn_implementation or "")
    one_row = runtime_arguments(config, types.SimpleNamespace(eval=None), flash, backend, model_type)["padding_free"]
    model, _ = load_model(config, training_precision(config), backend, gradient_checkpointing=False)
    model.train()  # the training forward: Unsloth's differs from its inference one
    device = next(model.parameters()).device
    rng = random.Random(0)
    examples = [[rng.randrange(1000, 100000) for _ in range(length)] for length in (37, 29, 41, 23)]
    rows = [{"input_ids": examples[0] + examples[1], "labels": examples[0] + examples[1], "seq_lengths": [37, 29]},
            {"input_ids": examples[2] + examples[3], "labels": examples[2] + examples[3], "seq_lengths": [41, 23]}]
    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True) if one_row else PackedRowsCollator(0)

    def logits(input_ids, position_ids):
        with torch.no_grad():
            out = model(input_ids=input_ids.to(device), position_ids=position_ids.to(device), use_cache=False)
        return out.logits.float()

    second = torch.tensor([examples[1]])
    alone = logits(second, torch.arange(len(examples[1]))[None])[0]
    result = {"one_row": one_row, "refused": refused}
    for micro in (1, 2):
        batch = collate(rows[:micro])
        packed = logits(batch["input_ids"], batch["position_ids"])
        result[f"batch {micro}"] = (packed[0, 37:66] - alone).abs().max().item()
    control = logits(torch.tensor([rows[0]["input_ids"]]), torch.arange(66)[None])
    result["control"] = (control[0, 37:66] - alone).abs().max().item()
    return result


def packing_verdict(result: dict) -> tuple[str, str]:
    worst = max(result["batch 1"], result["batch 2"])
    figure = (f"second example's logits, packed vs alone: max |diff| {result['batch 1']:.3g} (batch 1), "
              f"{result['batch 2']:.3g} (batch 2); leaking control {result['control']:.3g}; "
              f"{'one row per micro-batch' if result['one_row'] else 'packed rows as rows'}")
    isolated = worst <= LEAK_SHARE * result["control"]
    if result["refused"]:
        return ("PASS" if not isolated else "FAIL"), f"packing refused before launch, and needed: {figure}"
    return ("PASS" if isolated else "FAIL"), figure


# ---- speed and memory: real `finetune train` runs ----

def speed(recipe: Path, model: str, way: str, run: Path, seq: int, steps: int, warmup: int) -> dict:
    backend = way.split("-")[0]
    overrides = [f"model.backend={backend}", *SPEED_WAYS[model][way], f"train.max_length={seq}", "train.per_device_train_batch_size=1",
                 "train.gradient_accumulation_steps=1"]
    if model == "gpt-oss" and backend == "unsloth":
        overrides.append("train.packing=false")  # refused there (see packing)
    result = train(recipe, [*overrides, f"output_dir={run}", f"train.max_steps={warmup + steps}",
                            "train.logging_steps=1", "train.save_strategy=no", "train.disable_tqdm=true"], run)
    if "error" in result:
        return result
    rows = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]
    steps_rows = [row for row in rows if "loss" in row]
    first, last = steps_rows[warmup - 1], steps_rows[-1]
    return {
        "tokens_per_second": (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"]),
        "peak_gib": max(row["peak_memory_gb"] for row in rows if "peak_memory_gb" in row),
        "planned_gib": planned_gib(recipe, overrides),
        "final_loss": last["loss"],
    }


def planned_gib(recipe: Path, overrides: list[str]) -> float:
    """What `finetune estimate --probe` compares with the measured peak: the plan's tensors on this GPU (the whole
    process on the CPU), one process."""
    from finetune.models.loading import model_config
    from finetune.plan import devices, memory_plan, shapes
    from finetune.recipe.schema import load_recipe
    from finetune.recipe.train_section import trains_on_cpu

    config = load_recipe(recipe, overrides)
    device = devices.this_machine(trains_on_cpu(config.train))
    alone = memory_plan.launch_of(None, 1)
    shape = shapes.model_shape(model_config(config), config)
    plan = memory_plan.plan(config, shape, device, alone, memory_plan.micro_batch_of(config, device, alone, shape))
    return plan.measurable() / devices.GIB


def speed_verdict(result: dict) -> tuple[str, str]:
    off = (result["planned_gib"] - result["peak_gib"]) / result["peak_gib"]
    figure = (f"{result['tokens_per_second']:.0f} tokens/s, peak {result['peak_gib']:.2f} GiB, planned "
              f"{result['planned_gib']:.2f} GiB ({off:+.0%}), loss {result['final_loss']:.3f}")
    return ("PASS" if abs(off) <= 0.15 else "FAIL"), figure


# ---- launches: FSDP2's final save and DDP ----

def train(recipe: Path, overrides: list[str], run: Path, launch: list[str] | None = None,
          env: dict | None = None) -> dict:
    """`finetune train` (under `launch` when given); {} or {"error": the last line of its output}."""
    command = [*(launch or [sys.executable, "-m", "finetune", "train"]), str(recipe), *overrides]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    run.parent.mkdir(parents=True, exist_ok=True)
    (run.parent / f"{run.name}.log").write_text(result.stdout + result.stderr, encoding="utf-8")
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["exit " + str(result.returncode)])[-1]}
    return {}


def fsdp2_save(recipe: Path, run: Path) -> tuple[str, str]:
    import torch

    if not torch.cuda.is_available():
        return "SKIP", "FSDP needs a GPU here (on the CPU the Trainer's use_cpu turns the FSDP plugin off)"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(REPO / "accelerate_configs" / "fsdp2_8gpu.yaml"), "--num_processes", "1", "-m", "finetune.train"]
    result = train(recipe, [f"output_dir={run}", "train.max_steps=2", "train.save_steps=1", "train.max_length=256",
                            "model.backend=hf"], run, launch)
    if "error" in result:
        return "FAIL", result["error"]
    adapter = run / "final" / "adapter_model.safetensors"
    sharded = [path.name for path in (run / "checkpoint-2").iterdir() if "pytorch_model_fsdp" in path.name]
    return ("PASS" if adapter.is_file() else "FAIL"), (
        f"final/adapter_model.safetensors {adapter.stat().st_size if adapter.is_file() else 'missing'} bytes; "
        f"checkpoint-2 sharded: {', '.join(sharded) or 'no'}")


def ddp(recipe: Path, run: Path, overrides: list[str]) -> tuple[str, str]:
    """Two processes: one per GPU where there are two, else a gloo group on the one GPU (or the CPU)."""
    import torch

    overrides = [*overrides, f"output_dir={run}", "train.max_steps=3", "train.save_strategy=no",
                 "train.max_length=256", "train.per_device_train_batch_size=2"]
    if torch.cuda.device_count() >= 2:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(REPO / "accelerate_configs" / "ddp_8gpu.yaml"), "--num_processes", "2", "-m", "finetune.train"]
        result = train(recipe, overrides, run, launch)
    else:
        result = two_processes_on_one_device(recipe, overrides, run)
    if "error" in result:
        return "FAIL", result["error"]
    log = (run.parent / f"{run.name}.log").read_text()
    search = next((line for line in log.splitlines() if line.startswith("DDP unused-parameter search")), "")
    rows = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]
    return "PASS", f"{rows[-1].get('status')} at step {rows[-1].get('step')}; {search or 'no search line'}"


# Two processes on one GPU: each joins a gloo group first (NCCL refuses two processes on one device), then trains
# on cuda:0 as a launcher's first process would; accelerate and the Trainer find the group formed. (The same on a CPU.)
ONE_GPU_RANK = """
import sys, torch.distributed
torch.distributed.init_process_group("gloo")
from finetune.commands.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


def two_processes_on_one_device(recipe: Path, overrides: list[str], run: Path) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port)}
    processes = [subprocess.Popen([sys.executable, "-c", ONE_GPU_RANK, str(recipe), *overrides,
                                   "train.ddp_backend=gloo"], env={**common, "RANK": str(rank)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [process.communicate()[0] for process in processes]
    (run.parent / f"{run.name}.log").write_text("\n".join(outputs), encoding="utf-8")
    failed = [rank for rank, process in enumerate(processes) if process.returncode != 0]
    if failed:
        return {"error": f"process {failed[0]}: " + (outputs[failed[0]].strip().splitlines() or ["?"])[-1]}
    return {}


# ---- the whole check ----

class Checks:
    """Runs checks, prints each one's line, keeps them for results.json."""

    def __init__(self, out: Path, cuda: bool):
        self.out, self.cuda = out, cuda
        self.lines: dict[str, dict] = {}
        self.figures: dict[str, dict] = {}

    def record(self, name: str, verdict: str, figure: str, started: float | None = None) -> None:
        self.lines[name] = {"verdict": verdict, "figure": figure,
                            "seconds": round(time.time() - started, 1) if started else 0.0}
        print(f"{verdict} {name}: {figure}", flush=True)

    def run(self, name: str, body, needs_unsloth: bool = False) -> None:
        if needs_unsloth and not self.cuda:
            self.record(name, "SKIP", "Unsloth needs a CUDA GPU")
            return
        started = time.time()
        try:
            self.record(name, *body(), started)
        except Exception as error:  # one check's failure is its line; the others still run
            self.record(name, "FAIL", f"{type(error).__name__}: {error}", started)

    def packing(self, model: str, backend: str, recipe: Path) -> None:
        def body():
            child = subprocess.run([sys.executable, __file__, "--out", str(self.out), "--packing-child", str(recipe),
                                    backend], capture_output=True, text=True)
            (self.out / f"packing-{model}-{backend}.log").write_text(child.stdout + child.stderr)
            if child.returncode != 0:
                return "FAIL", (child.stderr.strip().splitlines() or ["?"])[-1]
            return packing_verdict(json.loads(child.stdout.strip().splitlines()[-1]))
        self.run(f"packing {model} {backend}", body, needs_unsloth=backend == "unsloth")

    def speed(self, model: str, way: str, recipe: Path, seq: int, steps: int, warmup: int) -> None:
        def body():
            result = speed(recipe, model, way, self.out / f"speed-{model}-{way}", seq, steps, warmup)
            self.figures[f"{model} {way}"] = result
            return ("FAIL", result["error"]) if "error" in result else speed_verdict(result)
        self.run(f"speed {model} {way}", body, needs_unsloth=way.startswith("unsloth"))

    def ratio(self, model: str, fast_way: str, base_way: str) -> None:
        fast, base = self.figures.get(f"{model} {fast_way}", {}), self.figures.get(f"{model} {base_way}", {})
        if "tokens_per_second" in fast and "tokens_per_second" in base:
            print(f"{model}: {fast_way} {fast['tokens_per_second']:.0f} / {base_way} {base['tokens_per_second']:.0f} "
                  f"tokens/s = {fast['tokens_per_second'] / base['tokens_per_second']:.2f}x", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json, logs and runs")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, short rows: a dry run that works on CPU")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"some of {', '.join(CHECKS)}")
    parser.add_argument("--models", default="llama,gpt-oss", help="some of llama, gpt-oss")
    parser.add_argument("--gpt-oss-layers", type=int, default=4, help="GPT-OSS depth for speed (the real model: 24)")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per speed run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--packing-child", nargs=2, metavar=("RECIPE", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.packing_child:
        print(json.dumps(packing_child(Path(args.packing_child[0]), args.packing_child[1])))
        return 0

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    cuda = torch.cuda.is_available()
    args.out.mkdir(parents=True, exist_ok=True)
    checks, only, models = Checks(args.out, cuda), set(args.only.split(",")), args.models.split(",")
    small = "tiny" if args.tiny else "small"
    short = make_data(args.out / "short.jsonl", rows=64, words=40)
    for model in models:
        recipe = write_recipe(args.out / f"{model}-{small}.yaml",
                              make_model(model, args.out / f"{model}-{small}", small, args.gpt_oss_layers), short)
        for backend in ("hf", "unsloth") if "packing" in only else ():
            checks.packing(model, backend, recipe)
        if "ddp" in only:
            unsloth = model == "gpt-oss" and cuda  # its experts without tokens: the unused-parameter search
            overrides = ["model.backend=unsloth", "train.packing=false"] if unsloth else ["model.backend=hf"]
            checks.run(f"ddp {model} {'unsloth' if unsloth else 'hf'}",
                       lambda: ddp(recipe, args.out / f"ddp-{model}", overrides))
        if "fsdp2-save" in only and model == "llama":
            checks.run("fsdp2-save llama", lambda: fsdp2_save(recipe, args.out / "fsdp2-llama"))
    if "speed" in only:
        size = "tiny" if args.tiny else "real"
        long = make_data(args.out / "long.jsonl", rows=200, words=60 if args.tiny else 600)
        for model in models:
            recipe = write_recipe(args.out / f"{model}-speed.yaml",
                                  make_model(model, args.out / f"{model}-{size}", size, args.gpt_oss_layers), long)
            for way in SPEED_WAYS[model]:
                checks.speed(model, way, recipe, 256 if args.tiny else 2048, args.steps, args.warmup)
        checks.ratio("llama", "unsloth-qlora", "hf-qlora")
        checks.ratio("gpt-oss", "unsloth-lora", "hf-lora")
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "tiny": args.tiny, "checks": checks.lines,
               "figures": checks.figures}
    (args.out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    failed = [name for name, line in checks.lines.items() if line["verdict"] == "FAIL"]
    print(f"{len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
