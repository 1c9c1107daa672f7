"""Data preparation at scale: rows per second and peak memory, ours against TRL's own.

Multi-turn conversations (three GSM8K question-answer exchanges each, in varying combinations) rendered with the
real Llama 3.2 tokenizer and chat template, at 2k, 20k and 100k conversations, each case in a fresh process:

  finetune   `prepare()` (exact assistant masks, truncation, packing, the cache on disk), data.num_proc 1 and 2
  TRL        SFTTrainer's dataset preparation with its defaults (chat template, tokenization, loss on every
             token: TRL refuses assistant-only masks with this template), packing, its dataset_num_proc 1 and 2,
             with a tiny model so that the preparation is what is timed

Peak memory is the process's peak resident memory over the preparation, above what it held before it.

    python benchmarks/data_prep.py [--sizes 2000,20000,100000] [--processes 1,2]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import ASSETS, gsm8k_rows  # noqa: E402  (the benchmarks share their data)

TURNS = 3
MAX_LENGTH = 2048


def write_conversations(path: Path, count: int) -> None:
    pairs = [row["messages"] for row in gsm8k_rows(7473)]
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(count):
            messages = [m for pair in rng.sample(pairs, TURNS) for m in pair]
            out.write(json.dumps({"messages": messages}) + "\n")


def measure_finetune(data: str, processes: int, home: str) -> dict:
    import os

    os.environ["FINETUNE_HOME"] = home
    from finetune.data.pipeline import prepare
    from finetune.models.loading import load_tokenizer
    from finetune.recipe.schema import load_recipe
    from finetune.training.probe import _reset_resident_peak, _resident_peak

    tokenizer_folder = ASSETS / "tokenizers" / "llama-3.2-instruct"
    recipe_path = Path(home) / "recipe.yaml"
    recipe_path.write_text(f"model: {{name_or_path: {tokenizer_folder}}}\ndata: {{train: {data}}}\n")
    recipe = load_recipe(recipe_path, [f"data.num_proc={processes}", f"train.max_length={MAX_LENGTH}"])
    tokenizer = load_tokenizer(recipe)
    _reset_resident_peak()
    before = _resident_peak()
    started = time.perf_counter()
    prepared = prepare(recipe, tokenizer, tokenizer.chat_template)
    seconds = time.perf_counter() - started
    return {"rows": prepared.report["rows"]["train"], "seconds": seconds, "memory": _resident_peak() - before}


def measure_trl(data: str, processes: int, scratch: str) -> dict:
    from datasets import load_dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from finetune.training.probe import _reset_resident_peak, _resident_peak

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / "llama-3.2-instruct")
    tokenizer.pad_token = tokenizer.eos_token
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=1))
    dataset = load_dataset("json", data_files=data, split="train", cache_dir=scratch)
    # TRL's default loss (every token): with Llama 3.2's official template TRL refuses assistant_only_loss ("not
    # training-compatible"), so it does less work per row than our exact assistant masks.
    args = SFTConfig(output_dir=scratch, max_length=MAX_LENGTH, dataset_num_proc=processes, packing=True,
                     use_cpu=True, report_to="none")
    _reset_resident_peak()
    before = _resident_peak()
    started = time.perf_counter()
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    seconds = time.perf_counter() - started
    return {"rows": len(dataset), "seconds": seconds, "memory": _resident_peak() - before,
            "packed_rows": len(trainer.train_dataset)}


def run_case(way: str, data: Path, processes: int, scratch: Path) -> dict:
    result = subprocess.run([sys.executable, __file__, "--one", way, str(data), str(processes), str(scratch)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{way} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2000,20000,100000")
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        way, data, processes, scratch = args.one
        measure = measure_finetune if way == "finetune" else measure_trl
        print(json.dumps(measure(data, int(processes), scratch)))
        return 0
    if not (ASSETS / "tokenizers" / "llama-3.2-instruct").is_dir():
        print(f"skipped: {ASSETS} has no Llama 3.2 tokenizer (set FINETUNE_SHARED_ASSETS)", file=sys.stderr)
        return 0
    results = []
    print(f"{'conversations':>13} {'way':<9} {'procs':>5} {'rows/s':>8} {'seconds':>8} {'peak MiB':>9}", flush=True)
    with tempfile.TemporaryDirectory(prefix="finetune-data-prep-") as tmp:
        for size in map(int, args.sizes.split(",")):
            data = Path(tmp) / f"conversations-{size}.jsonl"
            write_conversations(data, size)
            for processes in map(int, args.processes.split(",")):
                for way in ("finetune", "TRL"):
                    scratch = Path(tempfile.mkdtemp(dir=tmp))
                    result = {"size": size, "way": way, "processes": processes,
                              **run_case(way, data, processes, scratch)}
                    results.append(result)
                    print(f"{size:>13,} {way:<9} {processes:>5} {size / result['seconds']:>8,.0f} "
                          f"{result['seconds']:>8.1f} {result['memory'] / 2**20:>9,.0f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
