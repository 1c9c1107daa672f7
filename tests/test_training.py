"""Training through the real command line: one process, two DDP processes, QLoRA, stopping, logging back-ends."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.training.launcher import group_alive
from tests.conftest import SHORT, train_here

pytestmark = pytest.mark.integration


def progress(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]


def losses(run: Path) -> list[float]:
    return [row["loss"] for row in progress(run) if "loss" in row]


def adapter(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "final" / "adapter_model.safetensors")


def test_two_process_ddp_matches_one_process_with_the_same_global_batch(equal_batch_runs):
    """Through an epoch's end: 37 examples make 5 global batches of 4, the last one completed from its own
    window, so both runs see the same rows at every step, and count the same tokens."""
    # The data was never prepared before, so we can see who prepares it: once, for both processes.
    assert equal_batch_runs.outputs["two"].count("Prepared the data") == 1
    assert "Prepared the data" not in equal_batch_runs.outputs["one"]  # same data and settings: from the cache
    one, two = equal_batch_runs.one, equal_batch_runs.two
    single, ddp = losses(one), losses(two)
    assert len(single) == len(ddp) == 10
    assert max(abs(a - b) / abs(a) for a, b in zip(single, ddp)) <= 1e-4
    assert single[-1] < single[0]  # and it trained
    weights_one, weights_two = adapter(one), adapter(two)
    assert weights_one.keys() == weights_two.keys()
    assert max((weights_one[k] - weights_two[k]).abs().max().item() for k in weights_one) <= 1e-5
    assert progress(two)[-1]["status"] == "completed"
    # Only the main process writes: one progress row per step, not two. Every process's tokens are counted.
    assert [row["step"] for row in progress(two) if "loss" in row] == list(range(1, 11))
    counted = [[row["trained_tokens"] for row in progress(run) if "loss" in row] for run in (one, two)]
    assert counted[0] == counted[1]
    if (two.parent / "mlflow.db").exists():  # the main process alone logs to MLflow: one value per step
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{two.parent / 'mlflow.db'}")
        [tracked] = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
        history = client.get_metric_history(tracked.info.run_id, "loss")
        assert sorted(point.step for point in history) == list(range(1, 11))


def test_qlora_trains_on_cpu(tmp_path):
    result = train_here("quickstart", f"output_dir={tmp_path / 'run'}", *SHORT, "method=qlora")
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16
    assert progress(tmp_path / "run")[-1]["status"] == "completed"
    # what it printed: a line a person reads per logging step, no Trainer dicts, no bar outside a terminal
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    shape = re.compile(r"step [1-6]/6 \| loss [\d.]+ \| lr [\d.e-]+ \| [\d,]+ tokens/s \| [\d.]+ GB \| ETA \dm\d\ds")
    assert len(steps) == 6 and all(shape.fullmatch(line) for line in steps), result.stdout
    assert "{'loss'" not in result.stdout + result.stderr and "%|" not in result.stderr


def test_stop_request_saves_a_checkpoint_and_leaves_no_process(tmp_path):
    run = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "finetune", "train", "quickstart", "--accelerate-config", "cpu_ddp_2proc",
         f"output_dir={run}", "method=lora", "train.max_steps=100000", "train.logging_steps=1",
         "train.eval_on_start=false", "train.eval_strategy=no", "train.save_strategy=no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not (run / "progress.jsonl").exists() or len(progress(run)) < 3:
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=120)
    rows = progress(run)
    assert rows[-1]["status"] == "stopped"
    step = rows[-1]["step"]
    assert (run / f"checkpoint-{step}" / "finetune.yaml").is_file()  # resumable, with its config
    assert (run / "final" / "adapter_model.safetensors").is_file()
    deadline = time.monotonic() + 30
    while group_alive(process.pid):  # no process of the run is left (zombies, waiting for PID 1 to reap them, hold nothing)
        assert time.monotonic() < deadline, "a process of the run is still running"
        time.sleep(0.5)


def test_second_ctrl_c_stops_at_once_and_says_so(tmp_path):
    run = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "finetune", "train", "quickstart", f"output_dir={run}", "train.max_steps=100000",
         "train.logging_steps=1", "train.eval_on_start=false", "train.eval_strategy=no",
         "train.per_device_train_batch_size=64"],  # slow steps: both signals land in the same one
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 300
    while not (run / "progress.jsonl").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 130
    assert "stopped at once, without a checkpoint for this step" in stderr and "Traceback" not in stderr
    assert progress(run)[-1]["status"] == "failed" and progress(run)[-1]["error"] == "interrupted"


def test_logging_backends_continue_when_the_run_resumes_and_the_export_is_registered(tmp_path):
    """TensorBoard and MLflow (its embedded SQLite store in the workspace, no server, no settings) follow a run
    that resumes; `finetune export --register` adds the export to MLflow's model registry."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("sqlalchemy")
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = {key: value for key, value in os.environ.items() if not key.startswith("MLFLOW_")}
    run = tmp_path / "runs" / "tracked"
    settings = ["train", "quickstart", f"output_dir={run}", *SHORT, "train.report_to=[tensorboard, mlflow]",
                "train.save_strategy=steps", "train.save_steps=3", "data.eval_fraction=0.05",
                "train.eval_strategy=steps", "train.eval_steps=2", "mlflow.log_model=true"]
    first = subprocess.run([sys.executable, "-m", "finetune", *settings, "train.max_steps=3"],
                           capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = subprocess.run([sys.executable, "-m", "finetune", *settings, "--resume"],
                             capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    board = EventAccumulator(str(run / "tensorboard"))  # one log for the run, in the run folder
    board.Reload()
    assert [event.step for event in board.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"  # beside runs/
    assert f"open it with: mlflow ui --backend-store-uri {store}" in resumed.stdout
    client = MlflowClient(store)
    [experiment] = [e for e in client.search_experiments() if e.name == "quickstart"]  # the recipe's name
    [tracked] = client.search_runs([experiment.experiment_id])  # the resumed run went on in the same MLflow run
    assert tracked.info.run_name == "tracked" and tracked.info.status == "FINISHED"
    assert tracked.data.params["train.learning_rate"] == "0.001" and tracked.data.params["method"] == "lora"
    assert tracked.data.params["model.name_or_path"] == "builtin:tiny-llama"
    rows = progress(run)
    for metric in ("loss", "learning_rate", "grad_norm", "tokens_per_second", "trained_tokens", "peak_memory_gb",
                   "eval_loss", "eval_mean_token_accuracy", "samples_stop_rate"):
        history = client.get_metric_history(tracked.info.run_id, metric)
        expected = [(row["step"], row[metric]) for row in rows if metric in row]
        logged = sorted((point.step, point.value) for point in history)
        assert [step for step, _ in logged] == [step for step, _ in expected], metric  # one value per row's step
        assert [value for _, value in logged] == pytest.approx([value for _, value in expected]), metric
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3, 4, 5, 6]
    artifacts = {item.path for item in client.list_artifacts(tracked.info.run_id)}
    assert artifacts == {"finetune.yaml", "progress.jsonl", "model", "samples"}
    evaluated = [row["step"] for row in rows if "eval_loss" in row]
    assert [row["step"] for row in rows if "samples" in row] == evaluated  # the quickstart's eval.samples
    assert [item.path for item in client.list_artifacts(tracked.info.run_id, "samples")] == [
        f"samples/step-{step:06d}.json" for step in evaluated]
    model = {item.path for item in client.list_artifacts(tracked.info.run_id, "model")}
    assert {"model/adapter_model.safetensors", "model/README.md", "model/finetune.yaml"} <= model

    exported = subprocess.run([sys.executable, "-m", "finetune", "export", str(run), "--out", "exports/greeter",
                               "--register", "greeter"], capture_output=True, text=True, timeout=600, env=env,
                              cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f"registered: greeter version 1 in {store}" in exported.stdout
    [version] = client.search_model_versions("name='greeter'")
    assert version.source == str(tmp_path / "exports" / "greeter") and version.run_id == tracked.info.run_id
    assert version.description.startswith("# greeter")  # the card, without its metadata block
    assert "A LoRA fine-tune of `builtin:tiny-llama`" in version.description


def test_bad_rows_stop_before_training_with_no_run_folder(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "Hi"}]}\n{"oops"\n')
    result = train_here("quickstart", f"data.train={data}", f"output_dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert f"{data} line 1: no assistant turn to learn from" in result.stderr
    assert f"{data} line 2: not valid JSON" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_two_runs_in_one_process_keep_their_logs_apart_and_leave_nothing_behind(tmp_path):
    """Nor the trainer: under DDP it holds the process group's last work, and freed only when the interpreter
    exits, that aborts the process ("terminate called without an active exception") after a completed run."""
    script = f"""
import gc, logging, signal
import transformers
from finetune.training.run import run
handlers = lambda: {{name: list(logging.getLogger(name).handlers) for name in ("finetune", "transformers", "trl")}}
before = handlers(), signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
for name in ("first", "second"):
    run("quickstart", ["output_dir={tmp_path}/" + name, *{SHORT!r}])
assert (handlers(), signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
assert not [thing for thing in gc.get_objects() if isinstance(thing, transformers.Trainer)]
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    first = (tmp_path / "first" / "train.log").read_text()
    assert f"run folder {tmp_path}/first" in first and f"{tmp_path}/second" not in first


def test_final_gathers_fsdp_sharded_weights_whole_and_a_run_without_them_fails(tmp_path):
    """FSDP checkpoints are saved sharded, and the Trainer's save_model then writes no weights at all: final/ is
    saved with the state dict gathered whole (the Trainer's own test for it passes), then set back for checkpoints;
    and a final model without its weights fails the run instead of completing it. (FSDP needs GPUs: on the CPU the
    Trainer runs an FSDP launch as plain data parallel, so the gathering itself is for the GPU check.)"""
    import types

    from accelerate.utils import FullyShardedDataParallelPlugin

    from finetune.errors import RunFailed
    from finetune.training.run import check_final_weights, whole_state_dict

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    trainer = types.SimpleNamespace(is_fsdp_enabled=True, accelerator=types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin)))
    with whole_state_dict(trainer):
        assert "FULL_STATE_DICT" in str(plugin.state_dict_type)  # transformers' Trainer.save_model asks this
    assert "SHARDED_STATE_DICT" in str(plugin.state_dict_type)

    final = tmp_path / ".final.partial"
    final.mkdir()
    (final / "tokenizer.json").write_text("{}")
    with pytest.raises(RunFailed, match=r"the final model of step 12 was saved without its weights \(no "
                                        r"adapter_model.safetensors\); the run's checkpoints are kept"):
        check_final_weights(final, "lora", 12)
    assert not final.exists()  # nothing half-written is left
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"")
    check_final_weights(final, "full", 12)
    assert final.exists()
