"""`finetune export --gguf`: llama.cpp's converter of the pinned release without a checkout, and the GGUF checked by
llama.cpp itself (llama-cpp-python) against the export before the folder takes its name."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import cli_here, train_greeter, write_greetings

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not __import__("importlib").util.find_spec("llama_cpp"),
                                 reason="the gguf extra (llama-cpp-python) is not installed")]


@pytest.fixture(scope="module")
def greeter(tiny_models, tmp_path_factory):
    """Llama 3.2 (its real tokenizer, whose pre-tokenizer the converter knows), LoRA until it answers "Hi!"."""
    data = write_greetings(tmp_path_factory.mktemp("data") / "greetings.jsonl")
    return train_greeter(tiny_models["llama"], data, "lora", 30, 1e-2, 4, tmp_path_factory.mktemp("runs") / "llama")


def report(folder) -> dict:
    return json.loads((folder / "gguf-check.json").read_text())


def test_an_f32_gguf_answers_as_the_export_and_a_k_quant_is_reported(greeter, tmp_path, capsys, monkeypatch):
    """No llama.cpp checkout: the converter comes from the pinned sdist (fetched once, hash-checked). llama.cpp
    finds the template, BOS/EOS, end and control tokens, tokenization and chat prompts as in training; with an f32
    KV cache every greedy answer is identical, token for token through the end token."""
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    code, out, err = cli_here(capsys, "export", str(greeter), "--out", str(tmp_path / "f32"), "--merge",
                              "--dtype", "fp32", "--gguf")
    assert code == 0, err[-3000:]
    checked = report(tmp_path / "f32")
    assert (checked["metadata"], checked["tokenization"], checked["template"], checked["problems"]) == ([], [], [], [])
    [f32] = checked["greedy"]
    assert (f32["gguf_type"], f32["kv_cache"], f32["identical"], f32["prompts"]) == ("f32", "f32", 12, 12)
    assert f"gguf: {tmp_path / 'f32' / 'model-f32.gguf'} (checked by llama.cpp: " in out
    modelfile = (tmp_path / "f32" / "Modelfile").read_text()  # Ollama's, from the run's template and end tokens
    assert "\nFROM ./model-f32.gguf\n" in modelfile and 'PARAMETER stop "<|eot_id|>"' in modelfile
    assert "PARAMETER num_ctx 128" in modelfile and f"ollama: {tmp_path / 'f32' / 'Modelfile'}" in out
    card = (tmp_path / "f32" / "README.md").read_text()
    assert "`model-f32.gguf`" in card and "greedy answers 12 of 12 identical (f32, f32 KV cache)" in card

    code, out, err = cli_here(capsys, "export", str(greeter), "--out", str(tmp_path / "q4"), "--merge",
                              "--gguf-type", "q4_k_m")
    assert code == 0, err[-3000:]
    assert sorted(path.name for path in (tmp_path / "q4").glob("*.gguf")) == ["model-q4_k_m.gguf"]
    f32, q4 = report(tmp_path / "q4")["greedy"]
    assert f32["identical"] == 12 and (q4["gguf_type"], q4["kv_cache"], q4["prompts"]) == ("q4_k_m", "f16", 12)
    assert q4["identical"] + len(q4["divergences"]) == 12
    assert all(d["margin"] <= 0.2 for d in q4["divergences"])  # near-ties only, or the export would have failed


def test_a_model_the_converter_cannot_take_is_refused_before_any_work(tmp_path, capsys):
    """The quickstart's byte-level tokenizer has no pre-tokenizer llama.cpp knows: refused with the converter's
    reason, before the model is merged or anything is written."""
    from tests.conftest import train_here

    run = tmp_path / "run"
    result = train_here("quickstart", "train.max_steps=1", "train.eval_on_start=false", "data.eval_fraction=0",
                        f"output_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    code, _, err = cli_here(capsys, "export", str(run), "--out", str(tmp_path / "gguf"), "--gguf")
    assert code == 2 and err == ("error: --gguf: llama.cpp's converter cannot take this model: NotImplementedError: "
                                 "BPE pre-tokenizer was not recognized - update get_vocab_base_pre(); export without "
                                 "--gguf\n")
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_stale_template_that_reaches_the_gguf_fails_the_check_and_nothing_is_kept(greeter, tmp_path, monkeypatch):
    """The converter takes tokenizer_config.json's chat_template over chat_template.jinja: an export folder written
    by a tool that leaves a stale one there (planted here, as the converter is called) gives a GGUF that would chat
    with another template. llama.cpp's check finds it; the export exits 1 and keeps nothing."""
    from finetune.errors import CommandFailed
    from finetune.trained_model import export, gguf

    convert = gguf.convert

    def with_a_stale_template(script, folder, target, outtype, *extra):
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages }}"}))
        convert(script, folder, target, outtype, *extra)

    monkeypatch.setattr(gguf, "convert", with_a_stale_template)
    with pytest.raises(CommandFailed, match="gguf check failed: the embedded chat template is not the one the run "
                                            "trained with") as failure:
        export.export(greeter, tmp_path / "out", merge=True, gguf_type="f32")
    assert failure.value.exit_code == 1 and os.listdir(tmp_path) == []
