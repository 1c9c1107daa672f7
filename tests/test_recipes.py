"""The GPU recipes, scaled down: each trains with two-process DDP on the CPU on a random-init model of its own
architecture (GPT-OSS: experts, router, sinks, sliding-window layers; Llama 3.2: rope scaling, tied embeddings)
with the real tokenizer. What a CPU cannot do is changed and nothing else: the backend is hf (Unsloth needs a CUDA
GPU), and batch, accumulation, length and steps are small enough to finish in seconds."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, asset, launch_cli

pytestmark = pytest.mark.integration

# One row a step on each process: a step costs whole chunks of the 128k or 200k-token vocabulary in the loss
SCALED_DOWN = ["model.backend=hf", "train.max_steps=2", "train.max_length=512", "train.per_device_train_batch_size=1",
               "train.gradient_accumulation_steps=1", "data.max_rows=100", "train.save_strategy=no",
               "train.logging_steps=1"]


def data(architecture: str) -> list[str]:
    """The real data each recipe is for (read when a test runs: a clone without the shared assets skips it)."""
    if architecture == "llama":
        return [f"data.train={asset('datasets/sharegpt-fastchat/dummy_conversation.json')}"]
    return [f"data.train={asset('datasets/gsm8k/train.jsonl')}", "data.columns={instruction: question, output: answer}",
            "data.thinking_marker=####"]


def train(recipe: str, model, data: list[str], output_dir) -> list[dict]:
    scaled = SCALED_DOWN
    if "global_batch_size" in (REPO / "configs" / f"{recipe}.yaml").read_text():  # one row a process, as above
        scaled = [o for o in SCALED_DOWN if "gradient_accumulation" not in o] + ["train.global_batch_size=2"]
    result = launch_cli("cpu_ddp_2proc", recipe, f"model.name_or_path={model}", f"output_dir={output_dir}", *data,
                        *scaled)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (output_dir / "progress.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recipe, architecture", [
    ("llama-3.2-3b-unsloth-qlora", "llama"),
    ("llama-3.2-3b-lora", "llama"),
    ("gpt-oss-20b-unsloth-qlora", "gpt-oss"),
])
def test_recipe_trains_with_ddp(recipe, architecture, tiny_models, tmp_path):
    rows = train(recipe, tiny_models[architecture], data(architecture), tmp_path / "run")
    assert rows[-1]["status"] == "completed"
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """Qwen 3 (the real Qwen tokenizer and template) and Gemma 3 4B's image-text model (Llama 3.2's vocabulary with
    Gemma's turn tokens standing in), random-initialized at hidden 64."""
    from finetune.models.architectures import tiny_gemma3_image_text
    from tests.conftest import family_tokenizer, save_tiny_model
    from tests.test_families import family_model

    tokenizer = family_tokenizer("gemma3")
    return {"qwen3": family_model(tmp_path_factory.mktemp("qwen3"), "qwen3"),
            "gemma3": save_tiny_model(tmp_path_factory.mktemp("gemma3"), tiny_gemma3_image_text(len(tokenizer) + 3),
                                      tokenizer)}


@pytest.mark.parametrize("recipe, family", [("qwen3-4b-lora", "qwen3"), ("gemma-3-4b-qlora", "gemma3")])
def test_family_recipe_trains_with_ddp(recipe, family, family_models, tmp_path):
    """Qwen 3 on reasoning (GSM8K's rationale as thinking); Gemma 3 4B on conversations, its vision tower left
    without adapters: two DDP processes would wait for their gradients, which text never gives."""
    data_for = data("gpt-oss" if family == "qwen3" else "llama")
    rows = train(recipe, family_models[family], data_for, tmp_path / "run")
    assert rows[-1]["status"] == "completed"
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
    adapter = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert not any("vision" in name or "projector" in name for name in adapter["target_modules"])


def test_gpt_oss_recipe_trains_its_expert_adapters(tiny_models, tmp_path):
    """LoRA on the attention projections and on the experts of layers 7, 15 and 23 (PEFT target_parameters): the
    expert adapters are saved and moved away from their initialization, so they received gradients."""
    from safetensors.torch import load_file

    rows = train("gpt-oss-20b-lora", tiny_models["gpt-oss"], data("gpt-oss"), tmp_path / "run")
    assert rows[-1]["status"] == "completed"
    weights = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    experts = {name: tensor for name, tensor in weights.items() if ".experts." in name}
    layers = {name.split(".layers.")[1].split(".")[0] for name in experts}
    assert layers == {"7", "15", "23"}
    trained_b = [tensor for name, tensor in experts.items() if "lora_B" in name]
    assert len(trained_b) == 6 and all(tensor.abs().sum() > 0 for tensor in trained_b)  # B starts at zero
    config = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == sorted(
        f"{layer}.mlp.experts.{name}" for layer in (7, 15, 23) for name in ("gate_up_proj", "down_proj"))
