"""Every bad input in tests/bad_inputs.py gets its one clear message from `finetune validate` and from
`finetune train` (validate catches everything train refuses before its first step): exit status 2, no traceback,
no run folder, nothing left in the data cache. Then arbitrary input (hypothesis) to the override parser, the recipe
loader and the data readers: never anything but a result or that one message."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from finetune.errors import UserError
from finetune.recipe.schema import load_recipe
from tests.bad_inputs import CASES, Case
from tests.conftest import cli_here, run_cli

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TINY = ["train.max_length=128"]


def test_the_corpus_is_large_and_its_cases_distinct():
    assert len(CASES) >= 60
    assert len({case.name for case in CASES}) == len(CASES)


def prepare(case: Case, folder: Path) -> list[str]:
    """Write the case's files; return the command line's arguments after the command."""
    for name, content in case.files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    if case.setup:
        case.setup(folder)
    recipe = case.recipe_path or "quickstart"
    if case.recipe is not None:
        (folder / "recipe.yaml").write_bytes(case.recipe if isinstance(case.recipe, bytes) else case.recipe.encode())
        recipe = case.recipe_path or "recipe.yaml"
    overrides = [item.replace("{dir}", str(folder)) for item in case.overrides]
    args = [item.replace("{dir}", str(folder)) for item in case.args]
    return [recipe, f"output_dir={folder / 'run'}", *TINY, *overrides, *args]


def cache_entries(home: Path) -> set[str]:
    data = home / "data"
    return {path.name for path in data.iterdir()} if data.is_dir() else set()


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_gets_its_message(case, tmp_path, monkeypatch, capsys, isolated_home):
    monkeypatch.chdir(tmp_path)
    arguments = prepare(case, tmp_path)
    had_run = (tmp_path / "run").exists()
    cached = cache_entries(isolated_home)
    expected = case.message.replace("{dir}", str(tmp_path))
    for command in case.commands:
        code, _, err = cli_here(capsys, command, *arguments)
        assert (code, command) == (2, command), err
        assert err.startswith("error: ") and expected in err, f"{command}: {err}"
        assert "Traceback" not in err and err.count("error: ") == 1
        assert (tmp_path / "run").exists() == had_run  # no run folder made
        assert cache_entries(isolated_home) == cached  # nothing left in the data cache


@pytest.mark.parametrize("name", ["recipe with a key twice", "data in UTF-16", "1e99 epochs",
                                  "output_dir that cannot be written"])
def test_from_the_command_line_it_is_one_line_and_exit_status_2(name, tmp_path):
    case = next(case for case in CASES if case.name == name)
    result = run_cli("train", *prepare(case, tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_a_slow_hub_fails_fast(tmp_path):
    """Without HF_HUB_OFFLINE, a Hub that refuses connections is found out at once (the libraries alone retry for
    about a minute)."""
    env = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens there
    result = run_cli("validate", "quickstart", "model.name_or_path=someone/some-model", f"output_dir={tmp_path}/run",
                     env=env, timeout=40)
    assert result.returncode == 2
    assert "the Hub cannot be asked (http://127.0.0.1:9 cannot be reached from here)" in result.stderr


ACCEPTED = [  # inputs that look odd but are fine, and train
    ("UTF-8 with a byte-order mark", "data.jsonl", b"\xef\xbb\xbf" + json.dumps(
        {"instruction": "Say hi", "output": "Hi"}).encode() + b"\n"),
    ("CRLF line ends", "data.jsonl", (json.dumps({"instruction": "Say hi", "output": "Hi"}) + "\r\n").encode() * 2),
    ("CSV with a byte-order mark", "data.csv", b"\xef\xbb\xbfinstruction,output\r\nSay hi,Hi\r\n"),
    ("text content parts", "data.jsonl", (json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "Hi"}]}) + "\n").encode()),
]


@pytest.mark.parametrize("name, filename, content", ACCEPTED, ids=[name for name, _, _ in ACCEPTED])
def test_inputs_that_only_look_odd_are_accepted(name, filename, content, tmp_path, capsys):
    (tmp_path / filename).write_bytes(content)
    code, out, err = cli_here(capsys, "validate", "quickstart", f"data.train={tmp_path / filename}",
                              f"output_dir={tmp_path / 'run'}", "data.eval_fraction=0", "train.eval_on_start=false",
                              *TINY)
    assert code == 0 and "OK: the recipe and its data are valid." in out, err
    assert "bad rows: none" in out and "Say hi" in out


def test_bad_rows_of_every_kind_are_dropped_and_listed_in_file_order(tmp_path, capsys):
    from tests.bad_inputs import CHAT, chat

    data = tmp_path / "data.jsonl"
    data.write_bytes(b"\n".join([
        CHAT.encode(),
        chat(("assistant", "I speak first"), ("user", "Hi"), ("assistant", "Hello")).encode(),  # found by the template
        chat(("user", "Caf\u00e9?"), ("assistant", "Oui")).encode("latin-1"),  # one byte that is not UTF-8
        b'{"messages": [',  # not JSON
        CHAT.encode()]) + b"\n")
    code, out, err = cli_here(capsys, "validate", "quickstart", f"data.train={data}", "data.bad_rows=drop",
                              f"output_dir={tmp_path / 'run'}", "data.eval_fraction=0", "train.eval_on_start=false",
                              *TINY)
    assert code == 0, err
    listed = out.split("bad rows dropped (data.bad_rows=drop): 3\n")[1].splitlines()[:3]
    assert listed == [
        f"    {data} line 2: message 1: the conversation starts with the assistant; an answer is learned from what "
        "comes before it, so start with a user message (or a system prompt)",
        f"    {data} line 3: not UTF-8 text (byte 0xe9); save the file as UTF-8 (it may be Latin-1 or Windows-1252)",
        f"    {data} line 4: not valid JSON (Expecting value)"], out
    assert "train: 2 rows" in out


# Arbitrary input: a result or one UserError, nothing else, and never a run folder.
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
keys = st.sampled_from(["model.name_or_path", "method", "lora.r", "lora.dropout", "data.train", "data.columns",
                        "train.learning_rate", "train.num_train_epochs", "train.max_length", "output_dir", "x.y",
                        "train", "data", "lora.target_modules", "data.template_kwargs", "stage", "dpo.beta",
                        "dpo.loss_type", "kto.desirable_weight", "grpo.num_generations", "grpo.rewards", "model.adapter",
                        "train.use_cpu", "train.deepspeed", "train.accelerator_config"])
values = st.one_of(st.text(max_size=12), st.integers(-10**12, 10**12).map(str), st.floats().map(str),
                   st.sampled_from(["[1, 2", "{a: 1}", "null", "~", "true", "no", "1e99", "-0", ".nan", "'x"]))


@FAST
@given(overrides=st.lists(st.one_of(st.tuples(keys, values).map("=".join), st.text(max_size=20)), max_size=4))
def test_any_overrides_give_a_recipe_or_one_message(overrides, tmp_path):
    try:
        recipe = load_recipe("quickstart", [*overrides, f"output_dir={tmp_path / 'run'}"])
    except UserError as error:
        assert str(error)
    else:
        assert recipe.model.name_or_path
    assert not (tmp_path / "run").exists()


yaml_like = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.sampled_from(["model", "data", "train", "lora", "method",
                                                                "name_or_path", "r", "x"]), children, max_size=4)),
    max_leaves=12)


@FAST
@given(document=st.one_of(yaml_like.map(json.dumps), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_any_recipe_file_gives_a_recipe_or_one_message(document, tmp_path):
    path = tmp_path / "any.yaml"
    path.write_text(document, encoding="utf-8")
    try:
        load_recipe(path, [f"output_dir={tmp_path / 'run'}"])
    except UserError as error:
        assert str(error)
    assert not (tmp_path / "run").exists()


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10)),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.sampled_from(["messages", "role", "content", "conversations", "from", "value",
                                         "instruction", "input", "output", "prompt", "completion", "text",
                                         "tool_calls", "function", "name", "arguments", "thinking", "tools",
                                         "system", "type"]), children, max_size=5)),
    max_leaves=25)


@FAST
@given(rows=st.lists(json_values, min_size=1, max_size=4), suffix=st.sampled_from([".jsonl", ".json", ".csv"]),
       raw=st.binary(max_size=120), use_raw=st.booleans())
def test_any_data_file_gives_rows_bad_rows_or_one_message(rows, suffix, raw, use_raw, tmp_path_factory):
    from finetune.data.pipeline import prepare as prepare_data
    from finetune.models.loading import load_tokenizer

    folder = tmp_path_factory.mktemp("data")
    path = folder / f"rows{suffix}"
    if use_raw:
        path.write_bytes(raw)
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        path.write_text("\n".join(",".join(json.dumps(value) for value in (row if isinstance(row, list) else [row]))
                                  for row in rows))
    try:
        recipe = load_recipe("quickstart", [f"data.train={path}", "data.eval_fraction=0", "train.eval_on_start=false",
                                            "data.bad_rows=drop", f"output_dir={folder / 'run'}", *TINY])
        tokenizer = load_tokenizer(recipe)
        prepare_data(recipe, tokenizer, tokenizer.chat_template)
    except UserError as error:
        assert str(error)
    assert not (folder / "run").exists()
