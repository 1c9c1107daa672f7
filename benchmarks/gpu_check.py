"""Speed and memory of the GPU recipes' code paths, in one run: tokens/s and peak memory for Unsloth QLoRA,
transformers QLoRA (bitsandbytes NF4) and transformers bf16 LoRA, at sequence length 2048 and micro-batch 1, on
random-initialized models of the real shapes (speed and memory do not depend on the weights' values):
Llama-3.2-3B, and GPT-OSS 20B with fewer layers (--gpt-oss-layers) so that it loads in the time.

Every measurement is a real `finetune train` in its own process (Unsloth must be imported first, and each peak
is its own), read back from the run's progress.jsonl. Writes results.json and prints a table with the targets:
Unsloth at least 1.8x transformers QLoRA tokens/s; Llama-3.2-3B QLoRA peak at most 4 GB.

    python benchmarks/gpu_check.py --out DIR              # on a CUDA machine
    python benchmarks/gpu_check.py --out DIR --tiny       # a dry run on the CPU: tiny shapes, Unsloth skipped

Tokenizers come from $FINETUNE_SHARED_ASSETS, ../shared/assets or .assets (see ../shared/device/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSET_PLACES = [os.environ.get("FINETUNE_SHARED_ASSETS", ""), REPO.parent / "shared" / "assets", REPO / ".assets"]
WAYS = {
    "unsloth-qlora": ["model.backend=unsloth", "method=qlora"],
    "hf-qlora": ["model.backend=hf", "method=qlora"],
    "hf-lora": ["model.backend=hf", "method=lora"],
}
MODELS = {"llama-3.2-3b": "tokenizers/llama-3.2-instruct", "gpt-oss-20b": "tokenizers/gpt-oss"}


def asset(relative: str) -> Path:
    for place in ASSET_PLACES:
        if place and (Path(place) / relative).exists():
            return Path(place) / relative
    raise SystemExit(f"{relative} not found in $FINETUNE_SHARED_ASSETS, ../shared/assets or .assets")


def make_model(name: str, folder: Path, tiny: bool, gpt_oss_layers: int) -> None:
    """A random-initialized bf16 checkpoint of the architecture, with the real tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune import architectures

    if name == "llama-3.2-3b":
        config = architectures.tiny_llama_3_2() if tiny else architectures.llama_3_2_3b()
    else:
        config = architectures.tiny_gpt_oss() if tiny else architectures.gpt_oss_20b(num_hidden_layers=gpt_oss_layers)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(asset(MODELS[name])).save_pretrained(folder)


def make_data(path: Path, rows: int, words: int) -> None:
    """Conversations of random words: long rows to pack, whatever the tokenizer."""
    rng = random.Random(0)
    vocabulary = ["alpha", "river", "stone", "quick", "seven", "garden", "signal", "copper", "window", "orbit"]
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(rows):
            text = " ".join(rng.choice(vocabulary) for _ in range(words))
            out.write(json.dumps({"messages": [{"role": "user", "content": text[: len(text) // 3]},
                                               {"role": "assistant", "content": text}]}) + "\n")


def measure(way: str, model: Path, data: Path, run: Path, seq: int, steps: int, warmup: int) -> dict:
    recipe = run.parent / f"{run.name}.yaml"
    recipe.write_text(f"model: {{name_or_path: {model}}}\ndata: {{train: {data}}}\n", encoding="utf-8")
    command = [sys.executable, "-m", "finetune", "train", str(recipe), *WAYS[way], f"output_dir={run}",
               f"train.max_length={seq}", "train.per_device_train_batch_size=1", f"train.max_steps={warmup + steps}",
               "train.logging_steps=1", "train.save_strategy=no", "train.disable_tqdm=true"]
    result = subprocess.run(command, capture_output=True, text=True)
    (run.parent / f"{run.name}.log").write_text(result.stdout + result.stderr, encoding="utf-8")
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["exit " + str(result.returncode)])[-1]}
    rows = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]
    steps_rows = [row for row in rows if "loss" in row]
    first, last = steps_rows[warmup - 1], steps_rows[-1]
    return {
        "tokens_per_second": (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"]),
        "peak_memory_gb": max(row["peak_memory_gb"] for row in rows if "peak_memory_gb" in row),
        "final_loss": last["loss"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json, logs and checkpoints")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, short rows: a dry run that works on CPU")
    parser.add_argument("--models", default="llama-3.2-3b,gpt-oss-20b")
    parser.add_argument("--gpt-oss-layers", type=int, default=4, help="GPT-OSS depth (the real model has 24)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per way")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    seq = 256 if args.tiny else 2048
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "data.jsonl"
    make_data(data, rows=200, words=60 if args.tiny else 600)
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "sequence_length": seq,
               "micro_batch": 1, "tiny": args.tiny, "runs": {}}
    for name in args.models.split(","):
        folder = args.out / f"model-{name}"
        make_model(name, folder, args.tiny, args.gpt_oss_layers)
        for way in WAYS:
            key = f"{name} {way}"
            if way.startswith("unsloth") and not cuda:
                results["runs"][key] = {"skipped": "Unsloth needs a CUDA GPU"}
            else:
                results["runs"][key] = measure(way, folder, data, args.out / key.replace(" ", "-"), seq, args.steps,
                                               args.warmup)
            print(key, json.dumps(results["runs"][key]), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    print(table(results))
    return 0


def table(results: dict) -> str:
    lines = [f"device {results['device']}, sequence length {results['sequence_length']}, micro-batch 1",
             f"{'model / way':<32} {'tokens/s':>10} {'peak GB':>8}  note"]
    runs = results["runs"]
    for key, run in runs.items():
        if "tokens_per_second" in run:
            lines.append(f"{key:<32} {run['tokens_per_second']:>10.0f} {run['peak_memory_gb']:>8.2f}")
        else:
            lines.append(f"{key:<32} {'-':>10} {'-':>8}  {run.get('skipped') or run.get('error')}")
    for name in MODELS:
        fast, base = runs.get(f"{name} unsloth-qlora", {}), runs.get(f"{name} hf-qlora", {})
        if "tokens_per_second" in fast and "tokens_per_second" in base:
            ratio = fast["tokens_per_second"] / base["tokens_per_second"]
            lines.append(f"target {name}: unsloth {fast['tokens_per_second']:.0f} / hf {base['tokens_per_second']:.0f}"
                         f" = {ratio:.2f}x (target >= 1.8x)")
    for way in ("unsloth-qlora", "hf-qlora"):
        run = runs.get(f"llama-3.2-3b {way}", {})
        if "peak_memory_gb" in run and not results["tiny"]:
            lines.append(f"target llama-3.2-3b {way} peak {run['peak_memory_gb']:.2f} GB (target <= 4 GB)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
