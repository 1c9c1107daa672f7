"""Ray Train as the engine, on a local Ray: two workers train like two accelerate processes and like one process
with the same global batch, a worker killed mid-run is started again by Ray and the run resumes, and the panel's
Stop ends a Ray run with a checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import EQUAL_BATCH_EPOCH, SHORT, cli_here
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


def test_ray_options_are_checked_before_anything_starts(tmp_path, capsys):
    code, _, err = cli_here(capsys, "train", "quickstart", f"output_dir={tmp_path / 'run'}", "--num-workers", "2")
    assert code == 2 and "--num-workers, --gpus-per-worker, --address and --storage are for --engine ray" in err
    code, _, err = cli_here(capsys, "train", "quickstart", f"output_dir={tmp_path / 'run'}", "--engine", "ray",
                            "--num-workers", "0")
    assert code == 2 and "--num-workers must be at least 1" in err
    assert not (tmp_path / "run").exists()


def test_the_panel_stops_a_ray_run_at_the_end_of_a_step_with_a_checkpoint(tmp_path):
    """Stop signals the Ray driver alone (Ray's own processes share its group); the workers see the run folder's
    .stop, save a checkpoint and end with status stopped, and no process of the launch is left."""
    pytest.importorskip("ray.train", reason="the ray extra is not installed")
    from finetune.run_folder import checkpoint_step, latest_checkpoint, training_rows
    from finetune.ui.workspace import Workspace, group_alive

    workspace = Workspace(tmp_path)
    group = workspace.launch(workspace.command("quickstart", [*SHORT, "train.max_steps=1000"], "r", "ray:2"), "r")
    deadline = time.monotonic() + 600
    while len(training_rows(workspace.run("r").rows)) < 2:
        assert group_alive(group), workspace.console_tail("r")
        assert time.monotonic() < deadline, "the run never trained"
        time.sleep(0.5)
    assert workspace.stop("r") == "stopped", workspace.console_tail("r")
    info = workspace.run("r")
    assert info.status == "stopped" and info.resumable, workspace.console_tail("r")
    assert checkpoint_step(latest_checkpoint(workspace.run_folder("r"))) == info.rows[-1]["step"] < 1000
    assert not (workspace.run_folder("r") / ".stop").exists() and not group_alive(group)
