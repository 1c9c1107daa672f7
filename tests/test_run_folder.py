"""The run folder contract (finetune/run_folder.py): fast tests, no model."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from finetune.run_folder import RunFolder, checkpoints, latest_checkpoint, read_rows, running


def checkpoint(run, step: int, complete: bool = True):
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    if complete:
        RunFolder(run).mark_complete(folder, {"step": step})
    return folder


def test_importing_the_run_folder_contract_is_light():
    script = "import sys, finetune.run_folder, finetune.ui.workspace\n" \
             "print([m for m in ('torch', 'transformers', 'trl', 'gradio') if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stderr


def test_checkpoints_are_complete_ones_by_step_and_strays_are_ignored(tmp_path):
    for step in (2, 10, 4):
        checkpoint(tmp_path, step)
    checkpoint(tmp_path, 12, complete=False)
    (tmp_path / "checkpoint-foo").mkdir()
    (tmp_path / "checkpoint-7.bak").mkdir()
    (tmp_path / "checkpoint-3").write_text("a file")
    assert [path.name for path in checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4", "checkpoint-10"]
    assert [path.name for path in checkpoints(tmp_path, complete=False)][-1] == "checkpoint-12"
    assert latest_checkpoint(tmp_path).name == "checkpoint-10"


def test_rotation_counts_complete_checkpoints_and_keeps_the_best(tmp_path):
    for step in (2, 4, 6, 8):
        checkpoint(tmp_path, step)
    checkpoint(tmp_path, 10, complete=False)  # being written, or cut off: not counted, not removed
    RunFolder(tmp_path).rotate(2, keep="checkpoint-2")
    assert sorted(path.name for path in tmp_path.iterdir()) == \
        ["checkpoint-10", "checkpoint-2", "checkpoint-6", "checkpoint-8"]
    RunFolder(tmp_path).rotate(1)
    assert latest_checkpoint(tmp_path).name == "checkpoint-8"


def test_rewind_keeps_rows_up_to_the_checkpoint_and_says_where_it_resumed(tmp_path):
    run = RunFolder(tmp_path)
    for step in range(1, 6):
        run.append({"step": step, "loss": 1.0 / step})
    run.append({"step": 4, "eval_loss": 0.5})
    run.finish("failed", 5, 12.0, "boom")
    run.rewind(4, {"from": "checkpoint-4"})
    assert read_rows(tmp_path) == [
        {"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}, {"step": 3, "loss": 1 / 3}, {"step": 4, "loss": 0.25},
        {"step": 4, "eval_loss": 0.5},
        {"step": 4, "resumed": {"from": "checkpoint-4", "after": {"status": "failed", "step": 5, "error": "boom"}}}]


def test_a_running_run_is_seen_by_its_lock_and_a_second_runner_is_refused(tmp_path):
    from finetune.errors import UserError

    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from finetune.run_folder import RunFolder
        folder = RunFolder({str(tmp_path)!r})
        folder.hold()
        print("held", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        info = running(tmp_path)
        assert info["pid"] == holder.pid
        with pytest.raises(UserError, match="is in use by another process"):
            RunFolder(tmp_path).hold()
    finally:
        holder.kill()
        holder.wait()
    assert running(tmp_path) is None  # the lock goes with the process, however it ends
