"""The real architectures, full size on the meta device: exact parameter counts and each recipe's adapter size."""

from __future__ import annotations

import pytest
import torch

from finetune.models.architectures import (gemma2_2b, gemma3_1b, gemma3_4b, gpt_oss_20b, llama_3_2_3b, mistral_7b,
                                           parameter_count, phi3_mini, qwen2_5_1_5b, qwen3_4b)
from finetune.models.loading import lora_config
from finetune.recipe.schema import load_recipe
from tests.conftest import REPO


def test_full_size_parameter_counts():
    assert parameter_count(llama_3_2_3b()) == 3_212_749_824
    assert parameter_count(gpt_oss_20b()) == 20_914_757_184


@pytest.mark.parametrize("architecture, published", [
    (qwen2_5_1_5b, 1_543_714_304), (qwen3_4b, 4_022_468_096), (gemma2_2b, 2_614_341_888), (gemma3_1b, 999_885_952),
    (gemma3_4b, 4_300_079_472), (mistral_7b, 7_248_023_552), (phi3_mini, 3_821_079_552)])
def test_the_families_at_their_published_sizes(architecture, published):
    """The parameter counts their model cards and safetensors index state (Gemma 3 4B with its vision tower)."""
    assert parameter_count(architecture()) == published


def llama_lora_params(r: int) -> int:
    """LoRA adds r x (inputs + outputs) per adapted Linear; Llama 3.2 3B: 28 layers of q, k, v, o, gate, up, down."""
    hidden, kv, intermediate = 3072, 8 * 128, 8192
    per_layer = (hidden + hidden) + 2 * (hidden + kv) + (hidden + hidden) + 2 * (hidden + intermediate) + (
        intermediate + hidden)
    return 28 * r * per_layer


def gpt_oss_lora_params(r: int, expert_layers: int) -> int:
    """all-linear is q, k, v, o in each of 24 layers (the router and the experts are not Linear modules); each
    expert tensor (32, inputs, outputs) named in target_parameters adds r x 32 x (inputs + outputs)."""
    hidden, heads, kv, intermediate, experts = 2880, 64 * 64, 8 * 64, 2880, 32
    attention = (hidden + heads) + 2 * (hidden + kv) + (heads + hidden)
    expert = experts * ((hidden + 2 * intermediate) + (intermediate + hidden))
    return 24 * r * attention + expert_layers * r * expert


def decoder_lora_params(r: int, layers: int, hidden: int, q: int, kv: int, intermediate: int) -> int:
    """all-linear on a Llama-style decoder (q, k, v, o, gate, up, down); an image-text model's vision tower left out."""
    return layers * r * ((hidden + q) + 2 * (hidden + kv) + (q + hidden) + 2 * (hidden + intermediate)
                         + (intermediate + hidden))


RECIPES = {
    "qwen3-4b-lora": (qwen3_4b, decoder_lora_params(16, 36, 2560, 32 * 128, 8 * 128, 9728)),  # 33,030,144
    "gemma-3-4b-qlora": (gemma3_4b, decoder_lora_params(16, 34, 2560, 8 * 256, 4 * 256, 10240)),
    "llama-3.2-3b-unsloth-qlora": (llama_3_2_3b, llama_lora_params(16)),  # 24,313,856
    "llama-3.2-3b-lora": (llama_3_2_3b, llama_lora_params(16)),
    "gpt-oss-20b-lora": (gpt_oss_20b, gpt_oss_lora_params(8, expert_layers=3)),  # 15,040,512
    "gpt-oss-20b-unsloth-qlora": (gpt_oss_20b, gpt_oss_lora_params(8, expert_layers=0)),  # 3,981,312
}


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_adapter_sizes(name):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    architecture, expected = RECIPES[name]
    recipe = load_recipe(REPO / "configs" / f"{name}.yaml")
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(architecture())
        model = get_peft_model(base, lora_config(recipe, base))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == expected
    if recipe.lora.target_parameters:
        adapted = {n.split(".mlp.")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters()
                   if p.requires_grad and ".experts." in n}
        assert adapted == {"7", "15", "23"}
