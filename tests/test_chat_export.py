"""Chat with trained models and export them: tiny Llama 3.2 and GPT-OSS models (real tokenizers) trained here with
LoRA, QLoRA and in full, exported, and reloaded with plain transformers + PEFT, never with our code."""

from __future__ import annotations

import base64
import json
import os
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.conftest import cli_here, run_cli, save_tiny_model, train_greeter, train_here, write_greetings

pytestmark = pytest.mark.integration
PROMPT = [{"role": "user", "content": "I am qqq."}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two-layer random-init Llama 3.2 and GPT-OSS (experts, sinks, sliding window) with their real tokenizers."""
    from finetune.models.architectures import tiny_gpt_oss, tiny_llama_3_2

    return {"llama": save_tiny_model(tmp_path_factory.mktemp("llama"), tiny_llama_3_2()),
            "gpt-oss": save_tiny_model(tmp_path_factory.mktemp("gpt-oss"), tiny_gpt_oss())}


@pytest.fixture(scope="module")
def greetings(tmp_path_factory) -> Path:
    return write_greetings(tmp_path_factory.mktemp("data") / "greetings.jsonl")


# (architecture, method): steps, learning rate, batch. The long one learns the answer and its end token; GPT-OSS
# fine-tuned in full until it reasons and answers is the session's gpt_oss_greeter (conftest.py).
TRAINING = {
    ("llama", "lora"): (30, 1e-2, 4),
    ("llama", "qlora"): (4, 1e-2, 4),
    ("gpt-oss", "lora"): (4, 1e-2, 4),
    ("gpt-oss", "qlora"): (4, 1e-2, 4),
}


@pytest.fixture(scope="module")
def trained(models, greetings, tmp_path_factory, request):
    """trained(architecture, method) -> the run folder, trained once per module with `finetune train`."""
    runs: dict[tuple[str, str], Path] = {}

    def train(architecture: str, method: str) -> Path:
        if (architecture, method) == ("gpt-oss", "full"):
            return request.getfixturevalue("gpt_oss_greeter")
        if (architecture, method) not in runs:
            steps, learning_rate, batch = TRAINING[architecture, method]
            run = tmp_path_factory.mktemp("runs") / f"{architecture}-{method}"
            runs[architecture, method] = train_greeter(models[architecture], greetings, method, steps, learning_rate,
                                                       batch, run)
        return runs[architecture, method]

    return train


def plain_model(base: Path, adapter: Path | None = None, qlora: bool = False):
    """What a user writes: transformers (+ bitsandbytes for a 4-bit base) + PEFT, in float32 as trained on CPU."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    settings = {"dtype": torch.float32}
    if AutoConfig.from_pretrained(base).model_type == "gpt_oss":
        settings["attn_implementation"] = "eager"  # the attention sinks
    if qlora:
        settings["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(base, **settings)
    return (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()


def prompt_ids(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).apply_chat_template(
        PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def greedy(model, inputs, tokens: int = 8) -> list[int]:
    output = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return output[0, inputs["input_ids"].shape[1]:].tolist()


def logits(model, inputs):
    import torch

    with torch.inference_mode():
        return model(**inputs).logits[0]


@pytest.mark.parametrize("architecture, method", [("llama", "lora"), ("llama", "qlora"), ("gpt-oss", "lora"),
                                                  ("gpt-oss", "qlora")])
def test_adapter_export_reloads_with_plain_peft_identically(trained, models, tmp_path, architecture, method, capsys):
    from finetune.trained_model.chat import Chat

    run = trained(architecture, method)
    out = tmp_path / "export"
    code, printed, err = cli_here(capsys, "export", str(run / "final"), "--out", str(out))
    assert code == 0, err[-3000:]
    assert "checked: logits identical to the trained model's" in printed
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "chat_template.jinja",
            "generation_config.json", "README.md", "finetune.yaml"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(models[architecture])

    ours = Chat(run / "final").model  # the trained model, as our code loads it
    plain = plain_model(models[architecture], out, qlora=method == "qlora")
    inputs = prompt_ids(out)
    import torch

    assert torch.equal(logits(plain, inputs), logits(ours, inputs))
    assert greedy(plain, inputs) == greedy(ours, inputs)
    base = plain_model(models[architecture], qlora=method == "qlora")
    assert not torch.allclose(logits(base, inputs), logits(ours, inputs), atol=1e-3), "the adapter changes nothing"


@pytest.mark.parametrize("architecture", ["llama", "gpt-oss"])
def test_merged_export_in_float32_generates_like_the_trained_model(trained, tmp_path, architecture, capsys):
    """GPT-OSS's merge includes the adapters on the expert weights (target_parameters)."""
    import torch

    from finetune.trained_model.chat import Chat

    run = trained(architecture, "lora")
    out = tmp_path / "merged"
    code, _, err = cli_here(capsys, "export", str(run / "final"), "--out", str(out), "--merge", "--dtype", "fp32")
    assert code == 0, err[-3000:]
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()
    plain = plain_model(out)
    ours = Chat(run / "final").model
    inputs = prompt_ids(out)
    assert greedy(plain, inputs) == greedy(ours, inputs)
    assert torch.allclose(logits(plain, inputs), logits(ours, inputs), atol=1e-4)


def test_qlora_adapter_merges_into_a_16_bit_base(trained, tmp_path, capsys):
    from safetensors import safe_open

    run = trained("llama", "qlora")
    out = tmp_path / "merged"
    code, printed, err = cli_here(capsys, "export", str(run / "final"), "--out", str(out), "--merge")
    assert code == 0, err[-3000:]
    assert "exported the merged model" in printed and "logits within 0.05 of the largest" in printed
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as weights:
        assert {str(weights.get_slice(name).get_dtype()) for name in weights.keys()} == {"BF16"}


def test_export_card_tokenizer_and_generation_config(trained, tmp_path, gptoss_tokenizer, capsys):
    run = trained("gpt-oss", "lora")
    out = tmp_path / "export"
    assert cli_here(capsys, "export", str(run / "final"), "--out", str(out))[0] == 0
    generation = json.loads((out / "generation_config.json").read_text())
    assert sorted(gptoss_tokenizer.convert_ids_to_tokens(generation["eos_token_id"])) == [
        "<|call|>", "<|return|>"]
    card = (out / "README.md").read_text()
    metadata = yaml.safe_load(card.split("---")[1])
    assert metadata["library_name"] == "peft" and metadata["pipeline_tag"] == "text-generation"
    assert metadata["license"] == "other" and "lora" in metadata["tags"]
    progress = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]
    last_loss = [row for row in progress if "loss" in row][-1]
    assert f"| final train loss | {last_loss['loss']:.4f} (step {last_loss['step']}) |" in card
    assert "| final eval loss | not recorded |" in card
    assert "PeftModel.from_pretrained(base" in card and "name_or_path:" in card  # how to load; the recipe
    assert "7.mlp.experts" not in card  # this recipe adapts no experts
    # the main settings as the trainer had them: written (the scheduler) or not (the accumulation, TRL's default)
    assert "| lr_scheduler_type | constant_with_warmup |" in card and "| gradient_accumulation_steps | 1 |" in card
    assert (out / "chat_template.jinja").read_text() == (run / "final" / "chat_template.jinja").read_text()


def test_llama_export_keeps_the_base_end_tokens_and_never_shows_the_base_path(trained, models, tmp_path,
                                                                              llama_tokenizer, capsys):
    """Llama 3.2 ends a turn with <|eot_id|>, a tool call with <|eom_id|>, a text with <|end_of_text|>: the
    export's generation config keeps all three. The base is a local folder of unknown origin: the card says so."""
    run = trained("llama", "lora")
    out = tmp_path / "export"
    assert cli_here(capsys, "export", str(run / "final"), "--out", str(out))[0] == 0
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [128001, 128008, 128009]
    assert llama_tokenizer.convert_ids_to_tokens(generation["eos_token_id"]) == [
        "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
    card = (out / "README.md").read_text()
    assert str(models["llama"]) not in card and str(models["llama"].name) not in card
    assert "A LoRA fine-tune of a local model" in card and "| base model | a local model |" in card
    assert "base_model:" not in card.split("---")[1] and 'from_pretrained("BASE"' in card


def test_a_run_on_a_mixture_of_sources_exports_and_its_card_names_no_local_path(tmp_path, capsys):
    """Each kind of share (rows, fraction, weight) in data.train; local data is named as the card names a local
    base: never by its path on this machine, which a Hub push would publish."""
    from finetune.builtin import resolve_dataset

    rows = Path(resolve_dataset("builtin:greetings")).read_text().splitlines()
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(rows[:40]) + "\n")
    mixture = (f"data.train=[{{path: {tmp_path / 'a.jsonl'}, rows: 30}}, {{path: {tmp_path / 'b.jsonl'}, "
               f"fraction: 0.5}}, {{path: {tmp_path / 'c.jsonl'}, weight: 2}}]")
    run = tmp_path / "mix"
    trained = train_here("quickstart", mixture, "method=lora", "train.max_steps=1", "train.eval_on_start=false",
                      "data.eval_fraction=0", "train.save_strategy=no", "eval.samples=0", f"output_dir={run}",
                      f"data.decontaminate=[{tmp_path / 'a.jsonl'}]", "data.contaminated=report")
    assert trained.returncode == 0, trained.stderr[-3000:]
    checks = json.loads((run / "data_checks.json").read_text())
    assert checks["contamination"]["rows"] == 30 + 20 + 40  # a.jsonl's rows in each source's share
    code, out, err = cli_here(capsys, "export", str(run), "--out", str(tmp_path / "export"))
    assert code == 0, err
    card = (tmp_path / "export" / "README.md").read_text()
    assert "| data | local data |" in card and str(tmp_path) not in card
    assert "| data checks | " in card and "90 rows sharing 13 words with local data (data.contaminated=report)" in card


def test_a_local_base_is_named_by_its_hub_origin(tmp_path):
    from finetune.trained_model.model_card import base_origin

    cached = tmp_path / "hub" / "models--meta-llama--Llama-3.2-3B-Instruct" / "snapshots" / "abc123"
    cached.mkdir(parents=True)
    carded = tmp_path / "carded"
    carded.mkdir()
    (carded / "README.md").write_text("---\nbase_model: meta-llama/Llama-3.2-1B\nlicense: llama3.2\n---\n# A copy\n")
    configured = tmp_path / "configured"
    configured.mkdir()
    (configured / "config.json").write_text(json.dumps({"_name_or_path": "openai/gpt-oss-20b"}))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"_name_or_path": str(unknown)}))
    assert [base_origin(str(path)) for path in (cached, carded, configured, unknown)] == [
        "meta-llama/Llama-3.2-3B-Instruct", "meta-llama/Llama-3.2-1B", "openai/gpt-oss-20b", None]
    assert base_origin("meta-llama/Llama-3.2-3B-Instruct") == "meta-llama/Llama-3.2-3B-Instruct"
    assert base_origin("builtin:tiny-llama") == "builtin:tiny-llama"


def test_fully_fine_tuned_mixture_of_experts_exports_in_bf16(trained, tmp_path, capsys):
    """Rounding to bf16 can flip the router's choice at a near tie and move one position's logits far; the check
    tolerates a few such positions, not a broken export."""
    code, printed, err = cli_here(capsys, "export", str(trained("gpt-oss", "full") / "final"), "--out",
                                  str(tmp_path / "bf16"))
    assert code == 0, err[-3000:]
    assert "exported the model to" in printed and "positions" in printed


def test_chat_stops_at_the_end_token_it_learned(trained, capsys):
    from finetune.trained_model.chat import Chat, Sampling

    run = trained("llama", "lora")
    reply = Chat(run / "final").reply(PROMPT, Sampling(max_new_tokens=40, temperature=0))
    assert reply.answer == "Hi!" and reply.ended_by == "<|eot_id|>" and len(reply.token_ids) < 40
    code, printed, err = cli_here(capsys, "chat", str(run), "--prompt", "I am zed.", "--temperature", "0")
    assert code == 0, err[-3000:]
    assert printed == "Hi!\n"


def test_gpt_oss_chat_shows_reasoning_apart_and_stops_at_return(trained):
    """The analysis message ends with <|end|>; generation goes on to the final answer and stops at <|return|>."""
    from finetune.trained_model.chat import Chat, Piece, Reply, Sampling

    chat = Chat(trained("gpt-oss", "full") / "final")
    items = list(chat.stream(PROMPT, Sampling(max_new_tokens=60, temperature=0)))
    reply = items[-1]
    assert isinstance(reply, Reply)
    assert (reply.thinking, reply.answer, reply.ended_by) == ("Greet.", "Hi!", "<|return|>")
    kinds = [item.kind for item in items if isinstance(item, Piece)]
    assert kinds == sorted(kinds, key=["thinking", "answer"].index) and set(kinds) == {"thinking", "answer"}
    assert "".join(i.text for i in items if isinstance(i, Piece) and i.kind == "answer") == "Hi!"

    interactive = run_cli("chat", str(trained("gpt-oss", "full")), "--temperature", "0", input="I am bob.\nI am al.\n")
    assert interactive.returncode == 0, interactive.stderr[-3000:]
    assert interactive.stdout.count("reasoning> Greet.") == 2 and interactive.stdout.count("assistant> Hi!") == 2


@pytest.mark.parametrize("architecture", ["llama", "gpt-oss"])
def test_chat_renders_conversations_as_training_did(trained, architecture):
    """The prompt chat builds for a multi-turn conversation is, token for token, what training put before the
    assistant turn it trained on."""
    from finetune.data.render import IGNORE, Renderer
    from finetune.models.loading import load_tokenizer
    from finetune.trained_model.chat import Chat

    chat = Chat(trained(architecture, "lora") / "final")
    data = chat.folder.recipe.data
    tokenizer = load_tokenizer(chat.folder.recipe)  # what training loaded
    training = Renderer(tokenizer, tokenizer.chat_template, data.template_date, data.loss_on, data.train_thinking,
                        data.template_kwargs)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "I am ann."},
                    {"role": "assistant", "content": "Hi!", "thinking": "Greet."}, {"role": "user", "content": "Bye."},
                    {"role": "assistant", "content": "Bye!", "thinking": "Wave."}]
    ids, labels = training.encode({"messages": conversation})
    last_turn_start = max(i for i in range(1, len(labels)) if labels[i] != IGNORE and labels[i - 1] == IGNORE)
    assert chat.prompt_ids(conversation[:-1]) == ids[:last_turn_start]
    if architecture == "gpt-oss":  # the recipe's template variables reach chat too
        assert "Reasoning: medium" in tokenizer.decode(chat.prompt_ids(conversation[:2]))


def test_chat_worker_process(trained, tmp_path):
    from finetune.errors import UserError
    from finetune.trained_model.chat import Chat, ChatWorker, Sampling

    final = trained("llama", "lora") / "final"
    greedy_settings = Sampling(max_new_tokens=20, temperature=0)
    with ChatWorker(final) as worker:
        assert worker.reply(PROMPT, greedy_settings).answer == Chat(final).reply(PROMPT, greedy_settings).answer
        process = worker._process
    assert not process.is_alive()
    with pytest.raises(UserError, match="does not exist"):
        ChatWorker(tmp_path / "missing")


def test_bad_paths_get_clear_errors(trained, models, tmp_path, capsys):
    from finetune.errors import UserError
    from finetune.trained_model.saved_model import locate

    run = trained("llama", "lora")
    code, _, err = cli_here(capsys, "chat", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert code == 2 and "does not exist" in err and "Traceback" not in err

    no_config = tmp_path / "checkpoint-30"
    shutil.copytree(run / "checkpoint-30", no_config)
    (no_config / "finetune.yaml").unlink()
    with pytest.raises(UserError, match="has no finetune.yaml, so the recipe it was trained with is unknown"):
        locate(no_config)

    unfinished = tmp_path / "unfinished"
    shutil.copytree(run, unfinished, ignore=shutil.ignore_patterns("final"))
    with pytest.raises(UserError, match="is a run without final/ .*; pass .*checkpoint-30"):
        locate(unfinished)

    moved = tmp_path / "moved"
    shutil.copytree(run / "final", moved)
    recipe = yaml.safe_load((moved / "finetune.yaml").read_text())
    recipe["model"]["name_or_path"] = str(tmp_path / "no-such-base")
    (moved / "finetune.yaml").write_text(yaml.safe_dump(recipe))
    code, _, err = cli_here(capsys, "chat", str(moved), "--prompt", "I am zed.", "--temperature", "0")
    assert code == 2 and "no-such-base" in err and "--base-model" in err
    code, out, err = cli_here(capsys, "chat", str(moved), "--prompt", "I am zed.", "--temperature", "0",
                              "--base-model", str(models["llama"]))
    assert code == 0 and out == "Hi!\n", err


def test_export_refusals_leave_nothing(trained, tmp_path, capsys, monkeypatch):
    final = trained("llama", "lora") / "final"
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    code, _, err = cli_here(capsys, "export", str(final), "--out", str(taken))
    assert code == 2 and "not empty" in err and os.listdir(taken) == ["keep.txt"]

    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)  # as without the gguf extra
    code, _, err = cli_here(capsys, "export", str(final), "--out", str(tmp_path / "gguf"), "--merge", "--gguf")
    assert code == 2 and err.startswith("error: --gguf needs llama.cpp's Python bindings, which check the GGUF: "
                                        'pip install -e ".[gguf]"'), err
    assert not (tmp_path / "gguf").exists() and not list(tmp_path.glob(".gguf-partial-*"))


def test_failed_check_exits_nonzero_and_writes_nothing(trained, tmp_path, monkeypatch):
    """A merged bf16 export differs from the unmerged model by rounding; with no rounding allowed, it must fail."""
    from finetune.errors import CommandFailed
    from finetune.trained_model import export

    monkeypatch.setitem(export.TOLERANCE, "bfloat16", 0.0)
    with pytest.raises(CommandFailed, match="export check failed") as failure:
        export.export(trained("llama", "lora") / "final", tmp_path / "out", merge=True, push_to_hub="me/never")
    assert failure.value.exit_code == 1
    assert os.listdir(tmp_path) == []


class FakeHub:
    """The Hub's HTTP API, as far as creating a repository and committing files goes, on loopback: it records every
    request, so a test sees what would have been uploaded and with which credentials."""

    def __init__(self):
        self.requests: list[tuple[str, dict, bytes]] = []
        self.files: dict[str, bytes] = {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, b""))
                self.answer({"error": "not here"}, 404)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hub.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                if self.path == "/api/repos/create":
                    request = json.loads(body)
                    return self.answer({"url": f"{hub.url}/{request['organization']}/{request['name']}"})
                if self.path == "/api/validate-yaml":
                    return self.answer({"errors": [], "warnings": []})
                if "/preupload/" in self.path:
                    return self.answer({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                  for f in json.loads(body)["files"]]})
                if "/commit/" in self.path:
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            hub.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    return self.answer({"commitUrl": f"{hub.url}/me/tiny/commit/{'a' * 40}", "commitOid": "a" * 40})
                self.answer({"error": "not here"}, 404)

            def answer(self, data: dict, status: int = 200):
                payload = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


TOKEN = "hf_testTokenThatMustNeverBePrinted"


def hub_env(tmp_path: Path, **changes: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    return {**env, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1", **changes}


def test_push_to_hub_uploads_the_checked_export(trained, tmp_path):
    hub = FakeHub()
    out = tmp_path / "export"
    env = hub_env(tmp_path, HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_TOKEN=TOKEN)
    result = run_cli("export", str(trained("llama", "lora") / "final"), "--out", str(out), "--push-to-hub", "me/tiny",
                     "--private", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"pushed: {hub.url}/me/tiny" in result.stdout
    create = next(body for path, _, body in hub.requests if path == "/api/repos/create")
    assert json.loads(create) == {"name": "tiny", "organization": "me", "visibility": "private"}
    assert all(headers.get("authorization") == f"Bearer {TOKEN}" for path, headers, _ in hub.requests
               if path.startswith(("/api/repos", "/api/models")))
    assert hub.files == {path.name: path.read_bytes() for path in out.iterdir()}
    assert TOKEN not in result.stdout + result.stderr
    assert not any(TOKEN.encode() in path.read_bytes() for path in out.iterdir())


def test_push_without_token_or_offline_keeps_the_local_export(trained, tmp_path):
    final = trained("llama", "lora") / "final"
    result = run_cli("export", str(final), "--out", str(tmp_path / "a"), "--push-to-hub", "me/tiny",
                     env=hub_env(tmp_path))
    assert result.returncode == 2 and "no Hugging Face token" in result.stderr and "hf auth login" in result.stderr
    assert "hf upload me/tiny" in result.stderr and (tmp_path / "a" / "adapter_model.safetensors").is_file()

    result = run_cli("export", str(final), "--out", str(tmp_path / "b"), "--push-to-hub", "me/tiny",
                     env=hub_env(tmp_path, HF_HUB_OFFLINE="1", HF_TOKEN=TOKEN))
    assert result.returncode == 1 and "the upload failed" in result.stderr and "Traceback" not in result.stderr
    assert TOKEN not in result.stdout + result.stderr
    assert (tmp_path / "b" / "adapter_model.safetensors").is_file()


def test_panel_chat_models_are_shared_capped_and_unloaded(trained):
    """The panel's chat models: one worker per model for the sessions that use it, at most `limit` loaded (the
    least recently used goes), unloaded when their sessions leave them or when idle."""
    from finetune.ui.chat_models import ChatModels

    lora, qlora, gpt_oss = (trained(*kind) / "final" for kind in (("llama", "lora"), ("llama", "qlora"),
                                                                   ("gpt-oss", "lora")))
    models = ChatModels(limit=2, idle_s=3600)
    try:
        first = models.get("A", lora, base=False)
        assert models.get("B", lora, base=False) is first  # one model, two sessions
        second = models.get("B", qlora, base=False)  # B moves on; A still chats with the first
        assert first.alive() and second.alive()
        third = models.get("C", gpt_oss, base=False)  # a third one: the least recently used goes
        assert not first.alive() and second.alive() and third.alive()
        assert models.get("A", lora, base=False).reply([{"role": "user", "content": "I am zed."}]).answer
        models.release_session("C")
        assert not third.alive()
        models.idle_s = 0
        models.release_idle()
        assert models.loaded() == []
    finally:
        models.release_all()


def test_chat_and_export_of_a_run_logged_to_a_backend_missing_here(trained, tmp_path, capsys):
    """A run logged with a back-end this machine lacks (wandb is not installed here) still chats and exports:
    the saved recipe is not checked as if for training."""
    import shutil

    import yaml

    copy = tmp_path / "final"
    shutil.copytree(trained("llama", "lora") / "final", copy)
    recipe = yaml.safe_load((copy / "finetune.yaml").read_text())
    recipe["train"]["report_to"] = ["wandb"]
    (copy / "finetune.yaml").write_text(yaml.safe_dump(recipe))
    code, out, err = cli_here(capsys, "chat", str(copy), "--prompt", "I am zed.", "--temperature", "0",
                              "--max-new-tokens", "8")
    assert code == 0 and out.strip(), err[-2000:]
    code, _, err = cli_here(capsys, "export", str(copy), "--out", str(tmp_path / "out"))
    assert code == 0, err[-2000:]


def test_a_run_trained_with_a_system_prompt_gets_it_in_every_place_its_template_lives(tmp_path, capsys):
    """Training put data.system_prompt first in every row without one: `finetune chat`, `finetune serve` and the
    vLLM template file do too, so `export --check` finds every place's prompts identical to training's (it found
    chat, serve and the vLLM file without it before). The check writes nothing."""
    from finetune.trained_model.chat import Chat

    run = tmp_path / "run"
    result = train_here("quickstart", "data.system_prompt=Answer in one line, \"kindly\".", "train.max_steps=1",
                        "train.eval_on_start=false", "data.eval_fraction=0", "eval.samples=0", f"output_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    code, out, err = cli_here(capsys, "export", "--check", str(run))
    assert (code, err) == (0, ""), out
    assert out.splitlines() == ["| place | identical |", "|---|---|", "| finetune chat | 5 of 5 |",
                                "| finetune serve | 5 of 5 |", "| vLLM template file | 5 of 5 |",
                                "| GGUF | no GGUF model in the target |", "| Modelfile | no Modelfile in the target |"]
    chat = Chat(run)
    prompt = chat.tokenizer.decode(chat.prompt_ids([{"role": "user", "content": "Hi"}]))
    assert prompt.startswith('<|begin_of_text|><|im_start|>system\nAnswer in one line, "kindly".<|im_end|>\n')
    from finetune.trained_model.served_models import parse_targets
    from finetune.trained_model.server import load_served

    [served] = load_served(parse_targets([str(run)])).values()  # the chat the server answers requests with
    assert served.chat.prompt_ids([{"role": "user", "content": "Hi"}]) == chat.prompt_ids([{"role": "user",
                                                                                            "content": "Hi"}])
    assert sorted(os.listdir(tmp_path)) == ["run"]
