"""Real-token throughput of SFT on CPU, three ways, in one run, on the same model and data:

  1. plain TRL SFTTrainer with its defaults (padding to the longest row of each batch),
  2. TRL with its own packing (packing=True, padding_free=True),
  3. this toolkit's defaults (`finetune train`: LoRA, exact assistant-only loss, packed rows),
  and, to separate the effect of LoRA from the data path, 4. this toolkit with method=full.

The model is a random-initialized Llama-architecture model (hidden 256, 4 layers, about 37M parameters, most of them
the tied 128k-token embedding of the real Llama 3.2 tokenizer) trained on GSM8K rendered with the Llama 3.2 chat
template. Every way uses batch 8 (--batch-size), max length 512 and float32 (TRL's own default on CPU is bf16 autocast, which runs
several times slower than float32 on CPUs without bf16 matrix units; the toolkit trains in float32 on CPU). Real tokens are the tokens of the data, not padding; the
real-token fraction is real tokens over the positions the model computed.

    python benchmarks/throughput.py [--steps 5] [--warmup 1] [--batch-size 8] [--json results.json]

Needs ../shared/assets (the Llama 3.2 tokenizer and GSM8K), or $FINETUNE_SHARED_ASSETS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import TrainerCallback

REPO = Path(__file__).resolve().parents[1]
ASSETS = Path(os.environ.get("FINETUNE_SHARED_ASSETS", REPO.parent / "shared" / "assets"))
MAX_LENGTH = 512
MODEL_SIZES = {"bench": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4),
               "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2)}


@dataclass
class Result:
    way: str
    steps: int
    seconds: float
    real_tokens: int
    computed_tokens: int

    @property
    def real_tokens_per_second(self) -> float:
        return self.real_tokens / self.seconds

    @property
    def real_fraction(self) -> float:
        return self.real_tokens / self.computed_tokens


class Meter(TrainerCallback):
    """Times optimizer steps after `warmup` and counts the real and computed tokens of their batches."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.batches: list[tuple[int, int]] = []
        self.seconds = 0.0
        self.real = self.computed = self.steps = 0

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        loader = getattr(train_dataloader, "base_dataloader", train_dataloader)  # accelerate wraps the DataLoader
        collate = loader.collate_fn

        def counted(examples):
            batch = collate(examples)
            if "attention_mask" in batch:
                real = int(batch["attention_mask"].sum())
            elif "num_real_tokens" in batch:
                real = int(batch["num_real_tokens"])
            else:  # TRL's padding-free batches: one sequence, no padding at all
                real = batch["input_ids"].numel()
            self.batches.append((real, batch["input_ids"].numel()))
            return batch

        loader.collate_fn = counted

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        elapsed = time.perf_counter() - self.started
        real, computed = self.batches.pop(0)
        if state.global_step > self.warmup:
            self.seconds += elapsed
            self.real += real
            self.computed += computed
            self.steps += 1

    def result(self, way: str) -> Result:
        return Result(way, self.steps, self.seconds, self.real, self.computed)


def make_model(folder: Path, size: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / "llama-3.2-instruct")
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=True,
                         rope_theta=500000.0, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         **MODEL_SIZES[size])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def gsm8k_rows(rows: int) -> list[dict]:
    with open(ASSETS / "datasets" / "gsm8k" / "train.jsonl", encoding="utf-8") as handle:
        records = [json.loads(line) for _, line in zip(range(rows), handle)]
    return [{"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}
            for r in records]


def run_trl(way: str, model: Path, rows: list[dict], steps: int, warmup: int, batch: int, out: Path,
            **options) -> Result:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    meter = Meter(warmup)
    args = SFTConfig(output_dir=str(out / way), per_device_train_batch_size=batch, max_length=MAX_LENGTH,
                     max_steps=steps + warmup, use_cpu=True, save_strategy="no", report_to="none",
                     disable_tqdm=True, bf16=False, **options)
    trainer = SFTTrainer(model=str(model), args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(model), callbacks=[meter])
    trainer.train()
    return meter.result(way)


def run_toolkit(way: str, model: Path, rows: list[dict], steps: int, warmup: int, batch: int, out: Path,
                *overrides) -> Result:
    from finetune.training.run import run

    data = out / "gsm8k-messages.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    recipe = out / "recipe.yaml"
    recipe.write_text(f"model: {{name_or_path: {model}}}\ndata: {{train: {data}}}\n", encoding="utf-8")
    meter = Meter(warmup)
    run(str(recipe), [f"output_dir={out / way}", f"train.per_device_train_batch_size={batch}",
                      f"train.max_length={MAX_LENGTH}", f"train.max_steps={steps + warmup}",
                      "train.save_strategy=no", "train.disable_tqdm=true", *overrides], callbacks=(meter,))
    return meter.result(way)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="measured steps per way")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    parser.add_argument("--rows", type=int, default=2000, help="GSM8K rows to draw batches from")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step, every way")
    parser.add_argument("--size", choices=MODEL_SIZES, default="bench", help="tiny: a smoke run of the script")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if not (ASSETS / "tokenizers" / "llama-3.2-instruct").is_dir():
        print(f"skipped: {ASSETS} has no Llama 3.2 tokenizer (set FINETUNE_SHARED_ASSETS)", file=sys.stderr)
        return 0

    with tempfile.TemporaryDirectory(prefix="finetune-bench-") as tmp:
        out = Path(tmp)
        model = out / "model"
        make_model(model, args.size)
        rows = gsm8k_rows(args.rows)
        common = (model, rows, args.steps, args.warmup, args.batch_size, out)
        results = [
            run_trl("plain TRL defaults", *common),
            run_trl("TRL packing", *common, packing=True, padding_free=True),
            run_toolkit("finetune defaults", *common),
            run_toolkit("finetune, method=full", *common, "method=full"),
        ]
    baseline = results[0].real_tokens_per_second
    print(f"\n{'way':<24} {'real tok/s':>10} {'real tokens':>11} {'seconds':>8} {'real frac':>9} {'vs plain TRL':>12}")
    for r in results:
        print(f"{r.way:<24} {r.real_tokens_per_second:>10.1f} {r.real_tokens:>11,} {r.seconds:>8.1f} "
              f"{r.real_fraction:>9.1%} {r.real_tokens_per_second / baseline:>11.2f}x")
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "real_tokens_per_second": r.real_tokens_per_second,
                                          "real_fraction": r.real_fraction} for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
