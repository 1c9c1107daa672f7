"""`finetune prepare`: a recipe's data prepared once into a folder of Arrow shards, which `data.prepared` trains
from: the same rows as the preparation training does itself, refused when the recipe would prepare other rows, never
read half-written, through fsspec URLs too, and planned from without tokenizing. (Training from it under DDP, killed
and resumed: tests/test_resume.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.data.pipeline import prepare, prepare_into
from finetune.data.prepared_folder import load
from finetune.errors import UserError
from finetune.recipe.schema import load_recipe
from tests.conftest import cli_here, write_recipe


def conversations(path: Path, count: int, start: int = 0) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Repeat {i} twice."},
                                                      {"role": "assistant", "content": f"{i} {i}"}]}) + "\n"
                            for i in range(start, start + count)))
    return path


def recipe_file(folder: Path, data: Path, prepared: Path | str | None = None) -> Path:
    return write_recipe(folder, "model: {name_or_path: builtin:tiny-llama}\n"
                                f"data: {{train: {data}, eval_fraction: 0.1"
                                + (f", prepared: {prepared}" if prepared else "") + "}\n"
                                "train: {max_length: 64}\n")


def rows(data) -> tuple[list, list]:
    return data.train["input_ids"], data.train["labels"]


def test_prepare_writes_the_rows_training_would_prepare_once_and_again_when_an_input_changes(tmp_path, capsys):
    data = conversations(tmp_path / "rows.jsonl", 300)
    recipe = recipe_file(tmp_path, data)
    out = tmp_path / "prepared"
    code, printed, err = cli_here(capsys, "prepare", str(recipe), "--out", str(out))
    assert code == 0, err
    assert f"{out}: prepared: 270 train rows, 30 eval rows, " in printed
    assert f"train from it with: finetune train {recipe} data.prepared={out}" in printed
    assert {"train", "eval", "report.json", "eval_examples.json", "prepared.json"} <= {p.name for p in out.iterdir()}
    shards = sorted((out / "train").glob("*.arrow"))
    written = [shard.stat().st_mtime_ns for shard in shards]

    code, printed, _ = cli_here(capsys, "prepare", str(recipe), "--out", str(out))
    assert code == 0 and "already prepared from the same inputs, nothing to do" in printed
    assert [shard.stat().st_mtime_ns for shard in shards] == written

    from finetune.builtin import make_tokenizer

    tokenizer = make_tokenizer()
    from_folder = prepare(load_recipe(recipe, [f"data.prepared={out}"]), tokenizer, tokenizer.chat_template)
    by_training = prepare(load_recipe(recipe), tokenizer, tokenizer.chat_template)  # the cache training fills
    assert rows(from_folder) == rows(by_training) and from_folder.report == by_training.report
    assert from_folder.eval["input_ids"] == by_training.eval["input_ids"]

    conversations(data, 300, start=1)  # the same file, other rows
    code, printed, _ = cli_here(capsys, "prepare", str(recipe), "--out", str(out))
    assert code == 0 and f"{out}: prepared: 270 train rows" in printed
    again = prepare(load_recipe(recipe, [f"data.prepared={out}"]), tokenizer, tokenizer.chat_template)
    assert rows(again) != rows(from_folder)
    assert not list(tmp_path.glob(".prepared.*")), "the staging and replaced folders are gone"


def test_prepared_rows_from_other_inputs_are_refused_with_what_differs(tmp_path, capsys):
    data = conversations(tmp_path / "rows.jsonl", 50)
    recipe = recipe_file(tmp_path, data)
    out = tmp_path / "prepared"
    assert cli_here(capsys, "prepare", str(recipe), "--out", str(out))[0] == 0
    template = tmp_path / "other.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    code, _, err = cli_here(capsys, "validate", str(recipe), f"data.prepared={out}", "train.max_length=48",
                            f"model.chat_template={template}", "data.loss_on=all")
    assert code == 2
    assert f"error: data.prepared: {out} was prepared from other inputs than this recipe's:" in err
    assert "  data.loss_on: prepared with 'assistant', the recipe has 'all'" in err
    assert "  train.max_length: prepared with 64, the recipe has 48" in err
    assert "  the chat template: prepared with another one" in err
    assert "Traceback" not in err

    items = conversations(tmp_path / "items.jsonl", 5, start=1000)
    assert cli_here(capsys, "prepare", str(recipe), f"data.decontaminate=[{items}]", "--out",
                    str(tmp_path / "checked"))[0] == 0
    conversations(items, 5, start=2000)  # the evaluation set changed: what was checked is not what is now
    code, _, err = cli_here(capsys, "validate", str(recipe), f"data.prepared={tmp_path / 'checked'}",
                            f"data.decontaminate=[{items}]")
    assert code == 2 and "  data.decontaminate: the evaluation sets' contents are not those it was checked " \
                         "against" in err

    conversations(data, 50, start=7)
    code, _, err = cli_here(capsys, "validate", str(recipe), f"data.prepared={out}")
    assert code == 2 and "data.train / data.eval: the data files (or their shares) are not those it was prepared " \
                         "from" in err

    from finetune.builtin import make_tokenizer

    other = make_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    with pytest.raises(UserError, match="the tokenizer: prepared with builtin:tiny-llama's, which differs"):
        prepare(load_recipe(recipe, [f"data.prepared={out}", "data.train=null"]), other, other.chat_template)


def test_a_prepare_killed_half_way_is_never_read_and_the_next_one_starts_over(tmp_path, capsys):
    data = conversations(tmp_path / "rows.jsonl", 30000)
    out = tmp_path / "prepared"
    recipe = recipe_file(tmp_path, data, prepared=out)
    preparing = subprocess.Popen([sys.executable, "-m", "finetune", "prepare", str(recipe), "data.num_proc=1"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    staged = tmp_path / f".prepared.prepare-{socket.gethostname()}-{preparing.pid}"
    deadline = time.monotonic() + 300
    while len(list((staged / "train").glob("*.arrow"))) < 2:  # a shard written, the next begun
        assert preparing.poll() is None, preparing.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the preparation never started writing rows"
        time.sleep(0.1)
    os.killpg(preparing.pid, signal.SIGKILL)
    preparing.wait(timeout=60)

    assert not out.exists() and staged.is_dir()
    code, _, err = cli_here(capsys, "validate", str(recipe))
    assert code == 2 and f"data.prepared: {out} is not a complete prepared folder" in err
    code, printed, err = cli_here(capsys, "prepare", str(recipe))
    assert code == 0, err
    assert f"{out}: prepared: 27,000 train rows, 3,000 eval rows" in printed
    assert not staged.exists(), "the killed preparation's staging folder is removed"
    assert cli_here(capsys, "validate", str(recipe))[0] == 0


def test_prepared_rows_go_to_and_come_from_an_fsspec_url(tmp_path):
    from finetune.builtin import make_tokenizer

    data = conversations(tmp_path / "rows.jsonl", 40)
    recipe = load_recipe(recipe_file(tmp_path, data))
    tokenizer = make_tokenizer()
    folder, where, made = prepare_into(recipe, tokenizer, tokenizer.chat_template, "memory://bucket/prepared")
    written = load(folder)
    assert made and where == "memory://bucket/prepared"
    import fsspec

    files = fsspec.filesystem("memory").find("/bucket/prepared")
    assert "/bucket/prepared/prepared.json" in files and any(f.endswith(".arrow") for f in files)
    read = prepare(load_recipe(recipe_file(tmp_path, data, prepared="memory://bucket/prepared")), tokenizer,
                   tokenizer.chat_template)
    assert rows(read) == rows(written)
    assert prepare_into(recipe, tokenizer, tokenizer.chat_template, "memory://bucket/prepared")[2] is False


def test_the_time_plan_counts_the_prepared_rows_without_the_data_files(tmp_path, capsys):
    data = conversations(tmp_path / "rows.jsonl", 200)
    out = tmp_path / "prepared"
    recipe = recipe_file(tmp_path, data)
    assert cli_here(capsys, "prepare", str(recipe), "--out", str(out))[0] == 0
    tokens = json.loads((out / "report.json").read_text())["train"]["tokens"]
    data.unlink()  # nothing left to tokenize
    code, printed, err = cli_here(capsys, "estimate", str(recipe), "data.train=null", f"data.prepared={out}",
                                  "--gpu", "h100")
    assert code == 0, err
    assert f"over {tokens:,} tokens per epoch in 180 rows (counted from the prepared data" in printed
    from finetune.trained_model.model_card import data_names

    assert data_names(load_recipe(recipe, ["data.train=null", f"data.prepared={out}"])) == "local data"  # no path


def _read_from_disk() -> int:
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("read_bytes")).split()[1])


def _evict(paths: list[Path]) -> None:
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(descriptor)


@pytest.mark.skipif(not Path("/proc/self/io").exists() or not hasattr(os, "posix_fadvise"),
                    reason="needs Linux's per-process disk counters and posix_fadvise to empty the page cache")
def test_opening_prepared_rows_reads_little_of_them_from_disk(tmp_path):
    """A run (and a resumed one) opens every shard before its first step. Opened as datasets opens Arrow files, the
    kernel read ahead around each record batch's header and read the shards whole: at 2,000,000 conversations, 8 GB
    and 10.5 s before the first batch of a resume, on a disk with 8 MB read-ahead. Opening the shards and reading
    the rows' lengths and one batch reads a small part of them."""
    from finetune.builtin import make_tokenizer

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Repeat {i}: " + "word " * 200},
                                                      {"role": "assistant", "content": "word " * 200}]}) + "\n"
                            for i in range(3000)))
    recipe = load_recipe(write_recipe(tmp_path, "model: {name_or_path: builtin:tiny-llama}\n"
                                                f"data: {{train: {data}, eval_fraction: 0}}\n"
                                                "train: {max_length: 2048}\n"))
    tokenizer = make_tokenizer()
    folder = prepare_into(recipe, tokenizer, tokenizer.chat_template, str(tmp_path / "prepared"))[0]
    shards = sorted((folder / "train").glob("*.arrow"))
    size = sum(shard.stat().st_size for shard in shards)
    _evict(shards)
    before = _read_from_disk()
    shards[0].read_bytes()
    if _read_from_disk() == before:
        pytest.skip(f"{tmp_path} is not read from a disk here (tmpfs?), or its page cache cannot be emptied")
    _evict(shards)
    before = _read_from_disk()
    train = load(folder).train
    assert len(train["input_ids"][:16]) == 16 and len(train) > 100
    import pyarrow.compute as pc

    pc.list_value_length(train.with_format("arrow")[:]["input_ids"])
    read = _read_from_disk() - before
    assert read < size / 4, f"opening {len(shards)} shards of {size:,} bytes read {read:,} bytes from disk"
