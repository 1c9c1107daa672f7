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
        [sys.executable, str(REPO / "benchmarks" / "throughput.py"), "--size", "tiny", "--steps", "1", "--rows", "64",
         "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["way"] for r in results] == ["plain TRL defaults", "TRL packing", "finetune defaults",
                                           "finetune, method=full"]
    assert all(r["real_tokens"] > 0 and 0 < r["real_fraction"] <= 1 for r in results)
    assert results[1]["real_fraction"] == 1.0  # padding-free batches have no padding at all
    assert "vs plain TRL" in result.stdout


def test_gpu_check_dry_run_on_cpu(tmp_path):
    """On a CPU the GPU check runs at tiny sizes, measures the transformers ways and says why Unsloth is skipped."""
    asset("tokenizers/llama-3.2-instruct")
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path), "--tiny",
         "--models", "llama-3.2-3b", "--steps", "1", "--warmup", "1"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert runs["llama-3.2-3b unsloth-qlora"] == {"skipped": "Unsloth needs a CUDA GPU"}
    for way in ("hf-qlora", "hf-lora"):
        assert runs[f"llama-3.2-3b {way}"]["tokens_per_second"] > 0
        assert runs[f"llama-3.2-3b {way}"]["peak_memory_gb"] > 0
    assert "llama-3.2-3b hf-qlora" in result.stdout and "tokens/s" in result.stdout
