"""Runs that go wrong: a non-finite loss, out of GPU memory, a full disk, stop signals on every rank (also when
they arrive twice), and a checkpoint slower than the launcher's shutdown timeout. Each ends with one clear message,
a status in progress.jsonl, and the last complete checkpoint intact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.run_folder import checkpoints, is_complete
from finetune.training.launcher import children, process_tree
from tests.conftest import launch_argv, launch_cli, run_cli, train_here

pytestmark = pytest.mark.integration

QUICK = ["method=lora", "train.logging_steps=1", "train.eval_strategy=no", "train.eval_on_start=false",
         "data.max_rows=200", "train.warmup_steps=0"]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]


def wait_for_rows(run: Path, process: subprocess.Popen, count: int) -> None:
    deadline = time.monotonic() + 300
    while not (run / "progress.jsonl").exists() or len([r for r in rows(run) if "loss" in r]) < count:
        assert process.poll() is None, (process.stdout.read() if process.stdout else "")[-3000:]
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.3)


def all_gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return False
        except (ProcessLookupError, FileNotFoundError):
            continue
    return True


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    result = train_here("quickstart", f"output_dir={run}", *QUICK, "train.learning_rate=1e30",
                     "train.max_steps=10", "train.save_steps=1")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"error: step 2: the loss is nan, so the run stopped (status failed). Its last good checkpoint is " \
           f"{run}/checkpoint-1. Try a lower learning rate (train.learning_rate, now 1e+30), or gradient clipping " \
           "(train.max_grad_norm=1.0), in a new run." in result.stderr
    assert rows(run)[-1]["status"] == "failed" and rows(run)[-1]["step"] == 2
    assert [path.name for path in checkpoints(run, complete=False)] == ["checkpoint-1"]  # none saved from NaN


def test_out_of_memory_names_the_step_the_micro_batch_and_the_knobs(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "FINETUNE_FAULTS": "oom@forward:3"}
    result = run_cli("train", "quickstart", f"output_dir={run}", *QUICK, "train.max_steps=10",
                     "train.per_device_train_batch_size=4", "train.max_length=128", env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    message = result.stderr[result.stderr.index("error: "):].splitlines()[0]
    assert message.startswith("error: step 3: out of GPU memory on a micro-batch of 4 rows x ")
    for knob in ("halve train.per_device_train_batch_size (now 4) and double train.gradient_accumulation_steps "
                 "(now 1): the global batch stays 4", "lower train.max_length (now 128)", "method=qlora",
                 "train.gradient_checkpointing"):
        assert knob in message
    assert rows(run)[-1]["status"] == "failed" and "out of GPU memory" in rows(run)[-1]["error"]


def test_a_checkpoint_that_cannot_be_written_fails_the_run_and_keeps_the_one_before(tmp_path):
    run = tmp_path / "run"
    settings = [f"output_dir={run}", *QUICK, "train.max_steps=6", "train.save_steps=2"]
    env = {**os.environ, "FINETUNE_FAULTS": "enospc@save:4"}
    result = run_cli("train", "quickstart", *settings, env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"error: could not write checkpoint {run}/checkpoint-4: [Errno 28] No space left on device: " in \
        result.stderr
    assert f"Its last good checkpoint is {run}/checkpoint-2. Free some space, then continue the run with --resume" \
        in result.stderr
    assert rows(run)[-1]["status"] == "failed" and "No space left on device" in rows(run)[-1]["error"]
    assert [path.name for path in checkpoints(run, complete=False)] == ["checkpoint-2"]
    assert is_complete(run / "checkpoint-2")
    resumed = run_cli("train", "quickstart", *settings, "--resume")  # space is back
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert rows(run)[-1]["status"] == "completed" and rows(run)[-1]["step"] == 6


def ddp(run: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "finetune", "train", "quickstart", "--accelerate-config", "cpu_ddp_2proc",
         f"output_dir={run}", *QUICK, "train.max_steps=100000", "train.save_strategy=no", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)


def test_sigint_to_the_whole_process_group_stops_with_a_checkpoint_every_time(tmp_path):
    for trial in range(2):
        run = tmp_path / f"run{trial}"
        process = ddp(run)
        wait_for_rows(run, process, 2 + trial)
        tree = process_tree(process.pid)
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        output = process.communicate(timeout=300)[0]
        assert process.returncode == 0, output[-3000:]
        status = rows(run)[-1]
        assert status["status"] == "stopped", output[-3000:]
        assert is_complete(run / f"checkpoint-{status['step']}") and (run / "final").is_dir()
        assert all_gone(tree)


def test_a_stop_signal_that_arrives_twice_is_one_stop_request(tmp_path):
    """Under a bare `accelerate launch`, a scheduler may signal every process while the launcher passes the same
    signal on: each training process gets it twice."""
    run = tmp_path / "run"
    process = subprocess.Popen(
        [*launch_argv("cpu_ddp_2proc"), "quickstart", f"output_dir={run}", *QUICK, "train.max_steps=100000",
         "train.save_strategy=no"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "FINETUNE_FAULTS": "slow-save:5"})
    wait_for_rows(run, process, 2)
    for pid in children(process.pid):
        os.kill(pid, signal.SIGINT)
    time.sleep(1)  # the processes are saving their checkpoint when the launcher's copy of the signal arrives
    os.kill(process.pid, signal.SIGINT)
    output = process.communicate(timeout=300)[0]
    status = rows(run)[-1]
    assert status["status"] == "stopped", output[-3000:]
    assert is_complete(run / f"checkpoint-{status['step']}")
    # And it continues under the same bare launcher.
    resumed = launch_cli("cpu_ddp_2proc", "quickstart", f"output_dir={run}", *QUICK,
                         f"train.max_steps={status['step'] + 2}", "train.save_strategy=no", "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert rows(run)[-1]["status"] == "completed" and rows(run)[-1]["step"] == status["step"] + 2


def test_a_stop_lets_a_checkpoint_slower_than_the_launchers_timeout_finish(tmp_path):
    """torch's elastic agent kills its processes 30 s after it is signalled; the panel's Stop and a scheduler's
    SIGTERM reach `finetune train --accelerate-config`, which lets the checkpoint take as long as it takes."""
    run = tmp_path / "run"
    process = ddp(run, env={**os.environ, "FINETUNE_FAULTS": "slow-save:35"})
    wait_for_rows(run, process, 2)
    tree = process_tree(process.pid)
    started = time.monotonic()
    os.killpg(process.pid, signal.SIGTERM)
    output = process.communicate(timeout=300)[0]
    assert time.monotonic() - started > 35  # the save really took that long
    assert process.returncode == 0, output[-3000:]
    status = rows(run)[-1]
    assert status["status"] == "stopped" and is_complete(run / f"checkpoint-{status['step']}")
    assert all_gone(tree)


def test_killing_the_supervisor_stops_the_launcher_and_every_rank(tmp_path):
    """`kill -9` of `finetune train --accelerate-config` (nothing can catch it): the launcher and both ranks, in
    sessions of their own, must not train on for a job the user believes dead; they stop with a checkpoint."""
    run = tmp_path / "run"
    process = ddp(run)
    wait_for_rows(run, process, 2)
    tree = process_tree(process.pid)
    assert len(tree) >= 3, tree  # the launcher and its two training processes
    process.kill()
    process.wait(timeout=30)
    deadline = time.monotonic() + 120
    while not all_gone(tree):
        assert time.monotonic() < deadline, f"still running: {[pid for pid in tree if not all_gone([pid])]}"
        time.sleep(0.5)
    status = rows(run)[-1]
    assert status["status"] == "stopped" and is_complete(run / f"checkpoint-{status['step']}")


def test_a_second_ctrl_c_stops_every_process_at_once(tmp_path):
    run = tmp_path / "run"
    process = ddp(run, env={**os.environ, "FINETUNE_FAULTS": "slow-save:600"})
    wait_for_rows(run, process, 2)
    tree = process_tree(process.pid)
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(3)  # into the (slow) checkpoint
    os.killpg(process.pid, signal.SIGINT)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 130, output[-3000:]
    assert rows(run)[-1]["status"] == "failed" and rows(run)[-1]["error"] == "interrupted"
    time.sleep(1)
    assert all_gone(tree)
