"""The benchmark scripts run end to end (at a tiny size: their figures are for the closing note, not for asserts)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, asset

pytestmark = pytest.mark.integration


def benchmark(script: str, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, object]:
    """`python benchmarks/SCRIPT ARGS --json OUT` on the shared Llama 3.2 tokenizer and GSM8K, its main() called in
    this process (what the script's own runs need apart, it starts itself): (its run, its JSON)."""
    asset("tokenizers/llama-3.2-instruct")
    asset("datasets/gsm8k/train.jsonl")
    name = f"benchmark_{Path(script).stem}"
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / script)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        try:
            code = module.main([*args, "--json", str(out)])
        except SystemExit as stop:  # the scripts' way to fail with a message
            code = stop.code if isinstance(stop.code, int) else 1
            errors.write(str(stop.code))
    result = subprocess.CompletedProcess(["python", f"benchmarks/{script}", *args], code, printed.getvalue(),
                                         errors.getvalue())
    return result, json.loads(out.read_text()) if out.is_file() else None


def test_throughput_script_runs_all_ways(tmp_path):
    result, results = benchmark("throughput.py", tmp_path / "results.json", "--size", "tiny", "--steps", "1",
                                "--warmup", "0", "--rows", "64", "--batch-size", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["way"] for r in results] == ["plain TRL defaults", "TRL packing", "finetune defaults",
                                           "finetune, method=full"]
    assert all(r["real_tokens"] > 0 and 0 < r["real_fraction"] <= 1 for r in results)
    assert results[1]["real_fraction"] == 1.0  # padding-free batches have no padding at all
    assert "vs plain TRL" in result.stdout


def test_time_plan_script_puts_the_planned_run_time_beside_the_measured(tmp_path):
    result, results = benchmark("time_plan.py", tmp_path / "results.json", "--cases", "quickstart", "--size", "tiny",
                                "--steps", "2", "--rows", "32")
    assert result.returncode == 0, result.stderr[-3000:]
    [case] = results
    assert case["case"] == "quickstart" and case["planned_s"] > 0 and case["measured_s"] > 0
    assert case["speed"].startswith("measured: ") and "--probe: " in case["speed"]
    line = next(line for line in result.stdout.splitlines() if line.startswith("quickstart"))
    assert f"off {case['off']:+.1%}" in line and "target: within 20%" in result.stdout


def test_memory_script_puts_the_plan_beside_the_measure(tmp_path):
    result, [case] = benchmark("memory.py", tmp_path / "memory.json", "--sizes", "tiny", "--lengths", "128",
                               "--methods", "lora-fp32", "--checkpointing", "on")
    assert result.returncode == (0 if case["within"] else 1), result.stderr[-3000:]  # 1: a case off its target
    assert case["measured"] == max(case["measured_steps"], case["measured_loading"]) > 0
    assert case["planned"] == max(case["planned_steps"], case["planned_loading"]) > 0
    row = next(line.split() for line in result.stdout.splitlines() if line.startswith("tiny"))
    assert row[3:6] == ["1", "x", "128"] and row[6:] == [f"{case[key] / 2**30:.2f}Gi" for key in ("planned_steps", "measured_steps", "planned_loading",
                                                                 "measured_loading")] + [f"{case['off']:+.1%}"]


def test_generation_script_gives_the_same_answers_batched(tmp_path):
    result, results = benchmark("generation.py", tmp_path / "generation.json", "--size", "tiny", "--prompts", "6",
                                "--batch-size", "4", "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr[-3000:]
    assert results["same_answers"] is True and results["generated_tokens"] == 6 * 8
    assert results["one_at_a_time_s"] > 0 and results["batch_4_s"] > 0
    assert f"speedup: {results['one_at_a_time_s']:.2f} / {results['batch_4_s']:.2f} = {results['speedup']}x; " \
           "same answers: True" in result.stdout


def test_serve_script_times_batched_against_one_at_a_time(tmp_path):
    result, results = benchmark("serve.py", tmp_path / "serve.json", "--clients", "2", "--max-tokens", "4")
    assert result.returncode in (0, 1), result.stderr[-3000:]  # 1: batched under its target, at this tiny size
    assert results["tokens"] == 2 * 4 and results["one_at_a_time_s"] > 0 and results["batched_s"] > 0
    assert f"{results['one_at_a_time_s']:.2f} / {results['batched_s']:.2f} = {results['speedup']}x" in result.stdout


def test_data_prep_script_prepares_and_resumes(tmp_path):
    """(Its DDP training comparison, two 2-process runs, is left to the script's own runs: minutes of CI.)"""
    result, results = benchmark("data_prep.py", tmp_path / "data_prep.json", "--sizes", "300,600", "--trl-max", "300",
                                "--train-steps", "0", "--checks", "300")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(r["size"], r["way"]) for r in results["prepare"]] == [
        (300, "finetune"), (300, "no checks"), (300, "TRL"), (600, "finetune"), (600, "no checks")]
    assert all(r["seconds"] > 0 and r["disk"] > 0 and r["peak_memory"] > 0 for r in results["prepare"])
    checks = results["checks"]
    assert checks["size"] == 300 and checks["with"]["seconds"] > 0 and checks["without"]["seconds"] > 0
    assert "data checks on 300 conversations: " in result.stdout
    assert results["train"] is None and set(results["resume"]["seconds"]) == {"10", "10000"}
    assert "resume at step 10,000" in result.stdout
