"""Ray Train as the engine, on a local Ray: two workers train like two accelerate processes and like one process
with the same global batch, and a worker killed mid-run is started again by Ray and the run resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import EQUAL_BATCH_EPOCH, run_cli
from tests.test_training import adapter, losses, progress

pytestmark = pytest.mark.integration


def test_two_ray_workers_train_like_ddp_and_survive_a_killed_worker(equal_batch_runs, tmp_path):
    pytest.importorskip("ray.train", reason="the ray extra is not installed")
    run, ready = tmp_path / "ray-run", tmp_path / "killed"
    env = {**os.environ, "FINETUNE_FAULTS": "die@step:3", "FINETUNE_FAULT_READY": str(ready)}
    result = subprocess.run(
        [sys.executable, "-m", "finetune", "train", "quickstart", "--engine", "ray", "--num-workers", "2",
         "--storage", str(tmp_path / "ray-storage"), "--max-failures", "1", f"data.train={equal_batch_runs.data}",
         f"output_dir={run}", "train.per_device_train_batch_size=2", *EQUAL_BATCH_EPOCH,
         "train.save_strategy=steps", "train.save_steps=2"],
        capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]

    assert ready.read_text().startswith("step:3 ")  # rank 1 was killed after step 3 ...
    rows = progress(run)
    assert [row["resumed"]["from"] for row in rows if "resumed" in row] == ["checkpoint-2"]  # ... and resumed
    assert rows[-1]["status"] == "completed" and rows[-1]["step"] == 10
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, 11))
    assert f"completed: {run / 'final'}" in result.stdout

    ray_losses = losses(run)
    for reference in (equal_batch_runs.one, equal_batch_runs.two):
        assert max(abs(a - b) / abs(a) for a, b in zip(losses(reference), ray_losses)) <= 1e-4
        expected, got = adapter(reference), adapter(run)
        assert expected.keys() == got.keys()
        assert max((expected[key] - got[key]).abs().max().item() for key in expected) <= 1e-5
    pointer = tmp_path / "ray-storage" / run.name / "checkpoint-10" / "finetune_checkpoint.json"
    assert json.loads(pointer.read_text()) == {"checkpoint": str(run / "checkpoint-10")}


def test_ray_options_are_checked_before_anything_starts(tmp_path):
    result = run_cli("train", "quickstart", f"output_dir={tmp_path / 'run'}", "--num-workers", "2")
    assert result.returncode == 2
    assert "--num-workers, --gpus-per-worker, --address and --storage are for --engine ray" in result.stderr
    result = run_cli("train", "quickstart", f"output_dir={tmp_path / 'run'}", "--engine", "ray", "--num-workers", "0")
    assert result.returncode == 2 and "--num-workers must be at least 1" in result.stderr
    assert not (tmp_path / "run").exists()
