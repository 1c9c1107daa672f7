"""The memory plan against measurement: `finetune estimate`'s figure beside the peak of real training steps.

Random-initialized models with the real Llama 3.2 tokenizer, of three families: Llama (tied 128k embeddings) at
three sizes up to the Llama-3.2-1B shape; Qwen 2.5 (q/k/v biases, 2 KV heads, a 152k vocabulary) at its 1.5B
shape and Qwen 3 (q/k norms) at its 1.7B; Gemma 3 (a 262k vocabulary, sandwich norms, q/k norms, sliding-window
layers) at its 1B, trained on GSM8K packed into full rows of max_length tokens, two steps, each case in a fresh
process, the weights saved in bf16 as released checkpoints are:

  methods   LoRA fp32, LoRA bf16 (autocast), QLoRA (NF4 base)
  gradient checkpointing on and off
  max_length 512 and 2048; rows per step 1 (--batches 1,2 adds two)

On the CPU the measure is the process's peak resident memory, while the weights load and in the steps (the
`--device cpu` plan: its loading line and its total; the target compares the higher of each); on a GPU,
torch.cuda.max_memory_allocated in the steps (the plan's tensors). Target: within 15%.

`--compare-trl` instead trains the 1B shape at max_length 4096 with LoRA twice, once through `finetune train` and
once with TRL's SFTTrainer + PEFT with their defaults (same LoRA, the same conversations of 20 GSM8K exchanges,
longer than 4096 tokens, fp32 and gradient checkpointing for both), and prints both peaks.

    python benchmarks/memory.py [--sizes small,medium,1b,qwen2.5-1.5b,qwen3-1.7b,gemma3-1b] [--lengths 512,2048]
                                [--batches 1,2] [--methods lora-fp32,lora-bf16,qlora] [--checkpointing on,off]
    python benchmarks/memory.py --compare-trl [--sizes 1b]

Needs ../shared/assets (the Llama 3.2 tokenizer and GSM8K), or $FINETUNE_SHARED_ASSETS.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import ASSETS, gsm8k_rows  # noqa: E402  (the benchmarks share their data)

SIZES = {  # Llama's (with the tokenizer's vocabulary), or ("family", changes) of finetune/models/architectures.py
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32),  # a smoke run of the script
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),
    "medium": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),  # Llama-3.2-1B
    "qwen2.5-1.5b": ("qwen2.5", {}),
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8)),
    "gemma3-1b": ("gemma3", {}),
}
METHODS = {
    "lora-fp32": ["method=lora", "train.bf16=false"],
    "lora-bf16": ["method=lora", "train.bf16=true"],
    "qlora": ["method=qlora", "train.bf16=false"],
}
TARGET = 0.15


def make_model(folder: Path, size: str) -> None:
    """The size's model, its own vocabulary kept (the Llama tokenizer's ids are all inside it), saved in bf16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from finetune.models.architectures import FAMILIES

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / "llama-3.2-instruct")
    ends = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if isinstance(SIZES[size], tuple):
        family, changes = SIZES[size]
        config = FAMILIES[family](**changes, **ends)
    else:
        config = LlamaConfig(vocab_size=len(tokenizer), rope_theta=500000.0, max_position_embeddings=8192,
                             tie_word_embeddings=True, **ends, **SIZES[size])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_data(folder: Path, rows: int, turns: int = 1) -> Path:
    """GSM8K as conversations of `turns` question-answer pairs (20 pairs: longer than 4096 tokens)."""
    pairs = gsm8k_rows(rows * turns)
    conversations = [{"messages": [m for pair in pairs[i:i + turns] for m in pair["messages"]]}
                     for i in range(0, len(pairs), turns)]
    data = folder / f"gsm8k-{turns}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in conversations), encoding="utf-8")
    return data


def case_overrides(method: str, checkpointing: bool, length: int, rows: int = 1) -> list[str]:
    return [*METHODS[method], f"train.gradient_checkpointing={str(checkpointing).lower()}",
            f"train.max_length={length}", f"train.per_device_train_batch_size={rows}", "train.packing=true",
            "lora.r=16", "lora.dropout=0.0", "train.disable_tqdm=true"]


def measure_one(recipe: str, overrides: list[str]) -> dict:
    """In this process: the plan for this machine, then the probe's two steps."""
    import torch

    from finetune.models import backends
    from finetune.models.loading import model_config
    from finetune.plan import devices, memory_plan, shapes
    from finetune.recipe.schema import load_recipe
    from finetune.training.probe import probe

    backends.import_first(recipe, overrides)
    loaded = load_recipe(recipe, overrides)
    here = devices.this_machine(cpu=not torch.cuda.is_available())
    plan = memory_plan.plan(loaded, shapes.model_shape(model_config(loaded), loaded), here,
                            memory_plan.launch_of(None, 1), loaded.train_setting("per_device_train_batch_size"))
    measured = probe(recipe, overrides)
    return {"planned": plan.measurable(), "measured": max(measured.peak, measured.loading),
            "planned_steps": plan.tensors() if here.cuda else plan.total(), "measured_steps": measured.peak,
            "planned_loading": plan.loading, "measured_loading": measured.loading}


def run_case(recipe: Path, overrides: list[str]) -> dict:
    result = subprocess.run([sys.executable, __file__, "--one", str(recipe), *overrides],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"case failed: {' '.join(overrides)}\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def compare_trl_one(model: str, data: str, length: int) -> dict:
    """TRL's SFTTrainer + PEFT with their defaults, the same LoRA (r 16, all-linear) and data: its peak."""
    from datasets import load_dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from finetune.training.probe import PROBE_STEPS, PeakMemory

    meter = PeakMemory()
    with tempfile.TemporaryDirectory() as scratch:
        args = SFTConfig(output_dir=scratch, max_length=length, per_device_train_batch_size=1, max_steps=PROBE_STEPS,
                         save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=True,
                         bf16=False, use_cpu=True)
        trainer = SFTTrainer(model=model, args=args, train_dataset=load_dataset("json", data_files=data)["train"],
                             peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                    task_type="CAUSAL_LM"), callbacks=[meter])
        trainer.train()
    return {"measured": meter.peak}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,medium,1b", help="with --compare-trl: the last one (1b)")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--batches", default="1", help="rows per step, comma-separated")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--checkpointing", default="on,off")
    parser.add_argument("--compare-trl", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--one", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--trl-one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one[0], args.one[1:])))
        return 0
    if args.trl_one:
        print(json.dumps(compare_trl_one(args.trl_one[0], args.trl_one[1], int(args.trl_one[2]))))
        return 0
    if not (ASSETS / "tokenizers" / "llama-3.2-instruct").is_dir():
        print(f"skipped: {ASSETS} has no Llama 3.2 tokenizer (set FINETUNE_SHARED_ASSETS)", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory(prefix="finetune-memory-") as tmp:
        out = Path(tmp)
        if args.compare_trl:
            results = compare_trl(out, write_data(out, 8, turns=20), args.sizes.split(",")[-1])
        else:
            results = sweep(out, write_data(out, 400), args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r.get("within", True) for r in results) else 1


def sweep(out: Path, data: Path, args) -> list[dict]:
    results = []
    print(f"{'size':<12} {'method':<10} {'ckpt':<5} {'rows x length':>13} {'steps: planned':>15} {'measured':>9} "
          f"{'loading: planned':>17} {'measured':>9} {'peak: off':>10}", flush=True)
    for size in args.sizes.split(","):
        model = out / size
        make_model(model, size)
        recipe = out / f"{size}.yaml"
        recipe.write_text(f"model: {{name_or_path: {model}}}\ndata: {{train: {data}}}\n", encoding="utf-8")
        cases = [(rows, length, method, checkpointing) for rows in map(int, args.batches.split(","))
                 for length in map(int, args.lengths.split(",")) for method in args.methods.split(",")
                 for checkpointing in (c == "on" for c in args.checkpointing.split(","))]
        for rows, length, method, checkpointing in cases:
            result = run_case(recipe, case_overrides(method, checkpointing, length, rows))
            off = (result["planned"] - result["measured"]) / result["measured"]
            row = {"size": size, "method": method, "checkpointing": checkpointing, "rows": rows,
                   "max_length": length, **result, "off": off, "within": abs(off) <= TARGET}
            results.append(row)
            gib = {key: f"{value / 2**30:.2f}Gi" for key, value in result.items()}
            print(f"{size:<12} {method:<10} {'on' if checkpointing else 'off':<5} {f'{rows} x {length}':>13} "
                  f"{gib['planned_steps']:>15} {gib['measured_steps']:>9} {gib['planned_loading']:>17} "
                  f"{gib['measured_loading']:>9} {off:>+10.1%}"
                  f"{'' if row['within'] else '  (outside the target)'}", flush=True)
        for path in model.iterdir():
            path.unlink()
    return results


def compare_trl(out: Path, data: Path, size: str) -> list[dict]:
    """Our peak against TRL + PEFT's at max_length 4096 (LoRA, one row per step)."""
    model = out / size
    make_model(model, size)
    recipe = out / f"{size}.yaml"
    recipe.write_text(f"model: {{name_or_path: {model}}}\ndata: {{train: {data}}}\n", encoding="utf-8")
    ours = run_case(recipe, case_overrides("lora-fp32", True, 4096))
    theirs = subprocess.run([sys.executable, __file__, "--trl-one", str(model), str(data), "4096"],
                            capture_output=True, text=True)
    if theirs.returncode != 0:
        raise SystemExit(f"TRL case failed\n{theirs.stderr[-3000:]}")
    trl = json.loads(theirs.stdout.strip().splitlines()[-1])
    print(f"peak at max_length 4096, {size} shape, LoRA r 16: finetune {ours['measured'] / 2**30:.2f} GiB, "
          f"TRL + PEFT defaults {trl['measured'] / 2**30:.2f} GiB", flush=True)
    return [{"way": "finetune", **ours}, {"way": "TRL + PEFT", **trl, "within": ours["measured"] <= trl["measured"]}]


if __name__ == "__main__":
    sys.exit(main())
