"""The benchmark script runs end to end (at a tiny size: its figures are for the closing note, not for asserts)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, asset

pytestmark = pytest.mark.integration


def test_throughput_script_runs_all_ways(tmp_path):
    asset("tokenizers/llama-3.2-instruct")
    asset("datasets/gsm8k/train.jsonl")
    out = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "throughput.py"), "--size", "tiny", "--steps", "1", "--warmup", "0",
         "--rows", "64", "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["way"] for r in results] == ["plain TRL defaults", "TRL packing", "finetune defaults",
                                           "finetune, method=full"]
    assert all(r["real_tokens"] > 0 and 0 < r["real_fraction"] <= 1 for r in results)
    assert results[1]["real_fraction"] == 1.0  # padding-free batches have no padding at all
    assert "vs plain TRL" in result.stdout



def test_memory_script_puts_the_plan_beside_the_measure(tmp_path):
    asset("tokenizers/llama-3.2-instruct")
    asset("datasets/gsm8k/train.jsonl")
    out = tmp_path / "memory.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "memory.py"), "--sizes", "tiny", "--lengths", "128",
         "--methods", "lora-fp32", "--checkpointing", "on", "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    [case] = json.loads(out.read_text())
    assert result.returncode == (0 if case["within"] else 1), result.stderr[-3000:]  # 1: a case off its target
    assert case["planned"] > 0 and case["measured"] > 0
    row = next(line.split() for line in result.stdout.splitlines() if line.startswith("tiny"))
    assert row[4:] == [f"{case['planned'] / 2**30:.2f}Gi", f"{case['measured'] / 2**30:.2f}Gi", f"{case['off']:+.1%}"]


def test_generation_script_gives_the_same_answers_batched(tmp_path):
    asset("tokenizers/llama-3.2-instruct")
    asset("datasets/gsm8k/train.jsonl")
    out = tmp_path / "generation.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "generation.py"), "--size", "tiny", "--prompts", "6",
         "--batch-size", "4", "--max-new-tokens", "8", "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["same_answers"] is True and results["generated_tokens"] == 6 * 8
    assert results["one_at_a_time_s"] > 0 and results["batch_4_s"] > 0
    assert f"speedup: {results['one_at_a_time_s']:.2f} / {results['batch_4_s']:.2f} = {results['speedup']}x; " \
           "same answers: True" in result.stdout
