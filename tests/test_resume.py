"""Resuming: a 2-process DDP run killed with SIGKILL (every process at once) at several points, and resumed each
time, ends with the adapter, step count and token count of a run that was never interrupted. Stopping with a
signal, a changed process count, and recipes that are no longer the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.builtin import resolve_dataset
from finetune.training.launcher import process_tree
from tests.conftest import cli_here, run_cli, train_here

pytestmark = pytest.mark.integration

# 38 examples, global batch 8 (2 processes x 2 x 2 accumulation steps): 5 steps an epoch, the last batch completed
# with 2 rows from its window; 12 steps cross two epoch boundaries. LoRA dropout makes every rank's random state
# matter; a checkpoint every 2 steps, 2 kept.
SETTINGS = [
    "method=lora", "lora.dropout=0.1", "train.packing=false", "train.max_steps=12", "train.logging_steps=1",
    "train.per_device_train_batch_size=2", "train.gradient_accumulation_steps=2", "train.save_steps=2",
    "train.save_total_limit=2", "train.eval_strategy=no", "train.eval_on_start=false", "data.eval_fraction=0",
    "train.learning_rate=1e-3", "train.warmup_steps=0", "train.max_length=64",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    rows = Path(resolve_dataset("builtin:greetings")).read_text().splitlines()
    path = tmp_path_factory.mktemp("data") / "greetings-38.jsonl"
    path.write_text("\n".join(rows[:38]) + "\n")
    return path


def ddp_train(run: Path, data: Path, *extra: str, faults: str = "", resume: bool = False) -> subprocess.Popen:
    env = {**os.environ, "FINETUNE_FAULTS": faults, "FINETUNE_FAULT_READY": str(run.parent / f"{run.name}.ready")}
    return subprocess.Popen(
        [sys.executable, "-m", "finetune", "train", "quickstart", "--accelerate-config", "cpu_ddp_2proc",
         f"data.train={data}", f"output_dir={run}", *SETTINGS, *extra, *(["--resume"] if resume else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)


def kill_at_fault(process: subprocess.Popen, run: Path) -> None:
    """Wait until a process of the run is held at its fault, then SIGKILL every process of the run at once."""
    ready = run.parent / f"{run.name}.ready"
    deadline = time.monotonic() + 600
    while not ready.exists():
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the fault was never reached"
        time.sleep(0.2)
    pids = [process.pid, *process_tree(process.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=60)
    while any(alive(pid) for pid in pids[1:]):
        time.sleep(0.1)
    ready.unlink()  # only now: every process held at the fault writes the file, not only the first one


def alive(pid: int) -> bool:
    """Still running (a zombie, which nothing may reap in a container, has stopped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def finish(process: subprocess.Popen) -> str:
    output = process.communicate(timeout=900)[0]
    assert process.returncode == 0, output[-3000:]
    return output


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]


def changed(before: Path, after: Path) -> bool:
    """Whether a step changed the adapter between two checkpoints."""
    from safetensors.torch import load_file

    old, new = (load_file(folder / "adapter_model.safetensors") for folder in (before, after))
    return any(not (old[key] == new[key]).all() for key in old)


def adapter(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "final" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    finish(ddp_train(run, data))
    return run


def test_killed_again_and_again_the_run_ends_as_if_never_interrupted(uninterrupted, data, tmp_path):
    run = tmp_path / "run"
    # Mid gradient accumulation in step 4 (checkpoint-2 is the newest) ...
    kill_at_fault(ddp_train(run, data, faults="pause@micro:3"), run)
    # ... while checkpoint-6 is being written (checkpoint-4 is the newest complete one) ...
    kill_at_fault(ddp_train(run, data, faults="pause@save:6", resume=True), run)
    assert (run / "checkpoint-6").is_dir() and not (run / "checkpoint-6" / "finetune_state.json").exists()
    # ... at an epoch's end, right after checkpoint-10 and before the next step ...
    resumed = ddp_train(run, data, faults="pause@step:10", resume=True)
    kill_at_fault(resumed, run)
    assert "removed checkpoint-6, written after it or cut off" in resumed.stdout.read()
    # ... and after the last step's checkpoint, while final/ is being written: the run has nothing left to train.
    kill_at_fault(ddp_train(run, data, faults="pause@final:12", resume=True), run)
    assert (run / "checkpoint-12" / "finetune_state.json").is_file() and not (run / "final").exists()
    last = finish(ddp_train(run, data, resume=True))
    assert "resuming" in last and "from checkpoint-12 (step 12)" in last
    assert not (run / "checkpoint-13").exists()

    expected, got = rows(uninterrupted), rows(run)
    assert [row["resumed"]["from"] for row in got if "resumed" in row] == \
        ["checkpoint-2", "checkpoint-4", "checkpoint-10", "checkpoint-12"]
    training = {row["step"]: row for row in got if "loss" in row}
    assert [row["step"] for row in got if "loss" in row] == list(range(1, 13))  # none missing, none twice
    for row in expected:
        if "loss" in row:
            assert training[row["step"]]["loss"] == row["loss"]
            assert training[row["step"]]["trained_tokens"] == row["trained_tokens"]
    assert got[-1]["status"] == expected[-1]["status"] == "completed" and got[-1]["step"] == 12
    reference, resumed_weights = adapter(uninterrupted), adapter(run)
    assert reference.keys() == resumed_weights.keys()
    assert max((reference[key] - resumed_weights[key]).abs().max().item() for key in reference) <= 1e-6


def test_a_run_from_prepared_shards_is_the_run_from_its_data_killed_and_resumed(uninterrupted, data, tmp_path,
                                                                                capsys):
    """data.prepared: each process takes its rows from the shards `finetune prepare` wrote; killed in the second
    epoch and resumed (the position is the sampler's batch, not a count of rows read), the run ends as the
    uninterrupted run from the data file did."""
    prepared = tmp_path / "prepared"
    code, _, err = cli_here(capsys, "prepare", "quickstart", f"data.train={data}", *SETTINGS, "--out", str(prepared))
    assert code == 0, err
    run = tmp_path / "run"
    kill_at_fault(ddp_train(run, data, f"data.prepared={prepared}", faults="pause@step:7"), run)
    last = finish(ddp_train(run, data, f"data.prepared={prepared}", resume=True))
    assert "from checkpoint-6 (step 6)" in last and "Prepared the data" not in last
    expected, got = rows(uninterrupted), rows(run)
    assert [(row["step"], row["loss"], row["trained_tokens"]) for row in got if "loss" in row and row["step"] > 6] \
        == [(row["step"], row["loss"], row["trained_tokens"]) for row in expected if "loss" in row and row["step"] > 6]
    reference, resumed_weights = adapter(uninterrupted), adapter(run)
    assert max((reference[key] - resumed_weights[key]).abs().max().item() for key in reference) <= 1e-6


def test_a_different_process_count_resumes_with_the_same_global_batch(uninterrupted, data, tmp_path, capsys):
    run = tmp_path / "run"
    kill_at_fault(ddp_train(run, data, faults="pause@step:4"), run)
    common = ["train", "quickstart", f"data.train={data}", f"output_dir={run}", *SETTINGS, "--resume"]
    code, _, err = cli_here(capsys, *common)  # one process, 2 x 2: a global batch of 4, not 8
    assert code == 2
    assert "the global batch would be 4 (1 processes x per-device batch 2 x 2 accumulation steps) but the run's " \
           "is 8 (2 x 2 x 2)" in err
    resumed = run_cli(*common, "train.per_device_train_batch_size=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "note: the run trained on 2 processes and continues on 1, with the same global batch (8)" in resumed.stdout
    assert "(from trainer_state.json)" not in resumed.stderr + resumed.stdout  # our note, not the Trainer's warning
    final, expected = rows(run)[-1], rows(uninterrupted)
    assert final["status"] == "completed" and final["step"] == 12
    assert [row["trained_tokens"] for row in rows(run) if "loss" in row] == \
        [row["trained_tokens"] for row in expected if "loss" in row]


def test_recipe_changes_on_resume_are_refused_or_allowed(tmp_path, capsys):
    run = tmp_path / "run"
    short = ["method=lora", "train.max_steps=3", "train.save_steps=3", "train.logging_steps=1",
             "train.eval_strategy=no", "train.eval_on_start=false", "data.max_rows=64",
             "train.per_device_train_batch_size=4", "train.lr_scheduler_type=linear", "train.warmup_steps=0"]
    assert train_here("quickstart", f"output_dir={run}", *short).returncode == 0
    # refused before anything loads: checked in this process, as `finetune train` checks them
    code, _, err = cli_here(capsys, "train", "quickstart", f"output_dir={run}", *short)
    assert code == 2 and "continue that run with --resume" in err
    code, _, err = cli_here(capsys, "train", "quickstart", f"output_dir={run}", *short, "--resume")
    assert code == 2 and f"--resume: {run} already completed at step 3; raise train.max_steps" in err, err
    for change, key in (("lora.r=8", "lora.r"), ("train.learning_rate=1e-5", "train.learning_rate"),
                        ("data.max_rows=10", "data.max_rows"), ("train.max_length=128", "train.max_length"),
                        ("train.seed=1", "train.seed")):
        code, _, err = cli_here(capsys, "train", "quickstart", f"output_dir={run}", *short, change, "--resume")
        assert code == 2 and f"--resume: {key} is " in err and "Traceback" not in err, err
    longer = train_here("quickstart", f"output_dir={run}", *short, "--resume", "train.max_steps=5",
                     "train.save_steps=1")
    assert longer.returncode == 0, longer.stderr[-2000:]
    assert "note: train.max_steps 3 -> 5: the learning-rate schedule is planned again" in longer.stdout
    assert [row["step"] for row in rows(run) if "loss" in row] == [1, 2, 3, 4, 5]
    # The linear decay reached 0 at step 3 of the first plan; step 4 trains at the new plan's rate, not at 0.
    assert changed(run / "checkpoint-3", run / "checkpoint-4") and changed(run / "checkpoint-4", run / "checkpoint-5")
    assert rows(run)[-1]["status"] == "completed" and rows(run)[-1]["step"] == 5
    # The run folder's recipe is the one the run now follows, and the same length again has nothing left to train.
    assert "max_steps: 5" in (run / "finetune.yaml").read_text()
    code, _, err = cli_here(capsys, "train", "quickstart", f"output_dir={run}", *short, "--resume", "train.max_steps=5",
                            "train.save_steps=1")
    assert code == 2 and f"--resume: {run} already completed at step 5; raise train.max_steps" in err, err
    # From a named checkpoint: what came after it goes, and is done again.
    named = train_here("quickstart", *short, "train.max_steps=5", "--resume", str(run / "checkpoint-3"))
    assert named.returncode == 0, named.stderr[-2000:]
    assert f"resuming {run} from checkpoint-3 (step 3); removed checkpoint-4, checkpoint-5" in named.stdout
    assert [row["step"] for row in rows(run) if "loss" in row] == [1, 2, 3, 4, 5]
    assert [row["resumed"]["from"] for row in rows(run) if "resumed" in row] == ["checkpoint-3", "checkpoint-3"]
