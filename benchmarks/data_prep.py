"""Data preparation at scale: rows per second, peak memory and disk, ours against TRL's own; training from the
prepared shards against training from the data file; the time a resume takes to reach its batch.

Multi-turn conversations (three GSM8K question-answer exchanges each, in varying combinations) rendered with the
real Llama 3.2 tokenizer and chat template, each case in a fresh process:

  prepare    finetune `prepare --out` (exact assistant masks, truncation, packing, Arrow shards on disk; with its
             default data checks, and without them: "no checks", TRL's work) against
             TRL's SFTTrainer dataset preparation with its defaults (chat template, tokenization, loss on every
             token: TRL refuses assistant-only masks with this template; packing), on --processes processes each
             (data.num_proc, dataset_num_proc), at each of --sizes conversations (TRL up to --trl-max). Both from
             the JSON lines file: TRL's time includes load_dataset reading it into Arrow, printed apart. Peak memory:
             the preparing process's resident peak, and above what it held before, and the largest worker's peak.
  train      two DDP processes on the CPU train the throughput benchmark's tiny model for --train-steps steps on
             the first size's conversations, from data.train (the preparation training does itself) and from
             data.prepared (the shards): tokens per second of each, after the first steps.
  resume     on the largest prepared size, the time from a resume's position (global batch 16) at step 10 and at
             step 10,000 to its first batch of rows: the position is the sampler's, so no batch before it is read.

  checks     `prepare` of --checks conversations with the data checks off, and on (duplicates, and contamination
             against GSM8K's test set): the seconds and memory they add.

    python benchmarks/data_prep.py [--sizes 20000,200000,2000000] [--processes 2] [--trl-max 200000] [--checks N]
                                   [--ways "finetune,no checks,TRL"]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import ASSETS, REPO, gsm8k_rows, make_model  # noqa: E402  (the benchmarks share their data)

TURNS = 3
# each way of preparing: what runs it, with which overrides (the data checks are on by default; TRL has none)
WAYS = {"finetune": ("finetune", []), "no checks": ("finetune", ["data.duplicates=unchecked"]), "TRL": ("TRL", [])}
MAX_LENGTH = 2048
TRAIN_MAX_LENGTH = 512
GLOBAL_BATCH = 16
TOKENIZER = ASSETS / "tokenizers" / "llama-3.2-instruct"


def write_conversations(path: Path, count: int) -> None:
    pairs = [row["messages"] for row in gsm8k_rows(7473)]
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(count):
            messages = [m for pair in rng.sample(pairs, TURNS) for m in pair]
            out.write(json.dumps({"messages": messages}) + "\n")


def _peaks(before: int) -> dict:
    from finetune.training.probe import _resident_peak

    return {"peak_memory": _resident_peak(), "memory": _resident_peak() - before,
            "workers_memory": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


def _disk(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def measure_finetune(data: str, processes: int, scratch: str, *overrides: str) -> dict:
    os.environ["FINETUNE_HOME"] = scratch
    from finetune.data.pipeline import prepare_into
    from finetune.data.prepared_folder import read_report
    from finetune.models.loading import load_tokenizer
    from finetune.recipe.schema import load_recipe
    from finetune.training.probe import _reset_resident_peak, _resident_peak

    recipe_path = Path(scratch) / "recipe.yaml"
    recipe_path.write_text(f"model: {{name_or_path: {TOKENIZER}}}\ndata: {{train: {data}}}\n")
    recipe = load_recipe(recipe_path, [f"data.num_proc={processes}", f"train.max_length={MAX_LENGTH}", *overrides])
    tokenizer = load_tokenizer(recipe)
    _reset_resident_peak()
    before = _resident_peak()
    started = time.perf_counter()
    folder = Path(scratch) / "prepared"
    report = read_report(prepare_into(recipe, tokenizer, tokenizer.chat_template, str(folder))[0])
    seconds = time.perf_counter() - started
    return {"rows": report["rows"]["train"], "seconds": seconds, **_peaks(before), "disk": _disk(folder),
            "folder": str(folder)}


def measure_trl(data: str, processes: int, scratch: str) -> dict:
    from datasets import load_dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from finetune.training.probe import _reset_resident_peak, _resident_peak

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.pad_token = tokenizer.eos_token
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=1))
    cache = Path(scratch) / "cache"
    # TRL's default loss (every token): with Llama 3.2's official template TRL refuses assistant_only_loss ("not
    # training-compatible"), so it does less work per row than our exact assistant masks.
    args = SFTConfig(output_dir=scratch, max_length=MAX_LENGTH, dataset_num_proc=processes, packing=True,
                     use_cpu=True, report_to="none")
    _reset_resident_peak()
    before = _resident_peak()
    started = time.perf_counter()
    # from the data file, as ours: loading the JSON lines into Arrow is part of TRL's preparation
    dataset = load_dataset("json", data_files=data, split="train", cache_dir=str(cache))
    loaded = time.perf_counter()
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    seconds = time.perf_counter() - started
    return {"rows": len(dataset), "seconds": seconds, "load_seconds": loaded - started, **_peaks(before),
            "disk": _disk(cache), "packed_rows": len(trainer.train_dataset)}


def measure_resume(folder: str, steps: str) -> dict:
    """Seconds from a resume's position at each step to its first global batch of rows, as training does it: the
    rows' lengths for the sampler, its order from the batch on, the rows read from the memory-mapped shards. Each
    from a cold page cache (the shards' pages dropped first, where posix_fadvise can), as on a fresh machine."""
    import datasets  # noqa: F401  (imported before the clock starts, as a resuming run has it before its data)
    import pyarrow.compute as pc

    from finetune.data.prepared_folder import load
    from finetune.data.sampler import SimilarLengthSampler

    seconds = {}
    for step in map(int, steps.split(",")):
        for shard in Path(folder).rglob("*.arrow"):
            if hasattr(os, "posix_fadvise"):
                descriptor = os.open(shard, os.O_RDONLY)
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(descriptor)
        started = time.perf_counter()
        train = load(Path(folder)).train
        lengths = pc.list_value_length(train.with_format("arrow")[:]["input_ids"]).to_pylist()
        sampler = SimilarLengthSampler(lengths, GLOBAL_BATCH, seed=42)
        epoch, batch = divmod(step, len(sampler) // GLOBAL_BATCH)
        sampler.set_epoch(epoch)
        sampler.start_at(epoch, batch)
        order = iter(sampler)
        first = [next(order) for _ in range(GLOBAL_BATCH)]
        rows = train[first]["input_ids"]
        seconds[step] = time.perf_counter() - started
        assert len(rows) == GLOBAL_BATCH
    return {"rows": len(lengths), "seconds": seconds}


def time_checks(tmp: Path, size: int, processes: int) -> dict:
    """`prepare` with the data checks off, and with them on (duplicates, and contamination against GSM8K's test set):
    the seconds and peak memory the checks add."""
    data = tmp / "checks" / "conversations.jsonl"
    data.parent.mkdir()
    write_conversations(data, size)
    ways = {"without": ["data.duplicates=unchecked"],
            "with": ["data.duplicates=report", f"data.decontaminate=[{ASSETS / 'datasets' / 'gsm8k' / 'test.jsonl'}]",
                     "data.contaminated=report"]}
    found = {way: run_case("finetune", str(data), str(processes), tempfile.mkdtemp(dir=tmp), *overrides)
             for way, overrides in ways.items()}
    added = found["with"]["seconds"] - found["without"]["seconds"]
    print(f"\ndata checks on {size:,} conversations: {added:,.1f} s beyond the preparation's "
          f"{found['without']['seconds']:,.1f} s ({found['with']['seconds']:,.1f} s with them); peak memory "
          f"{found['without']['peak_memory'] / 2**20:,.0f} MiB without, {found['with']['peak_memory'] / 2**20:,.0f} "
          "MiB with", flush=True)
    data.unlink()
    return {"size": size, **{way: {key: value for key, value in result.items() if key != "folder"}
                             for way, result in found.items()}}


def train_tokens_per_second(data: Path, steps: int, scratch: Path) -> tuple[float, float]:
    """Mean tokens/s over the logged steps after the first two of 2-process DDP runs on the CPU: (from the data
    file, from the shards `finetune prepare` wrote for the same recipe)."""
    model = scratch / "model"
    make_model(model, "tiny")
    recipe = scratch / "recipe.yaml"
    recipe.write_text(f"model: {{name_or_path: {model}}}\ndata: {{train: {data}}}\n")
    settings = [f"train.max_length={TRAIN_MAX_LENGTH}", "data.eval_fraction=0"]
    training = [f"train.max_steps={steps}", "train.per_device_train_batch_size=4",
                "train.gradient_accumulation_steps=2", "train.logging_steps=1", "train.save_strategy=no",
                "train.eval_strategy=no", "train.eval_on_start=false"]
    shards = scratch / "shards"
    finetune(scratch, "prepare", str(recipe), *settings, "--out", str(shards))
    speeds = []
    for way, extra in (("from-data", []), ("from-prepared", [f"data.prepared={shards}"])):
        finetune(scratch, "train", str(recipe), "--accelerate-config", "cpu_ddp_2proc", f"output_dir={scratch / way}",
                 *settings, *training, *extra)
        rows = [json.loads(line) for line in (scratch / way / "progress.jsonl").read_text().splitlines()]
        speeds.append(statistics.mean(row["tokens_per_second"] for row in rows if "loss" in row and row["step"] > 2))
    return speeds[0], speeds[1]


def finetune(scratch: Path, *arguments: str) -> None:
    result = subprocess.run([sys.executable, "-m", "finetune", *arguments], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "FINETUNE_HOME": str(scratch / "home")})
    if result.returncode != 0:
        raise SystemExit(f"finetune {arguments[0]} failed:\n{result.stderr[-3000:]}")


def run_case(*arguments: str) -> dict:
    result = subprocess.run([sys.executable, __file__, "--one", *arguments], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{arguments[0]} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="20000,200000,2000000")
    parser.add_argument("--processes", default="2")
    parser.add_argument("--trl-max", type=int, default=200000, help="the largest size TRL prepares too")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"the ways to prepare, of {', '.join(WAYS)}")
    parser.add_argument("--train-steps", type=int, default=12, help="0: no training comparison")
    parser.add_argument("--resume-steps", default="10,10000")
    parser.add_argument("--checks", type=int, default=100000,
                        help="conversations the data checks are timed on (0: none)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    ways = args.ways.split(",")
    if not set(ways) <= set(WAYS):
        parser.error(f"--ways: {args.ways} (the ways are {', '.join(WAYS)})")
    if args.one:
        way, *rest = args.one
        measure = {"finetune": measure_finetune, "TRL": measure_trl, "resume": measure_resume}[way]
        print(json.dumps(measure(*rest) if way == "resume" else measure(rest[0], int(rest[1]), *rest[2:])))
        return 0
    if not TOKENIZER.is_dir():
        print(f"skipped: {ASSETS} has no Llama 3.2 tokenizer (set FINETUNE_SHARED_ASSETS)", file=sys.stderr)
        return 0
    results = {"prepare": [], "train": None, "resume": None}
    print(f"{'conversations':>13} {'way':<9} {'procs':>5} {'rows/s':>8} {'seconds':>8} {'peak MiB':>9} "
          f"{'added MiB':>9} {'worker MiB':>10} {'disk MiB':>9}", flush=True)
    with tempfile.TemporaryDirectory(prefix="finetune-data-prep-") as tmp:
        sizes = list(map(int, args.sizes.split(",")))
        for size in sizes:
            data = Path(tmp) / f"conversations-{size}.jsonl"
            write_conversations(data, size)
            for processes in map(int, args.processes.split(",")):
                for way in [way for way in ways if way != "TRL" or size <= args.trl_max]:
                    scratch = Path(tempfile.mkdtemp(dir=tmp))
                    kind, overrides = WAYS[way]
                    result = {"size": size, "way": way, "processes": processes,
                              **run_case(kind, str(data), str(processes), str(scratch), *overrides)}
                    results["prepare"].append(result)
                    print(f"{size:>13,} {way:<9} {processes:>5} {size / result['seconds']:>8,.0f} "
                          f"{result['seconds']:>8.1f} {result['peak_memory'] / 2**20:>9,.0f} "
                          f"{result['memory'] / 2**20:>9,.0f} "
                          f"{result['workers_memory'] / 2**20:>10,.0f} {result['disk'] / 2**20:>9,.0f}"
                          + (f"  ({result['load_seconds']:.1f} s of it load_dataset)" if way == "TRL" else ""),
                          flush=True)
            if size != sizes[-1]:
                data.unlink()
        ours = [r for r in results["prepare"] if r["way"] != "TRL"]
        if args.train_steps:
            first = Path(tmp) / "train"
            first.mkdir()
            data = first / "conversations.jsonl"
            write_conversations(data, sizes[0])
            from_data, from_shards = train_tokens_per_second(data, args.train_steps, first)
            results["train"] = {"from_data": from_data, "from_prepared": from_shards}
            print(f"\ntraining on 2 DDP processes, {sizes[0]:,} conversations: {from_shards:,.0f} tokens/s from "
                  f"the prepared shards, {from_data:,.0f} from the data file ({from_shards / from_data:.2f}x)")
        if args.checks:
            results["checks"] = time_checks(Path(tmp), args.checks, int(args.processes.split(",")[0]))
        if ours:
            resume = results["resume"] = run_case("resume", ours[-1]["folder"], args.resume_steps)
            for step, seconds in resume["seconds"].items():
                print(f"resume at step {int(step):,} ({resume['rows']:,} rows, global batch {GLOBAL_BATCH}): first "
                      f"batch after {seconds:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
