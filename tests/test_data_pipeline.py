"""Loading, bad rows, splits and the preprocessing cache."""

from __future__ import annotations

import json
import re

import pytest

from finetune.data import encoding, pipeline
from finetune.data.pipeline import prepare, prepare_into
from finetune.data.prepared_folder import load
from finetune.errors import UserError
from finetune.recipe.schema import load_recipe
from tests.conftest import asset, write_recipe


def alpaca(i: int) -> dict:
    return {"instruction": f"Say {i}.", "output": f"{i}"}


def recipe_for(tmp_path, train, *overrides):
    text = f"model: {{name_or_path: builtin:tiny-llama}}\ndata: {{train: {json.dumps(str(train))}}}\n"
    return load_recipe(write_recipe(tmp_path, text), ["train.max_length=128", *overrides])


def tokenizer():
    from finetune.builtin import make_tokenizer

    return make_tokenizer()


def run(recipe):
    tok = tokenizer()
    return prepare(recipe, tok, tok.chat_template)


def test_every_file_type_and_folders(tmp_path):
    import pandas

    folder = tmp_path / "data"
    (folder / "nested").mkdir(parents=True)
    (folder / "a.jsonl").write_text("\n".join(json.dumps(alpaca(i)) for i in range(3)) + "\n")
    (folder / "b.json").write_text(json.dumps([alpaca(i) for i in range(3, 5)]))
    pandas.DataFrame([alpaca(i) for i in range(5, 9)]).to_parquet(folder / "nested" / "c.parquet")
    pandas.DataFrame([alpaca(i) for i in range(9, 10)]).to_csv(folder / "d.csv", index=False)
    (folder / "notes.txt").write_text("ignored")
    data = run(recipe_for(tmp_path, folder, "train.packing=false"))
    assert data.report["rows"] == {"train": 10, "eval": 0}
    answers = sorted(tokenizer().decode([t for t in labels if t != -100]) for labels in data.train["labels"])
    assert answers == sorted(f"{i}<|im_end|>" for i in range(10))


def test_bad_rows_fail_with_file_and_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "Yo"}]}),
        json.dumps({"messages": [{"role": "user", "content": "Hi"}]}),
        json.dumps({"messages": []}),
    ]
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(UserError) as caught:
        run(recipe_for(tmp_path, path))
    message = str(caught.value)
    assert message.startswith("4 bad data rows:")
    assert f"{path} line 2: not valid JSON" in message
    assert f"{path} line 3: message 1 content is a number, not text" in message
    assert f"{path} line 4: no assistant turn to learn from" in message
    assert f"{path} line 5: empty conversation" in message
    assert "data.bad_rows=drop" in message

    data = run(recipe_for(tmp_path, path, "data.bad_rows=drop"))
    assert data.report["rows"]["train"] == 1 and data.report["bad_rows"]["count"] == 4


def test_unknown_format_and_missing_paths(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(UserError, match=r"qa.jsonl line 1: cannot tell the data format from its fields \(question, answer\)"):
        run(recipe_for(tmp_path, path))
    data = run(recipe_for(tmp_path, path, "data.format=alpaca", "data.columns={instruction: question, output: answer}"))
    assert data.report["rows"]["train"] == 1
    with pytest.raises(UserError, match="does not exist"):
        run(recipe_for(tmp_path, tmp_path / "missing.jsonl"))


def test_hub_dataset_offline_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="data.train: 'someone/no-such-dataset' is not a local file or folder, it is "
                                        "not in the local Hugging Face cache, and the Hub cannot be asked "
                                        r"\(HF_HUB_OFFLINE is set\)"):
        run(recipe_for(tmp_path, "someone/no-such-dataset"))


def test_eval_fraction_and_max_rows(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps(alpaca(i)) for i in range(100)) + "\n")
    data = run(recipe_for(tmp_path, path, "data.eval_fraction=0.1"))
    assert data.report["rows"] == {"train": 90, "eval": 10}
    assert run(recipe_for(tmp_path, path, "data.max_rows=20")).report["rows"]["train"] == 20


def test_truncation_and_untrainable_rows_are_counted(tmp_path):
    path = tmp_path / "a.jsonl"
    long_prompt = {"instruction": "x" * 400, "output": "y"}  # nothing to learn within max_length: dropped
    long_answer = {"instruction": "x", "output": "y" * 400}  # cut short, kept
    path.write_text("\n".join(json.dumps(r) for r in [alpaca(1), long_prompt, long_answer]) + "\n")
    report = run(recipe_for(tmp_path, path)).report
    assert report["train"]["truncated_rows"] == 1 and report["train"]["dropped_no_trained_tokens"] == 1
    assert report["rows"]["train"] == 2


def test_cached_by_content(tmp_path, monkeypatch):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps(alpaca(i)) for i in range(10)) + "\n")
    recipe = recipe_for(tmp_path, path)
    first = run(recipe)
    built = []
    monkeypatch.setattr(pipeline, "_build", lambda *args: built.append(args) or pytest.fail("rebuilt"))
    assert run(recipe).report == first.report  # same data, tokenizer and settings: read from the cache
    path.write_text("\n".join(json.dumps(alpaca(i)) for i in range(11)) + "\n")
    with pytest.raises(pytest.fail.Exception):
        run(recipe)  # contents changed: prepared again
    assert len(built) == 1


def test_parallel_preparation_is_the_same_and_says_how_far_it_is(tmp_path, monkeypatch, capsys, llama_tokenizer):
    """GSM8K through the Llama 3.2 template on one and on two worker processes: the same rows, masks and report,
    with progress lines (rows done, rows/s, time left) while it runs."""
    from finetune.data.render import training_template

    gsm8k = asset("datasets/gsm8k/train.jsonl")
    data = tmp_path / "gsm8k.jsonl"
    with open(gsm8k, encoding="utf-8") as rows:
        data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["question"]},
                                                         {"role": "assistant", "content": r["answer"]}]}) + "\n"
                                for r in map(json.loads, list(rows)[:2500])), encoding="utf-8")
    template = training_template(llama_tokenizer, llama_tokenizer.chat_template)
    monkeypatch.setattr(encoding, "PROGRESS_EVERY_S", 0.5)
    monkeypatch.setattr(encoding, "RATE_AFTER_S", 0.1)
    prepared = {}
    for processes in (1, 2):
        recipe = recipe_for(tmp_path, data, f"data.num_proc={processes}", "train.max_length=512",
                            "train.packing=false", "data.eval_fraction=0.1")
        prepared[processes] = load(prepare_into(recipe, llama_tokenizer, template,
                                                str(tmp_path / f"parallel-{processes}"))[0])
    one, two = prepared[1], prepared[2]
    assert one.report == two.report and len(one.train) == 2250 and len(one.eval) == 250
    assert one.train["input_ids"] == two.train["input_ids"] and one.train["labels"] == two.train["labels"]
    assert one.eval["labels"] == two.eval["labels"]
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("preparing train: ")]
    # a rate, and with it a time left, once rows have flowed for RATE_AFTER_S; never a time left without a rate
    assert any(" rows/s, " in line for line in progress), progress
    assert all(re.fullmatch(r"preparing train: [\d,]+ of 2,250 rows(, [\d,]+ rows/s, [\d,]+ s left)?", line)
               for line in progress), progress


def test_mixtures_take_each_source_share_deterministically(tmp_path):
    for name, count in (("a", 10), ("b", 20)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(alpaca(f"{name}{i}")) + "\n" for i in range(count)))

    def mixed(train: str, seed: int = 42):
        text = f"model: {{name_or_path: builtin:tiny-llama}}\ndata: {{train: {train}}}\n"
        recipe = load_recipe(write_recipe(tmp_path, text), ["train.max_length=128", "train.packing=false",
                                                            f"train.seed={seed}"])
        return run(recipe)

    rows = mixed(f"[{{path: {tmp_path / 'a.jsonl'}, rows: 15}}, {{path: {tmp_path / 'b.jsonl'}, fraction: 0.5}}]")
    assert rows.report["rows"]["train"] == 25
    assert [(s["used"], s["available"]) for s in rows.report["sources"]] == [(15, 10), (10, 20)]
    again = mixed(f"[{{path: {tmp_path / 'a.jsonl'}, rows: 15}}, {{path: {tmp_path / 'b.jsonl'}, fraction: 0.5}}]")
    assert again.train["input_ids"] == rows.train["input_ids"]  # the same rows for the same seed
    other = mixed(f"[{{path: {tmp_path / 'a.jsonl'}, rows: 15}}, {{path: {tmp_path / 'b.jsonl'}, fraction: 0.5}}]",
                  seed=7)
    assert other.train["input_ids"] != rows.train["input_ids"]
    weighted = mixed(f"[{{path: {tmp_path / 'a.jsonl'}, weight: 1}}, {{path: {tmp_path / 'b.jsonl'}, weight: 3}}]")
    assert [s["used"] for s in weighted.report["sources"]] == [8, 22]  # a quarter and three quarters of 30 rows

    from finetune.data.report import describe_data

    assert f"source {tmp_path / 'a.jsonl'}: 15 rows of its 10 (rows 15)" in describe_data(rows.report)


@pytest.mark.parametrize("entry, message", [
    ("{path: a.jsonl, rows: 5, fraction: 0.5}", "data.train[0] sets both rows and fraction; keep one"),
    ("{path: a.jsonl, share: 2}", "data.train[0] takes path: and one of rows, fraction, weight; 'share' is not"),
    ("{rows: 5}", "its path: is missing"),
    ("{path: a.jsonl, rows: 0}", "data.train[0].rows must be a positive whole number, got 0"),
])
def test_mixture_entries_are_checked(tmp_path, entry, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_recipe(write_recipe(tmp_path, f"model: {{name_or_path: builtin:tiny-llama}}\ndata: {{train: [{entry}]}}\n"))


def test_the_data_cache_key_changes_with_the_trl_version(monkeypatch, tmp_path, builtin_tokenizer):
    import importlib.metadata

    from finetune.data import prepared_folder, sources

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    recipe = recipe_for(tmp_path, data)
    key = lambda: prepared_folder.key_of(prepared_folder.inputs_of(
        recipe, builtin_tokenizer, None, [sources.resolve(str(data), "data.train")], []))
    before = key()
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "99.0.0" if name == "trl" else real_version(name))
    assert key() != before
