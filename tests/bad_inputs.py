"""The corpus of bad inputs: each case, and the message it must produce (exit status 2, that one message, no
traceback, no run folder, nothing in the data cache). test_bad_input.py runs every case through `finetune validate`
and `finetune train`.

In a case, `{dir}` stands for the case's own folder (also the folder the command runs in), where `files` are
written first; the recipe is `recipe` (a recipe file's text or bytes) or else the shipped quickstart recipe, with
`overrides` over it.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

CHAT = json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})
ALPACA = json.dumps({"instruction": "Say hi", "output": "Hi"})
RECIPE = "model: {name_or_path: builtin:tiny-llama}\ndata: {train: builtin:greetings}\n"


def chat(*messages: tuple[str, object], **extra) -> str:
    return json.dumps({"messages": [{"role": role, "content": content} for role, content in messages], **extra},
                      ensure_ascii=False)


@dataclass
class Case:
    name: str
    message: str  # the error message contains this ({dir} is the case's folder)
    overrides: list[str] = field(default_factory=list)
    recipe: str | bytes | None = None
    files: dict[str, str | bytes] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)  # command-line options after the overrides
    recipe_path: str | None = None  # what is passed as RECIPE: default recipe.yaml (with `recipe`) or quickstart
    commands: tuple[str, ...] = ("validate", "train")
    setup: Callable | None = None  # setup(folder) for what files cannot say


def data_case(name: str, content: str | bytes, message: str, filename: str = "data.jsonl", *more: str) -> Case:
    return Case(name, message, [f"data.train={filename}", *more], files={filename: content})


def _tokenizer_without_template(folder):
    from finetune import builtin

    tiny = builtin.resolve_model("builtin:tiny-llama")
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder / "plain-model")
    AutoConfig.from_pretrained(tiny).save_pretrained(folder / "plain-model")
    (folder / "plain-model" / "chat_template.jinja").unlink(missing_ok=True)


def _tokenizer_only(folder):
    from transformers import AutoTokenizer

    from finetune import builtin

    AutoTokenizer.from_pretrained(builtin.resolve_model("builtin:tiny-llama")).save_pretrained(folder / "no-weights")


def _model_without_tokenizer(folder):
    """A saved LlamaForCausalLM alone (config and weights), as `model.save_pretrained` leaves it."""
    import shutil

    from finetune import builtin

    tiny = Path(builtin.resolve_model("builtin:tiny-llama"))
    (folder / "bare-model").mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny / name, folder / "bare-model" / name)


def _qwen2_with_the_llama_tokenizer(folder):
    """A Qwen2 model of Llama 3.2's vocabulary size saved with the real Llama 3.2 tokenizer: transformers loads it
    as a Qwen2Tokenizer, which adds a pad token past the embedding."""
    import shutil

    import pytest
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.conftest import ASSETS

    tokenizer = ASSETS / "tokenizers" / "llama-3.2-instruct"
    if not tokenizer.is_dir():
        pytest.skip(f"needs the Llama 3.2 tokenizer in {tokenizer} (../shared/assets)")
    Qwen2ForCausalLM(Qwen2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=128256)).save_pretrained(folder / "qwen2")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer / name, folder / "qwen2" / name)


def _gemma2(folder):
    """A tiny Gemma 2 (soft-capped attention scores) with the Llama 3.2 tokenizer standing in for Gemma's."""
    import pytest

    from finetune.models.architectures import tiny
    from tests.conftest import ASSETS, family_tokenizer

    if not (ASSETS / "tokenizers" / "llama-3.2-instruct").is_dir():
        pytest.skip(f"needs the Llama 3.2 tokenizer in {ASSETS} (../shared/assets)")
    from transformers import AutoModelForCausalLM

    tokenizer = family_tokenizer("gemma2")
    tokenizer.save_pretrained(folder / "gemma2")
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' bar while it writes: not the command's output
        AutoModelForCausalLM.from_config(tiny("gemma2", vocab_size=len(tokenizer))).save_pretrained(folder / "gemma2")


def _run_with_a_cut_off_checkpoint(folder):
    run = folder / "run"
    (run / "checkpoint-4").mkdir(parents=True)  # no finetune_state.json: cut off while being written
    (run / "progress.jsonl").write_text('{"step": 4, "loss": 1.0}\n')


RAISES_ON_SYSTEM = ("{% for message in messages %}{% if message.role == 'system' %}"
                    "{{ raise_exception('System role not supported') }}{% endif %}"
                    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CASES = [
    # The recipe file.
    Case("recipe is a folder", "recipe recipes is a folder; pass a recipe file (.yaml)",
         files={"recipes/x.yaml": RECIPE}, recipe_path="recipes"),
    Case("recipe does not exist", "recipe 'nope.yaml' not found: no such file, and no shipped recipe of that name",
         recipe_path="nope.yaml"),
    Case("empty recipe", "recipe.yaml is empty; a recipe is a mapping of keys", recipe=""),
    Case("whitespace-only recipe", "recipe.yaml is empty", recipe="  \n\n   \n"),
    Case("recipe that is a list", "a recipe is a mapping of keys (model:, data:, train:, ...), not a list",
         recipe="- model\n- data\n"),
    Case("recipe that is a scalar", "a recipe is a mapping of keys (model:, data:, train:, ...), not the value 'hello'",
         recipe="hello\n"),
    Case("recipe with a key twice", "recipe.yaml line 3: key 'data' appears twice (first on line 2); keep one",
         recipe=RECIPE + "data: {train: other.jsonl}\n"),
    Case("recipe indented with tabs", "YAML indents with spaces, never tabs",
         recipe="model:\n\tname_or_path: builtin:tiny-llama\n"),
    Case("recipe in Latin-1", "recipe.yaml line 3: not UTF-8 text; save the recipe as UTF-8",
         recipe=RECIPE.encode() + "# café\n".encode("latin-1")),
    Case("recipe in UTF-16", "recipe.yaml line 1: not UTF-8 text", recipe=RECIPE.encode("utf-16")),
    Case("broken YAML", "recipe.yaml line 2, column 1: not valid YAML: expected ',' or ']'", recipe="model: [builtin:tiny-llama\n"),
    Case("unknown top-level key", "unknown key 'modle'; did you mean 'model'?",
         recipe=RECIPE + "modle: {}\n"),
    Case("unknown key in a section", "unknown key 'lora.rnak'; did you mean 'lora.r'?",
         recipe=RECIPE + "lora: {rnak: 8}\n"),
    Case("section given as a value", "data is a section of keys, not 'builtin:greetings'",
         recipe="model: {name_or_path: builtin:tiny-llama}\ndata: builtin:greetings\n"),
    Case("no model", "model.name_or_path is required", recipe="data: {train: builtin:greetings}\n"),
    Case("no data", "data.train is required", recipe="model: {name_or_path: builtin:tiny-llama}\n"),
    # Overrides.
    Case("override without a value", "override 'train.learning_rate': write overrides as key.sub=value",
         ["train.learning_rate"]),
    Case("override without a key", "override '=3': write overrides as key.sub=value", ["=3"]),
    Case("override into a value", "override 'method.kind=x': method is a value, not a section", ["method.kind=x"]),
    Case("misspelt override", "unknown key 'train.learnig_rate' (not a field of TRL's SFTConfig); did you mean "
         "'train.learning_rate'?", ["train.learnig_rate=1e-4"]),
    Case("override of the wrong type", "train.num_train_epochs must be a number, got 'lots'",
         ["train.num_train_epochs=lots"]),
    Case("override outside the choices", "method must be one of lora, qlora, full, got 'qdora'", ["method=qdora"]),
    Case("key another section owns", "train.output_dir is not used here: set the top-level output_dir",
         ["train.output_dir=elsewhere"]),
    Case("resume as a training key", "train.resume_from_checkpoint is not used here: continue a run with "
         "`finetune train RECIPE --resume [CHECKPOINT]`", ["train.resume_from_checkpoint=true"]),
    # Absurd numbers.
    Case("1e99 epochs", "train.num_train_epochs must be above 0 and at most 100,000, got 1e+99",
         ["train.num_train_epochs=1e99"]),
    Case("zero epochs", "train.num_train_epochs must be above 0", ["train.num_train_epochs=0"]),
    Case("negative epochs", "train.num_train_epochs must be above 0", ["train.num_train_epochs=-2"]),
    Case("zero rank", "lora.r must be a positive whole number", ["method=lora", "lora.r=0"]),
    Case("negative rank", "lora.r must be a positive whole number", ["method=lora", "lora.r=-8"]),
    Case("zero alpha", "lora.alpha must be a positive whole number", ["method=lora", "lora.alpha=0"]),
    Case("dropout of 1", "lora.dropout must be at least 0 and below 1", ["method=lora", "lora.dropout=1"]),
    Case("zero batch", "train.per_device_train_batch_size must be a positive whole number",
         ["train.per_device_train_batch_size=0"]),
    Case("negative batch", "train.per_device_train_batch_size must be a positive whole number",
         ["train.per_device_train_batch_size=-4"]),
    Case("zero accumulation", "train.gradient_accumulation_steps must be a positive whole number",
         ["train.gradient_accumulation_steps=0"]),
    Case("zero length", "train.max_length must be a positive whole number", ["train.max_length=0"]),
    Case("negative length", "train.max_length must be a positive whole number", ["train.max_length=-128"]),
    Case("NaN learning rate", "train.learning_rate must be a finite number above 0, got nan",
         ["train.learning_rate=.nan"]),
    Case("infinite learning rate", "train.learning_rate must be a finite number above 0, got inf",
         ["train.learning_rate=.inf"]),
    Case("negative learning rate", "train.learning_rate must be a finite number above 0",
         ["train.learning_rate=-1e-4"]),
    Case("zero max_steps", "train.max_steps must be -1 (train for num_train_epochs) or a positive whole number",
         ["train.max_steps=0"]),
    Case("eval fraction of 1", "data.eval_fraction must be at least 0 and below 1", ["data.eval_fraction=1"]),
    Case("zero max_rows", "data.max_rows must be a positive whole number", ["data.max_rows=0"]),
    Case("bad template date", "data.template_date must be a date as YYYY-MM-DD", ["data.template_date=yesterday"]),
    # Contradictions.
    Case("auto micro-batch without a global batch", "train.per_device_train_batch_size auto needs the global batch "
         "it splits: set train.global_batch_size", ["train.per_device_train_batch_size=auto"]),
    Case("global batch and accumulation", "train.gradient_accumulation_steps and train.global_batch_size both set "
         "the global batch", ["train.global_batch_size=16", "train.gradient_accumulation_steps=2"]),
    Case("zero global batch", "train.global_batch_size must be a positive whole number",
         ["train.global_batch_size=0"]),
    Case("global batch not a multiple of the micro-batch", "train.global_batch_size 12 is not a whole number of "
         "micro-batches of 8 rows on 1 process", ["train.global_batch_size=12", "train.per_device_train_batch_size=8"],
         commands=("train",)),
    Case("Liger with the chunked loss", "train.use_liger_kernel computes the loss with Liger's fused linear "
         "cross-entropy, which replaces TRL's chunked loss", ["train.use_liger_kernel=true",
                                                              "train.loss_type=chunked_nll"]),
    Case("Liger with activation offloading", "train.activation_offloading does not work with "
         "train.use_liger_kernel", ["train.use_liger_kernel=true", "train.activation_offloading=true"]),
    Case("Liger on the CPU", "train.use_liger_kernel needs a CUDA GPU (Liger's kernels are written in Triton, for "
         "GPUs) and this run trains on the CPU", ["train.use_liger_kernel=true"]),
    Case("activation offloading on the CPU", "train.activation_offloading needs a CUDA GPU",
         ["train.activation_offloading=true"]),
    Case("paged optimizer on the CPU", "train.optim paged_adamw_8bit: paged optimizers page GPU memory out to the "
         "CPU, and this run trains on the CPU", ["train.optim=paged_adamw_8bit"]),
    Case("bf16 and fp16", "train.bf16 and train.fp16 both ask for mixed precision; keep one",
         ["train.bf16=true", "train.fp16=true"]),
    Case("two eval choices", "data.eval and data.eval_fraction both choose the eval split; keep one",
         ["data.eval=builtin:greetings"]),
    Case("eval without eval data", "train.eval_strategy needs eval data", ["data.eval_fraction=0",
                                                                            "train.eval_strategy=steps"]),
    Case("adapter settings for a full fine-tune", "lora settings are given but method is full",
         recipe=RECIPE + "method: full\nlora: {r: 8}\n"),
    Case("unknown logging back-end", "train.report_to 'tensorbored' is not a logging back-end",
         ["train.report_to=tensorbored"]),
    Case("logging back-end not installed", "train.report_to 'wandb' is not installed; pip install wandb",
         ["train.report_to=wandb"]),
    # The run folder.
    Case("output_dir under a file", "output_dir {dir}/a-file/run: {dir}/a-file is a file, so the run folder cannot "
         "be made there", ["output_dir={dir}/a-file/run"], files={"a-file": "x"}),
    Case("output_dir that cannot be written", "output_dir /proc/finetune-run: cannot write in /proc",
         ["output_dir=/proc/finetune-run"]),
    Case("output_dir of an earlier run", "output_dir {dir}/run already exists and is not empty: continue that run "
         "with --resume", files={"run/progress.jsonl": '{"step": 1, "loss": 1.0}\n'}, commands=("train",)),
    Case("resume what is not a run", "--resume: {dir}/run is not a run folder (it has no progress.jsonl)",
         args=["--resume"], commands=("train",)),
    Case("resume from a cut-off checkpoint", "--resume: {dir}/run has no complete checkpoint to continue from "
         "(checkpoint-4 was cut off while being written)", args=["--resume"], commands=("train",),
         setup=_run_with_a_cut_off_checkpoint),
    Case("unknown accelerate config", "accelerate config 'nope' not found", args=["--accelerate-config", "nope"],
         commands=("train",)),
    Case("broken accelerate config", "launch.yaml line 2, column 1: not valid YAML",
         args=["--accelerate-config", "launch.yaml"], files={"launch.yaml": "num_processes: [2\n"},
         commands=("train",)),
    # Models and templates.
    Case("model folder that does not exist", "model.name_or_path: ./models/nope does not exist (no such folder; "
         "relative paths start from the folder finetune runs in, {dir})", ["model.name_or_path=./models/nope"]),
    Case("Hub model while offline", "model.name_or_path: 'someone/no-such-model' is not a local folder, it is not "
         "in the local Hugging Face cache, and the Hub cannot be asked (HF_HUB_OFFLINE is set)",
         ["model.name_or_path=someone/no-such-model"]),
    Case("unknown builtin model", "unknown builtin model 'builtin:nope'", ["model.name_or_path=builtin:nope"]),
    Case("model folder without weights' config", "model.name_or_path: cannot load a model from '{dir}/no-weights'",
         ["model.name_or_path={dir}/no-weights"], setup=_tokenizer_only),
    Case("tokenizer without a chat template", "the tokenizer of {dir}/plain-model has no chat template, and the "
         "data holds conversations; set model.chat_template", ["model.name_or_path={dir}/plain-model"],
         setup=_tokenizer_without_template),
    Case("template file that does not exist", "model.chat_template: missing.jinja does not exist",
         ["model.chat_template=missing.jinja"]),
    Case("template that is not Jinja", "model.chat_template template.jinja is not a valid Jinja template (line 1)",
         ["model.chat_template=template.jinja"], files={"template.jinja": "{% for message in %}{{ x }}"}),
    Case("template that refuses a system role", "the chat template cannot render it: System role not supported",
         ["model.chat_template=template.jinja", "data.train=data.jsonl"],
         files={"template.jinja": RAISES_ON_SYSTEM,
                "data.jsonl": chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello")) + "\n"}),
    # Data files.
    Case("relative data path that does not exist", "data.train: data/train.jsonl does not exist (no such file or "
         "folder; relative paths start from the folder finetune runs in, {dir})", ["data.train=data/train.jsonl"]),
    Case("Hub dataset while offline", "data.train: 'someone/no-such-data' is not a local file or folder, it is not "
         "in the local Hugging Face cache, and the Hub cannot be asked (HF_HUB_OFFLINE is set)",
         ["data.train=someone/no-such-data"]),
    data_case("data in Latin-1", CHAT.encode() + b"\n" + chat(("user", "Caf\u00e9?"), ("assistant", "Oui"))
              .encode("latin-1") + b"\n", "data.jsonl line 2: not UTF-8 text (byte 0xe9); save the file as "
              "UTF-8 (it may be Latin-1 or Windows-1252)"),
    data_case("data in UTF-16", (CHAT + "\n").encode("utf-16"), "data.jsonl is UTF-16 text; save it as UTF-8"),
    data_case("data in UTF-16 without a byte-order mark", (CHAT + "\n").encode("utf-16-le"),
              "data.jsonl is UTF-16 text; save it as UTF-8"),
    data_case("binary data", bytes(range(256)) * 4, "data.jsonl is not a text file (it holds binary data)"),
    data_case("gzip-compressed data", gzip.compress((CHAT + "\n").encode()),
              "data.jsonl is gzip-compressed; decompress it first"),
    data_case("JSON array in a .jsonl file", "[\n" + CHAT + ",\n" + CHAT + "\n]\n",
              "data.jsonl holds a JSON array, not one JSON object per line: name it .json"),
    data_case("JSON array on one line of a .jsonl file", "[" + CHAT + ", " + CHAT + "]\n",
              "data.jsonl holds a JSON array, not one JSON object per line"),
    data_case("JSON Lines in a .json file", CHAT + "\n" + CHAT + "\n",
              "data.json holds one JSON value per line (JSON Lines), not one JSON document: name it .jsonl",
              "data.json"),
    data_case("empty .jsonl", "", "data.jsonl is empty: it holds no rows"),
    data_case("whitespace-only .jsonl", "\n   \n\t\n", "data.jsonl is empty: it holds no rows"),
    data_case("empty .json", "", "data.json is empty: it holds no rows", "data.json"),
    data_case("empty .csv", "", "data.csv is empty: it holds no rows", "data.csv"),
    data_case("empty JSON list", "[]", "data.json is empty: it holds no rows", "data.json"),
    data_case(".json that is not a list", json.dumps({"a": 1, "b": 2}),
              "data.json: a .json data file holds a list of rows", "data.json"),
    data_case("broken .json", "[" + CHAT + ",", "data.json: not valid JSON at line 1", "data.json"),
    data_case("data file of another kind", "Hi there", "data.train: data.txt is a .txt file; use .jsonl, .json, "
              ".parquet, .csv", "data.txt"),
    Case("data folder mixing formats", "data folder mixed mixes data formats: mixed/a.jsonl holds messages rows, "
         "mixed/b.jsonl holds alpaca rows. Move the stray file out, or list the files in data.train one by one",
         ["data.train=mixed"],
         files={"mixed/a.jsonl": CHAT + "\n", "mixed/b.jsonl": ALPACA + "\n"}),
    Case("data folder without data files", "data.train: folder notes has no .jsonl, .json, .parquet, .csv files",
         ["data.train=notes"], files={"notes/readme.txt": "nothing here"}),
    data_case("CSV with the wrong columns", "name,age\nAda,36\n", "data.csv row 1: cannot tell the data "
              "format from its fields (name, age); set data.format", "data.csv"),
    Case("Parquet with the wrong columns", "data.parquet row 1: cannot tell the data format from its fields "
         "(name, age)", ["data.train=data.parquet"], setup=lambda folder: __import__("pyarrow.parquet").parquet
         .write_table(__import__("pyarrow").table({"name": ["Ada"], "age": [36]}), folder / "data.parquet")),
    data_case("text in a .parquet file", "not parquet", "data.parquet: not a readable Parquet file",
              "data.parquet"),
    data_case("row that is not an object", "42\n", "data.jsonl line 1: a row must be a JSON object, not int"),
    data_case("row of broken JSON", CHAT + '\n{"messages": [\n', "data.jsonl line 2: not valid JSON"),
    data_case("null field", ALPACA + "\n" + json.dumps({"instruction": "Say hi", "output": None}) + "\n",
              "data.jsonl line 2: 'output' is null"),
    data_case("null message content", CHAT + "\n" + chat(("user", None), ("assistant", "Hello")) + "\n",
              "data.jsonl line 2: message 1 content is null"),
    data_case("image parts", chat(("user", [{"type": "text", "text": "What is this?"},
                                            {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]),
                                  ("assistant", "A cat")) + "\n",
              "message 1 content has image_url parts: only text is trained here (text-only models)"),
    data_case("system message in the middle", chat(("user", "Hi"), ("system", "Be brief."), ("assistant", "Hello"))
              + "\n", "message 2: a system message comes after the conversation began; put it first"),
    data_case("tool result without a call", chat(("user", "Hi"), ("tool", "42"), ("assistant", "Hello")) + "\n",
              "message 2: a tool result without a tool call before it"),
    data_case("conversation ending with a user message",
              chat(("user", "Hi"), ("assistant", "Hello"), ("user", "And?")) + "\n",
              "the conversation ends with a user message that no assistant message answers; remove it (message 3)"),
    data_case("no assistant turn", chat(("user", "Hi")) + "\n", "line 1: no assistant turn to learn from"),
    data_case("unknown role", chat(("user", "Hi"), ("bot", "Hello")) + "\n", "message 2 has unknown role 'bot'"),
    data_case("empty conversation", json.dumps({"messages": []}) + "\n", "empty conversation"),
    data_case("ShareGPT turn from nobody", json.dumps({"conversations": [{"from": "human", "value": "Hi"},
                                                                         {"from": "robot", "value": "Hello"}]}) + "\n",
              "turn 2 has unknown role 'robot'"),
    data_case("tool call with broken arguments", json.dumps({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "weather", "arguments": "{city: Paris"}}]},
        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}) + "\n",
              "message 2: tool call arguments are not valid JSON"),
    data_case("column mapped to nothing", ALPACA + "\n", "line 1: no 'question' field (mapped from 'instruction')",
              "data.jsonl", "data.format=alpaca", "data.columns={instruction: question}"),
    data_case("format that does not fit the rows", ALPACA + "\n", "line 1: no 'messages' field", "data.jsonl",
              "data.format=messages"),
    Case("model folder without a tokenizer", "model.name_or_path: ./bare-model has no tokenizer (none of "
         "tokenizer.json, tokenizer.model, vocab.json, tokenizer_config.json, tiktoken.model). Save the base "
         "model's tokenizer beside the weights", ["model.name_or_path=./bare-model"], setup=_model_without_tokenizer),
    Case("several unknown keys", "3 unknown keys, fix them all and run again:\n  override 'lora.rnak=8': "
         "'lora.rnak'; did you mean 'lora.r'?\n  override 'data.eval_fractoin=0.1': 'data.eval_fractoin'; did you mean "
         "'data.eval_fraction'?\n  override 'train.learning_rat=0.1': 'train.learning_rat'; did you "
         "mean 'train.learning_rate'?", ["lora.rnak=8", "train.learning_rat=0.1", "data.eval_fractoin=0.1"]),
    data_case("preference pairs for stage sft", json.dumps({"prompt": "Pick a color.", "chosen": "blue",
                                                           "rejected": "red"}) + "\n",
              "line 1: this looks like preference data (chosen and rejected answers), which stage sft does not "
              "train on; set stage: dpo (or kto)"),
    data_case("every row too long", "".join(chat(("user", "word " * 20), ("assistant", "Hello")) + "\n"
                                            for _ in range(3)),
              "data.train: none of its 3 rows can be trained on: 3 have nothing to learn within train.max_length "
              "16 (their lengths: p50 ", "data.jsonl", "train.max_length=16", "data.eval_fraction=0",
              "train.eval_on_start=false"),
    data_case("rows too long to keep any answer", chat(("user", "word " * 200), ("assistant", "Hello")) + "\n",
              "1 data row longer than train.max_length (64) before any token that carries loss", "data.jsonl",
              "train.max_length=64", "data.too_long=fail"),
    # What needs a GPU, refused before any process starts (and by validate, which makes the same checks).
    Case("vLLM generation on the CPU", "grpo.use_vllm generates with vLLM, which needs a CUDA GPU, and this run trains "
         "on the CPU", ["stage=grpo", "grpo.rewards=[{function: length, max_tokens: 8}]", "grpo.use_vllm=true"]),
    Case("vLLM generation on the CPU, launched on two processes", "grpo.use_vllm generates with vLLM, which needs a "
         "CUDA GPU", ["stage=grpo", "grpo.rewards=[{function: length, max_tokens: 8}]", "grpo.use_vllm=true"],
         args=["--accelerate-config", "cpu_ddp_2proc"], commands=("train",)),
    Case("a tokenizer whose pad token the model has no row for", "model.name_or_path: the tokenizer does not match "
         "the model: its pad token '<|endoftext|>' is id 128,256, and the model's embedding has 128,256 rows (ids 0 "
         "to 128,255); set its pad token to one inside the vocabulary (e.g. \"pad_token\": \"<|eot_id|>\" in "
         "tokenizer_config.json) or resize the model's embeddings", ["model.name_or_path=./qwen2", "method=lora",
                                                                     "model.chat_template="],
         setup=_qwen2_with_the_llama_tokenizer),
    Case("Gemma 2's soft-capped attention asked of sdpa", "model.attn_implementation: sdpa ignores this model's "
         "attention soft-capping (attn_logit_softcapping 50.0), so it would train on other attention scores than the "
         "model's; leave model.attn_implementation unset (eager), or use flash_attention_2",
         ["model.name_or_path=./gemma2", "model.attn_implementation=sdpa"], setup=_gemma2),
    # What `finetune estimate` is asked, refused before any planning.
    *[Case(f"estimate {' '.join(args)}", message, ["train.max_length=64"], args=args, commands=("estimate",))
      for args, message in [
          (["--gpu", "0GB"], "--gpu '0GB': a card's memory is at least 1 GB; write it as 24GB or 80GiB"),
          (["--gpu", "h100", "--prices", "{dir}/nonexistent.yaml"],
           "--prices {dir}/nonexistent.yaml: no such file; write one line per card (h100: 3.50)"),
          (["--gpu", "h100", "--price-per-gpu-hour", "-3"],
           "--price-per-gpu-hour -3: a price is 0 or more (USD per GPU-hour)"),
          (["--gpu", "h100", "--tokens", "-10"], "--tokens -10: give the training tokens per epoch as a whole number"),
          (["--gpu", "h100", "--tokens", "0"], "--tokens 0: give the training tokens per epoch as a whole number"),
          (["--gpu", "h100", "--tokens", "1.5"], "--tokens 1.5: give the training tokens per epoch as a whole number"),
          (["--gpu", "h100", "--num-gpus", "100000"], "--num-gpus 100000: plan for 1 to 8,192 GPUs"),
          (["--gpu", "h100", "--num-gpus", "0"], "--num-gpus 0: plan for 1 to 8,192 GPUs"),
      ]],
]
