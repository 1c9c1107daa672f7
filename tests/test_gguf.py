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
    """A byte-level BPE tokenizer whose pre-tokenizer llama.cpp does not know (the builtin models' before they
    moved to a layout the converter takes): refused with the converter's reason, before the model is merged or
    anything is written."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from finetune.builtin import TEMPLATE, resolve_model
    from tests.conftest import train_here

    model = tmp_path / "model"
    shutil.copytree(resolve_model("builtin:tiny-llama"), model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    backend = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                   merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                        eos_token="<|im_end|>", pad_token="<|pad|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(model)
    run = tmp_path / "run"
    result = train_here("quickstart", f"model.name_or_path={model}", "train.max_steps=1", "train.eval_on_start=false",
                        "data.eval_fraction=0", "eval.samples=0", f"output_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    code, _, err = cli_here(capsys, "export", str(run), "--out", str(tmp_path / "gguf"), "--gguf")
    assert code == 2 and err == ("error: --gguf: llama.cpp's converter cannot take this model: NotImplementedError: "
                                 "BPE pre-tokenizer was not recognized - update get_vocab_base_pre(); export without "
                                 "--gguf\n")
    assert sorted(os.listdir(tmp_path)) == ["model", "run"]


def test_the_quickstart_goes_out_as_a_gguf_and_every_place_renders_its_prompts(quickstart_workspace, tmp_path):
    """The docs' commands on the README's model: a q8_0 GGUF that passes every check, and `export --check` finding
    the prompts of training, chat, serve, the vLLM template file, the GGUF and the Modelfile the same; a template
    changed in the export's tokenizer is found in the three places that read it, with the conversation."""
    from tests.test_readme import commands, run

    folder = quickstart_workspace.folder
    export, check = [c for c in commands() if "exports/quickstart-gguf" in c]
    done = run(export, folder)
    assert done.returncode == 0, done.stderr[-3000:]
    gguf_file = folder / "exports" / "quickstart-gguf" / "model-q8_0.gguf"
    assert "gguf: exports/quickstart-gguf/model-q8_0.gguf (checked by llama.cpp: " in done.stdout
    checked = report(folder / "exports" / "quickstart-gguf")
    assert (checked["metadata"], checked["tokenization"], checked["template"], checked["problems"]) == ([], [], [], [])
    f32, q8 = checked["greedy"]
    assert f32["identical"] == 12 and q8["identical"] + len(q8["divergences"]) == 12 and gguf_file.is_file()
    modelfile = (folder / "exports" / "quickstart-gguf" / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model-q8_0.gguf\n") and 'PARAMETER stop "<|im_end|>"' in modelfile

    parity = run(check, folder)
    assert parity.returncode == 0, parity.stdout + parity.stderr[-3000:]
    assert parity.stdout.splitlines() == [
        "| place | identical |", "|---|---|", "| finetune chat | 5 of 5 |", "| finetune serve | 5 of 5 |",
        "| vLLM template file | 5 of 5 |", "| GGUF model-q8_0.gguf | 5 of 5 |", "| Modelfile | 4 of 4 |"]

    changed = tmp_path / "changed"
    changed.mkdir()
    for item in (folder / "exports" / "quickstart-gguf").iterdir():
        (changed / item.name).symlink_to(item)
    template = (changed / "chat_template.jinja").read_text()
    (changed / "chat_template.jinja").unlink()  # the generation prompt without its newline
    (changed / "chat_template.jinja").write_text(template.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant'"))
    parity = run(f"finetune export --check {changed}", folder)
    assert parity.returncode == 1
    lines = parity.stdout.splitlines()
    assert lines[2:7] == ["| finetune chat | 0 of 5 |", "| finetune serve | 0 of 5 |", "| vLLM template file | 0 of 5 |",
                          "| GGUF model-q8_0.gguf | 5 of 5 |", "| Modelfile | 4 of 4 |"]
    assert "- finetune chat: 'Hello there!': the prompts part at token " in parity.stdout


def test_a_rank_stabilized_lora_goes_out_as_a_gguf_adapter_that_answers_as_trained(tmp_path, capsys):
    """Without --merge, --gguf writes the adapter as a GGUF adapter (convert_lora_to_gguf.py), checked on an f32
    GGUF of its base: every greedy answer identical. llama.cpp scales an adapter by alpha / r; a rank-stabilized
    one (alpha / sqrt(r)) answers as trained only with the alpha that gives its scale. No Modelfile: Ollama would
    need the base as a GGUF. Types the LoRA converter lacks, and DoRA, are refused before any work."""
    import shutil

    from tests.conftest import train_here

    run = tmp_path / "run"
    result = train_here("quickstart", "method=lora", "lora.r=16", "lora.use_rslora=true", "train.max_steps=60",
                        "train.learning_rate=5e-3", "train.eval_on_start=false", "data.eval_fraction=0",
                        "eval.samples=0", f"output_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    code, out, err = cli_here(capsys, "export", str(run), "--out", str(tmp_path / "adapter"), "--gguf-type", "f32")
    assert code == 0, err[-3000:]
    checked = report(tmp_path / "adapter")
    assert checked["problems"] == [] and [(g["identical"], g["prompts"]) for g in checked["greedy"]] == [(12, 12)]
    assert sorted(p.name for p in (tmp_path / "adapter").glob("*.gguf")) == ["adapter-f32.gguf"]
    assert not (tmp_path / "adapter" / "Modelfile").exists() and "ollama: no Modelfile: Ollama loads a GGUF " in out

    code, _, err = cli_here(capsys, "export", str(run), "--out", str(tmp_path / "q4"), "--gguf-type", "q4_k_m")
    assert code == 2 and err == ("error: --gguf-type q4_k_m: choose one of f32, f16, bf16, q8_0; merged (--merge) "
                                 "also q4_k_m\n")
    dora = tmp_path / "dora"
    shutil.copytree(run / "final", dora)
    settings = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    code, _, err = cli_here(capsys, "export", str(dora), "--out", str(tmp_path / "d"), "--gguf")
    assert code == 2 and err == "error: --gguf: llama.cpp has no DoRA adapters; export it merged (--merge --gguf)\n"
    assert sorted(os.listdir(tmp_path)) == ["adapter", "dora", "run"]


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
