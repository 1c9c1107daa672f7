"""The time plan against measurement: `finetune estimate --probe`'s planned run time beside the run's own.

Each case plans with `finetune estimate RECIPE --device cpu --probe` (two probe steps measure this machine's speed
on the recipe's longest batch; the plan counts the FLOPs of every step from the prepared data), then trains with
`finetune train` and takes the trainer's elapsed time from progress.jsonl (loading the model and preparing the data
come before it, as in the plan). Cases:

  quickstart           the README's quickstart: full fine-tune of the builtin tiny Llama, packed rows of 256 tokens
  bench-lora-512       the throughput benchmark's model (Llama architecture, 37M parameters, the real Llama 3.2
                       tokenizer) with LoRA on GSM8K, packed rows of 512 tokens
  bench-full-512       the same, full fine-tuning
  bench-lora-1024      LoRA at 1024 tokens
  quickstart-ddp2      the quickstart on two DDP processes (accelerate_configs/cpu_ddp_2proc), which share the cores
  bench-lora-512-ddp2  bench-lora-512 on two DDP processes

Target: the planned run time within 20% of the measured one. The FLOP count itself is checked against
torch.utils.flop_counter in tests/test_time_plan.py.

    python benchmarks/time_plan.py [--cases quickstart,bench-lora-512] [--size tiny --steps 3 --rows 64]
                                   [--json results.json]

Needs ../shared/assets (the Llama 3.2 tokenizer and GSM8K), or $FINETUNE_SHARED_ASSETS.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import ASSETS, MODEL_SIZES, gsm8k_rows, make_model  # noqa: E402  (the benchmarks share their model and data)

BENCH = ["train.per_device_train_batch_size=8", "train.eval_strategy=no", "train.eval_on_start=false",
         "train.save_strategy=no", "train.logging_steps=5", "data.eval_fraction=0"]
CASES = {
    "quickstart": ["quickstart"],
    "bench-lora-512": ["BENCH", "method=lora", "train.max_length=512", "train.max_steps=20", *BENCH],
    "bench-full-512": ["BENCH", "method=full", "train.max_length=512", "train.max_steps=15", *BENCH],
    "bench-lora-1024": ["BENCH", "method=lora", "train.max_length=1024", "train.max_steps=8", *BENCH],
    "quickstart-ddp2": ["quickstart"],
    "bench-lora-512-ddp2": ["BENCH", "method=lora", "train.max_length=512", "train.max_steps=10", *BENCH],
}
LAUNCHES = {name: ["--accelerate-config", "cpu_ddp_2proc"] for name in CASES if name.endswith("-ddp2")}
TARGET = 0.20
RUN_TIME = re.compile(r"run time\s+(?:(\d+)h(\d+)m|(\d+)m(\d+)s|([\d.]+) s|([\d,.]+) ms)")


def planned_seconds(text: str) -> float:
    """The plan's run time as `finetune estimate` prints it: 1h05m, 4m07s, 4.51 s or 729 ms."""
    hours, minutes_h, minutes, seconds, short, milliseconds = RUN_TIME.search(text).groups()
    if hours:
        return int(hours) * 3600 + int(minutes_h) * 60
    if minutes:
        return int(minutes) * 60 + int(seconds)
    return float(short) if short else float(milliseconds.replace(",", "")) / 1000


def finetune(*args: str, cwd: Path) -> str:
    result = subprocess.run([sys.executable, "-m", "finetune", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"finetune {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def run_case(name: str, folder: Path, bench_recipe: Path, steps: int | None) -> dict:
    recipe, *overrides = CASES[name]
    if recipe == "BENCH":
        recipe = str(bench_recipe)
    if steps:
        overrides.append(f"train.max_steps={steps}")
    launch = LAUNCHES.get(name, [])
    plan = finetune("estimate", recipe, *overrides, *launch, "--device", "cpu", "--probe", cwd=folder)
    run = folder / f"run-{name}"
    finetune("train", recipe, *overrides, f"output_dir={run}", *launch, cwd=folder)
    rows = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]
    measured = max(row["elapsed_s"] for row in rows if "elapsed_s" in row)
    planned = planned_seconds(plan)
    speed = next(line.split("speed", 1)[1].strip() for line in plan.splitlines() if line.lstrip().startswith("speed"))
    return {"case": name, "planned_s": planned, "measured_s": measured, "off": (planned - measured) / measured,
            "speed": speed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--size", choices=MODEL_SIZES, default="bench", help="tiny: a smoke run of the script")
    parser.add_argument("--steps", type=int, help="train this many steps in every case (a smoke run)")
    parser.add_argument("--rows", type=int, default=2000, help="GSM8K rows the bench model trains on")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if not (ASSETS / "tokenizers" / "llama-3.2-instruct").is_dir():
        print(f"skipped: {ASSETS} has no Llama 3.2 tokenizer (set FINETUNE_SHARED_ASSETS)", file=sys.stderr)
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="finetune-time-plan-") as tmp:
        folder = Path(tmp)
        make_model(folder / "model", args.size)
        data = folder / "gsm8k.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in gsm8k_rows(args.rows)), encoding="utf-8")
        bench_recipe = folder / "bench.yaml"
        bench_recipe.write_text(f"model: {{name_or_path: {folder / 'model'}}}\ndata: {{train: {data}}}\n")
        for name in args.cases.split(","):
            results.append(run_case(name, folder, bench_recipe, args.steps))
            result = results[-1]
            print(f"{name:<20} planned {result['planned_s']:>7,.0f} s  measured {result['measured_s']:>7,.1f} s  "
                  f"off {result['off']:+.1%}  ({result['speed']})", flush=True)
    missed = [r["case"] for r in results if abs(r["off"]) > TARGET]
    print(f"\ntarget: within {TARGET:.0%}; " + (f"missed: {', '.join(missed)}" if missed else "all within"))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
