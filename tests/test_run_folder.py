"""The run folder contract (finetune/run_folder.py) and the training order: fast tests, no model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from finetune.data.sampler import SimilarLengthSampler
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


def test_every_global_batch_is_full_and_of_similar_lengths():
    """37 rows of distinct lengths in global batches of 4: each batch is a run of neighbouring lengths, the last
    one completed with the nearest rows of its window, whatever the epoch."""
    lengths = [(7 * i) % 37 + 1 for i in range(37)]  # 1..37, shuffled
    sampler = SimilarLengthSampler(lengths, global_batch=4, seed=3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert len(order) == len(sampler) == 40
        chunks = [sorted(lengths[i] for i in order[k:k + 4]) for k in range(0, 40, 4)]
        assert max(len(set(chunk)) for chunk in chunks) == 4
        assert set(order) == set(range(37))  # every row, every epoch
        for chunk in chunks:
            assert chunk[-1] - chunk[0] <= 6, chunks  # neighbours (the completed batch reaches a little further)
        assert max(chunks, key=max) == chunks[0]  # the longest batch comes first


def test_a_resumed_epoch_starts_at_its_batch():
    lengths = list(range(1, 101))
    sampler = SimilarLengthSampler(lengths, global_batch=8, seed=0)
    sampler.set_epoch(2)
    whole = list(sampler)
    sampler.start_at(2, 5)
    assert list(sampler) == whole[5 * 8:]
    assert list(sampler) == whole  # once only; the next pass over the epoch is whole again
    sampler.start_at(3, 1)
    assert list(sampler) == whole  # for another epoch: nothing changes here


def test_the_data_cache_key_changes_with_the_trl_version(monkeypatch, tmp_path, builtin_tokenizer):
    import importlib.metadata

    from finetune.data import pipeline, sources

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    key = lambda: pipeline._cache_key([sources.resolve(str(data), "data.train")], [], {}, builtin_tokenizer, None)
    before = key()
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "99.0.0" if name == "trl" else real_version(name))
    assert key() != before
